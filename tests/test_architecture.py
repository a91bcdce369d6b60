"""The architecture holds: import contracts, no import cycle, committed schemas, no function over 80 lines, no organ
named outside the organ registry."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

from emrl_data.organs import ORGANS
from emrl_data.tables.records import SCHEMAS, schema_to_json


ROOT = Path(__file__).resolve().parent.parent
MAX_FUNCTION_LINES = 80
# The product packages (tests and bench are not product code): the line limit and the import graph cover them.
PACKAGES = ("emrl_data", "flows", "cli", "hub", "publishing", "model_io", "train", "inference")
LINE_LIMIT_PACKAGES = PACKAGES
# path::function -> why it may be longer for now.
LONG_FUNCTION_EXCEPTIONS: dict[str, str] = {}


def long_functions(root: Path, packages: tuple[str, ...], limit: int) -> dict[str, int]:
    """Every function or method of `packages` under `root` longer than `limit` lines (`def` line to its last line,
    decorators not counted), as `path::name` -> lines."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = (node.end_lineno or node.lineno) - node.lineno + 1
                    if lines > limit:
                        found[f"{path.relative_to(root).as_posix()}::{node.name}"] = lines
    return found


def test_import_contracts_hold() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_import_cycle() -> None:
    """No module of the product packages imports, directly or not, a module that imports it back
    (lazy imports inside functions count: a cycle is a cycle wherever the import statement sits)."""
    import grimp

    graph = grimp.build_graph(*PACKAGES, include_external_packages=False)
    cycles = set()
    for importer in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(importer):
            chain = graph.find_shortest_chain(importer=imported, imported=importer)
            if chain is not None:  # importer -> imported -> ... -> importer
                cycles.add(" -> ".join((importer, *chain)))
    assert not cycles, "import cycles:\n" + "\n".join(sorted(cycles))


def test_mining_and_training_never_import_each_other() -> None:
    """Mining (`inference/` and the flow that runs it) and training (`train/`) share how a CT reaches Qwen3-VL through
    `model_io` alone: no chain of imports, lazy ones included, leads from one to the other, and `model_io` imports no
    other package of the project."""
    import grimp

    graph = grimp.build_graph(*PACKAGES, include_external_packages=False)
    assert graph.find_shortest_chains(importer="inference", imported="train") == set()
    assert graph.find_shortest_chains(importer="flows.build_rl_hardset", imported="train") == set()
    assert graph.find_shortest_chains(importer="train", imported="inference") == set()
    assert graph.find_shortest_chains(importer="inference", imported="model_io")  # the encoder and the checks
    assert graph.find_shortest_chains(importer="train", imported="model_io")
    others = [p for p in PACKAGES if p != "model_io"]
    assert {p: graph.find_shortest_chains(importer="model_io", imported=p) for p in others} == dict.fromkeys(
        others, set()
    )


def test_committed_schemas_are_up_to_date() -> None:
    for name in SCHEMAS:
        committed = json.loads((ROOT / "schemas" / f"{name}.schema.json").read_text())
        assert committed == schema_to_json(name), (
            f"schemas/{name}.schema.json is stale: run `python -m emrl_data.tables.records --write-schemas schemas/`"
        )


def test_training_library_contract_names_every_module_directly_in_train() -> None:
    """The contract that keeps the training library free of tiny models, the miniature and tools lists its source
    modules by name; a new module directly in `train/` must join that list (or move into a subpackage)."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (library,) = [c for c in contracts if c["name"].startswith("the training library")]
    on_disk = {f"train.{p.stem}" for p in (ROOT / "train").glob("*.py") if p.stem != "__init__"}
    assert set(library["source_modules"]) == on_disk
    subpackages = {f"train.{p.parent.name}" for p in (ROOT / "train").glob("*/__init__.py")}
    assert set(library["forbidden_modules"]) == subpackages


def test_long_functions_finds_a_constructed_long_function(tmp_path: Path) -> None:
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    body = "\n".join(f"    x{i} = {i}" for i in range(4))
    (tmp_path / "pkg" / "sub" / "m.py").write_text(
        f"def five():\n{body}\n\n\n@decorated\ndef four():\n{body[: body.rindex(chr(10))]}\n\n\n"
        f"class C:\n    async def method(self):\n    {body.replace(chr(10), chr(10) + '    ')}\n"
    )
    assert long_functions(tmp_path, ("pkg",), 4) == {"pkg/sub/m.py::five": 5, "pkg/sub/m.py::method": 5}


def test_no_function_is_over_80_lines() -> None:
    found = long_functions(ROOT, LINE_LIMIT_PACKAGES, MAX_FUNCTION_LINES)
    over = {name: lines for name, lines in found.items() if name not in LONG_FUNCTION_EXCEPTIONS}
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines (split them at their seams): {over}"
    stale = sorted(set(LONG_FUNCTION_EXCEPTIONS) - set(found))
    assert not stale, f"LONG_FUNCTION_EXCEPTIONS lists functions that are no longer long (remove them): {stale}"


# The one home of organ knowledge, and the modules that may name an organ because they hold data, not behaviour.
ORGAN_REGISTRY = "emrl_data/organs.py"
ORGAN_NAME_EXCEPTIONS = {
    "emrl_data/synthetic/demo.py": "the demo atlas's and the benchmark's case specs: which organ each lesion is in",
    "train/tiny/model.py": "example locations in the tiny tokenizer's corpus (registry-derived ones change it)",
    "train/tiny/synthetic.py": "the miniature's 2-D organ outlines, one per organ: data, no branch on a name",
}


def organ_words() -> set[str]:
    """The words that name a registered organ: its name, display name, adjective and lesion-file prefixes."""
    return {w for s in ORGANS.values() for w in (s.name, s.display, s.adjective, *s.lesion_prefixes)}


def organ_mentions(path: Path, words: set[str]) -> list[str]:
    """Code of one module that names an organ: `Organ.LIVER`, or a string (not a docstring, not a comment) holding one
    of `words` as a word (`"kidney_right"` holds `kidney`), as `line: text`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if words & set(re.findall(r"[a-z]+", node.value.lower())):
                found.append(f"{node.lineno}: {node.value!r}")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Organ":
            if node.attr.lower() in words:
                found.append(f"{node.lineno}: Organ.{node.attr}")
    return sorted(found, key=lambda line: int(line.split(":")[0]))


def test_organ_mentions_finds_constructed_mentions(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        '"""The liver module."""\n'
        "# the pancreas, in a comment\n"
        "def f(structure, organ):\n"
        '    """Pancreas docstring."""\n'
        '    if structure == "kidney_right" or organ is Organ.LIVER:\n'
        '        return f"{organ} adrenal"\n'
        "    return Organ.SPLEEN\n"
    )
    assert organ_mentions(module, {"liver", "kidney", "pancreas", "renal"}) == [
        "5: 'kidney_right'",
        "5: Organ.LIVER",
    ]


def test_no_module_names_an_organ_outside_the_registry() -> None:
    """Organ knowledge lives in `emrl_data/organs.py` (what a defect of the synthetic atlas breaks included:
    `OrganAnatomy.defect_files`); code elsewhere looks it up and never branches on a particular organ."""
    words = organ_words()
    assert {"liver", "pancreas", "kidney"} <= words
    found = {}
    for package in LINE_LIMIT_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel != ORGAN_REGISTRY and rel not in ORGAN_NAME_EXCEPTIONS:
                found.update({rel: hits} if (hits := organ_mentions(path, words)) else {})
    assert not found, f"organs named outside {ORGAN_REGISTRY} (move the fact into the registry entry): {found}"
    for rel in ORGAN_NAME_EXCEPTIONS:
        assert organ_mentions(ROOT / rel, words), f"{rel} names no organ any more: remove its exception"


def imports_prefect(path: Path) -> bool:
    """Whether the module imports Prefect at its top level (`import prefect...` or `from prefect... import`); an
    `__init__.py` that holds nothing but its docstring counts as importing it (a package marker, no code)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in tree.body:
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "prefect" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "prefect":
            return True
    code = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    return path.name == "__init__.py" and not code


def prefect_free_modules(root: Path, package: str) -> list[str]:
    """The modules of `package` under `root` that do not import Prefect (`imports_prefect`), as paths."""
    return [
        path.relative_to(root).as_posix()
        for path in sorted((root / package).rglob("*.py"))
        if not imports_prefect(path)
    ]


def test_prefect_free_modules_finds_constructed_modules(tmp_path: Path) -> None:
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text('"""A package marker."""\n')
    (tmp_path / "pkg" / "sub" / "__init__.py").write_text("X = 1\n")
    (tmp_path / "pkg" / "flow.py").write_text("from prefect import flow\n")
    (tmp_path / "pkg" / "task.py").write_text("import prefect.artifacts\n")
    (tmp_path / "pkg" / "lazy.py").write_text("def f():\n    import prefect\n")
    (tmp_path / "pkg" / "sub" / "relative.py").write_text("from .prefect import flow\nimport prefectlike\n")
    assert prefect_free_modules(tmp_path, "pkg") == ["pkg/lazy.py", "pkg/sub/__init__.py", "pkg/sub/relative.py"]


def test_every_module_of_flows_imports_prefect() -> None:
    """`flows/` holds Prefect flows and tasks only: a module of it without Prefect belongs elsewhere (the CLI in
    `cli/`, pure code in `emrl_data/`, mining backends in `inference/`, the Hub release in `hub/`, publishing helpers
    in `publishing/`)."""
    misplaced = prefect_free_modules(ROOT, "flows")
    assert not misplaced, f"modules of flows/ that import no Prefect (move them out of flows/): {misplaced}"


# Imports sit at module top; one inside a function says why on its line or the line above (docs/dependencies.md).
LAZY_IMPORT_PACKAGES = (*PACKAGES, "schemas", "bench")
LAZY_REASON = re.compile(r"#\s*lazy:\s*\S")


def unexplained_lazy_imports(source: str, name: str) -> list[str]:
    """Every import statement inside a function of `source` with no `# lazy: <reason>` comment on its first line or
    on the line above, as `name:line`."""
    lines = source.splitlines()
    found = set()
    for function in ast.walk(ast.parse(source, filename=name)):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(function):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    line, above = lines[node.lineno - 1], lines[node.lineno - 2] if node.lineno > 1 else ""
                    if not (LAZY_REASON.search(line) or LAZY_REASON.match(above.strip())):
                        found.add((node.lineno, f"{name}:{node.lineno}"))
    return [where for _, where in sorted(found)]


def test_unexplained_lazy_imports_finds_constructed_imports() -> None:
    source = (
        "import os\n\n\n"
        "def f():\n"
        "    import json\n"
        "    import torch  # lazy: torch adds 2 s to start-up (measured)\n"
        "    # lazy: vllm is only in its side environment\n"
        "    from vllm import LLM\n"
        "    from trl import (  # lazy: the torch stack (see above)\n"
        "        GRPOConfig,\n"
        "    )\n"
        "    import yaml  # lazy:\n\n"
        "    class C:\n"
        "        async def g(self):\n"
        "            from x import y  # lazy\n"
        "            # a comment that is not a reason\n"
        "            import z\n"
    )
    assert unexplained_lazy_imports(source, "m.py") == ["m.py:5", "m.py:12", "m.py:16", "m.py:18"]


def test_every_import_inside_a_function_says_why_it_is_lazy() -> None:
    found = [
        where
        for package in LAZY_IMPORT_PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for where in unexplained_lazy_imports(path.read_text(encoding="utf-8"), path.relative_to(ROOT).as_posix())
    ]
    assert not found, (
        "imports inside functions with no `# lazy: <measured or factual reason>` on their line or the line above "
        f"(move them to the module top): {found}"
    )

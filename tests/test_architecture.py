"""The architecture holds: import contracts, no import cycle, committed schemas."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from emrl_data.tables.records import SCHEMAS, schema_to_json


ROOT = Path(__file__).resolve().parent.parent


def test_import_contracts_hold() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_import_cycle() -> None:
    """No module of emrl_data, flows, train or inference imports, directly or not, a module that imports it back
    (lazy imports inside functions count: a cycle is a cycle wherever the import statement sits)."""
    import grimp

    packages = ("emrl_data", "flows", "train", "inference")
    graph = grimp.build_graph(*packages, include_external_packages=False)
    cycles = set()
    for importer in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(importer):
            chain = graph.find_shortest_chain(importer=imported, imported=importer)
            if chain is not None:  # importer -> imported -> ... -> importer
                cycles.add(" -> ".join((importer, *chain)))
    assert not cycles, "import cycles:\n" + "\n".join(sorted(cycles))


def test_committed_schemas_are_up_to_date() -> None:
    for name in SCHEMAS:
        committed = json.loads((ROOT / "schemas" / f"{name}.schema.json").read_text())
        assert committed == schema_to_json(name), (
            f"schemas/{name}.schema.json is stale: run `python -m emrl_data.tables.records --write-schemas schemas/`"
        )


def test_training_library_contract_names_every_module_directly_in_train() -> None:
    """The contract that keeps the training library free of tooling, the miniature and tools lists its source
    modules by name; a new module directly in `train/` must join that list (or move into a subpackage)."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (library,) = [c for c in contracts if c["name"].startswith("the training library")]
    on_disk = {f"train.{p.stem}" for p in (ROOT / "train").glob("*.py") if p.stem != "__init__"}
    assert set(library["source_modules"]) == on_disk
    subpackages = {f"train.{p.parent.name}" for p in (ROOT / "train").glob("*/__init__.py")}
    assert set(library["forbidden_modules"]) == subpackages

"""The docs stay a front door and a reference: a short README that names every module, a decisions log organised
by subject (no section named after a work item), and relative links that resolve. Reads files only (well under 1 s).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_WORDS = 2000
# Reference pages that link their details (decisions.md, training.md, scaling.md, serving.md, the miniature's) rather
# than repeat them: capped at this many words each (and kept ROOM_PERCENT % under the cap).
MAX_DOC_WORDS = {
    "decisions.md": 4000,
    "training.md": 4000,
    "scaling.md": 4000,
    "serving.md": 4000,
    "miniature.md": 2500,
    "miniature_studies.md": 2500,
}
# Each capped doc keeps at least this percentage of its cap free, so an addition has room without a rewrite.
ROOM_PERCENT = 10
# The packages whose modules the README's code map must name, one bullet per module (`__init__.py` excluded).
CODE_PACKAGES = ("emrl_data", "flows", "cli", "model_io", "train", "inference", "hub", "publishing", "bench")
# A heading that names a work item rather than a subject: "#12", "issue 9", "session 4", "items 1-3", "helper".
WORK_ITEM_HEADING = re.compile(r"#\s*\d+|\bissues?\b|\bsessions?\b|\bitems?\s+\d|\bhelpers?\b|\bPR\b", re.IGNORECASE)
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)


def words(text: str) -> int:
    """Words as `wc -w` counts them: runs of non-whitespace."""
    return len(text.split())


def module_paths(root: Path) -> list[str]:
    """Every module file of the code packages, relative to `root`, `__init__.py` and caches excluded."""
    found = []
    for package in CODE_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root)
            if path.name != "__init__.py" and "__pycache__" not in rel.parts:
                found.append(rel.as_posix())
    return found


def room_limit(cap: int) -> int:
    """The most words a doc with this cap may have: the cap less `ROOM_PERCENT` % of it (rounded down)."""
    return cap * (100 - ROOM_PERCENT) // 100


def over_limit(texts: dict[str, str], limits: dict[str, int]) -> list[str]:
    """`name: N words (at most M)` for each text longer than its limit."""
    return [f"{n}: {words(texts[n])} words (at most {m})" for n, m in limits.items() if words(texts[n]) > m]


def unnamed_modules(readme: str, modules: list[str]) -> list[str]:
    """The modules the README does not name as a code span (`emrl_data/reading/atlas.py`)."""
    return [m for m in modules if f"`{m}`" not in readme]


def stale_module_names(readme: str, root: Path) -> list[str]:
    """Module paths the README names that do not exist (a renamed or removed module)."""
    packages = "|".join(CODE_PACKAGES)
    named = re.findall(rf"`((?:{packages})/[\w/]+\.py)`", readme)
    return sorted({n for n in named if not (root / n).is_file()})


def work_item_headings(markdown: str) -> list[str]:
    """Headings (outside code blocks) that name an issue, session or work item."""
    text = FENCE.sub("", markdown)
    return [line for line in text.splitlines() if line.startswith("#") and WORK_ITEM_HEADING.search(line)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links keep their text
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every heading anchor of a markdown file, duplicates numbered as GitHub does (`name`, `name-1`, ...)."""
    seen: dict[str, int] = {}
    result = set()
    for line in FENCE.sub("", markdown).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        result.add(base if n == 0 else f"{base}-{n}")
    return result


def broken_links(path: Path) -> list[str]:
    """Relative links of one markdown file whose target file or heading anchor does not exist."""
    text = path.read_text(encoding="utf-8")
    broken = []
    for target in LINK.findall(FENCE.sub("", text)):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:, data:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target} (no file {file_part})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text(encoding="utf-8")):
            broken.append(f"{target} (no heading #{anchor} in {dest.name})")
    return broken


# The rules, on constructed inputs: each check must be able to fail.


def test_checks_catch_constructed_defects(tmp_path: Path) -> None:
    assert words("a b\n c\t`d e`") == 5
    assert over_limit({"a.md": "x y z", "b.md": "x"}, {"a.md": 2, "b.md": 2}) == ["a.md: 3 words (at most 2)"]
    assert (room_limit(2000), room_limit(2500), room_limit(10)) == (1800, 2250, 9)
    (tmp_path / "bench").mkdir()
    (tmp_path / "flows" / "cli").mkdir(parents=True)
    for rel in ("bench/a.py", "flows/cli/__init__.py", "flows/cli/run.py"):
        (tmp_path / rel).write_text("")
    assert module_paths(tmp_path) == ["flows/cli/run.py", "bench/a.py"]  # package order, then path order
    assert unnamed_modules("- `bench/a.py`: a bench", module_paths(tmp_path)) == ["flows/cli/run.py"]
    assert stale_module_names("`bench/a.py` and `flows/cli.py`", tmp_path) == ["flows/cli.py"]
    doc = "# Decisions\n## Labels\n## Thin flows (issue 12, items 2)\n## Ctrl-C (session 4)\n```\n# #3 in code\n```\n"
    assert work_item_headings(doc) == ["## Thin flows (issue 12, items 2)", "## Ctrl-C (session 4)"]
    assert slug("Operations: the `emrl` command and local Prefect") == "operations-the-emrl-command-and-local-prefect"
    assert slug("Labels: size (mm) & attenuation") == "labels-size-mm--attenuation"
    assert anchors("# A\n## A\n## B c\n") == {"a", "a-1", "b-c"}
    (tmp_path / "x.md").write_text("# Here\n[ok](#here) [bad](#there) [gone](y.md) [web](https://e.org/#z)\n")
    assert broken_links(tmp_path / "x.md") == ["#there (no heading #there in x.md)", "y.md (no file y.md)"]


# The rules, on the real docs.


def test_readme_keeps_room_under_its_word_cap() -> None:
    n, limit = words(README.read_text(encoding="utf-8")), room_limit(MAX_README_WORDS)
    assert n <= limit, (
        f"README.md has {n} words, at most {limit}: at least {ROOM_PERCENT} % room under its cap of {MAX_README_WORDS}"
        " (move details to docs/)"
    )


def test_capped_docs_keep_room_under_their_word_caps() -> None:
    texts = {name: (ROOT / "docs" / name).read_text(encoding="utf-8") for name in MAX_DOC_WORDS}
    bad = over_limit(texts, {name: room_limit(cap) for name, cap in MAX_DOC_WORDS.items()})
    assert not bad, (
        f"each capped doc keeps at least {ROOM_PERCENT} % room under its cap {MAX_DOC_WORDS}; link details from the topic"
        f" docs instead of repeating them: {bad}"
    )


def test_readme_code_map_names_every_module() -> None:
    readme = README.read_text(encoding="utf-8")
    missing = unnamed_modules(readme, module_paths(ROOT))
    assert not missing, f"README.md's code map does not name: {missing} (add one bullet each)"
    stale = stale_module_names(readme, ROOT)
    assert not stale, f"README.md names modules that do not exist: {stale}"


def test_decisions_headings_name_subjects_not_work_items() -> None:
    bad = work_item_headings((ROOT / "docs" / "decisions.md").read_text(encoding="utf-8"))
    assert not bad, f"docs/decisions.md headings name a work item (organise by subject): {bad}"


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.name)
def test_relative_links_resolve(path: Path) -> None:
    assert not broken_links(path), f"{path.relative_to(ROOT)}: broken links {broken_links(path)}"

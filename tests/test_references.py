"""The repository stands on its own: every reference to a file or heading inside it resolves, and no text carries its
history (a work item, a revision date, a document that is not in the repository).

(a) References: markdown links (`tests/test_docs.py`'s `broken_links`, on every markdown file), and repository paths
written in any text file, backticked or not: `docs/contract.md#scoring`, `train/grpo.py`, `docs/data.md, "Outputs"`.
A path must exist; an anchor must be a heading of the target (GitHub's slugs: `tests/test_docs.py`'s `anchors`); a
quoted title must appear in the target. (b) History: "SPEC", `notes/...`, "§", "issue N", work-session wording, ISO
dates and clock times of runs, the device budget, a brief, a revision, a PR or commit; `ALLOWED` lists each place that
must keep such a text, with its reason. Reads files only (a few seconds).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.test_docs import anchors, broken_links


ROOT = Path(__file__).resolve().parents[1]
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".sh", ".cfg", ".ini", ".pth"}
TEXT_NAMES = {"Makefile", "run", ".gitignore"}
# A file path starts with a top-level folder (it is relative to the repository root) and ends with an extension;
# folder names (`train/test`, `flows/cli/`) are not checked.
TOP = r"(?:emrl_data|flows|train|inference|tests|bench|docs|schemas|\.ci)"
PATH_REF = re.compile(rf"(?<![\w/.\-]){TOP}/(?:[\w.\-]+/)*[\w.\-]*\.[A-Za-z]+(?:#[\w\-]+)?")
# A quoted title after a docs path: `docs/decisions.md, "Atlas robustness"` (the title may wrap onto a comment line).
QUOTED_REF = re.compile(r"(?<![\w/.\-])(docs/[\w\-]+\.md),? \"([^\"]+)\"")
# A path followed by one of these is a pattern (`zero{2,3}.yaml`, `seed-<s>`, `*.py`), not a file name.
PATTERN_TAIL = re.compile(r"[{*<\[]")
COMMENT_PREFIX = re.compile(r"\s*\n\s*(?:#\s*)?")

HISTORY = {
    "SPEC": re.compile(r"\bSPEC\b"),
    "notes": re.compile(r"(?<![\w/.\-])notes/"),
    "section sign": re.compile(r"§"),
    "issue": re.compile(r"\bissues?\s*#?\d+|\b(?:this|the) issue\b", re.IGNORECASE),
    "session": re.compile(r"\bsessions?\b", re.IGNORECASE),
    "date": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
    "clock time": re.compile(r"\b[0-2]\d:[0-5]\d UTC\b"),
    "device budget": re.compile(r"\bGPU slot\b|\bdevice (?:time|budget)\b", re.IGNORECASE),
    "work item": re.compile(r"\b(?:the|this|a) brief\b|\brevised\b|\bPR ?#\d+|\bcommit [0-9a-f]{7,}\b", re.IGNORECASE),
}
# "session" in its technical senses: a process session (setsid), a pytest fixture scope, a test session.
TECHNICAL_SESSION = re.compile(
    r"\b(?:own|process|other|test|server's) sessions?\b|\bsessions? of (?:its|their)\b|scope=\"session\"",
    re.IGNORECASE,
)
# (path, what the line holds, reason): the only places that keep a text the history scan looks for.
ALLOWED = (
    ("docs/decisions.md", r"gpt-4o-mini-2024-07-18", "a hosted model's snapshot name, as the API answers it"),
    ("docs/serving.md", r"gpt-4o-mini-2024-07-18", "a hosted model's snapshot name, as the API answers it"),
    ("inference/openai_client.py", r"gpt-4o-mini-2024-07-18", "a hosted model's snapshot name, as the API answers it"),
    ("tests/emrl_data/test_rl_hardset.py", r"gpt-4o-mini-2024-07-18", "a constructed answer naming a snapshot model"),
    ("tests/inference/test_hostile_server.py", r"tiny-2024-07-18", "a constructed answer naming a snapshot model"),
    ("tests/test_docs.py", r"issue 9|issue 12|session 4|an issue, session", "the heading checker's bad examples"),
    ("tests/test_references.py", r".", "the checkers' patterns and their constructed bad texts"),
)
# Files whose paths are constructed inputs of a checker's own test, not references (the reference scan skips them).
CONSTRUCTED = {
    "tests/test_docs.py": "the README checkers' constructed module paths",
    "tests/test_references.py": "the reference checkers' constructed paths",
}


def text_files(root: Path) -> list[str]:
    """The repository's text files (tracked, and new ones not ignored), relative to `root`, sorted."""
    run = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=root, capture_output=True, text=True
    )
    if run.returncode != 0:
        raise RuntimeError(f"{root}: the file list comes from git, and `git ls-files` failed: {run.stderr.strip()}")
    listed = run.stdout.splitlines()
    return sorted(
        rel
        for rel in set(listed)
        if (Path(rel).suffix in TEXT_SUFFIXES or Path(rel).name in TEXT_NAMES) and (root / rel).is_file()
    )


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def unresolved_paths(text: str, rel: str, root: Path) -> list[str]:
    """`rel:line: ref (why)` for each repository path (and `#anchor`) in `text` that does not resolve under `root`."""
    found = []
    for m in PATH_REF.finditer(text):
        if PATTERN_TAIL.match(text, m.end()):
            continue
        ref = m.group(0)
        path, _, anchor = ref.partition("#")
        where = f"{rel}:{_line(text, m.start())}: {ref}"
        target = root / path
        if not target.exists():
            found.append(f"{where} (no file {path})")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target.read_text(encoding="utf-8")):
            found.append(f"{where} (no heading #{anchor} in {path})")
    return found


def unresolved_titles(text: str, rel: str, root: Path) -> list[str]:
    """`rel:line: path "title" (why)` for each quoted title after a docs path that the target does not contain."""
    found = []
    for m in QUOTED_REF.finditer(text):
        path, title = m.group(1), COMMENT_PREFIX.sub(" ", m.group(2))
        target = root / path
        if not target.is_file():
            continue  # unresolved_paths names the missing file
        body = " ".join(target.read_text(encoding="utf-8").split())
        if title not in body:
            found.append(f'{rel}:{_line(text, m.start())}: {path} "{title}" (not in {path})')
    return found


def history_findings(text: str, rel: str, allowed: tuple[tuple[str, str, str], ...] = ALLOWED) -> list[str]:
    """`rel:line: kind: match` for each history mark in `text` that no `allowed` entry for `rel` covers."""
    keep = [re.compile(pattern) for path, pattern, _ in allowed if path == rel]
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        if any(k.search(line) for k in keep):
            continue
        technical = [t.span() for t in TECHNICAL_SESSION.finditer(line)]
        for kind, pattern in HISTORY.items():
            for m in pattern.finditer(line):
                if kind == "session" and any(a <= m.start() < b for a, b in technical):
                    continue
                found.append(f"{rel}:{number}: {kind}: {m.group(0)}")
    return found


def unused_allowances(root: Path, files: list[str], allowed: tuple[tuple[str, str, str], ...] = ALLOWED) -> list[str]:
    """Allow-list entries whose file no longer exists or no longer holds a matching line (stale reasons)."""
    stale = []
    for path, pattern, _ in allowed:
        target = root / path
        if path not in files or not re.search(pattern, target.read_text(encoding="utf-8")):
            stale.append(f"{path}: {pattern}")
    return stale


# The checks, on constructed inputs: each must be able to fail.


def test_path_check_names_missing_files_and_headings(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n## Scoring: r_e\n")
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "grpo.py").write_text("")
    text = (
        "See docs/a.md#scoring-r_e and `train/grpo.py`.\n"
        "# (docs/a.md#scoring, train/sft.py) and docs/b.md\n"
        "`train/launch/zero{2,3}.yaml`, flows/cli/ ok, x/train/y.py, tests.inference.helpers\n"
    )
    assert unresolved_paths(text, "f.py", tmp_path) == [
        "f.py:2: docs/a.md#scoring (no heading #scoring in docs/a.md)",
        "f.py:2: train/sft.py (no file train/sft.py)",
        "f.py:2: docs/b.md (no file docs/b.md)",
    ]


def test_title_check_names_a_title_the_target_lacks(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "d.md").write_text("- **Atlas robustness**: every\n  defect is a row.\n")
    text = '# (docs/d.md, "Atlas robustness") and (docs/d.md "every\n# defect is") and docs/d.md, "Lesion files"\n'
    assert unresolved_titles(text, "m.py", tmp_path) == ['m.py:2: docs/d.md "Lesion files" (not in docs/d.md)']


def test_markdown_link_check_is_run_on_every_markdown_file(tmp_path: Path) -> None:
    (tmp_path / "n.md").write_text("# N\n[up](../missing.md) [self](#n)\n")
    assert broken_links(tmp_path / "n.md") == ["../missing.md (no file ../missing.md)"]


def test_history_scan_names_each_kind_and_honours_the_allow_list() -> None:
    text = (
        "See SPEC §4 and notes/atlas.md (issue 21; the issue saw it).\n"
        "Measured on 2026-12-01 at 04:12 UTC within an 8-minute GPU slot of device time.\n"
        'In session 4 we did it; its own session and scope="session" are fine; mask_only/notes/x.txt too.\n'
        "Model gpt-x-2024-07-18 answered.\n"
        "An addition to the brief, revised in PR #7 (commit 0123abcd); an AI-unrevised file.\n"
    )
    allowed = (("r.md", r"gpt-x-2024-07-18", "a model name"),)
    assert history_findings(text, "r.md", allowed) == [
        "r.md:1: SPEC: SPEC",
        "r.md:1: notes: notes/",
        "r.md:1: section sign: §",
        "r.md:1: issue: issue 21",
        "r.md:1: issue: the issue",
        "r.md:2: date: 2026-12-01",
        "r.md:2: clock time: 04:12 UTC",
        "r.md:2: device budget: GPU slot",
        "r.md:2: device budget: device time",
        "r.md:3: session: session",
        "r.md:5: work item: the brief",
        "r.md:5: work item: revised",
        "r.md:5: work item: PR #7",
        "r.md:5: work item: commit 0123abcd",
    ]
    assert history_findings(text.splitlines()[3], "other.md", allowed) == ["other.md:1: date: 2024-07-18"]


def test_unused_allowances_are_named(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("model m-2024-07-18\n")
    allowed = (("a.md", r"m-2024-07-18", "model"), ("a.md", r"gone", "stale"), ("b.md", r".", "no file"))
    assert unused_allowances(tmp_path, ["a.md"], allowed) == ["a.md: gone", "b.md: ."]


def test_text_files_are_the_repositorys_text_files_git_does_not_ignore(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    for name in ("a.py", "Makefile", "ignored.md", "image.png", "docs/b.md"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("")
    (tmp_path / ".gitignore").write_text("ignored.md\n")
    assert text_files(tmp_path) == [".gitignore", "Makefile", "a.py", "docs/b.md"]
    with pytest.raises(RuntimeError, match="git ls-files` failed"):
        text_files(tmp_path_factory.mktemp("not-a-checkout"))


# The checks, on the repository.


def test_every_repository_path_and_anchor_resolves() -> None:
    problems = []
    for rel in text_files(ROOT):
        if rel in CONSTRUCTED:
            continue
        text = (ROOT / rel).read_text(encoding="utf-8")
        problems += unresolved_paths(text, rel, ROOT) + unresolved_titles(text, rel, ROOT)
        if rel.endswith(".md"):
            problems += [f"{rel}: link {b}" for b in broken_links(ROOT / rel)]
    assert not problems, "unresolved references:\n" + "\n".join(problems)


def test_no_text_carries_history() -> None:
    files = text_files(ROOT)
    problems = [f for rel in files for f in history_findings((ROOT / rel).read_text(encoding="utf-8"), rel)]
    assert not problems, "history in the repository (state what is; refer to docs/...#anchor):\n" + "\n".join(problems)
    stale = unused_allowances(ROOT, files)
    assert not stale, f"allow-list entries that match nothing (remove them): {stale}"

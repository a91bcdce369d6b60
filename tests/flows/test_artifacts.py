"""The artifacts fit the Prefect UI: narrow tables, short headers, short cells, no long links, no stray base64.

Why: Prefect 3.9's UI draws a markdown table in a box that scrolls sideways with its scroll bar hidden
(`.markdown-renderer__table{scrollbar-width:none; overflow:auto}`) and never wraps a cell, so a wide table simply
loses its right-hand columns (a wide summary loses its last column, Table 1 its B-Acc). Looked at in
Chromium at 1440 and 1024 px (docs/operations.md, "What you will see in the UI"): the artifact area at 1024 px is
about 720 px wide, a cell costs about 6.6 px per character plus 24 px of padding. `WIDTH_BUDGET` is that width in
characters with a margin: the sum over a table's columns of (its widest cell + 4) must stay under it.

Every check runs on markdown built from constructed inputs with exact expected values, and once on every artifact
of a real `build-sft-set` run (real Prefect API, tiny synthetic atlas).
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from emrl_data.outcome import Rejection, RejectReason
from emrl_data.synthetic import demo_specs, write_atlas
from emrl_data.tables.rl_hardset import summary_markdown as hardset_summary_markdown
from emrl_data.tables.sft_set import summary_markdown as sft_summary_markdown
from emrl_data.text.evaluation import evaluate
from flows._common import clip, rejection_table
from flows.publish import summary_markdown as publish_summary_markdown
from tests.loopback import loopback_http


MAX_COLUMNS = 7
MAX_HEADER_CHARS = 16
MAX_CELL_CHARS = 60
WIDTH_BUDGET = 100  # sum over columns of (widest cell + 4) characters: ~720 px at a 1024 px wide window
MAX_LINK_CHARS = 100
MAX_IMAGE_BYTES = 100_000  # the one inline picture allowed per artifact (the contact sheet: a 720 px JPEG, ~60 KB)
SMALL_FRAMES = {"frames": {"frame_size_px": 64, "max_frames": 8}}

_IMAGE = re.compile(r"!\[[^\]]*\]\((data:image/jpeg;base64,([A-Za-z0-9+/=]+))\)")
_LINK = re.compile(r"\[[^\]]*\]\(([^)]*)\)")
_URL = re.compile(r"(?:https?|file)://\S+")


def _cell(text: str) -> str:
    """A cell as the UI shows it: without the markdown emphasis and code marks."""
    return text.strip().replace("**", "").replace("`", "")


def markdown_tables(markdown: str) -> list[list[list[str]]]:
    """Every table of `markdown` as rows of cells (header first, the `---` line left out)."""
    tables: list[list[list[str]]] = []
    current: list[list[str]] | None = None
    for line in markdown.splitlines():
        if not line.startswith("|"):
            current = None
            continue
        cells = [_cell(c) for c in line.strip().strip("|").split("|")]
        if all(re.fullmatch(r":?-+:?", c) for c in cells):
            continue
        if current is None:
            current = []
            tables.append(current)
        current.append(cells)
    return tables


def table_problems(rows: list[list[str]]) -> list[str]:
    """What makes a table (header first) too wide for the UI; empty when it fits."""
    header, problems = rows[0], []
    if len(header) > MAX_COLUMNS:
        problems.append(f"{len(header)} columns > {MAX_COLUMNS}: {header}")
    problems += [f"header {h!r} > {MAX_HEADER_CHARS} chars" for h in header if len(h) > MAX_HEADER_CHARS]
    problems += [f"cell {c!r} > {MAX_CELL_CHARS} chars" for row in rows for c in row if len(c) > MAX_CELL_CHARS]
    if any(len(row) != len(header) for row in rows):
        problems.append(f"ragged rows under {header}")
    width = sum(max(len(row[j]) for row in rows if j < len(row)) + 4 for j in range(len(header)))
    if width > WIDTH_BUDGET:
        problems.append(f"table {header} is {width} characters wide > {WIDTH_BUDGET}")
    return problems


def markdown_problems(markdown: str) -> list[str]:
    """Every reason `markdown` would not fit the UI: wide tables, long links, base64 outside the one picture."""
    problems = [p for table in markdown_tables(markdown) for p in table_problems(table)]
    images = _IMAGE.findall(markdown)
    if len(images) > 1:
        problems.append(f"{len(images)} inline pictures > 1")
    problems += [
        f"inline picture of {len(base64.b64decode(b))} bytes"
        for _, b in images
        if len(base64.b64decode(b)) > MAX_IMAGE_BYTES
    ]
    rest = _IMAGE.sub("", markdown)
    if "data:" in rest or "base64," in rest:
        problems.append("a data: URI or base64 outside a markdown picture (the UI would print it as text)")
    links = [u for u in _LINK.findall(rest) + _URL.findall(rest) if len(u) > MAX_LINK_CHARS]
    problems += [f"link of {len(u)} chars > {MAX_LINK_CHARS}: {u[:60]}…" for u in links]
    return problems


def table_artifact_problems(table: list[dict[str, Any]]) -> list[str]:
    """The same limits for a table artifact (a list of row dicts; the keys are the headers)."""
    header = list(table[0])
    return table_problems([header] + [[str(row[k]) for k in header] for row in table])


# The checker itself, on markdown made to break it --------------------------------------------------------------------


def test_the_checker_names_each_problem() -> None:
    wide = "| " + " | ".join(f"c{j}" for j in range(8)) + " |\n|" + "---|" * 8 + "\n| " + " | ".join("x" * 8) + " |\n"
    assert markdown_problems(wide) == ["8 columns > 7: ['c0', 'c1', 'c2', 'c3', 'c4', 'c5', 'c6', 'c7']"]
    long_header = "| organ | positives / negatives |\n|---|---|\n| liver | 1 / 2 |\n"
    assert markdown_problems(long_header) == ["header 'positives / negatives' > 16 chars"]
    clipped = (
        "| table | split | rows by organ/label |\n|---|---|---|\n| organ_rows | train | " + "liver 1, " * 9 + "|\n"
    )
    assert markdown_problems(clipped) == [
        "header 'rows by organ/label' > 16 chars",
        f"cell {'liver 1, ' * 8 + 'liver 1,'!r} > 60 chars",
        "table ['table', 'split', 'rows by organ/label'] is 107 characters wide > 100",
    ]
    jpeg = base64.b64encode(b"\xff\xd8" + b"\0" * 100).decode()
    assert markdown_problems(f"![sheet](data:image/jpeg;base64,{jpeg})\n") == []
    as_link = f"data:image/jpeg;base64,{jpeg}"  # a link, not a picture: the UI prints the whole URI
    assert markdown_problems(f"[sheet]({as_link})\n") == [
        "a data: URI or base64 outside a markdown picture (the UI would print it as text)",
        f"link of 159 chars > 100: {as_link[:60]}…",
    ]
    url = "https://example.org/" + "a" * 90
    assert markdown_problems(f"see {url}\n") == [f"link of 110 chars > 100: {url[:60]}…"]


# Constructed inputs, exact values ------------------------------------------------------------------------------------


def _positive(organ: str, long_mm: float, detected: bool) -> dict[str, Any]:
    s = float(detected)
    return {
        "organ": organ,
        "has_lesion": True,
        "long_axis_mm": long_mm,
        "score_existence": s,
        "score_size": s,
        "score_location": s,
        "score_enhancement": s,
        "score_k_hit": s,
        "pred_has_lesion": detected,
    }


def _negative(organ: str, correct: bool) -> dict[str, Any]:
    return {
        "organ": organ,
        "has_lesion": False,
        "long_axis_mm": None,
        "score_existence": float(correct),
        "score_size": None,
        "score_location": None,
        "score_enhancement": None,
        "score_k_hit": None,
        "pred_has_lesion": not correct,
    }


# liver: every answer right (the widest cells: 100.00 and 100.0–100.0); pancreas: 1 of 2 lesions (one small, missed),
# 1 of 2 negatives; kidney: one large lesion found, no negative (Spec, B-Acc n/a).
PREDICTIONS = (
    [_positive("liver", 15.0, True), _positive("liver", 30.0, True), _negative("liver", True)] * 40
    + [_positive("pancreas", 12.0, False), _positive("pancreas", 40.0, True)]
    + [_negative("pancreas", True), _negative("pancreas", False)]
    + [_positive("kidney", 50.0, True)]
)


def test_evaluation_tables_fit_with_exact_values() -> None:
    markdown = evaluate(PREDICTIONS, n_bootstrap=0).to_markdown()
    assert markdown_problems(markdown) == []
    assert markdown_tables(markdown) == [
        [
            ["organ", "pos / neg", "Sen", "Sen ≤2", "Sen >2", "Spec", "B-Acc"],
            ["liver", "80 / 40", "100.00", "100.00", "100.00", "100.00", "100.00"],
            ["pancreas", "2 / 2", "50.00", "0.00", "100.00", "50.00", "50.00"],
            ["kidney", "1 / 0", "100.00", "n/a", "100.00", "n/a", "n/a"],
            ["average", "", "", "", "", "", "75.00"],
        ],
        [
            ["organ", "pos", "Size", "Location", "Enhancement", "K-Hit"],
            ["liver", "80", "100.00", "100.00", "100.00", "100.00"],
            ["pancreas", "2", "50.00", "50.00", "50.00", "50.00"],
            ["kidney", "1", "100.00", "100.00", "100.00", "100.00"],
            ["average", "", "83.33", "83.33", "83.33", "83.33"],
        ],
    ]
    assert "Table 2 overall (mean of its four averages): **83.33**" in markdown
    assert markdown.endswith("No intervals (n_bootstrap=0).\n")


def test_evaluation_interval_tables_fit() -> None:
    markdown = evaluate(PREDICTIONS, n_bootstrap=200, seed=3).to_markdown()
    assert markdown_problems(markdown) == []
    tables = markdown_tables(markdown)
    assert [t[0] for t in tables] == [
        ["organ", "pos / neg", "Sen", "Sen ≤2", "Sen >2", "Spec", "B-Acc"],
        ["organ", "Sen", "Sen ≤2", "Sen >2", "Spec", "B-Acc"],
        ["organ", "pos", "Size", "Location", "Enhancement", "K-Hit"],
        ["organ", "Size", "Location", "Enhancement", "K-Hit"],
    ]
    assert tables[1][1] == ["liver", *["100.0–100.0"] * 5]  # the widest interval cell
    assert tables[1][3] == ["kidney", "100.0–100.0", "n/a", "100.0–100.0", "n/a", "n/a"]
    assert tables[0][1] == ["liver", "80 / 40", *["100.00"] * 5]  # values stay apart from their intervals
    assert "Intervals: 95 % percentile bootstrap, 200 replicates, rows resampled within organ, seed 3." in markdown


def _sft_summary() -> dict[str, Any]:
    big = {
        "kidney/negative": 21043,
        "kidney/positive": 12001,
        "liver/negative": 20876,
        "liver/positive": 10987,
        "pancreas/negative": 23456,
        "pancreas/positive": 9876,
    }
    return {
        "pipeline_version": "0.1.0",
        "git_sha": "8703ee7d0eb4e91e2b5afbb33d5c8eb00b9efc25-dirty",
        "config_fingerprint": "b096f6162c919f18",
        "split_source": "IID split files",
        "cases": 9262,
        "cases_resumed_from_store": 0,
        "seconds": 5000.0,
        "cases_per_s": 1.852,
        "organ_rows": {"test": dict(big, total=sum(big.values())), "train": dict(big, total=sum(big.values()))},
        "sft_rows": {"train": {"liver/positive": 10987, "liver/negative": 10987, "total": 21974}},
        "rejections": {"labels/mask_grid_mismatch": 12, "load/corrupt_gzip": 3},
        "qa_flags": {"organ_volume_low": 4},
        "warnings": [],
        "output_dir": "/data/out",
        "tables": {"findings": "/data/out/findings", "sft": "/data/out/sft", "rejections": "/data/out/rejections"},
    }


def test_sft_summary_fits_with_five_digit_counts() -> None:
    markdown = sft_summary_markdown(_sft_summary(), Path("/data/out/contact_sheet.png"))
    assert markdown_problems(markdown) == []
    assert markdown_tables(markdown) == [
        [
            ["table", "split", "rows", "liver", "pancreas", "kidney"],
            ["organ_rows", "test", "98239", "10987 / 20876", "9876 / 23456", "12001 / 21043"],
            ["organ_rows", "train", "98239", "10987 / 20876", "9876 / 23456", "12001 / 21043"],
            ["sft_rows", "train", "21974", "10987 / 10987", "0 / 0", "0 / 0"],
        ],
        [["step/reason", "cases"], ["labels/mask_grid_mismatch", "12"], ["load/corrupt_gzip", "3"]],
    ]
    assert "\nRows per organ: positive / negative.\n" in markdown


def test_hardset_summary_fits() -> None:
    summary = {
        "model": "http://127.0.0.1:8000/v1#Qwen/Qwen3-VL-2B-Instruct",
        "predictions": 27786,
        "failed_predictions": 0,
        "hard_in_train": 9000,
        "train_rows_scored": 21974,
        "rl_hardset_rows": 2000,
        "target_size": 2000,
        "rl_hardset_by_organ": {"liver": 700, "pancreas": 600, "kidney": 700},
        "reasons": {"existence": 900, "size": 1500},
        "seconds": 812.5,
        "tables": {"predictions": "/data/out/predictions", "rl_hardset": "/data/out/rl_hardset"},
    }
    metrics = "## SFT model on the train split\n\n" + evaluate(PREDICTIONS, n_bootstrap=50).to_markdown()
    markdown = hardset_summary_markdown(summary, metrics)
    assert markdown_problems(markdown) == []
    assert len(markdown_tables(markdown)) == 4


def test_publish_summary_fits_with_a_long_location() -> None:
    location = "file:///home/someone/projects/e-mrl/demo-output/releases/emrl/abdomen-atlas-sft/.tags/v1.0.0"
    result = {
        "repo_id": "emrl/abdomen-atlas-sft",
        "tag": "v1.0.0",
        "status": "published",
        "target": "local",
        "message": f"Published emrl/abdomen-atlas-sft v1.0.0 to {location[7:]}.",
        "url": location,
        "commit": None,
        "uploaded": True,
        "rows": {"test": 30, "train": 74},
        "images_decoded": {"test": 8, "train": 8},
        "plan": [
            {"path": "README.md", "action": "add", "bytes": 10217},
            {"path": "data/train-00000-of-00001.parquet", "action": "add", "bytes": 1469150},
        ],
    }
    markdown = publish_summary_markdown(result)
    assert markdown_problems(markdown) == []
    assert f"- location: {location}\n" in markdown  # a list line wraps; a table cell would be cut off
    assert markdown_tables(markdown) == [
        [["split", "rows", "images"], ["test", "30", "8"], ["train", "74", "8"]],
        [
            ["file", "action", "bytes"],
            ["README.md", "add", "10217"],
            ["data/train-00000-of-00001.parquet", "add", "1469150"],
        ],
    ]


def test_rejection_table_shortens_the_detail() -> None:
    path = "mask_only/BDMAP_00000015/segmentations/liver.nii.gz"
    detail = f"{path}: mask grid is rotated or scaled relative to the CT's (mask shape (48, 44, 12) vs CT shape ...)"
    rejections = [
        Rejection("BDMAP_00000015", "liver", "labels", RejectReason.MASK_GRID_MISMATCH, detail, path),
        Rejection("BDMAP_00000014", None, "load", RejectReason.CORRUPT_GZIP, "gzip member 1 is corrupt", None),
    ]
    table = rejection_table(rejections)
    assert table == [
        {
            "case_id": "BDMAP_00000015",
            "organ": "liver",
            "step/reason": "labels/mask_grid_mismatch",
            "detail": "segmentations/liver.nii.gz: mask grid i…",
        },
        {
            "case_id": "BDMAP_00000014",
            "organ": "",
            "step/reason": "load/corrupt_gzip",
            "detail": "gzip member 1 is corrupt",
        },
    ]
    assert len(table[0]["detail"]) == 40
    assert table_artifact_problems(table) == []
    assert rejection_table([]) == [{"case_id": "", "organ": "", "step/reason": "none", "detail": ""}]
    assert clip("abc", 3) == "abc" and clip("abcd", 3) == "ab…"


# Every artifact of a real run ----------------------------------------------------------------------------------------


def _artifacts_of(flow_run_id: Any) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        return client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )


def _problems(artifacts: dict[str, Any]) -> dict[str, list[str]]:
    return {
        key: markdown_problems(a.data) if a.type == "markdown" else table_artifact_problems(json.loads(a.data))
        for key, a in artifacts.items()
    }


@pytest.fixture(scope="module")
def built(prefect_harness, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A real build-sft-set run on a 16-case synthetic atlas (with its defective cases); its output and artifacts."""
    from flows.build_sft_set import build_sft_set_flow

    root = tmp_path_factory.mktemp("artifacts")
    write_atlas(root / "atlas", demo_specs(16))
    state = build_sft_set_flow(
        atlas_root=str(root / "atlas"),
        output_dir=str(root / "out"),
        cases_per_task=4,
        max_workers=2,
        config=SMALL_FRAMES,
        return_state=True,
    )
    return root / "out", {a.key: a for a in _artifacts_of(state.state_details.flow_run_id) if a.key}


@pytest.mark.slow
def test_every_artifact_of_a_build_sft_set_run_fits(built: tuple[Path, dict[str, Any]]) -> None:
    _, artifacts = built
    assert set(artifacts) == {
        "build-sft-set-counts",
        "build-sft-set-rejections",
        "build-sft-set-summary",
        "build-sft-set-qa",
        "build-sft-set-contact-sheet",
    }
    assert _problems(artifacts) == {key: [] for key in artifacts}
    (picture,) = _IMAGE.findall(artifacts["build-sft-set-contact-sheet"].data)
    assert base64.b64decode(picture[1])[:2] == b"\xff\xd8"  # a JPEG thumbnail, shown as a picture, never as a link
    assert len(json.loads(artifacts["build-sft-set-rejections"].data)) >= 2  # the atlas's defective cases


@pytest.fixture
def negative_model() -> Iterator[str]:
    """A loopback OpenAI-compatible endpoint that never sees a lesion (the deployment tests' stub); yields …/v1."""
    from tests.cli.test_deployments import _NegativeReportHandler

    with loopback_http(_NegativeReportHandler) as base:
        yield f"{base}/v1"


@pytest.mark.slow
def test_every_artifact_of_a_build_rl_hardset_run_fits(
    built: tuple[Path, dict[str, Any]], negative_model: str, tmp_path: Path
) -> None:
    from flows.build_rl_hardset import build_rl_hardset_flow

    out, _ = built
    state = build_rl_hardset_flow(
        sft_dir=str(out / "sft"),
        output_dir=str(tmp_path),
        backend="openai",
        endpoint_url=negative_model,
        endpoint_model="negative-stub",
        n_bootstrap=50,
        return_state=True,
    )
    artifacts = {a.key: a for a in _artifacts_of(state.state_details.flow_run_id) if a.key}
    assert set(artifacts) == {"build-rl-hardset-summary", "build-rl-hardset-rows"}
    assert _problems(artifacts) == {key: [] for key in artifacts}
    summary = artifacts["build-rl-hardset-summary"].data
    assert summary.count("| organ | pos / neg | Sen | Sen ≤2 | Sen >2 | Spec | B-Acc |") == 2  # train and test
    assert summary.count("#### Table 1: 95 % intervals") == 2

"""The build-sft-set library: gathering from the case store, rejection rows, accounting and the run summary."""

from __future__ import annotations

from pathlib import Path

import pytest

from emrl_data import __version__
from emrl_data.config import CurateConfig, SftConfig
from emrl_data.labeling.case_store import CaseStore
from emrl_data.labeling.curate import CaseResult
from emrl_data.outcome import Rejection, RejectReason
from emrl_data.reading.atlas import AtlasPlan
from emrl_data.sources import Source
from emrl_data.tables.sft_set import (
    build_summary,
    check_every_case_accounted,
    gather_case_results,
    rejection_rows,
    rows_with_frames,
    select_sft_rows,
    sft_set_provenance,
    summary_markdown,
    unexpected_errors,
)


A, B, C = "BDMAP_00000001", "BDMAP_00000002", "BDMAP_00000003"


def _light(i: int, organ: str, split: str, has_lesion: bool) -> dict:
    return {"case_id": f"BDMAP_{i:08d}", "organ": organ, "split": split, "has_lesion": has_lesion}


# Train: liver 2 positives + 3 negatives, pancreas 1 positive, kidney 2 negatives (no positive); test: 2 rows.
_ROWS = [
    _light(5, "liver", "train", False),
    _light(1, "liver", "train", True),
    _light(2, "liver", "train", True),
    _light(3, "liver", "train", False),
    _light(4, "liver", "train", False),
    _light(6, "pancreas", "train", True),
    _light(7, "kidney", "train", False),
    _light(8, "kidney", "train", False),
    _light(9, "liver", "test", False),
    _light(10, "kidney", "test", True),
]


@pytest.mark.parametrize(
    ("ratio", "seed", "train_liver_negatives"),
    [
        (1.0, 0, [3, 5]),  # round(1.0 x 2) = 2 of 3, the smallest sha256(seed|case|organ)
        (1.0, 1, [3, 4]),  # another seed, another draw
        (0.5, 0, [5]),  # round(0.5 x 2) = 1
        (2.0, 0, [3, 4, 5]),  # 4 wanted, capped by the 3 there are
        (0.0, 0, []),
    ],
)
def test_select_sft_rows_samples_negatives_per_organ_and_keeps_the_test_split(
    ratio: float, seed: int, train_liver_negatives: list[int]
) -> None:
    chosen = select_sft_rows(_ROWS, SftConfig(negatives_per_positive=ratio, seed=seed))
    # Row order: split, organ, case id. Kidney has no train positive, so none of its train negatives is taken.
    assert [(r["split"], r["organ"], int(r["case_id"][6:])) for r in chosen] == [
        ("test", "kidney", 10),
        ("test", "liver", 9),
        *sorted(("train", "liver", i) for i in [1, 2, *train_liver_negatives]),
        ("train", "pancreas", 6),
    ]
    assert select_sft_rows(list(reversed(_ROWS)), SftConfig(negatives_per_positive=ratio, seed=seed)) == chosen


def _row(case_id: str, organ: str, split: str, has_lesion: bool, frame: bytes) -> dict:
    return {
        "case_id": case_id,
        "organ": organ,
        "split": split,
        "has_lesion": has_lesion,
        "frames": [{"bytes": frame, "path": f"{case_id}/{organ}/1.png"}],
    }


def _store(tmp_path: Path) -> tuple[CaseStore, dict[str, str]]:
    store = CaseStore(tmp_path / "cases")
    store.save(
        "kb",
        CaseResult(
            B,
            [_row(B, "pancreas", "train", True, b"pp"), _row(B, "liver", "test", False, b"l")],
            [Rejection(B, "kidney", "labels", RejectReason.EMPTY_ORGAN_MASK, "no voxel")],
            {"ct.nii.gz": "d2"},
        ),
    )
    store.save("ka", CaseResult(A, [_row(A, "liver", "train", False, b"abc")], [], {"ct.nii.gz": "d1"}))
    return store, {A: "ka", B: "kb"}


def test_gather_case_results_sorts_rows_and_keys_digests_by_row_id(tmp_path: Path) -> None:
    store, keys = _store(tmp_path)
    gathered = gather_case_results([A, B], store, keys)
    # split, organ, case id; frames are left in the store (only their size comes back)
    assert [(r["split"], r["organ"], r["case_id"], r["frames_bytes"]) for r in gathered.rows] == [
        ("test", "liver", B, 1),
        ("train", "liver", A, 3),
        ("train", "pancreas", B, 2),
    ]
    assert gathered.rejections == [Rejection(B, "kidney", "labels", RejectReason.EMPTY_ORGAN_MASK, "no voxel")]
    assert gathered.file_digests == {f"{A}/ct.nii.gz": "d1", f"{B}/ct.nii.gz": "d2"}


def test_gather_case_results_names_a_vanished_entry(tmp_path: Path) -> None:
    store, keys = _store(tmp_path)
    with pytest.raises(RuntimeError, match=f"case store entry of {C} vanished"):
        gather_case_results([A, C], store, keys | {C: "gone"})


def test_rows_with_frames_refuses_a_row_without_its_required_columns(tmp_path: Path) -> None:
    store, keys = _store(tmp_path)
    light = gather_case_results([A, B], store, keys).rows  # these toy rows lack the label columns of `sft`
    with pytest.raises(ValueError, match="sft: column 'lesion_count' is required but is null in row 'BDMAP_00000002'"):
        next(rows_with_frames(light, store, keys))


def test_rejection_rows_sort_by_case_organ_step_reason() -> None:
    rejections = [
        Rejection(B, "liver", "labels", RejectReason.EMPTY_ORGAN_MASK, "x"),
        Rejection(B, None, "load", RejectReason.MISSING_CT, "y", "BDMAP_00000002/ct.nii.gz"),
        Rejection(A, "liver", "frames", RejectReason.UNEXPECTED_ERROR, "z"),
    ]
    assert [(r["case_id"], r["organ"], r["reason"], r["path"]) for r in rejection_rows(rejections)] == [
        (A, "liver", "unexpected_error", None),
        (B, None, "missing_ct", "BDMAP_00000002/ct.nii.gz"),  # a whole-case rejection sorts before its organs
        (B, "liver", "empty_organ_mask", None),
    ]
    assert unexpected_errors(rejections) == [rejections[2]]
    source = Source("kits23", "CC-BY-NC-SA-4.0", "Heller et al.")
    assert [
        (r["source_dataset"], r["source_case_id"], r["source_license"]) for r in rejection_rows(rejections, source)
    ] == [
        ("kits23", A, "CC-BY-NC-SA-4.0"),
        ("kits23", B, "CC-BY-NC-SA-4.0"),
        ("kits23", B, "CC-BY-NC-SA-4.0"),
    ]


def test_check_every_case_accounted_names_the_cases_with_neither() -> None:
    rows = [{"case_id": A}]
    rejections = [Rejection(B, None, "load", RejectReason.MISSING_CT, "y")]
    check_every_case_accounted([A, B], rows, rejections)  # each has a row or a rejection
    with pytest.raises(RuntimeError, match=r"neither a row nor a rejection \(a bug\): \['BDMAP_00000003'\]"):
        check_every_case_accounted([A, B, C], rows, rejections)


def _summary(out: Path) -> dict:
    rows = [
        {"case_id": A, "organ": "liver", "split": "train", "has_lesion": True},
        {"case_id": B, "organ": "liver", "split": "test", "has_lesion": False},
    ]
    return build_summary(
        provenance={
            "pipeline_version": "0.1.0",
            "git_sha": "abc",
            "config_fingerprint": "f00",
            "config": {"x": 1},
            "split_source": "hash",
        },
        atlas_root=Path("/atlas"),
        output_dir=out,
        n_cases=3,
        n_resumed=1,
        rows=rows,
        sft_rows=rows[:1],
        rejections=[Rejection(C, None, "load", RejectReason.UNEXPECTED_ERROR, "boom")],
        qa_flags={"tiny_organ": 2},
        warnings=["CSV has 2 unknown cases"],
        file_digests={f"{A}/ct.nii.gz": "d1"},
        elapsed_s=1.5,
    )


def test_build_summary_counts_rows_rejections_and_leaves_the_full_config_out() -> None:
    assert _summary(Path("/out")) == {
        "pipeline_version": "0.1.0",
        "git_sha": "abc",
        "config_fingerprint": "f00",
        "split_source": "hash",
        "atlas_root": "/atlas",
        "output_dir": "/out",
        "cases": 3,
        "cases_resumed_from_store": 1,
        "organ_rows": {"test": {"liver/negative": 1, "total": 1}, "train": {"liver/positive": 1, "total": 1}},
        "sft_rows": {"train": {"liver/positive": 1, "total": 1}},
        "rejections": {"load/unexpected_error": 1},
        "unexpected_errors": 1,
        "qa_flags": {"tiny_organ": 2},
        "warnings": ["CSV has 2 unknown cases"],
        "input_files": {f"{A}/ct.nii.gz": "d1"},
        "seconds": 1.5,
        "cases_per_s": 2.0,
        "tables": {"findings": "/out/findings", "sft": "/out/sft", "rejections": "/out/rejections"},
    }


def test_summary_markdown_lists_counts_rejections_flags_and_outputs() -> None:
    summary = _summary(Path("/out"))
    assert summary_markdown(summary, Path("/out/contact_sheet.png")) == (
        "# build-sft-set\n\n"
        "- cases: **3** (1 resumed from the case store)\n"
        "- pipeline 0.1.0, config `f00`, git `abc`\n"
        "- split source: hash; took 1.5 s (2.0 cases/s)\n\n"
        "| table | split | rows | liver |\n| --- | --- | --- | --- |\n"
        "| organ_rows | test | **1** | 0 / 1 |\n"
        "| organ_rows | train | **1** | 1 / 0 |\n"
        "| sft_rows | train | **1** | 1 / 0 |\n\n"
        "Rows per organ: positive / negative.\n\n"
        "| step/reason | cases |\n|---|---|\n"
        "| load/unexpected_error | 1 |\n\n"
        "QA flags (see qa.md): tiny_organ 2\n\n"
        "Atlas warnings (1, see qa.md): CSV has 2 unknown cases\n\n"
        "Outputs:\n\n"
        "- `findings`: /out/findings\n- `sft`: /out/sft\n- `rejections`: /out/rejections\n"
        "- QA report: /out/qa.md\n"
        "- contact sheet (key frames with boxes): /out/contact_sheet.png\n"
    )
    no_rejections = summary | {"rejections": {}, "qa_flags": {}, "warnings": []}
    assert "| none | 0 |\n\nOutputs:" in summary_markdown(no_rejections, None)
    assert "contact sheet" not in summary_markdown(no_rejections, None)


def test_sft_set_provenance_records_versions_both_configs_and_the_plan() -> None:
    cfg = CurateConfig()
    plan = AtlasPlan("split", (), {}, "case-id hash", {}, ())
    provenance = sft_set_provenance(cfg, SftConfig(negatives_per_positive=2.0, seed=3), plan, git_sha=None)
    assert provenance == {
        "pipeline_version": __version__,
        "git_sha": None,
        "config_fingerprint": cfg.fingerprint(),
        "config": cfg.to_dict(),
        "sft_config": {"negatives_per_positive": 2.0, "seed": 3, "test_fraction": 0.10},
        "atlas_layout": "split",
        "split_source": "case-id hash",
        "sources": [
            {
                "dataset": "abdomenatlas",
                "licence": "CC-BY-NC-SA-4.0",
                "citation": "Bassi et al., RadGPT: constructing 3D image-text tumor datasets, arXiv 2501.04678",
            }
        ],
    }

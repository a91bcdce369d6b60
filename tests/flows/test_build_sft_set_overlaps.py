"""The same CT in two datasets through the real flow: an AbdomenAtlas Mini-cropped atlas and the same phantoms re-packed
as MSD Task03 (LPS, uint16 with slope and intercept); `emrl overlaps` lists the pairs, and `--exclude-overlaps-with`
refuses the atlas' test case that is an MSD training CT, as one rejection row."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from cli.main import main
from emrl_data.synthetic import CaseSpec
from emrl_data.types import Split
from flows.build_sft_set import build_sft_set_flow
from tests.emrl_data.test_fingerprint import LIVER_LESION, SHAPE, mini_cropped_atlas, msd_repack


def _table(folder: Path) -> list[dict]:
    return [row for path in sorted((folder / "data").glob("*.parquet")) for row in pq.read_table(path).to_pylist()]


def test_overlaps_are_listed_and_a_test_case_trained_on_elsewhere_is_refused(
    prefect_harness, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    one = CaseSpec("BDMAP_00000001", shape=SHAPE, lesions=LIVER_LESION, seed=1, split=Split.TEST)
    two = CaseSpec("BDMAP_00000002", shape=SHAPE, seed=2, split=Split.TEST)
    three = CaseSpec("BDMAP_00000003", shape=SHAPE, seed=3, split=Split.TRAIN)
    mini_cropped_atlas(tmp_path / "atlas", [one, two, three])
    msd_repack(tmp_path / "msd", [one, three], "uint16_scaled")  # liver_0 = case 1, liver_1 = case 3; both train
    out_atlas, out_msd = tmp_path / "out-atlas", tmp_path / "out-msd"
    build_sft_set_flow(atlas_root=str(tmp_path / "msd"), output_dir=str(out_msd), max_workers=1)
    assert {(r["case_id"], r["split"]) for r in _table(out_msd / "findings")} == {
        ("liver_0", "train"),
        ("liver_1", "train"),
    }

    summary = build_sft_set_flow(
        atlas_root=str(tmp_path / "atlas"),
        output_dir=str(out_atlas),
        max_workers=1,
        exclude_overlaps_with=str(out_msd),
    )

    detail = (
        "BDMAP_00000001: a test case that is the same CT as the training case(s) liver_0 (32 slices) of "
        f"{out_msd.resolve()}: a train/test leak; the case is not used"
    )
    assert [tuple(r.values()) for r in _table(out_atlas / "rejections")] == [
        ("BDMAP_00000001", None, "overlaps", "overlaps_training_ct", detail, None)
        + ("abdomenatlas", "BDMAP_00000001", "CC-BY-NC-SA-4.0")  # the row's source
    ]
    findings = _table(out_atlas / "findings")
    assert sorted({(r["case_id"], r["split"]) for r in findings}) == [
        ("BDMAP_00000002", "test"),
        ("BDMAP_00000003", "train"),
    ]
    assert len(findings) == 6  # three organs of each kept case (the crop moved no mask off its CT)
    sft = _table(out_atlas / "sft")
    assert sft and "BDMAP_00000001" not in {r["case_id"] for r in sft}
    assert summary["cases_refused_as_overlaps"] == 1
    assert summary["rejections"] == {"overlaps/overlaps_training_ct": 1}
    text = (out_atlas / "summary.md").read_text()
    assert "- test cases refused as training CTs of --exclude-overlaps-with: 1" in text

    main(["overlaps", str(out_atlas), str(out_msd)])

    assert (out_atlas / "overlaps.csv").read_text() == (
        "case_id_a,split_a,case_id_b,split_b,matched_slices,z_start_a_vox,z_start_b_vox\n"
        "BDMAP_00000001,test,liver_0,train,32,0,0\n"
        "BDMAP_00000003,train,liver_1,train,32,0,0\n"
    )
    printed = capsys.readouterr().out
    assert "| BDMAP_00000001 | test | liver_0 | train | 32 |" in printed
    assert f"2 pair(s) of the same CT among 3 x 2 cases; written to {out_atlas / 'overlaps.csv'}" in printed


def test_overlaps_without_a_fingerprint_table_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["overlaps", str(tmp_path / "a"), str(tmp_path / "b")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'a' / 'fingerprints.parquet'}: no fingerprint table" in err


def test_build_sft_set_refuses_an_exclusion_folder_without_a_fingerprint_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(
            ["build-sft-set", str(tmp_path / "atlas"), str(tmp_path / "out"), "--exclude-overlaps-with", str(tmp_path)]
        )
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"--exclude-overlaps-with {tmp_path}: no fingerprints.parquet there" in err
    assert not (tmp_path / "out").exists()  # refused before anything ran


def _strip_fingerprints(store: Path) -> int:
    """Rewrite every case-store entry without its fingerprint, as an entry written before fingerprints were kept."""
    stripped = 0
    for path in sorted(store.glob("*.case.json")):
        payload = json.loads(json.loads(path.read_text())["payload"])
        if payload.pop("fingerprint", None) is not None:
            stripped += 1
        body = json.dumps(payload, sort_keys=True, allow_nan=True)
        path.write_text(json.dumps({"sha256": hashlib.sha256(body.encode()).hexdigest(), "payload": body}))
    return stripped


def test_a_rerun_gives_stored_cases_their_fingerprints_and_the_same_shards(prefect_harness, tmp_path: Path) -> None:
    one = CaseSpec("BDMAP_00000001", shape=SHAPE, lesions=LIVER_LESION, seed=1, split=Split.TEST)
    two = CaseSpec("BDMAP_00000002", shape=SHAPE, seed=2, split=Split.TRAIN)
    mini_cropped_atlas(tmp_path / "atlas", [one, two])
    out = tmp_path / "out"
    build_sft_set_flow(atlas_root=str(tmp_path / "atlas"), output_dir=str(out), max_workers=1)
    shards = {p.relative_to(out): p.read_bytes() for p in sorted(out.glob("*/data/*.parquet"))}
    table = (out / "fingerprints.parquet").read_bytes()
    assert _strip_fingerprints(out / ".work" / "cases") == 2
    (out / "fingerprints.parquet").unlink()

    summary = build_sft_set_flow(atlas_root=str(tmp_path / "atlas"), output_dir=str(out), max_workers=1)

    assert summary["cases_resumed_from_store"] == 2
    assert (out / "fingerprints.parquet").read_bytes() == table
    assert {p.relative_to(out): p.read_bytes() for p in sorted(out.glob("*/data/*.parquet"))} == shards
    assert len(shards) == 5 and "cases_refused_as_overlaps" not in summary  # findings, sft: 2 splits; rejections

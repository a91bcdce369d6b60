"""Adversarial inputs: every hostile or messy input ends as a row or a rejection naming the file.

Files that cannot be read are made with symlink loops, dangling links and folders where files belong (a real OSError
even for root) and with chmod 000; under root, which chmod 000 does not stop, the mode-000 tests curate in a forked
child that dropped to uid 65534.
"""

from __future__ import annotations

import csv
import gzip
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import nibabel as nib
import numpy as np
import pyarrow as pa
import pytest

from emrl_data.config import CurateConfig
from emrl_data.labeling.case_store import CaseStore
from emrl_data.labeling.checksums import case_cache_key, file_checksum
from emrl_data.labeling.curate import CaseResult, curate_case
from emrl_data.outcome import Rejection, RejectReason
from emrl_data.reading.atlas import (
    AtlasError,
    NoCasesError,
    discover_cases,
    plan_atlas,
    read_metadata,
    read_split_files,
)
from emrl_data.synthetic import CaseSpec, LesionSpec, write_atlas
from emrl_data.tables.records import SCHEMAS
from emrl_data.types import Organ, Split


CFG = CurateConfig()
SHAPE = (96, 80, 32)
LIVER_LESION = LesionSpec(Organ.LIVER, "5", (12.0, 10.0, 10.0), "hypo")
KIDNEY_LESION = LesionSpec(Organ.KIDNEY, "left", (8.0, 8.0, 8.0), "hyper")
ID1, ID2, ID3 = "BDMAP_00000001", "BDMAP_00000002", "BDMAP_00000003"


def _atlas(root: Path, ids: tuple[str, ...] = (ID1,), **kwargs) -> Path:
    write_atlas(root, [CaseSpec(i, shape=SHAPE, lesions=(LIVER_LESION, KIDNEY_LESION)) for i in ids], **kwargs)
    return root


def _curate(root: Path) -> tuple[list[dict], list[Rejection], set[str]]:
    """Plan and curate every case; return rows, rejections and the ids accounted for."""
    plan = plan_atlas(root)
    rows, rejections = [], list(plan.rejections)
    for ref in plan.refs:
        result = curate_case(ref, split=plan.splits[ref.case_id], cfg=CFG, metadata=plan.metadata.get(ref.case_id))
        rows += result.rows
        rejections += result.rejections
    return rows, rejections, {r["case_id"] for r in rows} | {r.case_id for r in rejections}


def _loop(path: Path) -> None:
    """Replace `path` by a symlink to itself: open() raises OSError (ELOOP) for every user, root included."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    path.symlink_to(path.name)


def _chmod_blocks_reads(tmp_path: Path) -> bool:
    probe = tmp_path / "probe"
    probe.write_bytes(b"x")
    probe.chmod(0)
    try:
        probe.read_bytes()
    except PermissionError:
        return True
    finally:
        probe.chmod(0o644)
    return False


# --------------------------------------------------------------------------------------------------------------------
# Discovery: every case-like entry is a ref or a rejection


def _touch(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")


def test_discovery_accounts_for_loops_files_wrong_case_and_misplaced_folders(tmp_path: Path) -> None:
    _touch(tmp_path / "image_only" / ID1 / "ct.nii.gz")
    _touch(tmp_path / "mask_only" / ID1 / "segmentations/liver.nii.gz")
    (tmp_path / "image_only/BDMAP_00000002").symlink_to("BDMAP_00000002")  # a symlink to itself
    (tmp_path / "image_only/BDMAP_00000003").symlink_to(".")  # a symlink to its own parent
    _touch(tmp_path / "image_only/BDMAP_00000004")  # a file where a folder belongs
    _touch(tmp_path / "image_only/bdmap_00000005/ct.nii.gz")  # lower-case prefix
    _touch(tmp_path / "BDMAP_00000006/ct.nii.gz")  # a case folder outside image_only/ (mixed layouts)
    _touch(tmp_path / "image_only/notes/readme.txt")  # not case-like: a warning
    _touch(tmp_path / "image_only/.DS_Store")  # hidden entries: one summed warning
    _touch(tmp_path / "image_only/._BDMAP_00000001")

    found = discover_cases(tmp_path)

    assert found.layout == "split"
    assert [r.case_id for r in found.refs] == [ID1]
    assert [(r.case_id, r.reason, r.path) for r in found.rejections] == [
        ("BDMAP_00000002", RejectReason.NOT_A_CASE, "image_only/BDMAP_00000002"),
        ("BDMAP_00000003", RejectReason.NOT_A_CASE, "image_only/BDMAP_00000003"),
        ("BDMAP_00000004", RejectReason.NOT_A_CASE, "image_only/BDMAP_00000004"),
        ("BDMAP_00000006", RejectReason.NOT_A_CASE, "BDMAP_00000006"),
        ("bdmap_00000005", RejectReason.INVALID_CASE_ID, "image_only/bdmap_00000005"),
    ]
    details = [r.detail for r in found.rejections]
    assert "does not resolve" in details[0] and "own parent" in details[1] and "a file where" in details[2]
    assert "mixed layouts" in details[3] and "did you mean 'BDMAP_00000005'" in details[4]
    assert found.warnings == (
        "image_only/notes: not a case folder (name does not start with BDMAP), ignored",
        "image_only/: 2 hidden entries ignored (.DS_Store, ...)",
    )


def test_combined_layout_beside_an_empty_stray_image_only_is_found_with_a_warning(tmp_path: Path) -> None:
    _touch(tmp_path / ID1 / "ct.nii.gz")
    (tmp_path / "image_only").mkdir()

    found = discover_cases(tmp_path)

    assert found.layout == "combined" and [r.case_id for r in found.refs] == [ID1]
    assert found.warnings == ("image_only/ hold no case folder: ignored (combined layout)",)


def test_an_atlas_without_cases_fails_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "image_only").mkdir()
    with pytest.raises(NoCasesError) as excinfo:
        discover_cases(tmp_path)
    assert "\n" not in str(excinfo.value) and "no case under" in str(excinfo.value)
    _touch(tmp_path / "image_only/BDMAP_12x/ct.nii.gz")
    with pytest.raises(NoCasesError, match=r"1 case-like entry rejected \(first: folder 'image_only/BDMAP_12x'"):
        discover_cases(tmp_path)


def test_every_hostile_entry_ends_as_a_row_or_a_rejection(tmp_path: Path) -> None:
    root = _atlas(tmp_path, (ID1, ID2))
    (root / "image_only/BDMAP_00000007").symlink_to("BDMAP_00000007")
    _touch(root / "image_only/BDMAP_00000008")
    _touch(root / "image_only/bdmap_00000009/ct.nii.gz")

    rows, rejections, seen = _curate(root)

    assert seen == {ID1, ID2, "BDMAP_00000007", "BDMAP_00000008", "bdmap_00000009"}
    assert len(rows) == 6
    assert sorted((r.case_id, str(r.reason)) for r in rejections) == [
        ("BDMAP_00000007", "not_a_case"),
        ("BDMAP_00000008", "not_a_case"),
        ("bdmap_00000009", "invalid_case_id"),
    ]


def test_undecodable_file_names_reach_the_tables_escaped(tmp_path: Path) -> None:
    root = _atlas(tmp_path, (ID1,))
    os.mkdir(os.fsencode(root / "image_only") + b"/BDMAP_0000000\xff")  # not UTF-8: a surrogate in Python
    mask_dir = os.fsencode(root / "mask_only" / ID1 / "segmentations")
    shutil.copy(root / "mask_only" / ID1 / "segmentations/liver_lesion.nii.gz", mask_dir + b"/liver_\xffmass.nii.gz")

    rows, rejections, _ = _curate(root)

    (rejection,) = rejections
    assert rejection.case_id == "BDMAP_0000000\\udcff" and rejection.reason == RejectReason.INVALID_CASE_ID
    assert "unrecognised_lesion_file" in rows[0]["qa_flags"]
    assert rows[0]["warnings"][0].startswith("liver_\\udcffmass.nii*: lesion-like")
    pa.Table.from_pylist([r.to_row() for r in rejections], schema=SCHEMAS["rejections"])  # encodable
    pa.Table.from_pylist([{k: v for k, v in r.items() if k != "frames"} for r in rows])


# --------------------------------------------------------------------------------------------------------------------
# Per-case error boundary: unreadable files cost their case (CT) or their organ (mask), never the run


@pytest.mark.parametrize("kind", ["loop", "folder", "dangling"])
def test_an_unreadable_ct_rejects_its_case_naming_the_file(tmp_path: Path, kind: str) -> None:
    root = _atlas(tmp_path, (ID1, ID2))
    ct = root / "image_only" / ID2 / "ct.nii.gz"
    if kind == "loop":
        _loop(ct)
    elif kind == "folder":
        ct.unlink()
        ct.mkdir()
    else:
        ct.unlink()
        ct.symlink_to("nowhere.nii.gz")
    plan = plan_atlas(root)
    ref = plan.refs[1]
    assert case_cache_key(ref, CFG, "train") != case_cache_key(plan.refs[0], CFG, "train")  # never raises

    rows, rejections, _ = _curate(root)

    assert [(r.case_id, r.organ, r.step, r.reason, r.path) for r in rejections] == [
        (ID2, None, "load", RejectReason.UNREADABLE_FILE, f"image_only/{ID2}/ct.nii.gz")
    ]
    assert rejections[0].detail.startswith(f"image_only/{ID2}/ct.nii.gz: ")
    assert [r["case_id"] for r in rows] == [ID1] * 3


def test_an_unreadable_mask_costs_only_its_organ(tmp_path: Path) -> None:
    root = _atlas(tmp_path)
    _loop(root / "mask_only" / ID1 / "segmentations/pancreas.nii.gz")

    rows, rejections, _ = _curate(root)

    assert [(r.organ, r.step, r.reason, r.path) for r in rejections] == [
        ("pancreas", "labels", RejectReason.UNREADABLE_FILE, f"mask_only/{ID1}/segmentations/pancreas.nii.gz")
    ]
    assert [r["organ"] for r in rows] == ["liver", "kidney"]
    assert rows[0]["has_lesion"] and rows[1]["has_lesion"]


def test_an_unreadable_segmentations_folder_rejects_every_organ_but_not_the_run(tmp_path: Path) -> None:
    root = _atlas(tmp_path, (ID1, ID2))
    segmentations = root / "mask_only" / ID2 / "segmentations"
    _loop(segmentations)

    rows, rejections, _ = _curate(root)

    assert [(r.case_id, r.organ, r.reason) for r in rejections] == [
        (ID2, "liver", RejectReason.UNREADABLE_FILE),
        (ID2, "pancreas", RejectReason.UNREADABLE_FILE),
        (ID2, "kidney", RejectReason.UNREADABLE_FILE),
    ]
    assert all(r.path and r.path.startswith(f"mask_only/{ID2}/segmentations") for r in rejections)
    assert {r["case_id"] for r in rows} == {ID1}


def _curate_as_nobody(root: Path) -> tuple[list[tuple], list[tuple]]:
    """Run `_curate` in a forked child that dropped root to uid/gid 65534, where chmod 000 really blocks reads."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            rows, rejections, _ = _curate(root)
            out = {
                "rows": [(r["case_id"], r["organ"]) for r in rows],
                "rejections": [(r.case_id, r.organ, r.step, str(r.reason), r.path) for r in rejections],
            }
            os.write(write_end, json.dumps(out).encode())
        except BaseException as err:  # report anything to the parent
            os.write(write_end, json.dumps({"error": repr(err)}).encode())
            code = 1
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as fh:
        data = json.loads(fh.read() or b'{"error": "child wrote nothing"}')
    os.waitpid(pid, 0)
    assert "error" not in data, data["error"]
    return [tuple(r) for r in data["rows"]], [tuple(r) for r in data["rejections"]]


@pytest.mark.parametrize("target", ["ct", "mask", "segmentations", "case_folder"])
def test_mode_000_files_are_unreadable_file_rejections(tmp_path: Path, target: str) -> None:
    """Unreadable entries: a CT, a mask, `segmentations/` or a case folder with mode 000."""
    if os.geteuid() != 0 and not _chmod_blocks_reads(tmp_path):
        pytest.skip("chmod 000 does not block reads for this user (the symlink-loop tests cover OSError)")
    base = Path(tempfile.mkdtemp(prefix="emrl-mode000-"))  # traversable by uid 65534, unlike pytest's tmp_path
    try:
        base.chmod(0o755)
        root = _atlas(base / "atlas", (ID1, ID2))
        path = {
            "ct": root / "image_only" / ID2 / "ct.nii.gz",
            "mask": root / "mask_only" / ID2 / "segmentations/liver.nii.gz",
            "segmentations": root / "mask_only" / ID2 / "segmentations",
            "case_folder": root / "image_only" / ID2,
        }[target]
        path.chmod(0)
        if os.geteuid() == 0:
            rows, rejections = _curate_as_nobody(root)
        else:
            found_rows, found, _ = _curate(root)
            rows = [(r["case_id"], r["organ"]) for r in found_rows]
            rejections = [(r.case_id, r.organ, r.step, str(r.reason), r.path) for r in found]
        path.chmod(0o755)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    mask_dir = f"mask_only/{ID2}/segmentations"
    expected = {
        "ct": [(ID2, None, "load", "unreadable_file", f"image_only/{ID2}/ct.nii.gz")],
        "case_folder": [(ID2, None, "load", "unreadable_file", f"image_only/{ID2}/ct.nii.gz")],
        "mask": [(ID2, "liver", "labels", "unreadable_file", f"{mask_dir}/liver.nii.gz")],
        "segmentations": [
            (ID2, "liver", "labels", "unreadable_file", f"{mask_dir}/liver_lesion.nii.gz"),
            (ID2, "pancreas", "labels", "unreadable_file", f"{mask_dir}/pancreatic_lesion.nii.gz"),
            (ID2, "kidney", "labels", "unreadable_file", f"{mask_dir}/kidney_lesion.nii.gz"),
        ],
    }[target]
    assert rejections == expected
    kept = {"mask": [(ID2, "pancreas"), (ID2, "kidney")]}.get(target, [])
    assert rows == [(ID1, "liver"), (ID1, "pancreas"), (ID1, "kidney"), *kept]


def test_an_organ_level_error_keeps_the_other_organs(tmp_path: Path) -> None:
    root = _atlas(tmp_path)
    pancreas = root / "mask_only" / ID1 / "segmentations/pancreas.nii.gz"
    image = nib.load(str(pancreas))
    data = np.zeros(image.shape, dtype=np.int8)
    data[:4, :4, :4] = 1  # the mask sits in air: mean HU -1000
    nib.save(nib.Nifti1Image(data, image.affine, image.header), str(pancreas))

    rows, rejections, _ = _curate(root)

    (rejection,) = rejections
    assert rejection.organ == "pancreas" and rejection.case_id == ID1
    assert str(rejection.reason) == "mask_grid_mismatch"  # off the body, on the CT's own grid: organ-level
    assert "pancreas.nii.gz" in (rejection.path or "")
    assert [r["organ"] for r in rows] == ["liver", "kidney"]


# --------------------------------------------------------------------------------------------------------------------
# Metadata CSV and split files from many sources


HEADER = ["BDMAP ID", "number of liver lesion instances", "liver volume (cm^3)", "narrative report"]


def _write_csv(path: Path, lines: list[list[str]], delimiter: str = ",", encoding: str = "utf-8") -> None:
    text = "\n".join(delimiter.join(cells) for cells in [HEADER, *lines]) + "\n"
    path.write_bytes(text.encode(encoding))


@pytest.mark.parametrize("delimiter", [",", ";", "\t"])
def test_metadata_delimiters_are_sniffed(tmp_path: Path, delimiter: str) -> None:
    path = tmp_path / "meta.csv"
    _write_csv(path, [[ID1, "2.0", "1291.3", "Liver; two lesions, hypoattenuating"]], delimiter)
    # the report cell holds commas and semicolons: quoted, as a real exporter writes it
    path.write_text(path.read_text().replace("Liver; two lesions, hypoattenuating", '"Liver; two, three"'))

    rows, problems = read_metadata(path)

    assert problems == {}
    assert rows[ID1][Organ.LIVER].lesion_count == 2 and rows[ID1][Organ.LIVER].organ_volume_cm3 == 1291.3


def test_metadata_bad_cells_encodings_long_cells_and_duplicates(tmp_path: Path) -> None:
    path = tmp_path / "meta.csv"
    lines = [
        [ID1, "inf", "1200.0", "x"],  # non-finite
        [ID2, "1.0", "nan", "x" * 300_000],  # nan = absent (pandas); a cell over the csv module's default limit
        [ID3, "1.0", "900.0", "a"],
        [ID3, "2.0", "900.0", "a"],  # conflicting duplicate
        ["BDMAP_00000004", "0.0", "800.0", "b"],
        ["BDMAP_00000004", "0.0", "800.0", "b"],  # identical duplicate: one row
        ["BDMAP_00000005", "0.0", "-3.0", "c"],  # negative volume
        ["BDMAP_00000006", "0.0", "700.0"],  # a cell short
    ]
    _write_csv(path, lines)
    raw = path.read_bytes()
    raw += b"BDMAP_00000007,0.0,600.0,caf\xe9\n"  # cp1252 (Windows export): decoded
    raw += b"BDMAP_00000008,0.0,600.0,bad \x81 byte\n"  # neither UTF-8 nor cp1252: that row is rejected
    path.write_bytes(raw)

    rows, problems = read_metadata(path)

    assert sorted(rows) == [ID2, "BDMAP_00000004", "BDMAP_00000007"]
    assert rows[ID2][Organ.LIVER].organ_volume_cm3 is None
    assert rows["BDMAP_00000007"][Organ.LIVER].organ_volume_cm3 == 600.0
    assert sorted(problems) == [ID1, ID3, "BDMAP_00000005", "BDMAP_00000006", "BDMAP_00000008"]
    assert "'inf', not a finite non-negative number" in problems[ID1]
    assert problems[ID3] == f"meta.csv lines 4 and 5: two rows for {ID3} with different values (neither is used)"
    assert "'-3.0'" in problems["BDMAP_00000005"]
    assert "3 cells where the header has 4" in problems["BDMAP_00000006"]
    assert problems["BDMAP_00000008"] == (
        "meta.csv line 11: line 11 holds bytes that are neither UTF-8 nor cp1252 (or NUL)"
    )


def test_an_unclosed_quote_or_a_nul_byte_never_swallows_rows_silently(tmp_path: Path) -> None:
    path = tmp_path / "m.csv"
    path.write_bytes(
        b"BDMAP ID,number of liver lesion instances,narrative report\n"
        b'BDMAP_00000001,1.0,"a report\non two lines"\n'  # a legal multi-line cell
        b'BDMAP_00000002,1.0,"unclosed\n'
        b"BDMAP_00000003,2.0,fine\n"
        b'BDMAP_00000004,0.0,"closes the quote here"\n'
        b"BDMAP_00000005,0.0,x\n"
        b"BDMAP_00000006,1\x00.0,y\n"
    )

    rows, problems = read_metadata(path)

    assert sorted(rows) == [ID1, "BDMAP_00000005"]
    opened = "a quote opened on line 4 is not closed before line 5"
    assert problems == {
        ID2: f"m.csv line 4: {opened}",
        ID3: f"m.csv line 5: {opened}: swallowed into line 4",
        "BDMAP_00000004": f"m.csv line 6: {opened}: swallowed into line 4",
        "BDMAP_00000006": "m.csv line 8: line 8 holds bytes that are neither UTF-8 nor cp1252 (or NUL)",
    }


def test_a_bad_metadata_row_is_a_rejection_and_the_case_still_runs(tmp_path: Path) -> None:
    root = _atlas(tmp_path, (ID1, ID2))
    csv_path = root / "AbdomenAtlas3.0MiniWithMeta.csv"
    with csv_path.open(newline="") as fh:
        records = list(csv.DictReader(fh))
    conflicting = {**records[1], "number of liver lesion instances": "7.0"}  # ID2 again, another count
    with csv_path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(records[0]), delimiter=";")  # and a `;` export
        writer.writeheader()
        writer.writerows([*records, conflicting])

    rows, rejections, _ = _curate(root)

    assert [(r.case_id, r.reason, r.step) for r in rejections] == [(ID2, RejectReason.BAD_METADATA_ROW, "metadata")]
    assert len(rows) == 6
    assert [r["atlas_lesion_count"] for r in rows] == [1, 0, 1, None, None, None]


def test_an_id_in_two_split_files_is_a_split_conflict_never_a_leak(tmp_path: Path) -> None:
    root = _atlas(tmp_path, (ID1, ID2))
    (root / "TrainTestIDS/IID_train.csv").write_text(f"BDMAP ID\n{ID1}\n{ID2}\n")
    (root / "TrainTestIDS/IID_test.csv").write_bytes(f"BDMAP ID;note\n{ID2};caf\x81\n".encode("latin-1"))

    listing = read_split_files(root)
    assert listing is not None
    assert listing.splits == {ID1: Split.TRAIN}
    assert listing.conflicts == {ID2: ("TrainTestIDS/IID_train.csv", "TrainTestIDS/IID_test.csv")}
    plan = plan_atlas(root)
    assert [r.case_id for r in plan.refs] == [ID1]
    assert [(r.case_id, r.reason, r.path) for r in plan.rejections] == [
        (ID2, RejectReason.SPLIT_CONFLICT, "TrainTestIDS/IID_train.csv")
    ]
    assert "train/test leak" in plan.rejections[0].detail


@pytest.mark.parametrize("damage", ["no_id_column", "folder", "empty"])
def test_an_unusable_metadata_csv_is_a_run_warning_not_a_failure(tmp_path: Path, damage: str) -> None:
    root = _atlas(tmp_path)
    path = root / "AbdomenAtlas3.0MiniWithMeta.csv"
    if damage == "no_id_column":
        path.write_text("case;liver volume (cm^3)\nBDMAP_00000001;1200\n")
    elif damage == "folder":
        path.unlink()
        path.mkdir()
    else:
        path.write_bytes(b"")

    plan = plan_atlas(root)

    assert plan.metadata == {} and plan.rejections == () and [r.case_id for r in plan.refs] == [ID1]
    (warning,) = [w for w in plan.warnings if "IID_test.csv lists no valid case id" not in w]  # 1 case: all train
    assert warning.startswith("AbdomenAtlas3.0MiniWithMeta.csv not used: ")
    assert warning.endswith("; no atlas_* values in this run")


def test_split_files_that_cannot_be_used_stop_the_plan_in_one_line(tmp_path: Path) -> None:
    root = _atlas(tmp_path)
    (root / "TrainTestIDS/IID_test.csv").write_bytes(b"")
    assert plan_atlas(root).warnings == ("TrainTestIDS/IID_test.csv lists no valid case id (column 0)",)
    (root / "TrainTestIDS/IID_test.csv").unlink()
    (root / "TrainTestIDS/IID_test.csv").mkdir()  # a split decides train vs test: never guessed around
    with pytest.raises(AtlasError, match=r"^cannot use IID_test.csv: a folder where a CSV file belongs"):
        plan_atlas(root)


# --------------------------------------------------------------------------------------------------------------------
# Lesion files: the rule when <organ>_lesion is absent


def _rename(root: Path, old: str, *new: str) -> None:
    folder = root / "mask_only" / ID1 / "segmentations"
    data = (folder / f"{old}.nii.gz").read_bytes()
    (folder / f"{old}.nii.gz").unlink()
    for name in new:
        (folder / f"{name}.nii.gz").write_bytes(data)


@pytest.mark.parametrize(
    ("files", "expected_files", "has_lesion"),
    [
        (("liver_tumor",), ["liver_tumor"], True),
        (("liver_cyst", "liver_tumor"), ["liver_tumor", "liver_cyst"], True),
        (("hepatic_lesion",), ["hepatic_lesion"], True),
        (("liver_lesion", "liver_tumor"), ["liver_lesion"], True),
        (("liver_mass",), [], False),
    ],
)
def test_lesion_file_rule(tmp_path: Path, files: tuple[str, ...], expected_files: list[str], has_lesion: bool) -> None:
    root = _atlas(tmp_path / "atlas")
    reference = _atlas(tmp_path / "reference")
    _rename(root, "liver_lesion", *files)

    rows, rejections, _ = _curate(root)
    ref_rows, _, _ = _curate(reference)

    assert rejections == []
    liver, ref_liver = rows[0], ref_rows[0]
    assert liver["lesion_files"] == expected_files and liver["has_lesion"] is has_lesion
    if has_lesion:
        for key in ("lesion_count", "long_axis_mm", "volume_mm3", "bbox_xyxy_vox", "location", "attenuation"):
            assert liver[key] == ref_liver[key], key
        assert "unrecognised_lesion_file" not in liver["qa_flags"]
    else:
        assert "unrecognised_lesion_file" in liver["qa_flags"]
        assert liver["warnings"] == [
            "liver_mass.nii*: lesion-like file(s) no rule reads, not used; lesion files used: none (the row says "
            "no lesion)"
        ]
    assert rows[2]["lesion_files"] == ["kidney_lesion"] and rows[1]["lesion_files"] == []


# --------------------------------------------------------------------------------------------------------------------
# Case key: a real checksum; case store: no pickle, corrupt entries recomputed


def test_uncompressed_nifti_edited_in_the_middle_changes_the_key(tmp_path: Path) -> None:
    root = _atlas(tmp_path)
    ct_gz = root / "image_only" / ID1 / "ct.nii.gz"
    ct = ct_gz.with_name("ct.nii")
    ct.write_bytes(gzip.decompress(ct_gz.read_bytes()))
    ct_gz.unlink()
    (ref,) = plan_atlas(root).refs
    assert ref.ct_path == ct
    before = case_cache_key(ref, CFG, "train")
    data = bytearray(ct.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size, same head, same tail
    ct.write_bytes(bytes(data))
    assert case_cache_key(ref, CFG, "train") != before
    assert file_checksum(ct).startswith("xxh3:")


def test_gzip_trailer_is_used_only_when_it_covers_the_whole_payload(tmp_path: Path) -> None:
    root = _atlas(tmp_path)
    ct = root / "image_only" / ID1 / "ct.nii.gz"
    assert file_checksum(ct).startswith("gz:")  # one member, ISIZE = the NIfTI payload size
    payload = gzip.decompress(ct.read_bytes())
    two = tmp_path / "two.nii.gz"
    half = len(payload) // 2
    two.write_bytes(gzip.compress(payload[:half], mtime=0) + gzip.compress(payload[half:], mtime=0))
    edited = tmp_path / "edited.nii.gz"
    changed = bytearray(payload[:half])
    changed[half // 2 + 1000] ^= 0x01  # same length, first member only: its trailer is not the file's last 8 bytes
    edited.write_bytes(gzip.compress(bytes(changed), mtime=0) + gzip.compress(payload[half:], mtime=0))
    padded = tmp_path / "padded.nii.gz"
    padded.write_bytes(ct.read_bytes() + b"\0" * 1024)

    assert file_checksum(two).startswith("xxh3:") and file_checksum(padded).startswith("xxh3:")
    assert file_checksum(two) != file_checksum(edited)


def _result() -> CaseResult:
    row = {
        "case_id": ID1,
        "organ": "liver",
        "long_axis_mm": 12.5,
        "location": ["5"],
        "bbox_xyxy_vox": None,
        "lesion_count": np.int64(2),  # numpy scalars are stored as Python values
        "frames": [{"bytes": b"\x89PNG1", "path": "a.png"}, {"bytes": b"\x89PNG22", "path": "b.png"}],
    }
    rejection = Rejection(ID1, "kidney", "labels", RejectReason.UNREADABLE_FILE, "x: cannot be read", "x")
    return CaseResult(ID1, [row], [rejection], {"ct.nii.gz": "ab"})


def test_case_store_round_trips_without_pickle(tmp_path: Path) -> None:
    store = CaseStore(tmp_path)
    store.save("k", _result())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.case.json", "k.frames.arrow"]
    light = store.load_rows("k")
    assert light is not None
    assert light.rows == [
        {
            "case_id": ID1,
            "organ": "liver",
            "long_axis_mm": 12.5,
            "location": ["5"],
            "bbox_xyxy_vox": None,
            "lesion_count": 2,
            "frames_bytes": 11,
        }
    ]
    assert light.rejections == _result().rejections and light.file_digests == {"ct.nii.gz": "ab"}
    assert store.load_frames("k") == {"liver": _result().rows[0]["frames"]}


@pytest.mark.parametrize("damage", ["zero_json", "truncated_json", "tampered_json", "zero_arrow", "missing_arrow"])
def test_a_damaged_case_store_entry_is_recomputed_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    store = CaseStore(tmp_path)
    store.save("k", _result())
    json_path, arrow_path = tmp_path / "k.case.json", tmp_path / "k.frames.arrow"
    if damage == "zero_json":
        json_path.write_bytes(b"")
    elif damage == "truncated_json":
        json_path.write_bytes(json_path.read_bytes()[:50])
    elif damage == "tampered_json":
        json_path.write_text(json_path.read_text().replace("12.5", "99.5"))
    elif damage == "zero_arrow":
        arrow_path.write_bytes(b"")
    else:
        arrow_path.unlink()
    with caplog.at_level(logging.WARNING, logger="emrl_data.labeling.case_store"):
        assert not store.has("k")
        assert store.load_rows("k") is None
    assert "is unusable" in caplog.text and "curated again" in caplog.text
    store.save("k", _result())  # the rerun overwrites it
    assert store.has("k")


def test_planted_store_entries_are_refused_without_reading_and_replaced(tmp_path: Path) -> None:
    store = CaseStore(tmp_path)
    (tmp_path / "a.case.json").symlink_to("/dev/zero")  # reading it would never end
    (tmp_path / "b.case.json").mkdir()  # a folder where the entry belongs
    store.save("c", _result())
    (tmp_path / "c.frames.arrow").unlink()
    (tmp_path / "c.frames.arrow").symlink_to("/dev/zero")
    assert not store.has("a") and not store.has("b") and not store.has("c")
    for key in ("a", "b", "c"):
        store.save(key, _result())
        assert store.has(key) and store.load_frames(key) == {"liver": _result().rows[0]["frames"]}


def test_a_pickle_in_the_store_is_never_read(tmp_path: Path) -> None:
    store = CaseStore(tmp_path)
    (tmp_path / "k.rows.pkl").write_bytes(b"cos\nsystem\n(S'touch pwned'\ntR.")  # the old format's name
    assert not store.has("k")
    assert not os.path.exists("pwned")

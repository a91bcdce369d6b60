"""`build-sft-set` never stalls: special files end as rejections or warnings, a case past its time bound is
abandoned as `case_timeout`, and a full disk (or a file-size limit) fails in one line naming the file, leaving no
temporary file. Every test runs under a pytest-timeout deadline, so a hang fails it instead of stalling the suite.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import flows.build_sft_set as build
from cli.main import main
from emrl_data.synthetic import CaseSpec, LesionSpec, write_atlas
from emrl_data.types import Organ, Split
from flows.build_sft_set import build_sft_set_flow
from tests.flows.helpers import rejection_rows


ROOT = Path(__file__).resolve().parents[2]
LESION = (LesionSpec(Organ.LIVER, "5", (12.0, 10.0, 10.0), "hypo"),)
ID1, ID2, ID3 = "BDMAP_00000001", "BDMAP_00000002", "BDMAP_00000003"


def _atlas(root: Path, ids: tuple[str, ...] = (ID1, ID2, ID3)) -> Path:
    write_atlas(
        root, [CaseSpec(i, shape=(96, 80, 32), lesions=LESION, seed=n, split=Split.TRAIN) for n, i in enumerate(ids)]
    )
    return root


def _rejections(out: Path) -> list[tuple]:
    return rejection_rows(out, "case_id", "organ", "step", "reason", "detail", "path")


def _leftovers(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if ".tmp-" in p.name)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_emrl_build_sft_set_over_a_fifo_and_dev_zero_links_ends_with_named_rows(
    prefect_harness, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _atlas(tmp_path / "atlas")
    liver1 = f"mask_only/{ID1}/segmentations/liver.nii.gz"
    (root / liver1).unlink()
    os.mkfifo(root / liver1)  # a mask a row needs: open() used to wait for a writer forever
    ct2 = f"image_only/{ID2}/ct.nii.gz"
    (root / ct2).unlink()
    (root / ct2).symlink_to("/dev/zero")  # the CT: used to be read forever
    os.mkfifo(root / f"mask_only/{ID3}/segmentations/aorta.nii.gz")  # no row reads it
    (root / f"image_only/{ID3}/notes.bin").symlink_to("/dev/urandom")  # beside the CT
    out = tmp_path / "out"

    main(["build-sft-set", str(root), str(out), "--cases-per-task", "2", "--workers", "1"])  # returns: the run ended

    assert _rejections(out) == [
        (
            ID1,
            "liver",
            "labels",
            "unreadable_file",
            f"{liver1}: a named pipe where a NIfTI file belongs",
            liver1,
        ),
        (
            ID2,
            None,
            "load",
            "unreadable_file",
            f"{ct2}: a symlink to a character device ('/dev/zero') where a NIfTI file belongs",
            ct2,
        ),
    ]
    warnings = [
        "TrainTestIDS/IID_test.csv lists no valid case id (column 'BDMAP ID')",  # every case is train here
        f"image_only/{ID3}/notes.bin: a symlink to a character device ('/dev/urandom'), not read (no row uses it)",
        f"mask_only/{ID3}/segmentations/aorta.nii.gz: a named pipe, not read (no row uses it)",
    ]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["warnings"] == warnings
    assert manifest["organ_rows"]["train"]["total"] == 5 and manifest["cases_timed_out"] == 0
    assert "- cases abandoned past the per-case time bound (case_timeout): 0" in capsys.readouterr().out
    assert all(w in (out / "qa.md").read_text() for w in warnings)
    assert _leftovers(out) == []

    main(["build-sft-set", str(root), str(out), "--cases-per-task", "2", "--workers", "1"])  # resumes, same rows

    again = json.loads((out / "manifest.json").read_text())
    assert again["cases_resumed_from_store"] == 3 and again["warnings"] == warnings


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_case_past_its_time_bound_is_a_case_timeout_and_the_run_goes_on(
    prefect_harness, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _atlas(tmp_path / "atlas", (ID1, ID2))
    out = tmp_path / "out"
    build_sft_set_flow(atlas_root=str(root), output_dir=str(out), cases_per_task=2, max_workers=1)
    for entry in (out / ".work/cases").glob("*.case.json"):  # case 2 is curated again; case 1 resumes at once
        if ID2 in entry.read_text():
            entry.unlink()
    release = threading.Event()
    real_curate_case = build.curate_case

    def curate_blocking_case_2(ref, **kwargs):  # type: ignore[no-untyped-def]
        if ref.case_id == ID2:
            release.wait()  # a read that never returns, until the test releases it
        return real_curate_case(ref, **kwargs)

    monkeypatch.setattr(build, "curate_case", curate_blocking_case_2)
    try:
        summary = build_sft_set_flow(
            atlas_root=str(root), output_dir=str(out), cases_per_task=2, max_workers=1, case_timeout_s=5.0
        )
    finally:
        release.set()

    detail = (
        f"{ID2}: still running after 5 s, the per-case time bound (--case-timeout); abandoned, the run went on "
        "(a rerun tries it again)"
    )
    assert _rejections(out) == [(ID2, None, "curate", "case_timeout", detail, None)]
    assert summary["cases_timed_out"] == 1 and summary["cases_resumed_from_store"] == 1
    assert summary["rejections"] == {"curate/case_timeout": 1}
    assert "- cases abandoned past the per-case time bound (case_timeout): 1" in (out / "summary.md").read_text()
    assert summary["organ_rows"]["train"]["total"] == 3  # case 1's rows

    # The abandoned thread finishes case 2 once released and stores it: the rerun resumes both cases.
    deadline = time.monotonic() + 120
    while sum(ID2 in p.read_text() for p in (out / ".work/cases").glob("*.case.json") if "timeout" not in p.name) < 1:
        assert time.monotonic() < deadline, "the released case was never stored"
        time.sleep(0.05)
    monkeypatch.setattr(build, "curate_case", real_curate_case)
    again = build_sft_set_flow(atlas_root=str(root), output_dir=str(out), cases_per_task=2, max_workers=1)
    assert again["cases_timed_out"] == 0 and again["cases_resumed_from_store"] == 2
    assert again["organ_rows"]["train"]["total"] == 6


def test_case_timeout_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"case_timeout_s=0 must be a number of seconds > 0"):
        build_sft_set_flow.fn(atlas_root=str(tmp_path), output_dir=str(tmp_path / "out"), case_timeout_s=0)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_full_disk_fails_in_one_line_naming_the_shard_and_leaves_no_temporary_file(
    prefect_harness, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _atlas(tmp_path / "atlas", (ID1, ID2))
    out = tmp_path / "out"
    real_writer = pq.ParquetWriter

    class DiskFullWriter(real_writer):  # type: ignore[misc, valid-type]
        def write_table(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pq, "ParquetWriter", DiskFullWriter)  # every shard is streamed through ParquetWriter

    with pytest.raises(SystemExit) as exited:
        main(["build-sft-set", str(root), str(out), "--cases-per-task", "2", "--workers", "1"])

    shard = out / "findings/data/train-00000-of-00001.parquet"  # the first shard written
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert exited.value.code == 1 and "Traceback" not in err
    assert lines[-2] == (
        f"emrl build-sft-set: failed: the disk is full while writing {shard} (No space left on device, ENOSPC); "
        "finished cases are kept, free space and rerun"
    )
    assert lines[-1] == (
        "  fix: free space and rerun the same command: it resumes from the finished cases (no temporary file was left)"
    )
    assert _leftovers(out) == [] and not shard.exists()
    assert len(list((out / ".work/cases").glob("*.case.json"))) == 2  # finished cases are kept

    monkeypatch.setattr(pq, "ParquetWriter", real_writer)  # space again: the rerun resumes and finishes
    main(["build-sft-set", str(root), str(out), "--cases-per-task", "2", "--workers", "1"])
    assert json.loads((out / "manifest.json").read_text())["cases_resumed_from_store"] == 2 and shard.exists()


_EFBIG_STORE_SCRIPT = """
import resource, signal, sys
from pathlib import Path
from emrl_data.labeling.case_store import CaseStore
from emrl_data.labeling.curate import CaseResult
from emrl_data.atomic_write import OutputWriteError

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
row = {"organ": "liver", "frames": [{"bytes": b"x" * (2 << 20), "path": "f.png"}]}
try:
    CaseStore(Path(sys.argv[1])).save("k", CaseResult("BDMAP_00000001", rows=[row]))
except OutputWriteError as err:
    print(err)
    sys.exit(3)
"""


@pytest.mark.timeout(120)
def test_a_case_store_entry_over_the_file_size_limit_leaves_no_temporary_file(tmp_path: Path) -> None:
    store = tmp_path / "cases"
    done = subprocess.run(
        [sys.executable, "-c", _EFBIG_STORE_SCRIPT, str(store)], capture_output=True, text=True, timeout=100, cwd=ROOT
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout.strip() == (
        f"the file-size limit (ulimit -f) is reached while writing {store / 'k.frames.arrow'} (File too large, "
        "EFBIG); finished cases are kept, raise the limit and rerun"
    )
    assert sorted(p.name for p in store.iterdir()) == []


_EFBIG_SCRIPT = """
import resource, signal, sys
from pathlib import Path
import pyarrow as pa
from emrl_data.atomic_write import OutputWriteError
from emrl_data.tables.shards import write_split_streaming

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG instead of killing the process
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
schema = pa.schema([("blob", pa.binary())])
rows = [{"blob": bytes([i]) * 300_000} for i in range(8)]
try:
    write_split_streaming(rows, [100 << 20] * len(rows), schema, Path(sys.argv[1]), "train")
except OutputWriteError as err:
    print(err)
    sys.exit(3)
"""


@pytest.mark.timeout(120)
def test_a_file_size_limit_is_efbig_named_in_one_line_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    data = tmp_path / "data"
    done = subprocess.run(
        [sys.executable, "-c", _EFBIG_SCRIPT, str(data)],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=ROOT,
    )
    assert done.returncode == 3, done.stderr
    shard = data / "train-00000-of-00002.parquet"
    assert done.stdout.strip() == (
        f"the file-size limit (ulimit -f) is reached while writing {shard} (File too large, EFBIG); finished cases "
        "are kept, raise the limit and rerun"
    )
    assert sorted(p.name for p in data.iterdir()) == []

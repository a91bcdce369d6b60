"""Special files: a named pipe, socket, device or folder anywhere in a case's files never stalls a run.

Each kind of special file is planted in each position (the CT, a mask a row needs, a lesion file, a mask no row uses,
an extra file beside the CT, the metadata CSV, a split file, a case-store entry) and must end, in bounded time, as an
`unreadable_file` rejection naming the file and its kind (a file a row needs) or as a warning naming it (a file no row
needs, never opened). Every test runs under a short pytest-timeout deadline: an unguarded `open()` on a named pipe
waits for a writer forever and `/dev/zero` is read forever, so a regression fails here instead of stalling the
suite.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from emrl_data.config import CurateConfig
from emrl_data.labeling.case_store import CaseStore
from emrl_data.labeling.checksums import case_cache_key, file_checksum
from emrl_data.labeling.curate import CaseResult, curate_case
from emrl_data.outcome import Rejection, RejectReason
from emrl_data.reading import inflate
from emrl_data.reading.atlas import AtlasError, CaseRef, plan_atlas, special_entries
from emrl_data.reading.fileio import (
    FileChangedError,
    NotRegularFileError,
    check_unchanged,
    open_regular,
    read_regular_bytes,
)
from emrl_data.synthetic import CaseSpec, LesionSpec, write_atlas
from emrl_data.types import Organ


pytestmark = pytest.mark.timeout(60)  # a hang fails the test instead of stalling the suite

CFG = CurateConfig()
ID = "BDMAP_00000001"
LESIONS = (LesionSpec(Organ.LIVER, "5", (12.0, 10.0, 10.0), "hypo"),)
CT = f"image_only/{ID}/ct.nii.gz"
MASKS = f"mask_only/{ID}/segmentations"


def _block_device() -> str | None:
    """An existing block device to link to (mknod needs privileges), or None on a machine that shows none."""
    for name in sorted(os.listdir("/dev")):
        path = f"/dev/{name}"
        try:
            if stat.S_ISBLK(os.stat(path).st_mode):
                return path
        except OSError:
            continue
    return None


KINDS = {
    "fifo": "a named pipe",
    "socket": "a socket",
    "dev_zero": "a symlink to a character device ('/dev/zero')",
    "dev_urandom": "a symlink to a character device ('/dev/urandom')",
    "block_device": "a symlink to a block device",
    "folder": "a folder",
}


def _plant(path: Path, kind: str, sockets: list[socket.socket]) -> None:
    """Replace `path` (if present) with a special file of `kind`."""
    if path.exists() or path.is_symlink():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        cwd = os.getcwd()
        os.chdir(path.parent)  # AF_UNIX paths are limited to ~108 bytes: bind by the short relative name
        try:
            sock.bind(path.name)
        finally:
            os.chdir(cwd)
        sockets.append(sock)
    elif kind == "dev_zero":
        path.symlink_to("/dev/zero")
    elif kind == "dev_urandom":
        path.symlink_to("/dev/urandom")
    elif kind == "block_device":
        device = _block_device()
        if device is None:
            pytest.skip("no block device visible in /dev")
        path.symlink_to(device)
    elif kind == "folder":
        path.mkdir()
    else:
        raise ValueError(kind)


def _kind_text(kind: str) -> str:
    if kind == "block_device":
        return f"a symlink to a block device ({_block_device()!r})"
    return KINDS[kind]


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    made: list[socket.socket] = []
    yield made
    for sock in made:
        sock.close()


@pytest.fixture(scope="module")
def clean_atlas(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("clean")
    write_atlas(root, [CaseSpec(ID, shape=(96, 80, 32), lesions=LESIONS)])
    return root


def _copy(clean: Path, tmp_path: Path) -> Path:
    import shutil

    root = tmp_path / "atlas"
    shutil.copytree(clean, root, symlinks=True)
    return root


def _curate(root: Path) -> tuple[CaseResult, str]:
    plan = plan_atlas(root)
    (ref,) = plan.refs
    key = case_cache_key(ref, CFG, "train")
    return curate_case(ref, split="train", cfg=CFG), key


def _organs(result: CaseResult) -> list[str]:
    return sorted(r["organ"] for r in result.rows)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_special_file_as_the_ct_rejects_the_case_naming_its_kind(
    clean_atlas: Path, tmp_path: Path, kind: str, sockets: list[socket.socket]
) -> None:
    root = _copy(clean_atlas, tmp_path)
    _plant(root / CT, kind, sockets)

    result, _ = _curate(root)

    detail = f"{CT}: {_kind_text(kind)} where a NIfTI file belongs"
    assert result.rejections == [Rejection(ID, None, "load", RejectReason.UNREADABLE_FILE, detail, CT)]
    assert result.rows == [] and result.warnings == []


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("structure", ["liver", "liver_lesion"])
def test_a_special_file_as_a_needed_mask_costs_only_its_organ(
    clean_atlas: Path, tmp_path: Path, kind: str, structure: str, sockets: list[socket.socket]
) -> None:
    root = _copy(clean_atlas, tmp_path)
    rel = f"{MASKS}/{structure}.nii.gz"
    _plant(root / rel, kind, sockets)

    result, _ = _curate(root)

    detail = f"{rel}: {_kind_text(kind)} where a NIfTI file belongs"
    assert [(r.organ, r.reason, r.detail, r.path) for r in result.rejections] == [
        ("liver", RejectReason.UNREADABLE_FILE, detail, rel)
    ]
    assert _organs(result) == ["kidney", "pancreas"] and result.warnings == []


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("where", ["unused_mask", "beside_ct"])
def test_a_special_file_no_row_needs_is_never_opened_and_is_named_in_a_warning(
    clean_atlas: Path, tmp_path: Path, kind: str, where: str, sockets: list[socket.socket]
) -> None:
    root = _copy(clean_atlas, tmp_path)
    rel = f"{MASKS}/aorta.nii.gz" if where == "unused_mask" else f"image_only/{ID}/notes.bin"
    (root / rel).write_bytes(b"a regular stray file")
    _, key_with_a_regular_file = _curate(root)
    _plant(root / rel, kind, sockets)

    result, key = _curate(root)

    assert result.rejections == [] and _organs(result) == ["kidney", "liver", "pancreas"]
    if kind == "folder":  # a stray folder is no input at all: neither read nor warned
        assert result.warnings == []
    else:
        assert result.warnings == [f"{rel}: {_kind_text(kind)}, not read (no row uses it)"]
    if where == "unused_mask":  # only its name enters the key: the same key as with a regular file there
        assert key == key_with_a_regular_file


def test_the_key_reads_only_files_rows_read(clean_atlas: Path, tmp_path: Path) -> None:
    root = _copy(clean_atlas, tmp_path)
    (ref,) = plan_atlas(root).refs
    before = case_cache_key(ref, CFG, "train")
    stray = root / MASKS / "notes.bin"
    stray.write_bytes(b"x" * 1000)
    with_stray = case_cache_key(ref, CFG, "train")
    stray.write_bytes(b"y" * 1000)  # other content, same name: never read, so the same key
    assert case_cache_key(ref, CFG, "train") == with_stray != before
    liver = root / MASKS / "liver.nii.gz"
    liver.write_bytes(liver.read_bytes() + b"\0")  # a file rows read: its content is in the key
    assert case_cache_key(ref, CFG, "train") != with_stray
    assert case_cache_key(ref, CFG, "train") == case_cache_key(ref, CFG, "train")  # deterministic


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_special_metadata_csv_is_a_run_warning(
    clean_atlas: Path, tmp_path: Path, kind: str, sockets: list[socket.socket]
) -> None:
    root = _copy(clean_atlas, tmp_path)
    name = "AbdomenAtlas3.0MiniWithMeta.csv"
    _plant(root / name, kind, sockets)

    plan = plan_atlas(root)

    assert plan.metadata == {} and [r.reason for r in plan.rejections] == []
    assert [w for w in plan.warnings if name in w] == [
        f"{name} not used: cannot use {name}: {_kind_text(kind)} where a CSV file belongs (fix or remove it: it "
        "decides splits or weak labels); no atlas_* values in this run",
    ]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_special_split_file_stops_the_plan_in_one_line_naming_it(
    clean_atlas: Path, tmp_path: Path, kind: str, sockets: list[socket.socket]
) -> None:
    root = _copy(clean_atlas, tmp_path)
    _plant(root / "TrainTestIDS/IID_train.csv", kind, sockets)

    with pytest.raises(AtlasError) as failed:
        plan_atlas(root)

    assert str(failed.value) == (
        f"cannot use IID_train.csv: {_kind_text(kind)} where a CSV file belongs (fix or remove it: it decides "
        "splits or weak labels)"
    )


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
@pytest.mark.parametrize("entry", ["case.json", "frames.arrow"])
def test_a_special_case_store_entry_is_refused_unread_and_recomputed(
    tmp_path: Path, kind: str, entry: str, sockets: list[socket.socket], caplog: pytest.LogCaptureFixture
) -> None:
    store = CaseStore(tmp_path / "cases")
    store.save("k", CaseResult(ID, rejections=[Rejection(ID, None, "load", RejectReason.MISSING_CT, "no CT")]))
    _plant(tmp_path / "cases" / f"k.{entry}", kind, sockets)

    assert store.load_rows("k") is None  # the entry is "not there": never opened, never read
    if entry == "frames.arrow":  # (a special file where the JSON belongs is simply no entry)
        refused = f"case store entry k.case.json is unusable (k.frames.arrow: {_kind_text(kind)}, not a regular file)"
        assert refused in caplog.text
    store.save("k", CaseResult(ID))  # a fifo is replaced by the atomic rename
    assert store.load_rows("k") == CaseResult(ID)


def test_special_entries_lists_pipes_and_device_links_only(
    clean_atlas: Path, tmp_path: Path, sockets: list[socket.socket]
) -> None:
    root = _copy(clean_atlas, tmp_path)
    _plant(root / MASKS / "a_pipe", "fifo", sockets)
    _plant(root / MASKS / "b_zero.nii.gz", "dev_zero", sockets)
    _plant(root / f"image_only/{ID}/c_folder", "folder", sockets)
    (root / MASKS / "d_dangling").symlink_to("nowhere")
    (ref,) = plan_atlas(root).refs
    assert isinstance(ref, CaseRef)

    assert special_entries(ref) == (
        (f"{MASKS}/a_pipe", "a named pipe"),
        (f"{MASKS}/b_zero.nii.gz", "a symlink to a character device ('/dev/zero')"),
    )


# --- the reader itself ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "dev_urandom", "folder"])
def test_open_regular_refuses_without_opening(tmp_path: Path, kind: str, sockets: list[socket.socket]) -> None:
    path = tmp_path / "f"
    _plant(path, kind, sockets)
    for call in (open_regular, read_regular_bytes, file_checksum):
        with pytest.raises(NotRegularFileError) as refused:
            call(path)
        assert refused.value.kind == _kind_text(kind) and refused.value.errno == errno.EINVAL


def test_a_fifo_swapped_in_after_the_stat_is_refused_by_fstat_without_blocking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race: the path is a regular file when `stat` looks, a named pipe when it is opened."""
    import emrl_data.reading.fileio as fileio

    path = tmp_path / "f"
    path.write_bytes(b"regular")
    real_stat_regular = fileio.stat_regular

    def stat_then_swap(p: Path | str) -> os.stat_result:
        found = real_stat_regular(p)
        path.unlink()
        os.mkfifo(path)
        return found

    monkeypatch.setattr(fileio, "stat_regular", stat_then_swap)
    with pytest.raises(NotRegularFileError, match="a named pipe"):
        open_regular(path)


def test_a_file_that_grows_while_being_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"0123456789")
    with open_regular(path) as fh:
        before = os.fstat(fh.fileno())
        assert fh.read(before.st_size) == b"0123456789"
        with path.open("ab") as writer:
            writer.write(b"more")
        with pytest.raises(
            FileChangedError, match=r"changed while being read \(10 bytes at the start, 14 at the end\)"
        ):
            check_unchanged(fh, before, path)


def test_a_mask_rewritten_while_it_is_decoded_is_an_unreadable_file_rejection(
    clean_atlas: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer appends to liver.nii.gz while the reader inflates it: a named rejection, never a silent mix."""
    root = _copy(clean_atlas, tmp_path)
    liver = root / MASKS / "liver.nii.gz"
    real_read_gzip = inflate._read_gzip
    appended: list[bool] = []

    def read_while_a_writer_appends(f, head, size, name, payload_size):  # type: ignore[no-untyped-def]
        read = real_read_gzip(f, head, size, name, payload_size)
        if name.endswith("liver.nii.gz") and not appended:
            appended.append(True)
            with liver.open("ab") as writer:
                writer.write(b"\0" * 16)
        return read

    monkeypatch.setattr(inflate, "_read_gzip", read_while_a_writer_appends)
    result, _ = _curate(root)

    size = liver.stat().st_size
    rel = f"{MASKS}/liver.nii.gz"
    detail = f"{rel}: changed while being read ({size - 16} bytes at the start, {size} at the end)"
    assert [(r.organ, r.reason, r.detail, r.path) for r in result.rejections] == [
        ("liver", RejectReason.UNREADABLE_FILE, detail, rel)
    ]

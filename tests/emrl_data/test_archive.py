"""Hostile release parts: each refused member is a named rejection or a warning; nothing lands outside scratch."""

from __future__ import annotations

import gzip
import io
import tarfile
import zlib
from pathlib import Path

import pytest

from emrl_data.reading.archive import ScratchMeter, read_part
from emrl_data.synthetic.pack_release import tar_gz


CT = b"\x1f\x8b" + b"ct-bytes" * 8
NAME = "image_only/AbdomenAtlas3_images_BDMAP_BDMAP_00000001_BDMAP_00000003.tar.gz"


def _tar(members: list[tarfile.TarInfo], data: dict[str, bytes]) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info in members:
            tar.addfile(info, io.BytesIO(data[info.name]) if info.isreg() else None)
    return gzip.compress(raw.getvalue(), mtime=0)


def _member(name: str, size: int = 0, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.type, info.linkname = size, kind, link
    return info


def _read(data: bytes, tmp_path: Path, allowance: int = 1 << 20, kind: str = "image_only"):
    files: list[tuple[str, str]] = []
    meter = ScratchMeter(allowance)
    reading = read_part(
        io.BytesIO(data),
        name=NAME,
        kind=kind,
        dest=tmp_path / "scratch",
        case_range=(1, 3),
        meter=meter,
        on_file=lambda case, path: files.append((case, path.relative_to(tmp_path / "scratch").as_posix())),
    )
    outside = [p for p in tmp_path.rglob("*") if not p.is_relative_to(tmp_path / "scratch")]
    assert outside == []  # never a write outside scratch
    return reading, files


def _reasons(reading) -> dict[str, tuple[str, str]]:
    return {c: (r.step, str(r.reason)) for c, r in reading.rejected.items()}


def test_a_clean_part_unpacks_every_ct_into_the_layout(tmp_path: Path) -> None:
    data = tar_gz([("BDMAP_00000001", None), ("BDMAP_00000001/ct.nii.gz", CT), ("BDMAP_00000002/ct.nii.gz", CT)])
    reading, files = _read(data, tmp_path)
    assert files == [
        ("BDMAP_00000001", "image_only/BDMAP_00000001/ct.nii.gz"),
        ("BDMAP_00000002", "image_only/BDMAP_00000002/ct.nii.gz"),
    ]
    assert (reading.cases, reading.rejected, reading.warnings()) == (["BDMAP_00000001", "BDMAP_00000002"], {}, [])


@pytest.mark.parametrize(
    ("member", "detail"),
    [
        (_member("BDMAP_00000001/../../evil", 4), "an absolute or climbing (..) path"),
        (_member("/BDMAP_00000001/ct.nii.gz", 4), "an absolute or climbing (..) path"),
        (_member("BDMAP_00000001/ct.nii.gz", kind=tarfile.SYMTYPE, link="/etc/passwd"), "a symlink to '/etc/passwd'"),
        (_member("BDMAP_00000001/ct.nii.gz", kind=tarfile.LNKTYPE, link="BDMAP_00000002/ct.nii.gz"), "a hard link"),
        (_member("BDMAP_00000001/ct.nii.gz", kind=tarfile.CHRTYPE), "a device"),
        (_member("BDMAP_00000001/ct.nii.gz", kind=tarfile.FIFOTYPE), "a FIFO"),
    ],
)
def test_unsafe_members_reject_their_case_and_write_nothing(tmp_path: Path, member, detail: str) -> None:
    data = _tar(
        [member, _member("BDMAP_00000002/ct.nii.gz", len(CT))], {member.name: b"evil", "BDMAP_00000002/ct.nii.gz": CT}
    )
    reading, files = _read(data, tmp_path)
    assert _reasons(reading) == {"BDMAP_00000001": ("archive", "unsafe_archive_member")}
    assert detail in reading.rejected["BDMAP_00000001"].detail
    assert files == [("BDMAP_00000002", "image_only/BDMAP_00000002/ct.nii.gz")]
    assert not (tmp_path / "evil").exists()


def test_a_member_twice_rejects_its_case(tmp_path: Path) -> None:
    data = tar_gz([("BDMAP_00000001/ct.nii.gz", CT), ("BDMAP_00000001/ct.nii.gz", CT)])
    reading, _ = _read(data, tmp_path)
    assert _reasons(reading) == {"BDMAP_00000001": ("archive", "unsafe_archive_member")}
    assert "appears twice" in reading.rejected["BDMAP_00000001"].detail


def test_a_member_bigger_than_the_allowance_is_refused_unread(tmp_path: Path) -> None:
    data = tar_gz([("BDMAP_00000001/ct.nii.gz", CT), ("BDMAP_00000002/ct.nii.gz", CT * 4)])
    reading, files = _read(data, tmp_path, allowance=len(CT) * 2)
    assert _reasons(reading) == {"BDMAP_00000002": ("archive", "unsafe_archive_member")}
    assert "needs 264 bytes of scratch" in reading.rejected["BDMAP_00000002"].detail
    assert [c for c, _ in files] == ["BDMAP_00000001"]


def test_data_longer_than_its_header_is_corrupt_archive(tmp_path: Path) -> None:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        tar.addfile(_member("BDMAP_00000001/ct.nii.gz", len(CT)), io.BytesIO(CT))
        tar.addfile(_member("BDMAP_00000002/ct.nii.gz", len(CT)), io.BytesIO(CT))
    body = bytearray(raw.getvalue())
    body[512 + 512 : 512 + 512] = b"x" * 512  # 512 more bytes after member 1's data: where member 2's header was
    reading, files = _read(gzip.compress(bytes(body)), tmp_path)
    assert [c for c, _ in files] == ["BDMAP_00000001"]
    assert reading.broken is not None and "no valid tar header" in reading.broken


def test_a_truncated_gzip_rejects_the_case_being_read(tmp_path: Path) -> None:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        tar.addfile(_member("BDMAP_00000001/ct.nii.gz", len(CT)), io.BytesIO(CT))
        big = CT * 2000
        tar.addfile(_member("BDMAP_00000002/ct.nii.gz", len(big)), io.BytesIO(big))
    tar_bytes = raw.getvalue()
    split = 1024 + 4096  # inside member 2's data
    cut = zlib.compressobj(6, zlib.DEFLATED, 31)
    head = cut.compress(tar_bytes[:split]) + cut.flush(zlib.Z_FULL_FLUSH)
    reading, files = _read(head, tmp_path)
    assert [c for c, _ in files] == ["BDMAP_00000001"]
    assert _reasons(reading) == {"BDMAP_00000002": ("archive", "corrupt_archive")}
    assert reading.broken is not None


def test_outside_the_layout_or_the_range_is_a_warning(tmp_path: Path) -> None:
    data = tar_gz(
        [
            ("README.txt", b"hi"),
            ("BDMAP_00000009/ct.nii.gz", CT),
            ("BDMAP_00000001/notes.txt", b"x"),
            ("BDMAP_00000001/ct.nii.gz", CT),
            ("bdmap_00000002/ct.nii.gz", CT),
        ]
    )
    reading, files = _read(data, tmp_path)
    assert files == [("BDMAP_00000001", "image_only/BDMAP_00000001/ct.nii.gz")]
    assert _reasons(reading) == {"bdmap_00000002": ("discover", "invalid_case_id")}
    assert reading.warnings() == [
        f"{NAME}: 1 member skipped, a case outside the part's range BDMAP_00000001..BDMAP_00000003 "
        "(first: 'BDMAP_00000009/ct.nii.gz')",
        f"{NAME}: 1 member skipped, not a case folder (name does not start with BDMAP) (first: 'README.txt')",
        f"{NAME}: 1 member skipped, outside the case layout (first: 'BDMAP_00000001/notes.txt')",
    ]


MASK_NAME = "mask_only/AbdomenAtlas3_masks_BDMAP_BDMAP_00000001_BDMAP_00000003.tar.gz"


def _read_masks(data: bytes, tmp_path: Path, **kwargs):
    files: list[str] = []
    reading = read_part(
        io.BytesIO(data),
        name=MASK_NAME,
        kind="mask_only",
        dest=tmp_path / "scratch",
        case_range=(1, 3),
        meter=ScratchMeter(1 << 30),
        on_file=lambda case, path: files.append(path.name),
        **kwargs,
    )
    return reading, files


def test_a_300_byte_mask_name_is_skipped_with_a_warning_before_any_write(tmp_path: Path) -> None:
    long = "a" * 293 + ".nii.gz"  # 300 bytes: ENAMETOOLONG had it been created
    data = tar_gz([(f"BDMAP_00000001/segmentations/{long}", CT), ("BDMAP_00000001/segmentations/liver.nii.gz", CT)])
    reading, files = _read_masks(data, tmp_path)
    assert (files, reading.rejected) == (["liver.nii.gz"], {})
    shown = repr(f"BDMAP_00000001/segmentations/{long}"[:300])
    assert reading.warnings() == [
        f"{MASK_NAME}: 1 member skipped, a name over 128 bytes or with characters outside [A-Za-z0-9._-] "
        f"(first: {shown})"
    ]


def test_two_mask_names_differing_only_in_case_reject_the_case(tmp_path: Path) -> None:
    data = tar_gz(
        [
            ("BDMAP_00000001/segmentations/liver.nii.gz", CT),
            ("BDMAP_00000001/segmentations/Liver.nii.gz", CT),
            ("BDMAP_00000002/segmentations/liver.nii.gz", CT),
        ]
    )
    reading, files = _read_masks(data, tmp_path)
    assert _reasons(reading) == {"BDMAP_00000001": ("archive", "unsafe_archive_member")}
    assert reading.rejected["BDMAP_00000001"].detail == (
        "'BDMAP_00000001/segmentations/Liver.nii.gz' differs from "
        "'BDMAP_00000001/segmentations/liver.nii.gz' only in case"
    )
    assert files == ["liver.nii.gz", "liver.nii.gz"]  # one of case 1 (before the second name), one of case 2


def test_a_second_ct_rejects_the_case_as_duplicate_ct(tmp_path: Path) -> None:
    data = tar_gz(
        [("BDMAP_00000001/ct.nii.gz", CT), ("BDMAP_00000001/ct.nii", b"plain"), ("BDMAP_00000002/ct.nii", CT)]
    )
    reading, files = _read(data, tmp_path)
    assert _reasons(reading) == {"BDMAP_00000001": ("archive", "duplicate_ct")}
    assert reading.rejected["BDMAP_00000001"].detail == (
        "'BDMAP_00000001/ct.nii' is a second CT of the case; which one is the case's is unknown"
    )
    assert files == [
        ("BDMAP_00000001", "image_only/BDMAP_00000001/ct.nii.gz"),
        ("BDMAP_00000002", "image_only/BDMAP_00000002/ct.nii"),
    ]


def test_a_member_that_cannot_be_written_rejects_its_case_and_the_part_goes_on(tmp_path: Path) -> None:
    (tmp_path / "scratch" / "mask_only" / "BDMAP_00000001" / "segmentations" / "liver.nii.gz").mkdir(parents=True)
    data = tar_gz(
        [("BDMAP_00000001/segmentations/liver.nii.gz", CT), ("BDMAP_00000002/segmentations/liver.nii.gz", CT)]
    )
    reading, files = _read_masks(data, tmp_path)
    assert _reasons(reading) == {"BDMAP_00000001": ("archive", "unsafe_archive_member")}
    assert reading.rejected["BDMAP_00000001"].detail == (
        "'BDMAP_00000001/segmentations/liver.nii.gz' cannot be written (File exists); refused"
    )
    assert files == ["liver.nii.gz"] and reading.cases == ["BDMAP_00000002"] and reading.broken is None


def _gnu_long_name_chain(n: int) -> bytes:
    """`n` GNU long-name headers in a row, then one member (tarfile reads the chain recursively)."""
    raw = b"".join(
        tarfile.TarInfo._create_gnu_long_header(f"BDMAP_00000002/{i}", tarfile.GNUTYPE_LONGNAME, "utf-8", "strict")  # type: ignore[attr-defined]
        for i in range(n)
    )
    info = _member("BDMAP_00000002/ct.nii.gz", len(CT))
    return raw + info.tobuf(tarfile.USTAR_FORMAT) + CT + b"\0" * (512 - len(CT) % 512)


def test_a_chain_of_1500_gnu_long_name_headers_is_corrupt_archive_not_a_recursion_error(tmp_path: Path) -> None:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        tar.addfile(_member("BDMAP_00000001/ct.nii.gz", len(CT)), io.BytesIO(CT))
    body = raw.getvalue().rstrip(b"\0") + b"\0" * (512 - len(raw.getvalue().rstrip(b"\0")) % 512)
    reading, files = _read(gzip.compress(body + _gnu_long_name_chain(1500) + b"\0" * 1024), tmp_path)
    assert files == [("BDMAP_00000001", "image_only/BDMAP_00000001/ct.nii.gz")]
    assert reading.broken == (
        "the archive cannot be read on (more than 16 extended headers in a row); unfinished cases are corrupt_archive "
        "rejections"
    )


def test_inflated_bytes_are_capped_per_part_even_for_skipped_members(tmp_path: Path) -> None:
    data = tar_gz([("BDMAP_00000001/ct.nii.gz", CT), ("BDMAP_00000001/notes.txt", bytes(2 << 20))])
    reading, files = _read_masks(data, tmp_path, max_inflated_bytes=1 << 20)
    assert reading.broken == (
        "the archive cannot be read on ('BDMAP_00000001/notes.txt' declares 2097152 bytes, more than the "
        f"{(1 << 20) - len(CT)} the part may still inflate); unfinished cases are corrupt_archive rejections"
    )


def test_the_default_inflate_cap_follows_the_part_size_on_disk(tmp_path: Path) -> None:
    zeros = 80 << 20  # 80 MiB of zeros: about 80 KiB compressed, over 16 x that + 64 MiB
    path = tmp_path / "part.tar.gz"
    path.write_bytes(tar_gz([("BDMAP_00000001/README", bytes(zeros))]))
    with path.open("rb") as fh:
        reading = read_part(
            fh, name=MASK_NAME, kind="mask_only", dest=tmp_path / "scratch", case_range=(1, 3), meter=ScratchMeter(1)
        )
    cap = 16 * path.stat().st_size + (64 << 20)
    assert reading.broken == (
        f"the archive cannot be read on ('BDMAP_00000001/README' declares {zeros} bytes, more than the {cap} the part "
        "may still inflate); unfinished cases are corrupt_archive rejections"
    )


def test_a_negative_member_size_is_corrupt_archive(tmp_path: Path) -> None:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        tar.addfile(_member("BDMAP_00000001/ct.nii.gz", len(CT)), io.BytesIO(CT))
    body = raw.getvalue().rstrip(b"\0")
    body += b"\0" * (-len(body) % 512)
    header = bytearray(_member("BDMAP_00000002/ct.nii.gz", 0).tobuf(tarfile.USTAR_FORMAT))
    header[124:136] = b"\xff" * 12  # base-256 size field: -1
    header[148:156] = b" " * 8
    header[148:155] = b"%06o\0" % sum(header)  # the checksum of the edited header
    reading, files = _read(gzip.compress(body + bytes(header) + b"\0" * 1024), tmp_path)
    assert files == [("BDMAP_00000001", "image_only/BDMAP_00000001/ct.nii.gz")]
    assert reading.broken == (
        "the archive cannot be read on ('BDMAP_00000002/ct.nii.gz' declares a negative size (-1)); unfinished cases "
        "are corrupt_archive rejections"
    )

"""A synthetic atlas packed as the Hub release: `tar.gz` parts under the released names, plus the CSVs.

`write_release(atlas, out, part_cases=3)` turns a split-layout atlas (`write_atlas`) into
`image_only/AbdomenAtlas3_images_BDMAP_BDMAP_…tar.gz` and `mask_only/AbdomenAtlas3_masks_BDMAP_BDMAP_…tar.gz` parts
of `part_cases` cases each (members `BDMAP_XXXXXXXX/ct.nii.gz` and `BDMAP_XXXXXXXX/segmentations/<s>.nii.gz`, as
`tar -C image_only` expects), the metadata CSV and `TrainTestIDS/`. The bytes are deterministic (sorted members,
fixed times and owners), so a test can rebuild the same release and change one part.
"""

from __future__ import annotations

import gzip
import io
import tarfile
from pathlib import Path

from emrl_data.reading.atlas import METADATA_FILE, SPLIT_DIR
from emrl_data.reading.release import IMAGE_DIR, MASK_DIR, part_name, part_ranges
from emrl_data.types import is_valid_case_id


def tar_gz(entries: list[tuple[str, bytes | None]]) -> bytes:
    """Deterministic `tar.gz` bytes of `(member name, bytes)` entries in the given order; None makes a folder."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in entries:
            info = tarfile.TarInfo(name)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            if data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
    return gzip.compress(raw.getvalue(), compresslevel=6, mtime=0)


def case_entries(root: Path, kind: str, case_ids: list[str]) -> list[tuple[str, bytes | None]]:
    """The members of one part: each case's folder, then its files, by sorted path relative to `root/kind`."""
    entries: list[tuple[str, bytes | None]] = []
    for case_id in case_ids:
        folder = root / kind / case_id
        if not folder.is_dir():
            continue
        entries.append((case_id, None))
        for path in sorted(folder.rglob("*")):
            rel = path.relative_to(root / kind).as_posix()
            entries.append((rel, None if path.is_dir() else path.read_bytes()))
    return entries


def write_release(atlas: Path, out: Path, *, part_cases: int) -> dict[str, bytes]:
    """Write the release of a split-layout atlas under `out`; return its files (release path -> bytes).

    Args:
        atlas: a split-layout atlas root (`image_only/`, `mask_only/`, optional CSVs).
        out: where the release's files go (created).
        part_cases: cases per part (the release has 232); ranges start at BDMAP_00000001 and end at the last case.
    """
    names = sorted({p.name for kind in (IMAGE_DIR, MASK_DIR) for p in (atlas / kind).iterdir() if p.is_dir()})
    numbers = [int(n[6:]) for n in names if is_valid_case_id(n)]
    files: dict[str, bytes] = {}
    for start, end in part_ranges(max(numbers), part_cases):
        in_range = [n for n in names if is_valid_case_id(n) and start <= int(n[6:]) <= end]
        for kind in (IMAGE_DIR, MASK_DIR):
            files[part_name(kind, start, end)] = tar_gz(case_entries(atlas, kind, in_range))
    side = [atlas / METADATA_FILE, *sorted((atlas / SPLIT_DIR).glob("*.csv"))]
    files |= {p.relative_to(atlas).as_posix(): p.read_bytes() for p in side if p.is_file()}
    for rel, data in files.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
    return files

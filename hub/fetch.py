"""`emrl fetch-atlas DEST`: the Hub release in its released layout on disk, for users who want the files.

Parts are downloaded in parallel threads (`hub.download.download_verified`: verified, resumed after an interruption)
to `DEST/.emrl-fetch/<sha256>.tar.gz`, a name kept until the part is unpacked, so a verified part is never fetched
twice. Each is unpacked by `emrl_data.reading.archive.read_part` (nothing outside the folder, hostile members refused
and reported) into a fresh temporary folder `DEST/.emrl-fetch/unpack-<sha256>/`, whose case folders are then renamed
into `DEST/image_only/` or `DEST/mask_only/` (replacing what an interrupted run left there), so a rerun after an
interruption at any point completes. `DEST/.emrl-fetch/<part>.done` (the part's sha256) marks a part finished and
skipped by a rerun. The metadata CSV and `TrainTestIDS/` land beside `image_only/` and `mask_only/`, checked against
their git blob id.
"""

from __future__ import annotations

import logging
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from emrl_data.live_view import Counts, LiveView
from emrl_data.reading.archive import IMAGE_KIND, ScratchMeter, read_part
from emrl_data.reading.release import HubFile, parse_part_name, side_files
from hub.download import download_verified
from hub.listing import HubRelease, resolve_release
from hub.pairs import content_name


logger = logging.getLogger(__name__)
FETCH_DIR = ".emrl-fetch"


def fetch_atlas(dest: Path, *, repo_id: str, revision: str | None = None, workers: int = 4) -> dict[str, Any]:
    """Fetch the release into `dest`; return a report (commit, parts fetched / skipped / failed, warnings, problems).

    Raises:
        RuntimeError: a side file (metadata CSV, split file) failed verification twice.
    """
    release = resolve_release(repo_id, revision)
    dest = Path(dest).resolve()
    for side in side_files(release.files):
        done, _, mismatch = download_verified(release.commit, side.path, dest / side.path, side)
        if done is None:
            raise RuntimeError(f"{side.path} of {release.source}: {mismatch}; fetched twice")
    parts = [p for pair in release.pairs for p in (pair.mask, pair.image) if p is not None]
    counts = Counts(bytes_total=sum(p.size for p in parts), parts_total=len(parts), rejections=0, parts_unit="parts")
    with LiveView("fetch-atlas", counts) as view, ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(lambda part: _fetch_part(release, part, dest, view), parts))
    report: dict[str, Any] = {"source": release.source, "sha": release.sha, "fetched": [], "skipped": [], "failed": []}
    report["warnings"], report["rejected"] = list(release.warnings), []
    for part, (status, warnings, rejected) in zip(parts, results, strict=True):
        report[status].append(part.path)
        report["warnings"] += warnings
        report["rejected"] += rejected
    return report


def _fetch_part(release: HubRelease, part: HubFile, dest: Path, view: LiveView) -> tuple[str, list[str], list[str]]:
    """Fetch and unpack one part, counted in `view` (bytes as they come; the part and its cases once unpacked)."""
    work = dest / FETCH_DIR
    marker = work / (part.path.replace("/", "__") + ".done")
    if marker.is_file() and marker.read_text().strip() == content_name(part):
        view.drop_bytes(part.size)
        view.settle_part(part.path, bytes_read=0, cases=0, resumed=0, rejections=0)
        return "skipped", [], []
    archive = work / f"{content_name(part)}.tar.gz"
    if not (archive.is_file() and archive.stat().st_size == part.size):  # renamed there only once verified
        on_bytes = partial(view.add_bytes, part=part.path)
        done, _, mismatch = download_verified(release.commit, part.path, archive, part, on_bytes=on_bytes)
        if done is None:
            view.settle_part(part.path, bytes_read=0, cases=0, resumed=0, rejections=0)
            return "failed", [f"{part.path}: {mismatch}; fetched twice, not unpacked"], []
    else:
        view.drop_bytes(part.size)  # verified on disk by an earlier run: nothing to download
    kind, start, end = parse_part_name(part.path) or ("", 0, 0)
    unpack = work / f"unpack-{content_name(part)}"
    shutil.rmtree(unpack, ignore_errors=True)  # what an interrupted unpack left
    with archive.open("rb") as fh:
        reading = read_part(
            fh, name=part.path, kind=kind, dest=unpack, case_range=(start, end), meter=ScratchMeter(1 << 62)
        )
    for case_id in reading.cases:
        if case_id in reading.rejected:
            continue
        target = dest / kind / case_id
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)  # an earlier interrupted move of this part's case
        os.replace(unpack / kind / case_id, target)
    shutil.rmtree(unpack, ignore_errors=True)
    marker.write_text(content_name(part))
    archive.unlink()
    rejected = [f"{r.case_id}: {r.reason}: {r.detail}" for r in reading.rejected.values()]
    unpacked = len(reading.cases) - len(reading.rejected) if kind == IMAGE_KIND else 0  # a case: its CT
    view.settle_part(part.path, bytes_read=0, cases=unpacked, resumed=0, rejections=len(rejected))
    return "fetched", reading.warnings(), rejected

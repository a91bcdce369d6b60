"""`emrl fetch-atlas DEST`: the Hub release in its released layout on disk, for users who want the files.

Parts are downloaded in parallel threads, each verified against the sha256 the Hub lists and resumed after an
interruption (`flows.hub_atlas.download_file`), then unpacked by `emrl_data.reading.archive.read_part` (nothing outside
`DEST`, hostile members refused and reported) and removed; `DEST/.emrl-fetch/<part>.done` (the part's sha256) marks
a part finished, so a rerun skips it. The metadata CSV and `TrainTestIDS/` land beside `image_only/` and `mask_only/`.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from emrl_data.reading.archive import ScratchMeter, read_part
from emrl_data.reading.release import HubFile, parse_part_name, side_files
from flows.hub_atlas import HubRelease, download_verified, resolve_release


logger = logging.getLogger(__name__)


def fetch_atlas(dest: Path, *, repo_id: str, revision: str | None = None, workers: int = 4) -> dict[str, Any]:
    """Fetch the release into `dest`; return a report (commit, parts fetched / skipped / failed, warnings, problems).

    Raises:
        RuntimeError: a side file (metadata CSV, split file) failed verification twice.
    """
    release = resolve_release(repo_id, revision)
    dest = Path(dest).resolve()
    for side in side_files(release.files):
        done, _, mismatch = download_verified(release.url(side.path), dest / side.path, side)
        if done is None:
            raise RuntimeError(f"{side.path} of {release.source}: {mismatch}; fetched twice")
    parts = [p for pair in release.pairs for p in (pair.mask, pair.image) if p is not None]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(lambda part: _fetch_part(release, part, dest), parts))
    report: dict[str, Any] = {"source": release.source, "sha": release.sha, "fetched": [], "skipped": [], "failed": []}
    report["warnings"], report["rejected"] = list(release.warnings), []
    for part, (status, warnings, rejected) in zip(parts, results, strict=True):
        report[status].append(part.path)
        report["warnings"] += warnings
        report["rejected"] += rejected
    return report


def _fetch_part(release: HubRelease, part: HubFile, dest: Path) -> tuple[str, list[str], list[str]]:
    marker = dest / ".emrl-fetch" / (part.path.replace("/", "__") + ".done")
    if marker.is_file() and marker.read_text().strip() == (part.sha256 or str(part.size)):
        return "skipped", [], []
    archive = dest / ".emrl-fetch" / part.path
    done, _, mismatch = download_verified(release.url(part.path), archive, part)
    if done is None:
        return "failed", [f"{part.path}: {mismatch}; fetched twice, not unpacked"], []
    kind, start, end = parse_part_name(part.path) or ("", 0, 0)
    with archive.open("rb") as fh:
        reading = read_part(
            fh, name=part.path, kind=kind, dest=dest, case_range=(start, end), meter=ScratchMeter(1 << 62)
        )
    archive.unlink()
    marker.write_text(part.sha256 or str(part.size))
    rejected = [f"{r.case_id}: {r.reason}: {r.detail}" for r in reading.rejected.values()]
    return "fetched", reading.warnings(), rejected

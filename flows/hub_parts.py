"""`build-sft-set` on the Hub release: one Prefect task per part pair, within a scratch budget, resumable, incremental.

What one pair does is `hub.pairs.read_pair` (Prefect-free); here are the task around it (progress artifacts), the plan
of the run (revision, side files, splits, metadata, parts at once) and the gathering of the outcomes. Parts run on any
task runner; how many at once follows from the budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.futures import as_completed

from emrl_data.config import CurateConfig
from emrl_data.labeling.case_store import CaseStore
from emrl_data.live_view import PROGRESS_RECORD, Counts, LiveView, current_view
from emrl_data.outcome import Rejection
from emrl_data.reading.atlas import AtlasOrganMeta, AtlasPlan, plan_metadata, read_split_files
from emrl_data.reading.release import (
    PartPair,
    check_scratch_space,
    format_size,
    plan_concurrency,
    scratch_bytes_planned,
    side_files,
)
from emrl_data.types import Organ, is_valid_case_id
from flows._common import Progress, count_rejections, duration, new_progress_artifact, view_artifact
from flows.runners import check_cluster, make_task_runner
from hub.download import download_verified
from hub.listing import HubAccessError, HubRelease, local_release, resolve_release
from hub.pairs import CurateOne, PartJob, PartOutcome, read_pair
from hub.retry import one_line


class PartsFailedError(RuntimeError):
    """Part pairs that failed after their retries; every other pair finished and is in the part ledger."""

    def __init__(self, failed: dict[str, str], finished: int) -> None:
        lines = "; ".join(f"{part}: {why}" for part, why in sorted(failed.items()))
        super().__init__(f"{len(failed)} part pair(s) failed after their retries ({finished} finished): {lines}")
        self.failed = failed
        self.fix = (
            "rerun the same command: the finished pairs are in the part ledger and only the failed ones are read"
        )


BYTES_ARTIFACT = "build-sft-set-bytes"  # the run's progress artifact: percent of the bytes, the view's status


class PartFailedError(RuntimeError):
    """A part pair's failure in one line, every URL cut before its query string (`hub.retry.one_line`): the
    library's error names the signed URL it was refused on, and Prefect logs a failed task's error and traceback."""


class PartProgress:
    """Two progress artifacts of one part pair, bytes downloaded and cases curated (updated every 10 %), and a log
    line at every 10 % of the bytes with the rate and an ETA from bytes: a 14 GB pair moves every 1.4 GB, not once.
    Bytes and cases also go to the run's live view when the task runs in the flow's process (the thread runner)."""

    def __init__(self, job: PartJob) -> None:
        self.name = job.pair.name
        self.total_bytes = max(job.pair.bytes, 1)
        self.total_cases = job.pair.end - job.pair.start + 1
        self.bytes = self.cases = 0
        self._marks = [0.0, 0.0]
        self._started = time.perf_counter()
        self._logger = get_run_logger()  # the task's: add_bytes is called from the download's thread
        self._ids = [
            new_progress_artifact(f"{job.pair.name}: bytes downloaded"),
            new_progress_artifact(f"{job.pair.name}: cases curated"),
        ]

    def add_bytes(self, n: int) -> None:
        """Count `n` bytes downloaded."""
        self.bytes += n
        if (view := current_view()) is not None:
            view.add_bytes(n, part=self.name)
        if self._update(0, 100.0 * self.bytes / self.total_bytes):
            self._logger.info(self.bytes_line(), extra={PROGRESS_RECORD: True})

    def bytes_line(self) -> str:
        """`BDMAP_…: 4.2 GiB of 14.0 GiB (30 %), 97.12 MB/s, ETA 1 min 41 s`."""
        seconds = time.perf_counter() - self._started
        rate = self.bytes / seconds if seconds > 0 else 0.0
        left = max(self.total_bytes - self.bytes, 0)
        eta = "done" if left == 0 else (f"ETA {duration(left / rate)}" if rate > 0 else "ETA unknown")
        pct = min(100.0, 100.0 * self.bytes / self.total_bytes)
        return (
            f"{self.name}: {format_size(self.bytes)} of {format_size(self.total_bytes)} ({pct:.0f} %), "
            f"{rate / 1e6:.2f} MB/s, {eta}"
        )

    def add_case(self) -> None:
        """Count one case curated."""
        self.cases += 1
        if (view := current_view()) is not None:
            view.add_case(part=self.name)
        self._update(1, 100.0 * self.cases / self.total_cases)

    def finish(self) -> None:
        """Both at 100 %."""
        self._update(0, 100.0, force=True)
        self._update(1, 100.0, force=True)

    def _update(self, which: int, pct: float, force: bool = False) -> bool:
        if force or pct >= self._marks[which] + 10.0:
            self._marks[which] = pct
            update_progress_artifact(artifact_id=self._ids[which], progress=min(pct, 100.0))
            return True
        return False


@task(cache_policy=NO_CACHE)
def curate_part_task(job: PartJob, curate_one: CurateOne) -> PartOutcome:
    """Curate one part pair into the case store (or find it in the part ledger): `hub.pairs.read_pair` with progress
    artifacts and the run logger.

    `curate_one` curates one case under the per-case time bound (`flows.build_sft_set.curate_bounded`, handed in
    by the flow: the flow module imports this one).
    """
    progress = PartProgress(job)
    try:
        outcome = read_pair(
            job, curate_one, on_bytes=progress.add_bytes, on_case=progress.add_case, log=get_run_logger().info
        )
    except HubAccessError:  # its own line, no URL: the run stops on it
        raise
    except Exception as err:  # noqa: BLE001 (said again in one line, without the signed URL and its traceback)
        raise PartFailedError(one_line(err)) from None
    progress.finish()
    return outcome


# --------------------------------------------------------------------------------------------------------------------
# The flow side: plan the parts, run them, gather


@dataclass
class HubCuration:
    """What the Hub path hands back to the flow: a plan (splits, metadata, warnings), the cases and their keys."""

    plan: AtlasPlan
    case_ids: list[str]
    keys: dict[str, str]
    n_cached: int
    release: HubRelease
    summary: dict[str, Any]


@dataclass(frozen=True)
class HubOptions:
    """The Hub path's settings."""

    revision: str | None
    scratch_dir: Path
    scratch_budget_bytes: int
    local_root: Path | None = None  # a folder of parts (as `hf download` leaves them) instead of the Hub


def curate_release(
    repo_id: str | None,
    options: HubOptions,
    *,
    out: Path,
    cfg: CurateConfig,
    store: CaseStore,
    test_fraction: float,
    limit: int | None,
    runner: tuple[str, str | None, int],
    case_timeout_s: float | None,
    curate_one: CurateOne,
) -> HubCuration:
    """Resolve the revision, read the side files, run one task per part pair, and gather the cases.

    `repo_id` None: the release is the folder of parts `options.local_root`, read in place (checked against the
    revision's listing when `options.revision` is given)."""
    logger = get_run_logger()
    if repo_id is None:
        assert options.local_root is not None
        release = local_release(options.local_root, options.revision)
    else:
        release = resolve_release(repo_id, options.revision)
    logger.info(
        "%s: revision %s is commit %s, %d part pairs",
        release.source,
        release.revision,
        release.sha,
        len(release.pairs),
    )
    meta_root = out / ".work" / "hub" / release.sha
    if release.local_root is not None:
        meta_root = Path(release.local_root)
    for side in side_files(release.files) if release.local_root is None else ():
        done, _, mismatch = download_verified(release.commit, side.path, meta_root / side.path, side)
        if done is None:
            raise RuntimeError(f"{side.path} of {release.source}: {mismatch}; fetched twice")
    listing = read_split_files(meta_root)
    warnings = list(release.warnings)
    if listing is not None:
        warnings += [*listing.warnings, *(problem for _, problem in listing.problems)]
    wanted = {c for p in release.pairs for c in p.case_ids()}
    metadata, meta_rejections = plan_metadata(meta_root, wanted, warnings)
    pairs, last_case = _limited(release.pairs, limit)
    concurrency, allowance = plan_concurrency(pairs, options.scratch_budget_bytes, runner[2])
    logger.info(
        "scratch budget %s: %d part pair(s) at once, %s each",
        format_size(options.scratch_budget_bytes),
        concurrency,
        format_size(allowance),
    )
    check_scratch_space(options.scratch_dir, scratch_bytes_planned(pairs, options.scratch_budget_bytes, concurrency))
    jobs = [
        PartJob(
            pair=p,
            commit=release.commit,
            splits={c: str(s) for c, s in (listing.splits.items() if listing else ()) if p.holds(c)},
            conflicts={c: list(f) for c, f in (listing.conflicts.items() if listing else ()) if p.holds(c)},
            metadata={c: m for c, m in metadata.items() if p.holds(c)},
            test_fraction=test_fraction,
            cfg_dict=cfg.to_dict(),
            store_dir=str(store.root),
            ledger_dir=str(out / ".work" / "parts"),
            scratch_dir=str(options.scratch_dir),
            allowance_bytes=allowance,
            case_timeout_s=case_timeout_s,
            last_case=last_case,
            local_root=release.local_root,
        )
        for p in pairs
    ]
    started = time.perf_counter()
    outcomes = _run_parts(jobs, concurrency, runner[0], runner[1], store, curate_one)
    summary = {"parts_seconds": round(time.perf_counter() - started, 2), "parts_at_once": concurrency}
    return _gather(release, listing is not None, metadata, meta_rejections, warnings, outcomes, options, summary)


def _limited(pairs: tuple[PartPair, ...], limit: int | None) -> tuple[list[PartPair], int | None]:
    """The pairs holding the first `limit` case numbers of the release, and the last case number kept."""
    if limit is None:
        return list(pairs), None
    kept, left = [], limit
    for p in pairs:
        if left <= 0:
            break
        kept.append(p)
        last, left = min(p.end, p.start + left - 1), left - (p.end - p.start + 1)
    return kept, last


def _run_parts(
    jobs: list[PartJob], concurrency: int, kind: str, address: str | None, store: CaseStore, curate_one: CurateOne
) -> list[PartOutcome]:
    """Run the part tasks, at most `concurrency` at once (a window, whatever the runner's own size), under the run's
    live view (`parts_view`). A pair that fails after its retries ends itself, not the run: the others finish, then
    `PartsFailedError` names the failed ones (a refused token ends the run at once: every pair would meet it)."""
    check_cluster(kind, address, store.root)
    logger = get_run_logger()
    progress = Progress(len(jobs), "curating part pairs", unit="parts")
    outcomes: list[PartOutcome] = []
    failed: dict[str, str] = {}
    queue = list(jobs)
    with make_task_runner(kind, concurrency, address=address) as runner, parts_view(jobs) as view:
        pending: dict[Any, PartJob] = {}
        while queue or pending:
            while queue and len(pending) < concurrency:
                job = queue.pop(0)
                pending[runner.submit(curate_part_task, parameters={"job": job, "curate_one": curate_one})] = job
            future = next(iter(as_completed(list(pending))))
            done_job = pending.pop(future)
            try:
                outcome = future.result()
            except HubAccessError:
                raise
            except Exception as err:  # noqa: BLE001 (named in the run's error, the other pairs go on)
                failed[done_job.pair.name] = str(err) if isinstance(err, PartFailedError) else one_line(err)
                logger.error("%s failed after its retries: %s", done_job.pair.name, failed[done_job.pair.name])
                view.fail_part(done_job.pair.name, done_job.pair.bytes)
                progress.advance(1)
                continue
            outcomes.append(outcome)
            _settle(view, outcome, done_job, store)
            progress.advance(1, resumed=int(outcome.from_ledger))
    if failed:
        raise PartsFailedError(failed, len(outcomes))
    return sorted(outcomes, key=lambda o: o.part)


def parts_view(jobs: list[PartJob]) -> LiveView:
    """The run's live view over its part pairs (bytes of both parts, the wanted cases), followed by the progress
    artifact `build-sft-set-bytes`."""
    counts = Counts(
        bytes_total=sum(j.pair.bytes for j in jobs),
        parts_total=len(jobs),
        cases_total=sum(j.wanted(c) for j in jobs for c in j.pair.case_ids()),
        rejections=0,
    )
    on_mark = view_artifact(BYTES_ARTIFACT, "bytes downloaded, all part pairs")
    return LiveView("build-sft-set", counts, on_mark=on_mark)


def _settle(view: LiveView, outcome: PartOutcome, job: PartJob, store: CaseStore) -> None:
    """Count a finished pair in the view: its bytes and cases not counted live, its rejections (from the store)."""
    if outcome.from_ledger:
        view.drop_bytes(job.pair.bytes)
    view.settle_part(
        outcome.part,
        bytes_read=outcome.bytes_read,
        cases=len(outcome.done),
        resumed=sum(cached for _, _, cached in outcome.done),
        rejections=count_rejections(store, [k for _, k, _ in outcome.done]),
    )


def _gather(
    release: HubRelease,
    has_listing: bool,
    metadata: Mapping[str, dict[Organ, AtlasOrganMeta]],
    meta_rejections: list[Rejection],
    warnings: list[str],
    outcomes: list[PartOutcome],
    options: HubOptions,
    timing: dict[str, Any],
) -> HubCuration:
    keys = {c: k for o in outcomes for c, k, _ in o.done}
    case_ids = sorted(keys)
    seen = set(case_ids)
    rejections = tuple(r for r in meta_rejections if r.case_id in seen or not is_valid_case_id(r.case_id))
    warnings = [*warnings, *(w for o in outcomes for w in o.warnings)]
    split_source = "IID split files" if has_listing else "case-id hash"
    plan = AtlasPlan(
        "split",
        (),
        {},
        split_source,
        {c: dict(m) for c, m in metadata.items() if c in seen},
        rejections,
        tuple(warnings),
    )
    rows = [o.row() for o in outcomes]
    summary = {
        "repo": release.repo_id,
        "revision": release.revision,
        "sha": release.sha,
        "source": release.source,
        "part_pairs": len(outcomes),
        "parts_read": sum(not o.from_ledger for o in outcomes),
        "parts_from_ledger": sum(o.from_ledger for o in outcomes),
        "parts_failed_verification": sum(not o.verified for o in outcomes),
        "bytes_read": sum(o.bytes_read for o in outcomes),
        "scratch_budget_bytes": options.scratch_budget_bytes,
        **timing,
        "peak_scratch_bytes_per_part": max((o.peak_scratch_bytes for o in outcomes), default=0),
        "per_part": rows,
    }
    create_table_artifact(key="build-sft-set-hub-parts", table=rows, description=f"part pairs of {release.source}")
    n_cached = sum(cached for o in outcomes for _, _, cached in o.done)
    return HubCuration(plan, case_ids, keys, n_cached, release, summary)


def hub_summary_lines(hub: Mapping[str, Any]) -> list[str]:
    """The summary.md lines of a Hub run: the pinned revision, parts read or skipped, bytes, time and rate per part."""
    seconds = sum(r["seconds"] for r in hub["per_part"] if not r["from_ledger"])
    lines = [
        f"- atlas: `{hub['source']}` (revision `{hub['revision']}`)",
        f"- part pairs: {hub['part_pairs']} ({hub['parts_read']} read, {hub['parts_from_ledger']} already curated, "
        f"{hub['parts_failed_verification']} failed verification); {format_size(hub['bytes_read'])} read"
        f"{_rate(hub['bytes_read'], seconds, ' a pair on average')}; {hub['parts_at_once']} at once within a scratch budget of "
        f"{format_size(hub['scratch_budget_bytes'])}",
    ]
    per_part: Callable[[dict[str, Any]], str] = lambda r: (  # noqa: E731
        f"{r['part']} {format_size(r['bytes_read'])} {r['seconds']} s{_rate(r['bytes_read'], r['seconds'])}"
    )
    cases, run_s = sum(r["cases"] for r in hub["per_part"]), hub.get("parts_seconds", 0)
    overall = f"- over the run: {format_size(hub['bytes_read'])} and {cases} cases in {run_s} s"
    if run_s:
        overall += f"{_rate(hub['bytes_read'], run_s)}, {cases / run_s:.2f} cases/s"
    return [*lines, overall, "- per part: " + "; ".join(per_part(r) for r in hub["per_part"])]


def _rate(n_bytes: int, seconds: float, what: str = "") -> str:
    """` at 97.1 MB/s` (MB: 10**6 bytes), or nothing when no byte or no time was spent."""
    return f" at {n_bytes / seconds / 1e6:.1f} MB/s{what}" if n_bytes and seconds > 0 else ""

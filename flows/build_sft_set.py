"""Flow `build-sft-set`: atlas -> organ rows -> `findings`, `sft` and `rejections` tables (docs/contract.md#outputs).

discover -> batches of cases (one task each, resumable through a content-keyed case store) -> select the SFT rows ->
Parquet shards in the Hub layout + `manifest.json` -> artifacts (counts, summary, contact sheet). Thin: this module
plans, submits tasks, shows progress, publishes artifacts and applies the failure threshold; curation is in
`emrl_data.labeling.curate`, the tables, accounting and summary in `emrl_data.tables.sft_set`.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import cv2
import numpy as np
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError
from prefect.futures import as_completed
from prefect.states import Completed, Crashed, State

from emrl_data.atomic_write import write_json_atomic, write_text_atomic
from emrl_data.config import CurateConfig, SftConfig
from emrl_data.labeling.case_store import CaseStore
from emrl_data.labeling.checksums import case_cache_key
from emrl_data.labeling.curate import PLAUSIBLE_ORGAN_VOLUME_CM3, CaseResult, curate_case, fingerprint_case
from emrl_data.live_view import Counts, LiveView
from emrl_data.outcome import Rejection, RejectReason
from emrl_data.reading.atlas import AtlasOrganMeta, AtlasPlan, CaseRef, plan_atlas
from emrl_data.reading.release import parse_size
from emrl_data.tables import overlaps
from emrl_data.tables.qa import build_qa_report, qa_markdown
from emrl_data.tables.sft_set import (
    GatheredCases,
    build_summary,
    check_every_case_accounted,
    gather_case_results,
    select_sft_rows,
    sft_set_provenance,
    summary_markdown,
    unexpected_errors,
    with_source,
    write_contact_sheet,
    write_sft_set_tables,
)
from emrl_data.time_bound import CASE_TIMES, CaseOverrunError, CaseThread
from emrl_data.types import Organ
from flows._common import Progress, batched, count_rejections, git_sha, rejection_table
from flows.hub_parts import HubOptions, curate_release, hub_summary_lines
from flows.runners import check_cluster, is_lost_worker_error, make_task_runner, settle_future
from hub.listing import hub_repo, is_parts_folder


DEFAULT_SCRATCH_BUDGET = "64G"  # four released part pairs at once (about 15 GiB each, `scratch_need`)


def timeout_key(case_id: str) -> str:
    """The case-store key of a case abandoned past its time bound: never a content key, so a rerun curates it."""
    return f"timeout-{case_id}"


@task(cache_policy=NO_CACHE)
def curate_batch_task(
    refs: list[CaseRef],
    splits: dict[str, str],
    metadata: dict[str, dict[Organ, AtlasOrganMeta]],
    cfg_dict: dict[str, Any],
    store_dir: str,
    case_timeout_s: float | None = None,
) -> list[tuple[str, str, bool]]:
    """Curate a batch of cases into the case store; return (case_id, key, was_cached) per case.

    Each case (its key, its curation and its store entry) runs on the worker's `CaseThread` under
    `CASE_TIMES.bound_s(case_timeout_s)`; a case past it is stored as a `case_timeout` rejection under `timeout_key`.
    """
    cfg = CurateConfig.from_dict(cfg_dict)
    store = CaseStore(Path(store_dir))
    return [
        curate_bounded(ref, splits[ref.case_id], metadata.get(ref.case_id), cfg, store, case_timeout_s) for ref in refs
    ]


def curate_bounded(
    ref: CaseRef,
    split: str,
    meta: Mapping[Organ, AtlasOrganMeta] | None,
    cfg: CurateConfig,
    store: CaseStore,
    case_timeout_s: float | None,
) -> tuple[str, str, bool]:
    """Curate one case into the store on the worker's `CaseThread` under `CASE_TIMES.bound_s(case_timeout_s)`.

    Returns:
        (case_id, store key, was_cached); a case past its bound is stored as a `case_timeout` rejection under
        `timeout_key`.
    """
    bound = CASE_TIMES.bound_s(case_timeout_s)
    try:
        result: tuple[str, str, bool] = CaseThread.current().run(
            partial(_curate_one, ref, split, meta, cfg, store), bound
        )
    except CaseOverrunError:
        detail = (
            f"{ref.case_id}: still running after {bound:g} s, the per-case time bound (--case-timeout); "
            "abandoned, the run went on (a rerun tries it again)"
        )
        get_run_logger().warning("%s", detail)
        rejection = Rejection(ref.case_id, None, "curate", RejectReason.CASE_TIMEOUT, detail)
        store.save(timeout_key(ref.case_id), CaseResult(ref.case_id, rejections=[rejection]))
        return ref.case_id, timeout_key(ref.case_id), False
    return result


def _curate_one(
    ref: CaseRef, split: str, meta: Mapping[Organ, AtlasOrganMeta] | None, cfg: CurateConfig, store: CaseStore
) -> tuple[str, str, bool]:
    key = case_cache_key(ref, cfg, split, _meta_key(meta))
    cached = store.load_rows(key)
    if cached is not None:
        if cached.fingerprint is None and cached.rows and (found := fingerprint_case(ref, cfg=cfg)) is not None:
            store.add_fingerprint(key, found)  # an entry stored without one
        return ref.case_id, key, True
    started = time.perf_counter()
    result = curate_case(ref, split=split, cfg=cfg, metadata=meta)
    CASE_TIMES.record(time.perf_counter() - started)
    store.save(key, result)
    return ref.case_id, key, False


def _meta_key(meta: Mapping[Organ, AtlasOrganMeta] | None) -> str:
    return "" if meta is None else repr(sorted((str(k), v) for k, v in meta.items()))


@flow(name="build-sft-set", log_prints=False)
def build_sft_set_flow(
    atlas_root: str,
    output_dir: str,
    cases_per_task: int = 8,
    max_workers: int = 2,
    negatives_per_positive: float = 1.0,
    seed: int = 0,
    test_fraction: float = 0.10,
    max_unexpected_errors: int = 0,
    limit: int | None = None,
    config: dict[str, Any] | None = None,
    task_runner: str = "thread",
    task_runner_address: str | None = None,
    case_timeout_s: float | None = None,
    revision: str | None = None,
    scratch_dir: str | None = None,
    scratch_budget: str = DEFAULT_SCRATCH_BUDGET,
    exclude_overlaps_with: str | None = None,
    layout: str | None = None,
    labels_dir: str | None = None,
) -> dict[str, Any]:
    """Build the `findings`, `sft` and `rejections` tables from an AbdomenAtlas-layout folder or the Hub release.

    Args:
        atlas_root: the atlas folder (split or combined layout; optional metadata CSV and TrainTestIDS/), or
            `hf://datasets/OWNER/NAME`: the release on the Hub, read part pair by part pair (docs/data.md), or a folder
            of its parts as `hf download` leaves them, read in place (checked against `revision`'s listing if given).
        output_dir: where the table folders go (`findings/`, `sft/`, `rejections/`, `manifest.json`, ...).
        cases_per_task: cases per Prefect task (a folder; on the Hub a task is one part pair).
        max_workers: tasks run at once (threads); on the Hub at most as many part pairs as the scratch budget holds.
        negatives_per_positive: train negatives sampled per organ, as a ratio of its positives.
        seed: seed of the negative sampling.
        test_fraction: test share of the hash split (used when there are no IID split files).
        max_unexpected_errors: the flow fails when more cases than this hit an unexpected (non-data) error.
        limit: process only the first N cases (by id); None for all.
        config: overrides of the curation config, e.g. {"frames": {"max_frames": 16}}.
        task_runner: "thread" (default), "process", "dask" or "ray" (docs/scaling.md).
        task_runner_address: an existing Dask scheduler or Ray cluster address (dask/ray only).
        case_timeout_s: the per-case time bound in seconds: a case still running after it is abandoned as a
            `case_timeout` rejection and the run goes on; None (default) = max(600 s, 10x the median case time).
        revision: Hub only: the branch, tag or commit to read (default `main`); pinned to its commit sha.
        scratch_dir: Hub only: where parts are downloaded and unpacked (default `OUTPUT_DIR/.work/scratch`).
        scratch_budget: Hub only: the most the scratch folder may hold at once, e.g. `64G`.
        exclude_overlaps_with: another output folder: a test case that is one of its training CTs is rejected.
        layout, labels_dir: a folder's layout (`emrl layouts`; None: detected) and labels folder (PANORAMA).

    Returns:
        The run summary (also written to `summary.json`).
    """
    if case_timeout_s is not None and not case_timeout_s > 0:
        raise ValueError(f"case_timeout_s={case_timeout_s!r} must be a number of seconds > 0 (or None).")
    started = time.perf_counter()
    other = _other_fingerprints(exclude_overlaps_with)  # before any case is read: a wrong folder fails at once
    cfg = CurateConfig.from_dict(config or {})
    sft_cfg = SftConfig(negatives_per_positive=negatives_per_positive, seed=seed, test_fraction=test_fraction)
    (out := Path(output_dir).resolve()).mkdir(parents=True, exist_ok=True)
    store = CaseStore(out / ".work" / "cases")
    hub = HubOptions(revision, Path(scratch_dir or out / ".work" / "scratch").resolve(), parse_size(scratch_budget))
    runner, given = (task_runner, task_runner_address, max_workers), (layout, labels_dir)  # given: a folder's reading
    read = _read_atlas(atlas_root, out, cfg, store, sft_cfg, limit, runner, hub, cases_per_task, case_timeout_s, given)
    gathered = gather_case_results(read.case_ids, store, read.keys)
    rows, refused = _fingerprints(out, read, gathered, other)
    rows, rejections = with_source(rows, read.plan.source), [*read.plan.rejections, *gathered.rejections, *refused]
    warnings = (*read.plan.warnings, *gathered.warnings)  # atlas warnings, then special files no row needed
    sft_rows = select_sft_rows(rows, sft_cfg)
    provenance = sft_set_provenance(cfg, sft_cfg, read.plan, git_sha=git_sha()) | read.provenance
    write_sft_set_tables(out, rows, sft_rows, rejections, store, read.keys, provenance, read.plan.source)
    check_every_case_accounted(read.case_ids, rows, rejections)
    digests = gathered.file_digests
    qa = build_qa_report(
        rows, rejections, plausible_volume_cm3=PLAUSIBLE_ORGAN_VOLUME_CM3, warnings=warnings, file_digests=digests
    )
    summary = _summary(provenance, read, out, rows, sft_rows, rejections, qa, warnings, digests, started)
    summary |= {} if other is None else {"cases_refused_as_overlaps": len(refused)}
    write_json_atomic(summary, out / "manifest.json")
    sheet = write_contact_sheet(sft_rows, store, read.keys, out / "contact_sheet.png")
    _reports(out, summary, qa_markdown(qa), rejections, sheet)
    get_run_logger().info("build-sft-set done in %.1f s: %s", summary["seconds"], out)
    _fail_on_unexpected_errors(rejections, max_unexpected_errors, out)
    return summary


def _other_fingerprints(other_out: str | None) -> tuple[str, list[overlaps.FingerprintRow]] | None:
    """(the folder, its fingerprint table) of `--exclude-overlaps-with`, or None without it."""
    if other_out is None:
        return None
    folder = Path(other_out).resolve()
    return str(folder), overlaps.read_fingerprints(folder)


def _fingerprints(
    out: Path, read: AtlasRead, gathered: GatheredCases, other: tuple[str, list[overlaps.FingerprintRow]] | None
) -> tuple[list[dict[str, Any]], list[Rejection]]:
    """Write the run's fingerprint table; (the organ rows kept, the test cases refused as training CTs of `other`)."""
    prints = overlaps.fingerprint_rows(read.case_ids, gathered.fingerprints, read.plan.splits, gathered.rows)
    overlaps.write_fingerprints(out, prints)
    if other is None:
        return gathered.rows, []
    return overlaps.exclude_overlapping_tests(gathered.rows, prints, other[1], other[0])


def _summary(
    provenance: dict[str, Any],
    read: AtlasRead,
    out: Path,
    rows: Sequence[Mapping[str, Any]],
    sft_rows: Sequence[Mapping[str, Any]],
    rejections: list[Rejection],
    qa: Any,
    warnings: Sequence[str],
    digests: Mapping[str, str],
    started: float,
) -> dict[str, Any]:
    """The run summary: `build_summary`, then the runner's retries, the timed-out cases and the Hub part pairs."""
    summary = build_summary(
        provenance=provenance,
        atlas_root=read.root,
        output_dir=out,
        n_cases=len(read.case_ids),
        n_resumed=read.n_cached,
        rows=rows,
        sft_rows=sft_rows,
        rejections=rejections,
        qa_flags=qa.flag_counts,
        warnings=warnings,
        file_digests=digests,
        elapsed_s=time.perf_counter() - started,
    )
    summary["batches_retried"] = read.n_retried  # batches run again because the cluster lost a worker
    summary["cases_timed_out"] = sum(r.reason == RejectReason.CASE_TIMEOUT for r in rejections)
    if read.hub_summary:
        summary["hub"] = read.hub_summary
    return summary


@dataclass(frozen=True)
class AtlasRead:
    """The curated atlas, whichever way it was read: plan, cases and their store keys, and what the run reports."""

    root: str
    plan: AtlasPlan
    case_ids: list[str]
    keys: dict[str, str]
    n_cached: int
    n_retried: int = 0
    provenance: dict[str, Any] = field(default_factory=dict)
    hub_summary: dict[str, Any] = field(default_factory=dict)


def _read_atlas(
    atlas_root: str,
    out: Path,
    cfg: CurateConfig,
    store: CaseStore,
    sft_cfg: SftConfig,
    limit: int | None,
    runner: tuple[str, str | None, int],
    hub: HubOptions,
    cases_per_task: int,
    case_timeout_s: float | None,
    reading: tuple[str | None, str | None] = (None, None),
) -> AtlasRead:
    """Plan and curate the atlas: a folder in batches of cases, or the Hub release part pair by part pair.

    `reading`: the layout named and the labels folder given, for a folder (`plan_atlas`)."""
    repo_id = hub_repo(atlas_root)
    parts_folder = repo_id is None and is_parts_folder(Path(atlas_root))
    if repo_id is not None or parts_folder:
        if reading[0] not in (None, "abdomenatlas") or reading[1] is not None:
            raise ValueError(f"{atlas_root} is the AbdomenAtlas release: --layout and --labels are for a folder")
        if parts_folder:
            hub = replace(hub, local_root=Path(atlas_root).resolve())
        done = curate_release(
            repo_id,
            hub,
            out=out,
            cfg=cfg,
            store=store,
            test_fraction=sft_cfg.test_fraction,
            limit=limit,
            runner=runner,
            case_timeout_s=case_timeout_s,
            curate_one=curate_bounded,
        )
        source = {"atlas_source": done.release.source, "atlas_revision": done.release.sha}
        return AtlasRead(
            done.release.source, done.plan, done.case_ids, done.keys, done.n_cached, 0, source, done.summary
        )
    root = Path(atlas_root).resolve()
    labels = None if reading[1] is None else Path(reading[1]).resolve()
    plan = _plan(root, limit, sft_cfg.test_fraction, reading[0], labels)
    keys, n_cached, n_retried = _curate_cases(plan, cfg, store, cases_per_task, runner[2], *runner[:2], case_timeout_s)
    return AtlasRead(str(root), plan, [r.case_id for r in plan.refs], keys, n_cached, n_retried)


def _plan(
    root: Path, limit: int | None, test_fraction: float, layout: str | None = None, labels: Path | None = None
) -> AtlasPlan:
    """Plan the atlas (cases, splits, metadata) and log it; ValueError when it holds no case."""
    plan = plan_atlas(root, limit=limit, test_fraction=test_fraction, layout=layout, labels=labels)
    if not plan.refs:
        raise ValueError(f"No cases in {root}: expected BDMAP_######## folders (in image_only/ and mask_only/).")
    get_run_logger().info(
        "%d cases in %s (%s layout), split from %s, metadata: %s",
        len(plan.refs),
        root,
        plan.layout,
        plan.split_source,
        "yes" if plan.metadata else "no",
    )
    return plan


def _reports(
    out: Path, summary: Mapping[str, Any], qa_md: str, rejections: Sequence[Rejection], sheet: Path | None
) -> None:
    """Write `summary.md` and `qa.md` and publish the run's artifacts."""
    lines = summary_markdown(summary, sheet).split("\n")
    retried = f"- batches retried after a lost worker: {summary['batches_retried']}"
    timed_out = f"- cases abandoned past the per-case time bound (case_timeout): {summary['cases_timed_out']}"
    hub = hub_summary_lines(summary["hub"]) if "hub" in summary else []
    if "cases_refused_as_overlaps" in summary:
        hub.append(
            f"- test cases refused as training CTs of --exclude-overlaps-with: {summary['cases_refused_as_overlaps']}"
        )
    summary_md = "\n".join([*lines[:3], retried, timed_out, *hub, *lines[3:]])  # under the cases line
    write_text_atomic(summary_md, out / "summary.md")
    write_text_atomic(qa_md, out / "qa.md")
    _artifacts(summary, rejections, summary_md, qa_md, sheet)


def _fail_on_unexpected_errors(rejections: Sequence[Rejection], max_unexpected_errors: int, out: Path) -> None:
    """Fail the run (after its outputs are written) when more cases than allowed hit an unexpected error."""
    unexpected = unexpected_errors(rejections)
    if len(unexpected) > max_unexpected_errors:
        raise RuntimeError(
            f"{len(unexpected)} case(s) hit unexpected errors (more than max_unexpected_errors="
            f"{max_unexpected_errors}); outputs were written, see {out / 'rejections'}: "
            + "; ".join(f"{r.case_id}: {r.detail}" for r in unexpected[:3])
        )


def _curate_cases(
    plan: AtlasPlan,
    cfg: CurateConfig,
    store: CaseStore,
    cases_per_task: int,
    max_workers: int,
    task_runner: str,
    task_runner_address: str | None,
    case_timeout_s: float | None = None,
) -> tuple[dict[str, str], int, int]:
    """Submit one curation task per batch of cases, with progress.

    A batch whose workers were lost is run again: by the cluster itself (Dask re-sends a task whose worker died,
    counted by `settle_future`), or here, once, when the cluster gave up on it (`KilledWorker`). The case store makes
    a second run of a batch idempotent: cases the lost worker had finished are read back, not curated twice.

    Returns:
        The store key per case, the number of cases found in the store (resumed), and the batches retried.
    """
    refs, splits, metadata = list(plan.refs), plan.splits, plan.metadata
    # an existing cluster is checked before any case is sent: address, project on the workers, shared atlas and output
    check_cluster(task_runner, task_runner_address, store.root, read_dirs=tuple(sorted({r.root for r in refs})))
    progress = Progress(len(refs), "curating cases", unit="cases")
    keys: dict[str, str] = {}
    n_cached = 0
    batches = list(batched(refs, cases_per_task))
    lost_runs: dict[Any, State] = {}  # task run id -> its final state, for batches that lost a worker
    consumed: list[Any] = []  # task run ids of the batches whose results are in hand
    with (
        make_task_runner(task_runner, max_workers, address=task_runner_address) as runner,
        LiveView("build-sft-set", Counts(cases_total=len(refs), rejections=0)) as view,
    ):

        def submit(batch: list[CaseRef]) -> Any:
            parameters = {
                "refs": batch,
                # only this batch's entries: tasks may be pickled to other processes or machines
                "splits": {r.case_id: splits[r.case_id] for r in batch},
                "metadata": {r.case_id: metadata[r.case_id] for r in batch if r.case_id in metadata},
                "cfg_dict": cfg.to_dict(),
                "store_dir": str(store.root),
                "case_timeout_s": case_timeout_s,
            }
            return runner.submit(curate_batch_task, parameters=parameters)

        pending = {submit(batch): i for i, batch in enumerate(batches)}
        resubmitted: set[int] = set()
        while pending:
            again = {}
            for future in as_completed(list(pending)):
                index = pending[future]
                try:
                    done = future.result()
                except Exception as exc:
                    if not is_lost_worker_error(exc) or index in resubmitted:
                        raise
                    get_run_logger().warning("batch %d lost its workers (%s): submitting it again", index, exc)
                    lost_runs[future.task_run_id] = Crashed(message=f"its worker was lost ({exc}); batch resubmitted")
                    resubmitted.add(index)
                    again[submit(batches[index])] = index
                    continue
                if settle_future(future) > 0:
                    lost_runs[future.task_run_id] = Completed(message="ran again after its worker was lost")
                consumed.append(future.task_run_id)
                for case_id, key, cached in done:
                    keys[case_id] = key
                    n_cached += cached
                resumed = sum(cached for _, _, cached in done)
                view.add_cases(len(done), resumed=resumed, rejections=count_rejections(store, [k for _, k, _ in done]))
                progress.advance(len(done), resumed=resumed)
            pending = again
    if lost_runs:  # Dask also recomputes finished batches whose results were on the lost worker: same task run ids
        done_runs: dict[Any, Any] = {
            run: Completed(message="finished (a worker was lost in this run)") for run in consumed
        }
        _record_lost_batches({**done_runs, **lost_runs})
    return keys, n_cached, len(lost_runs)


def _record_lost_batches(final_states: Mapping[Any, State], wait_s: float = 6.0) -> None:
    """Write the final state of the task runs of batches that lost a worker, so none is left Running in the UI.

    A batch Dask re-sent ran again under the same task run id: its result is here, so its run is Completed (the
    server may otherwise keep the lost worker's Running: seen in tests/flows/test_cluster.py). A batch the flow
    resubmitted goes on under a new task run: the lost one is Crashed. Workers report task runs as events, recorded
    every few seconds, so a run not found yet is tried again for up to `wait_s`; one still not found never started.
    """
    waiting = dict(final_states)
    deadline = time.monotonic() + wait_s
    with get_client(sync_client=True) as client:
        while waiting:
            for task_run_id, state in list(waiting.items()):
                try:
                    client.set_task_run_state(task_run_id, state, force=True)
                    del waiting[task_run_id]
                except (ObjectNotFound, PrefectHTTPStatusError) as error:
                    if getattr(getattr(error, "response", None), "status_code", 404) != 404:
                        get_run_logger().warning("could not record task run %s: %s", task_run_id, error)
                        del waiting[task_run_id]
            if waiting and time.monotonic() > deadline:
                break
            time.sleep(0.5 if waiting else 0)


def _contact_sheet_artifact(path: Path, thumbnail_width_px: int = 720) -> None:
    """Show the contact sheet in the Prefect UI: a markdown artifact with a small JPEG thumbnail and the file's path.

    An image artifact would print its whole data URL under the picture; a markdown image shows only the picture.
    The thumbnail (at most `thumbnail_width_px` wide: the UI's width at 1024 px, labels still legible; about 60 KB) is for
    a glance; the PNG at `path` is for reading.
    """
    image = cv2.imdecode(np.frombuffer(path.read_bytes(), np.uint8), cv2.IMREAD_COLOR)
    if image is None:
        raise RuntimeError(f"could not decode {path} as an image")
    if image.shape[1] > thumbnail_width_px:
        scale = thumbnail_width_px / image.shape[1]
        size = (thumbnail_width_px, round(image.shape[0] * scale))
        image = cv2.resize(image, size, interpolation=cv2.INTER_AREA)
    ok, jpeg = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, 75])
    if not ok:
        raise RuntimeError(f"could not encode {path} as JPEG")
    thumbnail = "data:image/jpeg;base64," + base64.b64encode(jpeg.tobytes()).decode()
    create_markdown_artifact(
        key="build-sft-set-contact-sheet",
        markdown=f"Key frames of SFT positives with their boxes (thumbnail; full size: `{path}`)\n\n"
        f"![contact sheet thumbnail]({thumbnail})\n",
        description=f"contact sheet: {path}",
    )


def _artifacts(
    summary: Mapping[str, Any], rejections: Sequence[Rejection], summary_md: str, qa_md: str, sheet: Path | None
) -> None:
    """Publish the run's artifacts: row counts, every rejection, the summary, the QA report and the contact sheet."""
    table = []
    for kind in ("organ_rows", "sft_rows"):
        for split, counts in summary[kind].items():
            table += [{"table": kind, "split": split, "group": k, "rows": v} for k, v in counts.items()]
    create_table_artifact(key="build-sft-set-counts", table=table, description="rows per table, split and organ")
    create_table_artifact(
        key="build-sft-set-rejections",
        table=rejection_table(rejections),
        description="every rejection with its reason code (details clipped: the full text is in rejections/)",
    )
    create_markdown_artifact(key="build-sft-set-summary", markdown=summary_md, description="run summary")
    create_markdown_artifact(
        key="build-sft-set-qa", markdown=qa_md, description="QA: flags, CSV agreement, worst rows"
    )
    if sheet is not None:
        _contact_sheet_artifact(sheet)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Run the build-sft-set flow once.")
    parser.add_argument("atlas_root")
    parser.add_argument("output_dir")
    args = parser.parse_args()
    print(json.dumps(build_sft_set_flow(args.atlas_root, args.output_dir), indent=2, default=str))

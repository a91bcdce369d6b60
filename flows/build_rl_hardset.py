"""Flow `build-rl-hardset`: SFT rows -> the SFT model's reports -> parse -> score -> the hard set for GRPO.

sft shards (train + test) -> predictions (resumable: one fsync'd JSONL line per finished row) -> scores from the
shared `emrl_data.text.scoring` (the GRPO reward's own functions) -> `predictions` table (every row) + Table 1/2 of the SFT
model on train and test -> `rl_hardset` (train rows the model gets wrong, ranked by R, stratified by organ, capped
at `target_size`, each with the reasons it was chosen and the SFT prediction). Thin: selection, the
tables, metrics and summary are in `emrl_data.tables.rl_hardset`, scoring in `emrl_data.text.scoring`, inference in `inference`.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import pyarrow.parquet as pq
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from emrl_data import __version__
from emrl_data.atomic_write import write_json_atomic, write_text_atomic
from emrl_data.config import HARD_SET_SIZE
from emrl_data.live_view import Counts, LiveView
from emrl_data.tables.records import PREDICTION_TRUTH_COLUMNS
from emrl_data.tables.rl_hardset import (
    SPLITS,
    CollectedPredictions,
    HardRow,
    build_summary,
    collect_predictions,
    select_hard_rows,
    summary_markdown,
    write_hardset_tables,
)
from emrl_data.tables.shards import digest_file, split_shards
from emrl_data.types import row_id
from flows._common import Progress, git_sha
from inference import ResultStore, request_from_row, run_inference
from inference.factory import FailFastOnAuth, make_backend
from inference.openai_client import DIALECTS, MAX_TOKENS_FIELDS


def _shards(sft_dir: Path, split: str) -> list[Path]:
    return split_shards(sft_dir / "data", split)


def _iter_rows(sft_dir: Path, split: str, columns: Sequence[str] | None = None, batch: int = 32) -> Iterator[dict]:
    """Stream the rows of a split (a few row batches in memory at a time, never all frames at once)."""
    for path in _shards(sft_dir, split):
        for record_batch in pq.ParquetFile(path).iter_batches(batch_size=batch, columns=columns):
            yield from record_batch.to_pylist()


@task(cache_policy=NO_CACHE)
def probe_task(sft_dir: str, split: str, backend_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Probe the endpoint with the first row of `split` before any row is sent (`OpenAIBackend.probe`).

    Raises:
        EndpointAuthError, EndpointProbeError: one line each; the run stops here.
    """
    logger = get_run_logger()
    row = next(_iter_rows(Path(sft_dir), split, ["case_id", "organ", "prompt", "frames"], batch=1), None)
    if row is None:
        logger.warning("probe skipped: the %s split has no rows", split)
        return {}
    backend = cast(FailFastOnAuth, make_backend(**backend_kwargs)).backend  # the endpoint inside FailFastOnAuth
    try:
        report = backend.probe(request_from_row(row))
    finally:
        backend.close()
    tokens = (
        f"prompt tokens {report.prompt_tokens[0]} -> {report.prompt_tokens[1]}"
        if report.usage_reported
        else "no usage reported (frames not checked)"
    )
    logger.info(
        "probe ok: %s, dialect %s, %d -> %d frames: %s (%.1f s)",
        backend.model,
        backend.dialect,
        *report.frame_counts,
        tokens,
        report.seconds,
    )
    return {"frame_counts": list(report.frame_counts), "prompt_tokens": list(report.prompt_tokens)}


@task(cache_policy=NO_CACHE)
def predict_task(
    sft_dir: str,
    splits: list[str],
    store_path: str,
    backend_kwargs: dict[str, Any],
    limit: int | None,
    retry_errors: bool = True,
) -> dict[str, Any]:
    """Run the model over the rows of `splits` that the store has no result for (and, with `retry_errors`, those
    stored as errors); return `{"results": every result by row id, "retried_errors": rows sent again}`."""
    logger = get_run_logger()
    sft = Path(sft_dir)
    total = sum(min(pq.ParquetFile(p).metadata.num_rows, limit or 10**12) for s in splits for p in _shards(sft, s))
    progress = Progress(total, "SFT model predictions", unit="rows")
    backend = make_backend(**backend_kwargs)
    results: dict[str, dict[str, Any]] = {}
    retried = [0]
    with (
        ResultStore(Path(store_path)) as store,
        LiveView("SFT model predictions", Counts(cases_total=total, unit="rows")) as view,
    ):
        for split in splits:
            chunk: list = []
            rows = _iter_rows(sft, split, ["case_id", "organ", "prompt", "frames"])
            for index, row in enumerate(rows):
                if limit is not None and index >= limit:
                    break
                chunk.append(request_from_row(row))
                if len(chunk) == 32:
                    results |= _run(
                        backend, chunk, store, backend_kwargs["rows_per_call"], view, progress, retry_errors, retried
                    )
                    chunk = []
            if chunk:
                results |= _run(
                    backend, chunk, store, backend_kwargs["rows_per_call"], view, progress, retry_errors, retried
                )
    failed = sum(r["error"] is not None for r in results.values())
    logger.info(
        "%d predictions (%d failed, %d earlier errors sent again) in %s", len(results), failed, retried[0], store_path
    )
    return {"results": results, "retried_errors": retried[0]}


def _run(backend, requests, store, batch_size, view, progress, retry_errors, retried) -> dict[str, dict[str, Any]]:
    def tick(n: int, resumed: int = 0) -> None:
        view.add_cases(n, resumed=resumed)
        progress.advance(n, resumed=resumed)

    todo = len(store.pending(requests, retry_errors=retry_errors))
    retried[0] += todo - len(store.pending(requests))
    if already := len(requests) - todo:
        tick(already, resumed=already)
    done = run_inference(backend, requests, store, batch_size=batch_size, progress=tick, retry_errors=retry_errors)
    return {rid: {"text": r.text, "error": r.error, "model": r.model} for rid, r in done.items()}


# The flow's settings the prediction tasks build their backend from (handed to them as one dict).
BACKEND_SETTINGS = tuple(
    "backend model_path endpoint_url dialect endpoint_model rows_per_call max_new_tokens max_concurrency device "
    "max_tokens_field connect_timeout_s first_byte_timeout_s answer_timeout_s".split()
)


@flow(name="build-rl-hardset")
def build_rl_hardset_flow(
    sft_dir: str,
    output_dir: str,
    model_path: str | None = None,
    backend: str = "transformers",
    endpoint_url: str | None = None,
    endpoint_model: str | None = None,
    dialect: str = "vllm",
    max_tokens_field: str = "max_tokens",
    probe: bool = True,
    connect_timeout_s: float = 10.0,
    first_byte_timeout_s: float = 120.0,
    answer_timeout_s: float = 300.0,
    splits: list[str] | None = None,
    target_size: int = HARD_SET_SIZE,
    rows_per_call: int = 4,
    max_new_tokens: int = 256,
    max_concurrency: int = 8,
    device: str = "auto",
    max_failed_predictions: int = 0,
    retry_errors: bool = True,
    n_bootstrap: int = 1000,
    limit: int | None = None,
) -> dict[str, Any]:
    """Mine the SFT model's mistakes on the SFT train split into the `rl_hardset` table.

    Args:
        sft_dir: the `sft` table folder written by build-sft-set.
        output_dir: where `predictions/` and `rl_hardset/` go (usually the same output root as the SFT set).
        model_path: the SFT checkpoint directory (backend "transformers").
        backend: "transformers" (local checkpoint) or "openai" (an OpenAI-compatible endpoint such as `vllm serve`).
        endpoint_url: the endpoint's base URL including `/v1` (backend "openai").
        endpoint_model: the model name the endpoint serves (backend "openai").
        dialect: how requests are written (backend "openai"): "vllm" (the frames as one `video_url` plus vLLM's
            fields; our checkpoints on `vllm serve`) or "openai" (one `image_url` per frame, standard fields only;
            `transformers serve`, hosted APIs). `docs/serving.md`.
        max_tokens_field: "max_tokens" or "max_completion_tokens" (OpenAI's newer models) (backend "openai").
        probe: send the first train row twice (2 and 4 frames) before the run: a wrong endpoint, model name, key or
            dialect, or a server that drops the frames, stops the run in one line before any row (backend "openai").
        connect_timeout_s, first_byte_timeout_s, answer_timeout_s: the deadlines of each request (backend "openai";
            `docs/serving.md`); past one the row is a `timeout` error, sent again by the next run (`retry_errors`).
        splits: the splits to predict (default both). `["test"]` evaluates a model on the test split only (a served
            or hosted comparison model: `predictions/` and its metrics; the hard set is then empty).
        target_size: the cap of the hard set (paper: about 2K).
        rows_per_call: rows per generate call / request batch.
        max_new_tokens: generation length cap.
        max_concurrency: in-flight requests (backend "openai").
        device: "auto", "cpu" or "cuda[:N]" (backend "transformers").
        max_failed_predictions: the flow fails when more rows than this could not be predicted.
        retry_errors: send the rows an earlier run stored as errors again (default); False keeps them as they are.
        n_bootstrap: bootstrap replicates of the metric intervals.
        limit: predict only the first N rows of each split (smoke runs).

    Returns:
        The run summary (also `rl_hardset/summary.json`).
    """
    started = time.perf_counter()
    sft, out = Path(sft_dir).resolve(), Path(output_dir).resolve()
    splits = _checked_settings(sft, splits, dialect, max_tokens_field)
    store = _store(sft, out, backend, model_path, endpoint_url, endpoint_model, max_new_tokens, dialect)
    model, fingerprint, store_path = store
    settings = locals()
    backend_kwargs = {name: settings[name] for name in BACKEND_SETTINGS}  # what the tasks build their backend from
    if backend == "openai" and probe:
        probe_task(str(sft), splits[0], backend_kwargs)
    predicted = predict_task(str(sft), splits, str(store_path), backend_kwargs, limit, retry_errors)
    results = predicted["results"]  # scored with the shared scorer; the hard rows are chosen from the train split
    columns = [*PREDICTION_TRUTH_COLUMNS, "frames"]
    collected = collect_predictions({s: _iter_rows(sft, s, columns) for s in SPLITS}, results, str(model))
    chosen = select_hard_rows(collected.scored["train"], target_size=target_size)
    provenance: dict[str, Any] = {"pipeline_version": __version__, "git_sha": git_sha(), **_sft_sources(sft)}
    provenance.update(config_fingerprint=fingerprint, model=str(model), sft_dir=str(sft), target_size=target_size)
    inference = {
        "retried_errors": predicted["retried_errors"],
        "kept_errors": not retry_errors,
        "other_model_answers": _other_models(results, endpoint_model if backend == "openai" else None),
    }
    summary = _write_outputs(sft, out, collected, chosen, provenance, n_bootstrap, started, inference)
    _fail_on_failed_predictions(collected.failed, len(collected.predictions), max_failed_predictions, retry_errors)
    return summary


def _sft_sources(sft: Path) -> dict[str, Any]:
    """The SFT set's `sources` (its manifest's: dataset, licence, citation), for the hard set's card; {} without."""
    manifest = sft / "manifest.json"
    sources = json.loads(manifest.read_text(encoding="utf-8")).get("sources") if manifest.is_file() else None
    return {"sources": sources} if sources else {}


def _store(
    sft: Path,
    out: Path,
    backend: str,
    model_path: str | None,
    endpoint_url: str | None,
    endpoint_model: str | None,
    max_new_tokens: int,
    dialect: str,
) -> tuple[str | None, str, Path]:
    """The model's name in the outputs, the store's fingerprint and the store's path (its folder created)."""
    model = model_path if backend == "transformers" else f"{endpoint_url}#{endpoint_model}"
    request_format = dialect if backend == "openai" else None  # the dialect changes what the model sees
    fingerprint = _store_fingerprint(sft, model_path, model, max_new_tokens, request_format)
    store_path = out / ".work" / f"predictions-{fingerprint}.jsonl"
    store_path.parent.mkdir(parents=True, exist_ok=True)
    return model, fingerprint, store_path


def _other_models(results: Mapping[str, Mapping[str, Any]], asked: str | None) -> dict[str, int]:
    """How many answers named each model other than `asked` (hosted APIs answer with dated names), most first."""
    counts: dict[str, int] = {}
    for result in results.values():
        if asked is not None and (name := result.get("model")) is not None and name != asked:
            counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _checked_settings(sft: Path, splits: list[str] | None, dialect: str, max_tokens_field: str) -> list[str]:
    """Return the splits to predict, in table order (default: all).

    Raises:
        FileNotFoundError: no train shards (build-sft-set has not run).
        ValueError: no known split, or an unknown dialect or length-cap field.
    """
    if not _shards(sft, "train"):
        raise FileNotFoundError(f"No train shards under {sft / 'data'}; run build-sft-set first.")
    chosen = list(SPLITS) if splits is None else [s for s in SPLITS if s in splits]
    if not chosen:
        raise ValueError(f"splits must name at least one of {list(SPLITS)}; got {splits!r}.")
    if dialect not in DIALECTS or max_tokens_field not in MAX_TOKENS_FIELDS:
        raise ValueError(f"{dialect=} must be one of {DIALECTS}; {max_tokens_field=} one of {MAX_TOKENS_FIELDS}.")
    return chosen


def _write_outputs(
    sft: Path,
    out: Path,
    collected: CollectedPredictions,
    chosen: Sequence[HardRow],
    provenance: dict[str, Any],
    n_bootstrap: int,
    started: float,
    inference: Mapping[str, Any],
) -> dict[str, Any]:
    """Write `predictions/`, `rl_hardset/` (tables, metrics, summary.json/md) and the artifacts; return the summary."""
    metrics_text = write_hardset_tables(
        out, _iter_rows(sft, "train"), collected, chosen, provenance=provenance, n_bootstrap=n_bootstrap
    )
    summary = build_summary(
        provenance=provenance,
        collected=collected,
        chosen=chosen,
        out=out,
        elapsed_s=time.perf_counter() - started,
        inference=inference,
    )
    write_json_atomic(summary, out / "rl_hardset" / "summary.json")
    summary_md = summary_markdown(summary, metrics_text)
    write_text_atomic(summary_md, out / "rl_hardset" / "summary.md")
    _artifacts(summary_md, chosen)
    get_run_logger().info(
        "build-rl-hardset: %d hard rows of %d train rows", len(chosen), len(collected.scored["train"])
    )
    return summary


class FailedPredictionsError(RuntimeError):
    """More rows than allowed could not be predicted. `str(err)` names how many and the first; `fix` says what a
    rerun of the same command does with them."""

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(problem)
        self.fix = fix


def _fail_on_failed_predictions(
    failed: Sequence[Mapping[str, Any]], total: int, max_failed_predictions: int, retry_errors: bool
) -> None:
    """Fail the run (after its outputs are written) when more rows than allowed could not be predicted."""
    if len(failed) <= max_failed_predictions:
        return
    first = f"{row_id(failed[0]['case_id'], failed[0]['organ'])}: {failed[0]['inference_error']}"
    problem = (
        f"{len(failed)} of {total} row(s) could not be predicted (max_failed_predictions={max_failed_predictions}); "
        f"first: {first}"
    )
    kept = total - len(failed)
    if retry_errors:
        fix = f"rerun the same command: it sends only these {len(failed)} row(s) again and keeps the {kept} predicted"
    else:
        fix = f"rerun without --keep-errors (flow: retry_errors=true) to send these {len(failed)} row(s) again"
    raise FailedPredictionsError(problem, fix)


def _store_fingerprint(
    sft: Path, model_path: str | None, model: str | None, max_new_tokens: int, dialect: str | None = None
) -> str:
    """Key of the prediction store: the model, the generation settings, the request dialect of an endpoint other than
    the default "vllm" (so earlier stores keep their key) and the exact SFT shards (16 hex digits)."""
    key: dict[str, Any] = {
        "model": str(Path(model_path).resolve()) if model_path else model,
        "max_new_tokens": max_new_tokens,
        "shards": [digest_file(p).sha256 for s in SPLITS for p in _shards(sft, s)],
    }
    if dialect not in (None, "vllm"):
        key["dialect"] = dialect
    key_src = json.dumps(key, sort_keys=True)
    return hashlib.sha256(key_src.encode()).hexdigest()[:16]


def _artifacts(summary_md: str, chosen: Sequence[HardRow]) -> None:
    """Publish the run summary and the chosen rows (first 500) with why they were chosen."""
    create_markdown_artifact(key="build-rl-hardset-summary", markdown=summary_md, description="hard set + SFT metrics")
    create_table_artifact(
        key="build-rl-hardset-rows",
        table=[
            {
                "case_id": h.case_id,
                "organ": h.organ,
                "rank": h.rank,
                "reward": round(h.reward, 4),
                "reasons": ", ".join(h.reasons),
            }
            for h in chosen[:500]
        ]
        or [{"case_id": "", "organ": "", "rank": 0, "reward": 0.0, "reasons": "none"}],
        description="the chosen rows and why (first 500)",
    )

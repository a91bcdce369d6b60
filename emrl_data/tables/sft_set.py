"""The SFT set: which organ rows it holds, and the `build-sft-set` run without its orchestration (docs/contract.md#what-the-pipeline-does, docs/contract.md#outputs).

The selection (`select_sft_rows`): every lesion-positive organ row of the train split plus negatives sampled per organ
(`SftConfig.negatives_per_positive`, default 1:1, chosen by a seeded hash so the choice is stable as the atlas grows);
the test split is kept whole for evaluation. Every organ row stays in `findings` whether selected or not.

The run: `flows.build_sft_set` plans the atlas, submits the curation tasks, shows progress and publishes artifacts;
everything it writes goes through here. Order of a run: `gather_case_results` (the light rows of every case from the
case store) -> `select_sft_rows` -> `write_sft_set_tables` -> `check_every_case_accounted` -> the run summary,
`build_summary` and `summary_markdown` (`manifest.json`, `summary.md`), and `write_contact_sheet`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from emrl_data import __version__
from emrl_data.atomic_write import write_bytes_atomic
from emrl_data.config import CurateConfig, SftConfig
from emrl_data.labeling.case_store import CaseStore
from emrl_data.labeling.fingerprint import CtFingerprint
from emrl_data.labeling.frames import draw_contact_sheet
from emrl_data.outcome import Rejection, RejectReason
from emrl_data.reading.atlas import AtlasPlan
from emrl_data.sources import Source
from emrl_data.tables.records import check_required
from emrl_data.tables.table_folder import (
    count_rejections,
    count_rows,
    finish_table,
    row_order,
    write_split,
    write_table,
)
from emrl_data.types import Organ, Split, row_id


TABLES = ("findings", "sft", "rejections")
"""The table folders a run writes under its output directory."""

_SPLITS = (str(Split.TRAIN), str(Split.TEST))


@dataclass(frozen=True, slots=True)
class GatheredCases:
    """The light rows (no frames) of every case, in row order, with the case-level rejections and input digests.

    Attributes:
        rows: one `findings` row per organ row, sorted by `emrl_data.tables.table_folder.row_order`.
        rejections: the cases' rejections, in case order (the plan's own rejections are not included).
        file_digests: sha256 of every input file read, keyed `row_id(case_id, file name)`.
        warnings: the cases' own warnings for the run (special files no row needed), in case order.
        fingerprints: case id -> its CT's fingerprint, for every case whose CT was read.
    """

    rows: list[dict[str, Any]]
    rejections: list[Rejection]
    file_digests: dict[str, str]
    warnings: list[str] = field(default_factory=list)
    fingerprints: dict[str, CtFingerprint] = field(default_factory=dict)


def _sample_key(seed: int, row: Mapping[str, Any]) -> str:
    return hashlib.sha256(f"{seed}|{row['case_id']}|{row['organ']}".encode()).hexdigest()


def select_sft_rows(rows: Sequence[Mapping[str, Any]], cfg: SftConfig) -> list[Mapping[str, Any]]:
    """Return the SFT rows: train positives + per-organ sampled train negatives + every test row, in `row_order`.

    Negatives per organ = round(ratio x that organ's train positives), capped by the negatives available; the
    negatives with the smallest sha256(seed|case_id|organ) are taken.
    """
    chosen: list[Mapping[str, Any]] = [r for r in rows if r["split"] == Split.TEST]
    train = [r for r in rows if r["split"] == Split.TRAIN]
    for organ in Organ:
        positives = [r for r in train if r["organ"] == organ and r["has_lesion"]]
        negatives = sorted(
            (r for r in train if r["organ"] == organ and not r["has_lesion"]), key=lambda r: _sample_key(cfg.seed, r)
        )
        n_neg = min(len(negatives), round(cfg.negatives_per_positive * len(positives)))
        chosen += positives + negatives[:n_neg]
    return sorted(chosen, key=row_order)


def sft_set_provenance(
    cfg: CurateConfig, sft_cfg: SftConfig, plan: AtlasPlan, *, git_sha: str | None
) -> dict[str, Any]:
    """Return the provenance every table of the run records: versions, both configs, the atlas layout and split source.

    Args:
        cfg: the curation config; sft_cfg: the SFT selection config; plan: the atlas plan.
        git_sha: the code's commit, None outside a git checkout (the flow reads it; the library never runs git).
    """
    return {
        "pipeline_version": __version__,
        "git_sha": git_sha,
        "config_fingerprint": cfg.fingerprint(),
        "config": cfg.to_dict(),
        "sft_config": {
            "negatives_per_positive": sft_cfg.negatives_per_positive,
            "seed": sft_cfg.seed,
            "test_fraction": sft_cfg.test_fraction,
        },
        "atlas_layout": plan.layout,
        "split_source": plan.split_source,
        "sources": [plan.source.to_dict()],
    }


def with_source(rows: Iterable[Mapping[str, Any]], source: Source) -> list[dict[str, Any]]:
    """The rows with their source columns (`source_dataset`, `source_case_id`, `source_license`)."""
    return [{**row, **source.columns(row["case_id"])} for row in rows]


def gather_case_results(case_ids: Sequence[str], store: CaseStore, keys: Mapping[str, str]) -> GatheredCases:
    """Read back the light rows, rejections and file digests of every case from the case store.

    Args:
        case_ids: the cases of the run, in plan order.
        store: the case store the curation tasks wrote into.
        keys: the store key of each case id.

    Raises:
        RuntimeError: a case's store entry vanished or broke during the run.
    """
    rows: list[dict[str, Any]] = []
    rejections: list[Rejection] = []
    digests: dict[str, str] = {}
    warnings: list[str] = []
    fingerprints: dict[str, CtFingerprint] = {}
    for case_id in case_ids:
        result = store.load_rows(keys[case_id])
        if result is None:
            raise RuntimeError(f"case store entry of {case_id} vanished or broke during the run: {store.root}")
        rows += result.rows
        rejections += result.rejections
        warnings += result.warnings
        digests.update({row_id(case_id, name): digest for name, digest in result.file_digests.items()})
        if result.fingerprint is not None:
            fingerprints[case_id] = result.fingerprint
    rows.sort(key=row_order)
    return GatheredCases(rows, rejections, digests, warnings, fingerprints)


def rejection_rows(rejections: Iterable[Rejection], source: Source | None = None) -> list[dict[str, Any]]:
    """Return the `rejections` table rows, sorted by case id, organ (none first), step and reason; with `source`,
    each names it (`Source.columns`)."""
    rows: list[dict[str, Any]] = [{**r.to_row(), **(source.columns(r.case_id) if source else {})} for r in rejections]
    return sorted(rows, key=lambda r: (r["case_id"], r["organ"] or "", r["step"], r["reason"]))


def unexpected_errors(rejections: Iterable[Rejection]) -> list[Rejection]:
    """Return the rejections whose reason is `UNEXPECTED_ERROR` (bugs, not data defects), in input order."""
    return [r for r in rejections if r.reason == RejectReason.UNEXPECTED_ERROR]


def check_every_case_accounted(
    case_ids: Iterable[str], rows: Iterable[Mapping[str, Any]], rejections: Iterable[Rejection]
) -> None:
    """Check that every input case ends in an organ row or a rejection (the house rule: no silent skip).

    Raises:
        RuntimeError: naming the first 10 cases with neither (a bug in the pipeline, never a data defect).
    """
    accounted = {r["case_id"] for r in rows} | {r.case_id for r in rejections}
    missing = [case_id for case_id in case_ids if case_id not in accounted]
    if missing:
        raise RuntimeError(f"Cases with neither a row nor a rejection (a bug): {missing[:10]}")


def rows_with_frames(
    rows: Iterable[Mapping[str, Any]], store: CaseStore, keys: Mapping[str, str]
) -> Iterator[dict[str, Any]]:
    """Yield each SFT row with its `frames`, read back from the case store one case at a time (rows grouped by case).

    Raises:
        ValueError: a row misses a required `sft` column (`emrl_data.tables.records.check_required`).
    """
    cached_case, cached_frames = None, {}
    for row in rows:
        if row["case_id"] != cached_case:
            cached_case, cached_frames = row["case_id"], store.load_frames(keys[row["case_id"]])
        full = {**row, "frames": cached_frames[row["organ"]]}
        check_required("sft", full)
        yield full


def _write_sft(
    sft_rows: Sequence[Mapping[str, Any]],
    out: Path,
    store: CaseStore,
    keys: Mapping[str, str],
    provenance: Mapping[str, Any],
) -> None:
    """Stream the SFT rows with their frames into shards (frames are read back per case, never all at once)."""
    counts = {}
    for split in _SPLITS:
        part = [r for r in sft_rows if r["split"] == split]
        counts[split] = count_rows(part).get(split, {"total": 0})
        sizes = [int(r["frames_bytes"]) for r in part]
        write_split("sft", split, rows_with_frames(part, store, keys), sizes, out)
    finish_table("sft", out, provenance=provenance, counts=counts)


def write_sft_set_tables(
    out: Path,
    rows: Sequence[Mapping[str, Any]],
    sft_rows: Sequence[Mapping[str, Any]],
    rejections: Iterable[Rejection],
    store: CaseStore,
    keys: Mapping[str, str],
    provenance: Mapping[str, Any],
    source: Source,
) -> None:
    """Write the `findings`, `sft` (frames streamed from the store) and `rejections` tables under `out`.

    Args:
        out: the output root; each table goes into its own folder (`TABLES`).
        rows: every organ row (light, no frames), in row order.
        sft_rows: the rows chosen for SFT (`select_sft_rows`).
        rejections: every rejection of the run (plan and cases).
        store: the case store holding the frames.
        keys: the store key of each case id.
        provenance: written into each table's manifest and card.
        source: the dataset the cases come from, named by every rejection row (`with_source` names it on the rows).
    """
    by_split = {split: [r for r in rows if r["split"] == split] for split in _SPLITS}
    counts = {split: count_rows(part).get(split, {"total": 0}) for split, part in by_split.items()}
    write_table("findings", by_split, out, provenance=provenance, counts=counts)
    _write_sft(sft_rows, out, store, keys, provenance)
    # One split; "train" is the Hub convention for a table without splits (load_dataset maps it by name).
    write_table("rejections", {"train": rejection_rows(rejections, source)}, out, provenance=provenance)


def build_summary(
    *,
    provenance: Mapping[str, Any],
    atlas_root: Path | str,
    output_dir: Path,
    n_cases: int,
    n_resumed: int,
    rows: Sequence[Mapping[str, Any]],
    sft_rows: Sequence[Mapping[str, Any]],
    rejections: Sequence[Rejection],
    qa_flags: Mapping[str, int],
    warnings: Sequence[str],
    file_digests: Mapping[str, str],
    elapsed_s: float,
) -> dict[str, Any]:
    """Return the run summary written to `manifest.json` (the provenance without the full config, counts, timing).

    Args:
        provenance: the run's provenance (its `config` entry is left out; the fingerprint stays).
        atlas_root: the atlas folder read.
        output_dir: the output root.
        n_cases: cases planned.
        n_resumed: cases whose curation was found in the case store.
        rows: every organ row; sft_rows: the SFT rows; rejections: every rejection.
        qa_flags: QA flag counts (`QaReport.flag_counts`).
        warnings: atlas warnings of the plan.
        file_digests: sha256 of every input file read.
        elapsed_s: seconds from the start of the run (`cases_per_s` is end to end, resumed cases included).
    """
    return {
        **{k: v for k, v in provenance.items() if k != "config"},
        "atlas_root": str(atlas_root),
        "output_dir": str(output_dir),
        "cases": n_cases,
        "cases_resumed_from_store": n_resumed,
        "organ_rows": count_rows(rows),
        "sft_rows": count_rows(sft_rows),
        "rejections": count_rejections(rejections),
        "unexpected_errors": len(unexpected_errors(rejections)),
        "qa_flags": dict(qa_flags),
        "warnings": list(warnings),
        "input_files": dict(file_digests),
        "seconds": round(elapsed_s, 2),
        "cases_per_s": round(n_cases / elapsed_s, 3),
        "tables": {name: str(output_dir / name) for name in TABLES},
    }


def summary_markdown(summary: Mapping[str, Any], contact_sheet: Path | None) -> str:
    """Return `summary.md`: cases, provenance, rows per table/split/organ, rejections, QA flags and the outputs."""
    lines = [
        "# build-sft-set",
        "",
        f"- cases: **{summary['cases']}** ({summary['cases_resumed_from_store']} resumed from the case store)",
        f"- pipeline {summary['pipeline_version']}, config `{summary['config_fingerprint']}`, "
        f"git `{summary['git_sha']}`",
        f"- split source: {summary['split_source']}; took {summary['seconds']} s ({summary['cases_per_s']} cases/s)",
        "",
        *_rows_table(summary),
        "",
        "Rows per organ: positive / negative.",
    ]
    lines += ["", "| step/reason | cases |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in summary["rejections"].items()] or ["| none | 0 |"]
    if summary["qa_flags"]:
        lines += ["", "QA flags (see qa.md): " + ", ".join(f"{k} {v}" for k, v in summary["qa_flags"].items())]
    if summary["warnings"]:
        lines += ["", f"Atlas warnings ({len(summary['warnings'])}, see qa.md): {summary['warnings'][0]}"]
    lines += ["", "Outputs:", ""] + [f"- `{name}`: {path}" for name, path in summary["tables"].items()]
    lines.append(f"- QA report: {Path(summary['output_dir']) / 'qa.md'}")
    if contact_sheet is not None:
        lines.append(f"- contact sheet (key frames with boxes): {contact_sheet}")
    return "\n".join(lines) + "\n"


def _rows_table(summary: Mapping[str, Any]) -> list[str]:
    """Rows per table and split, one column per organ ("positive / negative"): narrow enough for the Prefect UI."""
    groups = [(t, split, counts) for t in ("organ_rows", "sft_rows") for split, counts in summary[t].items()]
    named = {key.split("/")[0] for _, _, counts in groups for key in counts if key != "total"}
    organs = [str(o) for o in Organ if str(o) in named] + sorted(named - {str(o) for o in Organ})
    rows = [["table", "split", "rows", *organs], ["---"] * (3 + len(organs))]
    for table, split, counts in groups:
        cells = [f"{counts.get(f'{o}/positive', 0)} / {counts.get(f'{o}/negative', 0)}" for o in organs]
        rows.append([table, split, f"**{counts['total']}**", *cells])
    return ["| " + " | ".join(row) + " |" for row in rows]


def write_contact_sheet(
    sft_rows: Sequence[Mapping[str, Any]], store: CaseStore, keys: Mapping[str, str], path: Path, max_tiles: int = 24
) -> Path | None:
    """Draw the key frame of the first `max_tiles` SFT positives with their boxes into the PNG at `path`.

    Returns:
        `path`, or None (nothing written) when there is no positive row.
    """
    positives = [r for r in sft_rows if r["has_lesion"]][:max_tiles]
    if not positives:
        return None
    tiles = []
    for row in rows_with_frames(positives, store, keys):
        k = row["key_slice_frame"]
        tiles.append(
            (row["frames"][k - 1]["bytes"], tuple(row["bbox_xyxy_px"]), f"{row['case_id'][-4:]} {row['organ']} k={k}")
        )
    write_bytes_atomic(draw_contact_sheet(tiles), path)
    return path

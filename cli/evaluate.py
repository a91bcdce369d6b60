"""`emrl eval`: Table 1/2 with bootstrap intervals from prediction files, one table set per model.

Reads the Parquet/JSONL predictions `build-rl-hardset` writes (or any file with the sft truth columns and a report
column), scores them with `emrl_data.text.evaluation` and writes metrics.md/json/png; several inputs (or a `model`
column) give one folder per model and a side-by-side table.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import polars as pl

from cli.errors import UsageError
from emrl_data.tables.shards import split_shards
from emrl_data.text.comparison import paired_differences
from emrl_data.text.evaluation import evaluate, score_predictions, write_evaluation, write_report
from emrl_data.text.results_card import CardMismatch, check_comparable, dataset_source, headline, make_card, read_card


def prediction_files(path: Path) -> list[Path]:
    """The Parquet/JSONL files of a predictions file or table folder (`OUT/predictions`, its `data/`)."""
    if path.is_file():
        if path.suffix not in (".parquet", ".jsonl", ".ndjson"):
            raise UsageError(f"{path} is not a .parquet or .jsonl file", "pass OUT/predictions or a predictions file")
        return [path]
    if not path.is_dir():
        raise UsageError(f"{path} does not exist", "pass OUT/predictions (written by build-rl-hardset) or a file")
    for folder in (path / "data", path):
        files = sorted(folder.glob("*.parquet")) or sorted([*folder.glob("*.jsonl"), *folder.glob("*.ndjson")])
        if files:
            return files
    raise UsageError(f"no .parquet or .jsonl files in {path} or {path / 'data'}", "pass OUT/predictions or a file")


def read_predictions(predictions: Sequence[Path], split: str = "all") -> Any:
    """All prediction rows of `predictions` as one polars frame (split filtered, failed inferences left out).

    With several inputs, a file without a `model` column is named by its path, so that it gets its own tables, and a
    model name found in more than one input is suffixed with its input's path (two runs of one checkpoint stay two).
    """
    frames: list[Any] = []
    seen: dict[str, Path] = {}
    for given in predictions:
        inputs = []
        for f in prediction_files(Path(given)):
            frame = pl.read_ndjson(f) if f.suffix in (".jsonl", ".ndjson") else pl.read_parquet(f)
            if len(predictions) > 1 and "model" not in frame.columns:
                frame = frame.with_columns(pl.lit(str(given)).alias("model"))
            inputs.append(frame)
        names = {n for f in inputs if "model" in f.columns for n in f.get_column("model").unique().to_list()}
        clash = {n for n in names if n in seen and seen[n] != given}
        if clash:
            inputs = [
                f.with_columns(
                    pl.when(pl.col("model").is_in(list(clash)))
                    .then(pl.col("model") + f" [{given}]")
                    .otherwise(pl.col("model"))
                    .alias("model")
                )
                for f in inputs
            ]
        seen |= {n: given for n in names - clash}
        frames += inputs
    frame = pl.concat(frames, how="diagonal_relaxed")
    if split != "all":
        if "split" not in frame.columns:
            raise UsageError(f"--split {split}: the predictions have no split column", "use --split all")
        frame = frame.filter(pl.col("split") == split)
    if "inference_error" in frame.columns:  # rows the model never answered: left out, as build-rl-hardset does
        failed = frame.filter(pl.col("inference_error").is_not_null()).height
        frame = frame.filter(pl.col("inference_error").is_null())
        if failed:
            print(f"  {failed} row(s) without a prediction (inference errors) left out")
    if frame.height == 0:
        where = " ".join(str(p) for p in predictions)
        raise UsageError(f"no prediction rows in {where} (split {split})", "check the path/--split")
    return frame


def by_model(frame: Any) -> list[tuple[str | None, Any]]:
    """Split the rows by their `model` column, in order of first appearance; one unnamed group without it."""
    if "model" not in frame.columns:
        return [(None, frame)]
    frame = frame.with_columns(pl.col("model").fill_null("(unnamed)"))
    names = frame.get_column("model").unique(maintain_order=True).to_list()
    return [(name, frame.filter(pl.col("model") == name)) for name in names]


def with_gold_reports(frame: Any, gold: Path | None, sources: Sequence[dict[str, Any]]) -> Any:
    """The rows with their gold `findings` and `impression` (for the text metrics), joined by case and organ.

    Rows that carry them (or a `report` column) already are returned as they are; otherwise they come from the `sft`
    table `gold` names, or else the one the predictions' manifest names (`sft_dir`, as `build-rl-hardset` writes it).
    """
    if {"findings", "impression"} <= set(frame.columns) or "report" in frame.columns:
        return frame
    named = [Path(s["sft_dir"]) for s in sources if s.get("sft_dir")]
    folder = gold if gold is not None else (named[0] if named else None)
    fix = "pass --gold OUT/sft (the sft table the predictions were made on), or leave out --text-metrics"
    if folder is None:
        raise UsageError(
            "--text-metrics needs the gold reports: the predictions carry none and name no sft table", fix
        )

    shards = split_shards(folder / "data")
    if not shards:
        raise UsageError(f"--text-metrics: no gold reports in {folder / 'data'} (no .parquet shards)", fix)
    if "case_id" not in frame.columns:
        raise UsageError("--text-metrics: the predictions have no case_id column to join the gold reports on", fix)
    columns = ["case_id", "organ", "findings", "impression"]
    gold_rows = pl.concat([pl.read_parquet(f, columns=columns) for f in shards]).unique(["case_id", "organ"])
    joined = frame.join(gold_rows, on=["case_id", "organ"], how="left")
    missing = joined.filter(pl.col("findings").is_null()).height
    if missing:
        raise UsageError(f"--text-metrics: {missing} prediction row(s) have no gold report in {folder}", fix)
    return joined


def evaluate_predictions(
    predictions: Sequence[Path],
    out: Path,
    split: str = "all",
    text_column: str = "prediction",
    n_bootstrap: int = 1000,
    seed: int = 0,
    text_metrics: bool = False,
    gold: Path | None = None,
    against: Path | None = None,
) -> None:
    """Score the predictions, print Table 1/2 per model and write them under `out` (`out/model-N/` for several).

    With several models, each is compared with the first on the rows both answered (paired differences of every
    Table 1/2 cell with paired bootstrap intervals), printed and written to `out/metrics.md` and `out/metrics.json`
    (the results card). `text_metrics` adds BLEU-1..4, ROUGE-L and CIDEr-D against the gold reports. `against`, an
    earlier evaluation's card, is refused unless made on the same rows, else its headline numbers are printed beside.
    """
    frame = read_predictions(predictions, split)
    sources = [dataset_source(Path(p)) for p in predictions]
    if text_metrics:
        frame = with_gold_reports(frame, gold, sources)
    groups = by_model(frame)
    names = [model if model is not None else str(predictions[0]) for model, _ in groups]
    scored, results, texts = [], [], {}
    for name, (_, part) in zip(names, groups, strict=True):
        scored.append(score_predictions(part.to_dicts(), text_column=text_column))
        results.append(evaluate(scored[-1], n_bootstrap=n_bootstrap, seed=seed))
        if text_metrics:
            texts[name] = _text_metrics(part.to_dicts(), text_column, n_bootstrap, seed)
    try:
        card = make_card(models=names, split=split, sources=sources, rows=scored[0], evaluations={})
    except CardMismatch as exc:
        raise UsageError(str(exc), "evaluate predictions made on the same sft table together") from None
    if against is not None:
        _check_against(card | {"evaluations": {n: r.to_json() for n, r in zip(names, results, strict=True)}}, against)
    for index, ((model, _), name, result, rows) in enumerate(zip(groups, names, results, scored, strict=True), 1):
        folder = Path(out) if len(groups) == 1 else Path(out) / f"model-{index}"
        appendix = texts[name].to_markdown() if name in texts else ""
        own_card = make_card(models=[name], split=split, sources=sources, rows=rows, evaluations={})
        own_card["text_metrics"] = {name: texts[name].to_json()} if name in texts else {}
        paths = write_evaluation(result, folder, model=model, card=own_card, appendix=appendix)
        if model is not None:
            print(f"# Model: {model}\n")
        print(result.to_markdown())
        if appendix:
            print(appendix)
        for kind, written in paths.items():
            print(f"  {kind:<9} {written}")
    if len(groups) > 1:
        _compare(out, groups, names, scored, results, texts, card, text_column, n_bootstrap, seed)


def _compare(
    out: Path,
    groups: list[tuple[str | None, Any]],
    names: list[str],
    scored: list[list[dict[str, Any]]],
    results: list[Any],
    texts: dict[str, Any],
    card: dict[str, Any],
    text_column: str,
    n_bootstrap: int,
    seed: int,
) -> None:
    """Print and write (`out/metrics.md`, `out/metrics.json`) the models side by side and each one's paired
    differences against the first (text metrics too when they were computed)."""
    try:
        paired = [
            paired_differences(scored[0], rows, names=(names[0], name), n_bootstrap=n_bootstrap, seed=seed)
            for name, rows in zip(names[1:], scored[1:], strict=True)
        ]
    except ValueError as exc:
        raise UsageError(f"cannot pair the models' rows: {exc}", "give every prediction row its case_id") from None
    side = [
        "## Models side by side",
        "",
        "| model | folder | rows | average B-Acc | Table 2 overall |",
        "| --- | --- | --- | --- | --- |",
    ]
    for index, (name, (_, part), result) in enumerate(zip(names, groups, results, strict=True), start=1):
        cells = f"{result.average_bacc.to_markdown()} | {result.table2_overall.to_markdown()}"
        side.append(f"| {name} | model-{index} | {part.height} | {cells} |")
    markdown = "\n".join(side) + f"\n\n## Paired differences against {names[0]}\n\n"
    markdown += "\n".join(c.to_markdown() for c in paired)
    text_paired = []
    if texts:
        # lazy: rouge_score and sacrebleu add 0.8 s to `emrl eval` (measured); only --text-metrics needs them
        from emrl_data.text.text_metrics import paired_text_differences

        reference_rows = _answered(groups[0][1].to_dicts())
        text_paired = [
            paired_text_differences(
                reference_rows,
                _answered(part.to_dicts()),
                names=(names[0], name),
                text_column=text_column,
                n_bootstrap=n_bootstrap,
                seed=seed,
            )
            for name, (_, part) in zip(names[1:], groups[1:], strict=True)
        ]
    for name, metrics in texts.items():
        markdown += f"\n## Text metrics: {name}\n\n" + metrics.to_markdown()
    for metrics in text_paired:
        markdown += f"\n## Text metrics, paired: {metrics.title}\n\n" + metrics.to_markdown()
    card |= {
        "evaluations": {n: r.to_json() for n, r in zip(names, results, strict=True)},
        "paired_differences": [c.to_json() for c in paired],
        "text_metrics": {n: t.to_json() for n, t in texts.items()},
        "text_paired_differences": [t.to_json() for t in text_paired],
    }
    paths = write_report(out, markdown, card)
    print("\n" + markdown)
    for kind, written in paths.items():
        print(f"  {kind:<9} {written}")


def _text_metrics(rows: list[dict[str, Any]], text_column: str, n_bootstrap: int, seed: int) -> Any:
    from emrl_data.text.text_metrics import text_metrics  # lazy: 0.8 s, --text-metrics only (see _compare)

    return text_metrics(_answered(rows), text_column=text_column, n_bootstrap=n_bootstrap, seed=seed)


def _answered(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows with a prediction (failed inferences are left out, as from the tables)."""
    return [r for r in rows if r.get("inference_error") is None]


def _check_against(card: dict[str, Any], against: Path) -> None:
    """Refuse an earlier card made on other rows (`check_comparable`); else print its headline numbers beside ours."""
    try:
        earlier = read_card(Path(against))
        check_comparable(card, earlier)
    except CardMismatch as exc:
        raise UsageError(str(exc), "compare evaluations of the same predictions rows, split and parser") from None
    except ValueError as exc:
        raise UsageError(str(exc), "pass --against an earlier emrl eval folder or its metrics.json") from None

    def pct(value: float | None) -> str:
        return "n/a" if value is None else f"{100 * value:.2f}"

    print(f"## Against {against} (the same rows)\n\n| model | average B-Acc then / now | Table 2 overall then / now |")
    print("| --- | --- | --- |")
    now, then = headline(card), headline(earlier)
    for model in [*then, *(m for m in now if m not in then)]:
        old, new = then.get(model, {}), now.get(model, {})
        cells = [f"{pct(old.get(k))} / {pct(new.get(k))}" for k in ("average_bacc", "table2_overall")]
        print(f"| {model} | {cells[0]} | {cells[1]} |")
    print()

"""`emrl eval`: Table 1/2 with bootstrap intervals from prediction files, one table set per model.

Reads the Parquet/JSONL predictions `build-rl-hardset` writes (or any file with the sft truth columns and a report
column), scores them with `emrl_data.text.evaluation` and writes metrics.md/json/png; several inputs (or a `model`
column) give one folder per model and a side-by-side table.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cli.errors import UsageError


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

    With several inputs, a file without a `model` column is named by its path, so that it gets its own tables.
    """
    import polars as pl

    frames = []
    for given in predictions:
        for f in prediction_files(Path(given)):
            frame = pl.read_ndjson(f) if f.suffix in (".jsonl", ".ndjson") else pl.read_parquet(f)
            if len(predictions) > 1 and "model" not in frame.columns:
                frame = frame.with_columns(pl.lit(str(given)).alias("model"))
            frames.append(frame)
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
    import polars as pl

    if "model" not in frame.columns:
        return [(None, frame)]
    frame = frame.with_columns(pl.col("model").fill_null("(unnamed)"))
    names = frame.get_column("model").unique(maintain_order=True).to_list()
    return [(name, frame.filter(pl.col("model") == name)) for name in names]


def evaluate_predictions(
    predictions: Sequence[Path],
    out: Path,
    split: str = "all",
    text_column: str = "prediction",
    n_bootstrap: int = 1000,
    seed: int = 0,
) -> None:
    """Score the predictions, print Table 1/2 per model and write them under `out` (`out/model-N/` for several)."""
    from emrl_data.text.evaluation import evaluate, score_predictions, write_evaluation

    groups = by_model(read_predictions(predictions, split))
    compared = []
    for index, (model, part) in enumerate(groups, start=1):
        folder = Path(out) if len(groups) == 1 else Path(out) / f"model-{index}"
        rows = score_predictions(part.to_dicts(), text_column=text_column)
        result = evaluate(rows, n_bootstrap=n_bootstrap, seed=seed)
        paths = write_evaluation(result, folder, model=model)
        if model is not None:
            print(f"# Model: {model}\n")
        print(result.to_markdown())
        for kind, written in paths.items():
            print(f"  {kind:<9} {written}")
        compared.append((model, index, part.height, result))
    if len(groups) > 1:
        print(
            "\n## Models side by side\n\n| model | folder | rows | average B-Acc | Table 2 overall |\n| --- | --- | --- | --- | --- |"
        )
        for model, index, n_rows, result in compared:
            cells = f"{result.average_bacc.to_markdown()} | {result.table2_overall.to_markdown()}"
            print(f"| {model} | model-{index} | {n_rows} | {cells} |")

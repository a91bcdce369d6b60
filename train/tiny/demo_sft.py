"""The demo's SFT stage on CPU: a tiny Qwen3-VL built locally, the LM warm-up, then the paper's SFT (`train.sft`).

A randomly initialised tiny LLM cannot write a report, so before the paper's SFT (vision encoder + projector, LLM
frozen) every part trains on the reports and on the verifier task until held-out reports parse
(`train.tiny.warmup`). Qwen3-VL-8B-Instruct already writes and describes images and skips this: production SFT is
`python -m train.sft`, which takes none of these options.

    python -m train.tiny.demo_sft --config train/configs/sft_demo.yaml --dataset_dir <out>/sft --output_dir <dir>
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trl import SFTConfig

from emrl_data.text.parser import ParseFailure, parse_report
from model_io.processor import user_messages
from train.checks import TrainConfigError, run_cli
from train.data import load_split
from train.entry import train_main
from train.sft import SftScriptArguments, load_policy, load_sft_rows, train_sft
from train.tiny.model import build_model, build_processor
from train.tiny.warmup import held_out_indices, lm_warmup
from train.tiny.warmup_checks import generate_texts, report_parse_rate


@dataclass
class DemoSftArguments(SftScriptArguments):
    """`train.sft`'s knobs plus the demo's: the tiny model's seed, the LM warm-up and its stop rule."""

    tiny_seed: int = field(default=0, metadata={"help": "Seed of the tiny model built when no model is given."})
    lm_warmup_steps: int = field(
        default=0, metadata={"help": "The warm-up's step cap (an error when reached before its targets); 0 = none."}
    )
    lm_warmup_learning_rate: float | None = field(
        default=None, metadata={"help": "Learning rate of the LM warm-up (default: learning_rate)."}
    )
    lm_warmup_target_parse_rate: float = field(
        default=0.95, metadata={"help": "The warm-up stops once this held-out greedy parse rate is reached."}
    )
    lm_warmup_target_sampled_parse_rate: float = field(
        default=0.0,
        metadata={"help": "Also this parse rate of reports sampled at temperature 1 (0 = off)."},
    )
    lm_warmup_eval_every: int = field(default=50, metadata={"help": "Warm-up steps between criterion checks."})
    lm_warmup_val_rows: int = field(
        default=8, metadata={"help": "Train rows held out of the warm-up for its criterion (evenly spaced)."}
    )
    lm_warmup_verifier_task: bool = field(
        default=True, metadata={"help": "The warm-up also teaches the verifier task (r_c needs it)."}
    )
    lm_warmup_both_classes: bool = field(
        default=False,
        metadata={
            "help": "The warm-up also waits for held-out reports that claim a lesion on some positive row and "
            "none on some negative row."
        },
    )
    lm_warmup_both_classes_split: str | None = field(
        default=None,
        metadata={
            "help": "The split whose greedy reports that target reads (None = the held-out train rows); the "
            "SFT's stop split, so the SFT starts from a model that already meets its criterion."
        },
    )
    parse_rate_split: str | None = field(
        default=None, metadata={"help": "After SFT, print the greedy parse rate of this split (e.g. test)."}
    )
    sft_stop_split: str | None = field(
        default=None,
        metadata={
            "help": "SFT runs max_steps a round until the greedy reports of this split have existence "
            "sensitivity and specificity both above 0 (None = one round)."
        },
    )
    sft_max_rounds: int = field(default=1, metadata={"help": "The cap on those rounds."})
    sft_cap_is_error: bool = field(
        default=True,
        metadata={
            "help": "Reaching sft_max_rounds before the criterion is an error (false: a one-line note, and the "
            "last round's model is kept)."
        },
    )


def _criterion_warmup(model: Any, processor: Any, dataset: Any, args: DemoSftArguments, config: SFTConfig) -> None:
    """Run `lm_warmup` on the train rows minus `lm_warmup_val_rows` evenly spaced ones (its criterion's rows: shards
    are often sorted by organ, so the last rows would all be one organ)."""
    n_val = args.lm_warmup_val_rows
    if len(dataset) <= n_val:
        raise TrainConfigError(
            f"{args.dataset_dir}: {len(dataset)} train rows leave none for the warm-up beside "
            f"lm_warmup_val_rows={n_val}; lower lm_warmup_val_rows or add rows"
        )
    rows = [dict(r) for r in dataset]
    val = set(held_out_indices(len(rows), n_val))
    train_rows, val_rows = [r for i, r in enumerate(rows) if i not in val], [rows[i] for i in sorted(val)]
    split = args.lm_warmup_both_classes_split
    class_rows = None if split is None else [dict(r) for r in load_split(str(args.dataset_dir), split)]
    result = lm_warmup(
        model,
        processor,
        train_rows,
        val_rows,
        class_rows=class_rows,
        max_steps=args.lm_warmup_steps,
        learning_rate=args.lm_warmup_learning_rate or config.learning_rate,
        batch_size=config.per_device_train_batch_size,
        eval_every=args.lm_warmup_eval_every,
        target_parse_rate=args.lm_warmup_target_parse_rate,
        target_sampled_parse_rate=args.lm_warmup_target_sampled_parse_rate,
        seed=config.seed,
        verifier_task=args.lm_warmup_verifier_task,
        require_both_classes=args.lm_warmup_both_classes,
    )
    sampled = f", sampled {result.sampled_parse_rate:.0%}" if result.sampled_parse_rates else ""
    print(
        f"LM warm-up (demo only): {result.steps} full-model steps in {result.seconds:.0f} s, held-out parse rate "
        f"{result.parse_rate:.0%}{sampled} (target {args.lm_warmup_target_parse_rate:.0%})",
        flush=True,
    )


def _print_parse_rate(model: Any, processor: Any, dataset_dir: str, split: str) -> None:
    """Print the greedy parse rate of the trained model on `split` (one line)."""
    rows = [dict(r) for r in load_split(dataset_dir, split)]
    rate, _ = report_parse_rate(model, processor, rows)
    print(f"SFT parse rate on the {split} split: {round(rate * len(rows))}/{len(rows)} reports parse ({rate:.0%})")


def existence_rates(model: Any, processor: Any, rows: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """Return (sensitivity, specificity) of the greedy reports' existence claims on `rows` (an unreadable report
    claims nothing: wrong on a positive row, right on none); None for a class without rows."""
    texts = generate_texts(model, processor, [user_messages(r["prompt"], r["frames"]) for r in rows], 128)
    pos, neg = [], []
    for row, text in zip(rows, texts, strict=True):
        parsed = parse_report(text, row["organ"])
        readable = not isinstance(parsed, ParseFailure)
        if row["has_lesion"]:
            pos.append(readable and parsed.has_lesion)  # type: ignore[union-attr]
        else:
            neg.append(readable and not parsed.has_lesion)  # type: ignore[union-attr]
    return (sum(pos) / len(pos) if pos else None), (sum(neg) / len(neg) if neg else None)


def sft_until_both_classes(
    model: Any, processor: Any, dataset: Any, args: DemoSftArguments, config: SFTConfig
) -> Path:
    """Run the paper's SFT `max_steps` a round until the greedy reports of `sft_stop_split` say "lesion" on some
    positive row and "no lesion" on some negative one (both rates above 0); one round without `sft_stop_split`.

    Raises:
        TrainConfigError: when `sft_max_rounds` rounds end before the criterion (one line), unless
            `sft_cap_is_error` is false: then a one-line note, and the last round's model is kept.
    """
    if args.sft_stop_split is None:
        return train_sft(model, processor, dataset, config, step_logs=args.step_logs)
    rows = [dict(r) for r in load_split(str(args.dataset_dir), args.sft_stop_split)]
    for round_ in range(1, args.sft_max_rounds + 1):
        out = train_sft(model, processor, dataset, config, step_logs=args.step_logs)
        sens, spec = existence_rates(model, processor, rows)
        text = f"sensitivity {_pct(sens)}, specificity {_pct(spec)}"
        print(
            f"SFT round {round_} ({round_ * config.max_steps} steps): {args.sft_stop_split} split {text}", flush=True
        )
        if (sens or 0) > 0 and (spec or 0) > 0:
            return out
    missed = (
        f"demo SFT: the {args.sft_stop_split} split's existence {text} after sft_max_rounds={args.sft_max_rounds} "
        f"rounds of {config.max_steps} steps"
    )
    if args.sft_cap_is_error:
        raise TrainConfigError(f"{missed} (both must be above 0); raise sft_max_rounds")
    print(
        f"note: {missed}: the model answers one class there, so GRPO's existence reward has little spread; the last "
        "round's model goes on",
        flush=True,
    )
    return out


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def run_demo_sft(args: DemoSftArguments, training_args: SFTConfig) -> Path:
    """Build (or load) the policy, warm it up when asked, run the paper's SFT, save; return the output folder."""
    dataset = load_sft_rows(args)
    if args.model_name_or_path is None:
        processor = build_processor()
        model = build_model(processor.tokenizer, seed=args.tiny_seed)
    else:
        model, processor = load_policy(args.model_name_or_path, dtype=args.dtype)
    if args.lm_warmup_steps > 0:
        _criterion_warmup(model, processor, dataset, args, training_args)
    out = sft_until_both_classes(model, processor, dataset, args, training_args)
    if args.parse_rate_split:
        _print_parse_rate(model, processor, str(args.dataset_dir), args.parse_rate_split)
    return out


def main(argv: list[str] | None = None) -> None:
    """CLI entry: `python -m train.tiny.demo_sft --config YAML [--dataset_dir D] [--output_dir O] [overrides]`."""
    train_main("sft", DemoSftArguments, SFTConfig, run_demo_sft, argv)


if __name__ == "__main__":
    run_cli(main)

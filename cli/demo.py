"""`emrl demo`: synthetic atlas -> build-sft-set -> tiny SFT -> build-rl-hardset -> tiny GRPO, on CPU.

The production path at the demo's smaller shapes (`cli.settings`: `demo` values, `DEMO_FRAMES`); training runs as
`python -m train.tiny.demo_sft` (tiny model, LM warm-up, the paper's SFT) and `python -m train.grpo` subprocesses
(the CLI, like the flows, never imports train). Rerunning resumes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

from cli.settings import BUILD_RL_HARDSET, BUILD_SFT_SET, DEMO_FRAMES, demo_kwargs
from emrl_data import PROJECT_ROOT
from emrl_data.synthetic import demo_specs, write_atlas


def synth_atlas(out: Path, cases: int, seed: int, layout: str) -> Path:
    """Write a synthetic atlas of `cases` cases to `out` (what `emrl synth` does), printing where it went."""
    specs = demo_specs(n_cases=cases, seed=seed)
    out = Path(out)
    started = time.perf_counter()
    with tqdm(total=1, desc=f"writing {len(specs)} synthetic cases", unit="atlas", disable=None) as bar:
        write_atlas(out, specs, layout=layout)
        bar.update(1)
    print(f"Synthetic atlas: {len(specs)} cases ({layout} layout) in {out} ({time.perf_counter() - started:.1f} s)")
    print(f"  ground truth: {out / 'synthetic_truth.json'}")
    return out


def _run_train(module: str, *args: str) -> None:
    """Run a `train/` script in its own process (the CLI, like the flows, never imports train)."""
    cmd = [sys.executable, "-m", module, *args]
    subprocess.run(cmd, cwd=PROJECT_ROOT, check=True)


def run_demo(out: Path, cases: int, skip_training: bool = False) -> None:
    """The whole pipeline on a synthetic atlas of `cases` cases under `out`, printing what each step made."""
    # The tiny model runs faster on one thread per process (on a loaded 2-core machine, 2 threads per process made the
    # warm-up 7x slower: 13.7 vs 1.8 min); set before torch loads here or in the training subprocesses. An explicit
    # setting wins.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # lazy: Prefect and the flows add 0.9 s to `emrl synth`, which shares this module (measured)
    from flows.build_rl_hardset import build_rl_hardset_flow
    from flows.build_sft_set import build_sft_set_flow  # lazy: see the line above

    out = Path(out).resolve()
    atlas = out / "atlas"
    started = time.perf_counter()
    print(f"== 1/5  synthetic AbdomenAtlas -> {atlas}")
    synth_atlas(atlas, cases=cases, seed=0, layout="split")

    print(f"\n== 2/5  build-sft-set (Prefect flow) -> {out}")
    build_sft_set_flow(atlas_root=str(atlas), output_dir=str(out), config=DEMO_FRAMES, **demo_kwargs(BUILD_SFT_SET))
    print((out / "summary.md").read_text())
    if skip_training:
        return print_outputs(out, started)

    print(f"== 3/5  tiny Qwen3-VL: LM warm-up on the reports, then the paper's SFT freezing -> {out / 'sft_model'}")
    _run_train(
        "train.tiny.demo_sft",
        "--config",
        "train/configs/sft_demo.yaml",
        "--dataset_dir",
        str(out / "sft"),
        "--output_dir",
        str(out / "sft_model"),
    )

    print(f"\n== 4/5  build-rl-hardset (Prefect flow) with the tiny SFT model -> {out / 'rl_hardset'}")
    build_rl_hardset_flow(
        sft_dir=str(out / "sft"),
        output_dir=str(out),
        model_path=str(out / "sft_model"),
        **demo_kwargs(BUILD_RL_HARDSET),
    )
    print((out / "rl_hardset" / "summary.md").read_text())
    print(
        "The tables above evaluate a tiny model initialised at random and trained for minutes on synthetic cases: a "
        "check that the pipeline runs, not a result; learning is shown in docs/miniature.md#learning-proof-on-cpu.\n"
    )

    print(f"== 5/5  E-MRL GRPO (r_e + r_f + r_c, verifier) beside an lr-0 control -> {out / 'grpo_model'}")
    _run_train(
        "train.grpo",
        "--config",
        "train/configs/grpo_demo.yaml",
        "--dataset_dir",
        str(out / "rl_hardset"),
        "--model_name_or_path",
        str(out / "sft_model"),
        "--output_dir",
        str(out / "grpo_model"),
    )
    print_outputs(out, started)


def print_outputs(out: Path, started: float) -> None:
    """List what the demo wrote, with one line each on what it is."""
    print(f"\nDemo outputs ({time.perf_counter() - started:.0f} s):")
    items = [
        ("atlas", out / "atlas", "synthetic AbdomenAtlas + synthetic_truth.json"),
        ("findings", out / "findings", "every organ row, all labels"),
        ("sft", out / "sft", "SFT set (Hub layout)"),
        ("rejections", out / "rejections", "defective cases with reason codes"),
        ("contact", out / "contact_sheet.png", "key frames with their boxes"),
        ("sft_model", out / "sft_model", "tiny SFT checkpoint"),
        ("predictions", out / "predictions", "the SFT model's reports, parsed and scored"),
        ("rl_hardset", out / "rl_hardset", "hard set + metrics.md (Table 1/2)"),
        ("grpo_model", out / "grpo_model", "tiny GRPO checkpoint + reward_curve.png"),
        ("manifest", out / "manifest.json", "versions, config fingerprint, input hashes, counts"),
    ]
    for name, path, what in items:
        if path.exists():
            print(f"  {name:<12} {path}  ({what})")
    print(f"\n  load: datasets.load_dataset('parquet', data_dir='{out / 'sft' / 'data'}')")

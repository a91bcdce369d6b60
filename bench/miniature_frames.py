"""Benchmark: what 128-px frames cost the miniature against its 64-px frames, as ratios measured in one run.

The pilot's rows (`make_visible_rows`: 20 frames, liver, pancreas and kidney, lesions of 31, 56 and 90 mm) at each
frame size, and the tiny Qwen3-VL of the miniature (`train.tiny.model`, seeded), one torch thread as a study's job
runs. Each round, in this process (warm after a first unmeasured round), for each size in turn, times in CPU seconds
(user + system: on a shared machine wall time mostly measures the wait for a core):

  * warm-up step - one optimizer step of the warm-up: a report batch (4 rows) and a verifier batch (32 frames), as
    `train.tiny.warmup.lm_warmup` takes it;
  * report - one greedy report of a positive row, 128 new tokens (`eval_max_new_tokens`), as the eval, a warm-up
    check and (sampled) a GRPO rollout make it.

It also prints each size's tokens a report prompt holds and the image tokens of one frame pair. Rounds are
interleaved; each ratio is taken per round, then the median. The last line reads
`128px/64px: warmup_step=...x report=...x prompt_tokens=...x`.

    python bench/miniature_frames.py [--rounds 3] [--steps 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root, for `python bench/...`

import numpy as np  # noqa: E402
import torch  # noqa: E402

from model_io.processor import user_messages  # noqa: E402
from train.data import SFTCollator  # noqa: E402
from train.tiny.model import build_model, build_processor  # noqa: E402
from train.tiny.synthetic import make_visible_rows  # noqa: E402
from train.tiny.verifier_data import BalancedPairs, VerifierCollator  # noqa: E402
from train.tiny.warmup import balanced_rows  # noqa: E402


SIZES_PX = (64, 128)
ROWS = dict(n_frames=20, organs=("liver", "pancreas", "kidney"), sizes_mm=(31.0, 56.0, 90.0), span=3)


class Setup:
    """One frame size's rows, model, optimizer and collators."""

    def __init__(self, size_px: int) -> None:
        self.size_px = size_px
        self.rows = make_visible_rows(24, split="train", seed=0, size_px=size_px, **ROWS)
        self.processor = build_processor()
        self.model = build_model(self.processor.tokenizer, seed=0)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=3e-3, weight_decay=0.0)
        self.rng = np.random.default_rng(0)
        self.reports, self.verifier = SFTCollator(self.processor), VerifierCollator(self.processor)
        self.pairs = BalancedPairs(self.rows, self.rng, ROWS["span"], True)
        self.positive = next(r for r in self.rows if r["has_lesion"])

    def tokens(self) -> tuple[int, int]:
        """Return (tokens of one report row's input, image tokens of one frame pair)."""
        batch = self.reports([self.positive])
        video = int(self.model.config.video_token_id)
        image_tokens = int((batch["input_ids"][0] == video).sum())
        return int(batch["input_ids"].shape[1]), image_tokens // (ROWS["n_frames"] // 2)

    def warmup_step(self) -> None:
        self.model.train()
        batch = self.reports(balanced_rows(self.rows, self.rng, 4))
        vbatch = self.verifier(self.pairs.draw(32))
        self.opt.zero_grad()
        loss = self.model(**batch).loss + self.model(**vbatch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()

    def report(self) -> None:
        """A greedy report of exactly 128 new tokens (a random model may stop early: its length is fixed here)."""
        self.model.eval()
        inputs = self.processor.apply_chat_template(
            [user_messages(self.positive["prompt"], self.positive["frames"])],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
        )
        with torch.no_grad():
            self.model.generate(**inputs, max_new_tokens=128, min_new_tokens=128, do_sample=False)


def cpu_seconds(fn, times: int) -> float:
    start = time.process_time()
    for _ in range(times):
        fn()
    return (time.process_time() - start) / times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="warm-up steps a size and round")
    args = parser.parse_args()
    torch.set_num_threads(1)
    setups = {size: Setup(size) for size in SIZES_PX}
    for size, setup in setups.items():
        prompt, pair = setup.tokens()
        print(f"{size} px: {prompt} tokens a report prompt, {pair} image tokens a frame pair", flush=True)
    for setup in setups.values():  # the unmeasured warm round
        setup.warmup_step()
        setup.report()
    ratios: dict[str, list[float]] = {"warmup_step": [], "report": []}
    for i in range(args.rounds):
        step = {s: cpu_seconds(setups[s].warmup_step, args.steps) for s in SIZES_PX}
        report = {s: cpu_seconds(setups[s].report, 1) for s in SIZES_PX}
        ratios["warmup_step"].append(step[128] / step[64])
        ratios["report"].append(report[128] / report[64])
        print(
            f"round {i + 1}: warm-up step {step[64]:.3f} / {step[128]:.3f} CPU s, "
            f"report {report[64]:.2f} / {report[128]:.2f} CPU s (64 / 128 px)",
            flush=True,
        )
    prompt_ratio = setups[128].tokens()[0] / setups[64].tokens()[0]
    print(
        f"128px/64px: warmup_step={statistics.median(ratios['warmup_step']):.2f}x "
        f"report={statistics.median(ratios['report']):.2f}x prompt_tokens={prompt_ratio:.2f}x"
    )


if __name__ == "__main__":
    main()

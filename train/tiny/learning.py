"""Learning diagnostics of the CPU demo and tests: do the reports parse, does GRPO move log-probs the right way.

* `parse_rate`: greedy reports of a checkpoint on a split, and the fraction that `emrl_data.text.parser` parses.
* `logprob_shift_correlation`: one GRPO rollout batch, one optimizer step on it, and the Pearson correlation between
  each completion's advantage and the change of its summed log-prob (positive = the update has the right sign).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from emrl_data.text.parser import ParseFailure, parse_report
from model_io.processor import load_model_and_processor, user_messages
from model_io.video import frames_to_array
from train.data import SFTCollator, load_split


logger = logging.getLogger(__name__)


def generate_reports(model: Any, processor: Any, rows: list[dict[str, Any]], max_new_tokens: int = 128) -> list[str]:
    """Return the greedy report of each row (video + prompt), vision tokens suppressed."""
    texts = []
    model.eval()
    for row in rows:
        inputs = processor.apply_chat_template(
            [user_messages(row["prompt"], frames_to_array(row["frames"]))],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
        )
        with torch.no_grad():
            out = model.generate(
                **inputs, max_new_tokens=max_new_tokens, do_sample=False, suppress_tokens=processor.vision_token_ids
            )
        texts.append(processor.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)[0])
    return texts


def parse_rate(
    model_dir: str | Path, dataset_dir: str | Path, split: str = "test", max_new_tokens: int = 128
) -> float:
    """Return the fraction of `split` rows whose greedy report from `model_dir` parses."""
    model, processor = load_model_and_processor(model_dir, dtype=torch.float32)
    rows = [dict(r) for r in load_split(dataset_dir, split)]
    reports = generate_reports(model, processor, rows, max_new_tokens)
    ok = [not isinstance(parse_report(t, r["organ"]), ParseFailure) for t, r in zip(reports, rows, strict=True)]
    return sum(ok) / max(1, len(ok))


def _sequence_logps(trainer: Any, batch: dict[str, Any]) -> torch.Tensor:
    """Return the summed completion log-prob per row of a rollout batch (current weights, no grad)."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    trainer._ct_videos = list(zip(batch["ct_pixel_values_videos"], batch["ct_video_grid_thw"], strict=True))
    try:
        with torch.no_grad():
            logps, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, mask, batch["completion_ids"].shape[1]
            )[:2]
    finally:
        trainer._ct_videos = None
    return (logps * batch["completion_mask"]).sum(1)


def logprob_shift_correlation(trainer: Any, rows: list[dict[str, Any]], lr: float = 1e-3) -> tuple[float, dict]:
    """Roll out `rows` (already repeated per generation), take one AdamW step on the GRPO loss of that batch.

    Returns (Pearson correlation of advantage vs Δ summed log-prob, details). Uses the trainer's own rollout,
    rewards and loss (`_generate_and_score_completions`, `_compute_loss`); the optimizer is a fresh AdamW over the
    trainable parameters.
    """
    if not hasattr(
        trainer, "current_gradient_accumulation_steps"
    ):  # set by Trainer.train(); one step, no accumulation
        trainer.current_gradient_accumulation_steps = 1
    batch = trainer._generate_and_score_completions(rows)
    before = _sequence_logps(trainer, batch)
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    opt.zero_grad()
    loss = trainer._compute_loss(trainer.model, batch)
    loss.backward()
    grad_norm = float(torch.norm(torch.stack([p.grad.norm() for p in params if p.grad is not None])))
    opt.step()
    after = _sequence_logps(trainer, batch)
    adv, delta = batch["advantages"].float(), (after - before).float()
    if adv.std() == 0 or delta.std() == 0:
        return 0.0, {"grad_norm": grad_norm, "advantages": adv.tolist(), "delta": delta.tolist()}
    corr = float(torch.corrcoef(torch.stack([adv, delta]))[0, 1])
    return corr, {"grad_norm": grad_norm, "advantages": adv.tolist(), "delta": delta.tolist()}


class GradientTamper:
    """A `TrainerCallback` for the learning test's negative controls: before every optimizer step, flip the gradient's
    sign (`mode="flip"`) or replace each gradient tensor by Gaussian noise of the same norm (`mode="noise"`, seeded).

    A learning claim that still holds under either is not a claim about the gradient.
    """

    def __init__(self, mode: str, seed: int = 0):
        if mode not in ("flip", "noise"):
            raise ValueError(f"mode={mode!r}; choose 'flip' or 'noise'.")
        self.mode = mode
        self.generator = torch.Generator().manual_seed(seed)
        self.steps = 0
        # Duck-typed callback: TRL/transformers call the `on_*` methods a TrainerCallback defines.
        for name in dir(TrainerCallback):
            if name.startswith("on_") and not hasattr(self, name):
                setattr(self, name, lambda *a, **k: None)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        """Tamper with every gradient in place (after clipping, before the step)."""
        for param in model.parameters():
            if param.grad is None:
                continue
            if self.mode == "flip":
                param.grad.neg_()
            else:
                noise = torch.randn(param.grad.shape, generator=self.generator, dtype=param.grad.dtype)
                param.grad.copy_(noise * (param.grad.norm() / noise.norm().clamp_min(1e-12)))
        self.steps += 1


def report_logps(model: Any, processor: Any, rows: list[dict[str, Any]], reports: list[str]) -> torch.Tensor:
    """Return the summed log-prob of each `reports[i]` given row i's frames and prompt (teacher forced, one at a time)."""
    collate = SFTCollator(processor)
    was_training = model.training
    model.eval()
    out = []
    with torch.no_grad():
        for row, report in zip(rows, reports, strict=True):
            batch = collate([{**row, "report": report}])
            labels = batch.pop("labels")
            logits = model(**batch).logits[:, :-1].float()
            target = labels[:, 1:]
            mask = target != -100
            logp = torch.log_softmax(logits, -1).gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
            out.append(float((logp * mask).sum()))
    model.train(was_training)
    return torch.tensor(out)


def existence_margins(model: Any, processor: Any, rows: list[dict[str, Any]], opposite: list[str]) -> torch.Tensor:
    """Per row: log p(its true report's token) - log p(`opposite[i]`'s token) at the first token where they differ.

    `opposite[i]` is a report with the other lesion claim, so that token is the existence decision ("No" vs "A");
    both are scored after the same teacher-forced prefix, with the row's frames shown. Positive = the policy prefers
    the right claim for what the frames show; no sampling noise.
    """
    collate = SFTCollator(processor)
    tok = processor.tokenizer
    was_training = model.training
    model.eval()
    out = []
    with torch.no_grad():
        for row, other in zip(rows, opposite, strict=True):
            a, b = tok(row["report"])["input_ids"], tok(other)["input_ids"]
            j = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
            batch = collate([{**row, "report": tok.decode(a[:j])}])  # prefix + eos; the eos label is not read
            batch.pop("labels")
            logits = model(**batch).logits[0, -2].float()  # at the prefix's last token: predicts report token j
            logp = torch.log_softmax(logits, -1)
            out.append(float(logp[a[j]] - logp[b[j]]))
    model.train(was_training)
    return torch.tensor(out)

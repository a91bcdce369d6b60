"""Precision: fp32 master weights keep AdamW updates at the paper's lr 5e-6; bf16 weights are refused."""

import pytest
import torch
from transformers import TrainerCallback

from model_io.processor import load_model_and_processor
from train.checks import TrainConfigError, check_precision, require_fp32_trainable
from train.data import load_split
from train.sft import build_sft_trainer, make_sft_config


class _NonzeroGrads(TrainerCallback):
    """Record, right before the optimizer step, which trainable weights received a nonzero gradient."""

    def __init__(self, model):
        self.model, self.masks = model, {}

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        for name, param in self.model.named_parameters():
            if param.requires_grad and param.grad is not None:
                self.masks[name] = param.grad.detach() != 0


@pytest.mark.slow
def test_one_adamw_step_at_5e_6_changes_99_percent_of_weights_with_a_gradient(tiny_dir, sft_table, tmp_path):
    model, processor = load_model_and_processor(tiny_dir, dtype=torch.float32)
    args = make_sft_config(
        output_dir=str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=2,
        learning_rate=5e-6,
        lr_scheduler_type="constant",
        use_cpu=True,
        bf16=True,
        save_strategy="no",
    )
    trainer = build_sft_trainer(model, processor, load_split(sft_table, "train"), args)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    recorder = _NonzeroGrads(model)
    trainer.add_callback(recorder)
    trainer.train()
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)  # masters stayed fp32
    with_grad = sum(int(m.sum()) for m in recorder.masks.values())
    changed = sum(
        int(((p.detach() != before[n]) & recorder.masks[n]).sum())
        for n, p in model.named_parameters()
        if n in recorder.masks
    )
    assert with_grad > 10_000
    assert changed / with_grad >= 0.99


def test_bf16_weights_with_bf16_adamw_lose_most_updates():
    """Why the rule exists: the same step on bf16 weights (std 0.02) rounds most updates away."""
    torch.manual_seed(0)
    for dtype, low, high in ((torch.float32, 0.99, 1.0), (torch.bfloat16, 0.0, 0.5)):
        w = torch.nn.Parameter((torch.randn(256, 256) * 0.02).to(dtype))
        opt = torch.optim.AdamW([w], lr=5e-6, weight_decay=0.0)
        before = w.detach().clone()
        w.grad = torch.randn_like(w)
        opt.step()
        frac = float((w.detach() != before).float().mean())
        assert low <= frac <= high, (dtype, frac)


def test_pure_bf16_is_refused_with_a_reason():
    with pytest.raises(TrainConfigError, match="no fp32 master copy"):
        check_precision("bfloat16")
    check_precision("bfloat16", lora=True)  # LoRA: bf16 only for the frozen base
    check_precision("float32")
    layer = torch.nn.Linear(4, 4).to(torch.bfloat16)
    with pytest.raises(TrainConfigError, match="not fp32"):
        require_fp32_trainable(layer)

"""The single-GPU path: LoRA on the LLM, projector in full, ViT frozen; fp32 trainables over a bf16 base."""

import torch

from train.data import load_split
from train.grpo import build_grpo_trainer, make_grpo_config


def test_lora_grpo_trains_adapters_and_projector_only(tiny_dir, sft_table, tmp_path):
    from model_io.processor import CTQwen3VLProcessor

    proc = CTQwen3VLProcessor.from_pretrained(tiny_dir)
    args = make_grpo_config(
        proc,
        ["r_e", "r_f"],
        output_dir=str(tmp_path),
        num_generations=4,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        max_completion_length=6,
        max_steps=1,
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        learning_rate=1e-2,
    )
    trainer = build_grpo_trainer(
        str(tiny_dir), load_split(sft_table, "train"), args, rewards=["r_e", "r_f"], dtype="bfloat16", lora_r=4
    )
    model = trainer.model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
    assert any("lora_A" in n for n in trainable)
    assert any(".merger.modules_to_save." in n for n in trainable)
    assert any("deepstack_merger_list.0.modules_to_save." in n for n in trainable)
    assert not any(".blocks." in n for n in trainable)  # ViT frozen
    assert not any(n.endswith("q_proj.base_layer.weight") for n in trainable)  # LLM base frozen (bf16)
    assert any(p.dtype == torch.bfloat16 for p in model.parameters())

"""SFT and GRPO stages on CPU with the tiny model: parameter groups, video in the loss, padding, verifier."""

import numpy as np
import pytest
import torch
from trl import GRPOConfig

from train.data import frames_to_array, load_model_and_processor, load_split, user_messages
from train.freeze import parameter_group
from train.grpo import build_grpo_trainer
from train.rewards import Verifier
from train.sft import build_sft_trainer, make_sft_config


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _changed_groups(before, model):
    changed, same = set(), set()
    for n, p in model.named_parameters():
        (same if torch.equal(before[n], p.detach()) else changed).add(n)
    return changed, same


def _length_reward(completions, **kwargs):
    return [float(len(c[0]["content"]) % 7) for c in completions]  # varies within a group -> nonzero advantages


class _VerifierReward:
    """Calls the verifier on each row's frame 1 and checks it used the trainer's current weights."""

    __name__ = "r_verify"

    def __init__(self):
        self.verifier = Verifier(max_new_tokens=4)
        self.per_call = []
        self.matches = []

    def __call__(self, completions, frames, **kwargs):
        shown = [frames_to_array(f)[0] for f in frames]
        texts = self.verifier(shown)
        self.per_call.append((len(completions), len(texts)))
        trainer = self.verifier.trainer
        model, proc = trainer.accelerator.unwrap_model(trainer.model), trainer.processing_class
        from emrl_data.report import VERIFIER_PROMPT
        from train.data import verifier_messages

        msgs = [verifier_messages(f, VERIFIER_PROMPT) for f in shown]  # same batch as the verifier's call
        inputs = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True,
                                          return_tensors="pt", padding=True)  # fmt: skip
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=4, do_sample=False, suppress_tokens=proc.vision_token_ids)
        direct = proc.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        self.matches.append(direct == texts)
        return [float(len(t) % 3) for t in texts]


def _grpo_args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "grpo"), num_generations=4, per_device_train_batch_size=4,
                max_completion_length=10, max_steps=2, beta=0.01, learning_rate=1e-2, logging_steps=1, use_cpu=True,
                bf16=False, report_to="none", save_strategy="no", loss_type="grpo", seed=0)  # fmt: skip
    base.update(kw)
    return GRPOConfig(**base)


@pytest.fixture(scope="module")
def grpo_run(tiny_dir, sft_table, tmp_path_factory):
    ds = load_split(sft_table, "train")
    reward = _VerifierReward()
    trainer = build_grpo_trainer(str(tiny_dir), ds, _grpo_args(tmp_path_factory.mktemp("g")),
                                 reward_funcs=[_length_reward, reward])  # fmt: skip
    before = _snapshot(trainer.model)
    trainer.train()
    return trainer, before, reward


def test_sft_step_trains_vision_and_projector_only(tiny_dir, sft_table, tmp_path):
    model, processor = load_model_and_processor(tiny_dir, dtype=torch.float32)
    args = make_sft_config(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, learning_rate=1e-2,
                           use_cpu=True, bf16=False, save_strategy="no")  # fmt: skip
    trainer = build_sft_trainer(model, processor, load_split(sft_table, "train"), args)
    before = _snapshot(model)
    trainer.train()
    assert model.is_gradient_checkpointing  # activation checkpointing is on (enabled by train())
    changed, same = _changed_groups(before, model)
    assert {parameter_group(n) for n in changed} == {"vit", "projector"}
    assert all(parameter_group(n) != "llm" for n in changed)
    assert {parameter_group(n) for n in same} == {"llm"}  # every LLM tensor is bit-identical
    assert any(n.startswith("model.visual.deepstack_merger_list.") for n in changed)
    assert any(n.startswith("model.visual.blocks.") for n in changed)


def test_grpo_step_trains_projector_and_llm_only(grpo_run):
    trainer, before, _ = grpo_run
    changed, same = _changed_groups(before, trainer.model)
    assert {parameter_group(n) for n in changed} == {"projector", "llm"}
    assert all(parameter_group(n) != "vit" for n in changed)  # every ViT tensor is bit-identical
    assert any(n.startswith("model.visual.merger.") for n in changed)
    assert any(n.startswith("model.language_model.") for n in changed)


def test_verifier_once_per_completion_with_current_weights(grpo_run):
    _, _, reward = grpo_run
    assert reward.verifier.n_calls == 2  # one generation call per step
    assert reward.per_call == [(4, 4), (4, 4)]  # one answer per completion
    assert reward.verifier.n_queries == 8
    assert reward.verifier.trainer is not None


@pytest.mark.xfail(
    reason="open: TRL's HF generation path diverges from plain generate after the first tokens "
    "(decode-step M-RoPE / mm_token_type_ids); see the train/ report",
    strict=False,
)
def test_verifier_text_equals_live_model_greedy_text(grpo_run):
    _, _, reward = grpo_run
    assert reward.matches == [True, True]  # the trainer's live model gives the same greedy text


def _logps(trainer, frames_list, prompt="Describe the liver."):
    proc = trainer.processing_class
    texts = [proc.apply_chat_template(user_messages(prompt * (i + 1), f), add_generation_prompt=True, tokenize=False)
             for i, f in enumerate(frames_list)]  # fmt: skip
    batch = proc(text=texts, videos=[frames_to_array(f) for f in frames_list], padding=True, return_tensors="pt")
    completion = proc.tokenizer(["<findings>No focal liver lesion.</findings>"] * len(texts), return_tensors="pt")
    ids = torch.cat([batch["input_ids"], completion["input_ids"]], 1)
    mask = torch.cat([batch["attention_mask"], completion["attention_mask"]], 1)
    videos = [proc.expand_videos([t], [frames_to_array(f)])[1:] for t, f in zip(
        ["<|vision_start|><|video_pad|><|vision_end|>"] * len(texts), frames_list, strict=True)]  # fmt: skip
    trainer._ct_videos = [(p[0], g[0]) for p, g in videos]
    try:
        with torch.no_grad():
            logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask,
                                                                      completion["input_ids"].shape[1])  # fmt: skip
    finally:
        trainer._ct_videos = None
    return logps


def test_video_reaches_the_logprob_forward(grpo_run):
    trainer, _, _ = grpo_run
    frames = np.random.default_rng(0).integers(0, 256, (8, 64, 64), dtype=np.uint8)
    scrambled = frames[np.random.default_rng(1).permutation(8)][:, ::-1]
    a, b = _logps(trainer, [frames]), _logps(trainer, [np.ascontiguousarray(scrambled)])
    assert (a - b).abs().max() > 1e-4


def test_left_padding_does_not_change_logprobs(grpo_run):
    trainer, _, _ = grpo_run
    rng = np.random.default_rng(2)
    short = rng.integers(0, 256, (6, 64, 64), dtype=np.uint8)
    long = rng.integers(0, 256, (8, 64, 64), dtype=np.uint8)
    alone = _logps(trainer, [short])
    batched = _logps(trainer, [short, long])  # row 0 is left-padded to row 1's longer prompt
    torch.testing.assert_close(batched[0], alone[0], atol=1e-5, rtol=1e-5)

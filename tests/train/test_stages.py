"""SFT and GRPO stages on CPU with the tiny model: parameter groups, video in the loss, padding, verifier.

Generation references. Inside `trainer.train()` the policy is in train mode with activation (gradient) checkpointing
on. A plain `model.generate` in that state is NOT a valid reference: every `GradientCheckpointingLayer` then drops
`past_key_values` (transformers 5.17 `modeling_layers.py`), so the `DynamicCache` that `generate` created stays empty
while `cache_position` advances and only the newest token is fed: from the second token on, each step sees one
token and no context (the old xfail "matches only on the first token"). TRL's own path disables checkpointing for
generation (`trl.models.utils._unwrap_model_for_generation`), and so does `_plain_generate` here. `_greedy_reference`
needs no cache at all: one full forward over prompt + tokens so far per step (the ground truth).
"""

from contextlib import contextmanager

import numpy as np
import pytest
import torch
from trl import GRPOConfig

from model_io.processor import load_model_and_processor, user_messages
from model_io.video import frames_to_array
from tests.train.helpers import until_eos
from train.data import load_split
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


@contextmanager
def _checkpointing_off(model, gradient_checkpointing_kwargs=None):
    """Disable activation checkpointing for the block (a checkpointed layer discards the KV cache), then restore it."""
    was_on = model.is_gradient_checkpointing
    if was_on:
        model.gradient_checkpointing_disable()
    try:
        yield model
    finally:
        if was_on:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)


def _plain_generate(model, inputs, max_new_tokens, suppress, eos_ids, gc_kwargs=None):
    """Greedy `model.generate` (KV cache on, checkpointing off) -> one token list per row, cut after EOS.

    `gc_kwargs` are the checkpointing kwargs to restore afterwards (the trainer's `gradient_checkpointing_kwargs`).
    """
    with _checkpointing_off(model, gc_kwargs), torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            suppress_tokens=suppress,
            eos_token_id=eos_ids,
            pad_token_id=eos_ids[0],
        )
    return [until_eos(row, eos_ids) for row in out[:, inputs["input_ids"].shape[1] :].tolist()]


def _greedy_reference(model, inputs, max_new_tokens, suppress, eos_ids):
    """Greedy decoding without any cache: a full forward of prompt + tokens so far per step (ground truth).

    `inputs` is a processor output (`input_ids` (B, P), `attention_mask`, `mm_token_type_ids` (B, P), pixel fields);
    generated tokens are text (type 0), so `mm_token_type_ids` grows with zeros.
    """
    ids, mask, mm = inputs["input_ids"], inputs["attention_mask"], inputs["mm_token_type_ids"]
    pixels = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=ids, attention_mask=mask, mm_token_type_ids=mm, use_cache=False, **pixels).logits
            logits = logits[:, -1].clone()
            logits[:, suppress] = -float("inf")
            nxt = logits.argmax(-1, keepdim=True)
            ids, mask, mm = (
                torch.cat([ids, nxt], 1),
                torch.cat([mask, torch.ones_like(nxt)], 1),
                torch.cat([mm, 0 * nxt], 1),
            )
    return [until_eos(row, eos_ids) for row in ids[:, inputs["input_ids"].shape[1] :].tolist()]


def _length_reward(completions, **kwargs):
    return [float(len(c[0]["content"]) % 7) for c in completions]  # varies within a group -> nonzero advantages


class _VerifierReward:
    """Calls the verifier on each row's frame 1 and checks it used the trainer's current weights.

    Per call it records whether the verifier's texts equal (a) a plain greedy `generate` of the live model and (b) the
    cache-free greedy reference, on the same batch, and whether the policy was then in train mode with checkpointing on
    (the state in which a naive `model.generate` breaks).
    """

    __name__ = "r_verify"

    def __init__(self):
        self.verifier = Verifier(max_new_tokens=4)
        self.per_call = []
        self.matches = []
        self.reference_matches = []
        self.training_with_checkpointing = []

    def __call__(self, completions, frames, **kwargs):
        shown = [frames_to_array(f)[0] for f in frames]
        texts = self.verifier(shown)
        self.per_call.append((len(completions), len(texts)))
        trainer = self.verifier.trainer
        model, proc = trainer.accelerator.unwrap_model(trainer.model), trainer.processing_class
        from emrl_data.text.report import VERIFIER_PROMPT
        from model_io.processor import verifier_messages

        self.training_with_checkpointing.append(model.training and model.is_gradient_checkpointing)
        msgs = [verifier_messages(f, VERIFIER_PROMPT) for f in shown]  # same batch as the verifier's call
        inputs = proc.apply_chat_template(
            msgs, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt", padding=True
        )
        eos = list(trainer.eos_token_ids)
        direct = _plain_generate(
            model, inputs, 4, proc.vision_token_ids, eos, trainer.args.gradient_checkpointing_kwargs
        )
        reference = _greedy_reference(model, inputs, 4, proc.vision_token_ids, eos)
        self.matches.append(proc.batch_decode(direct, skip_special_tokens=True) == texts)
        self.reference_matches.append(proc.batch_decode(reference, skip_special_tokens=True) == texts)
        return [float(len(t) % 3) for t in texts]


def _grpo_args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path / "grpo"),
        num_generations=4,
        per_device_train_batch_size=4,
        max_completion_length=10,
        max_steps=2,
        beta=0.01,
        learning_rate=1e-4,
        logging_steps=1,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        loss_type="grpo",
        seed=0,
    )
    base.update(kw)
    return GRPOConfig(**base)


@pytest.fixture(scope="module")
def grpo_run(tiny_dir, sft_table, tmp_path_factory):
    ds = load_split(sft_table, "train")
    reward = _VerifierReward()
    trainer = build_grpo_trainer(
        str(tiny_dir), ds, _grpo_args(tmp_path_factory.mktemp("g")), reward_funcs=[_length_reward, reward]
    )
    before = _snapshot(trainer.model)
    trainer.train()
    return trainer, before, reward


def test_sft_step_trains_vision_and_projector_only(tiny_dir, sft_table, tmp_path):
    model, processor = load_model_and_processor(tiny_dir, dtype=torch.float32)
    args = make_sft_config(
        output_dir=str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        use_cpu=True,
        bf16=False,
        save_strategy="no",
    )
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


def test_verifier_text_equals_live_model_greedy_text(grpo_run):
    _, _, reward = grpo_run
    assert reward.training_with_checkpointing == [True, True]  # the state in which a naive generate breaks
    assert reward.matches == [True, True]  # the trainer's live model gives the same greedy text
    assert reward.reference_matches == [True, True]  # and so does cache-free greedy decoding


@pytest.fixture(scope="module")
def greedy_rollout(grpo_run):
    """One greedy GRPO rollout batch through `VideoGRPOTrainer._generate_and_score_completions`.

    Two prompts of different lengths, 4 completions each (the shorter prompt is left-padded in the batch).

    Taken after the 2 training steps (live weights, train mode, checkpointing on). The rewards are swapped for
    `_length_reward` so the verifier's call counts stay those of training.
    """
    trainer, _, _ = grpo_run
    saved_config, saved_funcs = trainer.generation_config, trainer.reward_funcs
    greedy = saved_config.__class__.from_dict(saved_config.to_dict())
    greedy.do_sample, greedy.temperature, greedy.top_p, greedy.top_k, greedy.min_p = False, None, None, None, None
    rows = [dict(trainer.train_dataset[i]) for i in (0, 0, 0, 0, 2, 2, 2, 2)]  # liver, kidney: 282 vs 284 tokens
    trainer.generation_config, trainer.reward_funcs = greedy, [_length_reward, _length_reward]
    try:
        out = trainer._generate_and_score_completions(rows)
    finally:
        trainer.generation_config, trainer.reward_funcs = saved_config, saved_funcs
    return trainer, rows, out


def _row_inputs(proc, row):
    """Plain processor inputs of one GRPO row (unpadded): the sample's user turn, rendered as in SFT."""
    prompt = row["prompt"][-1]["content"]
    return proc.apply_chat_template(
        [user_messages(prompt, row["frames"])],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )


@pytest.mark.slow
def test_grpo_rollout_greedy_completion_equals_plain_generate(greedy_rollout):
    trainer, rows, out = greedy_rollout
    model, proc = trainer.accelerator.unwrap_model(trainer.model), trainer.processing_class
    assert model.training and model.is_gradient_checkpointing  # the live training state
    eos, n_new = list(trainer.eos_token_ids), trainer.max_completion_length
    prompt_lens = out["prompt_mask"].sum(1).tolist()
    assert len(set(prompt_lens)) == 2  # two prompt lengths: the shorter prompt is left-padded in the batch
    for i, row in enumerate(rows):
        inputs = _row_inputs(proc, row)
        trl_prompt = out["prompt_ids"][i][out["prompt_mask"][i].bool()].tolist()
        assert trl_prompt == inputs["input_ids"][0].tolist()  # same prompt tokens (video placeholder included)
        rollout = out["completion_ids"][i][out["completion_mask"][i].bool()].tolist()
        assert len(rollout) > 1  # more than the first token is compared
        plain = _plain_generate(
            model, inputs, n_new, proc.vision_token_ids, eos, trainer.args.gradient_checkpointing_kwargs
        )
        plain = plain[0]
        assert rollout == plain  # the rollout is what the policy generates on its own
        assert rollout == _greedy_reference(model, inputs, n_new, proc.vision_token_ids, eos)[0]


def test_loss_logprobs_equal_a_plain_forward_of_prompt_and_completion(greedy_rollout):
    trainer, rows, out = greedy_rollout
    model, proc = trainer.accelerator.unwrap_model(trainer.model), trainer.processing_class
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    n_completion = out["completion_ids"].shape[1]
    trainer._ct_videos = list(zip(out["ct_pixel_values_videos"], out["ct_video_grid_thw"], strict=True))
    try:  # as `_compute_loss` does; batch_size 3 makes TRL cut the 8 rows into chunks 3 + 3 + 2
        with torch.no_grad():
            logps, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, n_completion, batch_size=3)
    finally:
        trainer._ct_videos = None
    for i, row in enumerate(rows):
        inputs = _row_inputs(proc, row)
        completion = out["completion_ids"][i][out["completion_mask"][i].bool()]
        full = torch.cat([inputs["input_ids"], completion[None]], 1)  # unpadded prompt + completion
        mm = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(completion)[None]], 1)
        with torch.no_grad():
            logits = model(
                input_ids=full,
                attention_mask=torch.ones_like(full),
                mm_token_type_ids=mm,
                pixel_values_videos=inputs["pixel_values_videos"],
                video_grid_thw=inputs["video_grid_thw"],
                use_cache=False,
            ).logits
        n_prompt = inputs["input_ids"].shape[1]
        step_logps = torch.log_softmax(logits[0, n_prompt - 1 : -1].float() / trainer.temperature, -1)
        expected = step_logps.gather(-1, completion[:, None])[:, 0]
        torch.testing.assert_close(logps[i, : len(completion)], expected, atol=1e-5, rtol=1e-5)


def _logps(trainer, frames_list, prompt="Describe the liver."):
    proc = trainer.processing_class
    texts = [
        proc.apply_chat_template(user_messages(prompt * (i + 1), f), add_generation_prompt=True, tokenize=False)
        for i, f in enumerate(frames_list)
    ]
    batch = proc(text=texts, videos=[frames_to_array(f) for f in frames_list], padding=True, return_tensors="pt")
    completion = proc.tokenizer(["<findings>No focal liver lesion.</findings>"] * len(texts), return_tensors="pt")
    ids = torch.cat([batch["input_ids"], completion["input_ids"]], 1)
    mask = torch.cat([batch["attention_mask"], completion["attention_mask"]], 1)
    videos = [
        proc.expand_videos([t], [frames_to_array(f)])[1:]
        for t, f in zip(["<|vision_start|><|video_pad|><|vision_end|>"] * len(texts), frames_list, strict=True)
    ]
    trainer._ct_videos = [(p[0], g[0]) for p, g in videos]
    try:
        with torch.no_grad():
            logps, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, mask, completion["input_ids"].shape[1]
            )
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


def test_each_prompt_video_is_encoded_once_per_rollout(grpo_run, monkeypatch):
    """TRL repeats each row G times and tokenises every copy; the video of a prompt is still encoded once."""
    import model_io.processor

    trainer, _, _ = grpo_run
    calls = []
    real = model_io.processor.encode_ct_video
    monkeypatch.setattr(model_io.processor, "encode_ct_video", lambda *a, **k: calls.append(1) or real(*a, **k))
    rows = [dict(trainer.train_dataset[i]) for i in (0, 0, 0, 0, 2, 2, 2, 2)]
    saved = trainer.reward_funcs
    trainer.reward_funcs = [_length_reward, _length_reward]
    try:
        trainer._generate_and_score_completions(rows)
    finally:
        trainer.reward_funcs = saved
    assert len(calls) == 2  # two prompts, eight completions


def test_rollout_sampling_settings_are_temperature_only(grpo_run):
    """Sampled rollouts draw from softmax(logits / T) over the whole vocabulary (vision tokens suppressed), as the
    miniature's diagnosis samples: no top-k, top-p, min-p or repetition penalty reshapes them."""
    trainer, _, _ = grpo_run
    gen = trainer.generation_config
    assert gen.do_sample is True and gen.temperature == trainer.args.temperature == 1.0
    assert gen.top_k in (0, None) and gen.top_p in (1.0, None) and gen.min_p is None
    assert gen.repetition_penalty in (1.0, None)
    assert set(trainer.processing_class.vision_token_ids) <= set(gen.suppress_tokens)

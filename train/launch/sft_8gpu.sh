#!/usr/bin/env bash
# SFT on 8 GPUs (DeepSpeed ZeRO-2 by default; ACCEL_CONFIG=train/launch/zero3.yaml or ddp.yaml to change).
# Usage: train/launch/sft_8gpu.sh DATASET_DIR OUTPUT_DIR [MODEL] [extra flags...]
set -euo pipefail
DATASET_DIR=${1:?dataset dir}; OUTPUT_DIR=${2:?output dir}; MODEL=${3:-Qwen/Qwen3-VL-8B-Instruct}
shift $(( $# < 3 ? $# : 3 ))
# The launch checks (ZeRO stage, DeepSpeed installed, precision, completions per step) before any process starts;
# each rank repeats them on what accelerate exported (train.distributed.check_launch).
${PYTHON:-python3} -m train.checks "${ACCEL_CONFIG:-train/launch/zero2.yaml}" train/configs/sft.yaml
accelerate launch --config_file "${ACCEL_CONFIG:-train/launch/zero2.yaml}" -m train.sft \
  --config train/configs/sft.yaml --dataset_dir "$DATASET_DIR" --model_name_or_path "$MODEL" \
  --output_dir "$OUTPUT_DIR" "$@" || {
  rc=$?
  echo "error: a training process failed (exit $rc); its traceback above names it (exitcode -9 / Signal 9 is usually the host's OOM killer: see the host memory column in docs/training.md); accelerate stopped the other ranks." >&2
  exit $rc
}

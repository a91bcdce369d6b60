#!/usr/bin/env bash
# SFT on one GPU. Usage: train/launch/sft_1gpu.sh DATASET_DIR OUTPUT_DIR [MODEL (path or Hub id)] [extra flags...]
set -euo pipefail
DATASET_DIR=${1:?dataset dir, e.g. out/sft}; OUTPUT_DIR=${2:?output dir}; MODEL=${3:-Qwen/Qwen3-VL-8B-Instruct}
shift $(( $# < 3 ? $# : 3 ))
# sft.yaml's 64 samples per step on one GPU: micro-batch 1 x accumulation 64 (the config's 8 is for 8 GPUs).
${PYTHON:-python3} -m train.checks none train/configs/sft.yaml --gradient_accumulation_steps 64
${PYTHON:-python3} -m train.sft --config train/configs/sft.yaml --dataset_dir "$DATASET_DIR" \
  --model_name_or_path "$MODEL" --output_dir "$OUTPUT_DIR" --gradient_accumulation_steps 64 "$@"

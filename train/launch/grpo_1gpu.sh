#!/usr/bin/env bash
# E-MRL GRPO on one GPU. Usage: train/launch/grpo_1gpu.sh HARDSET_DIR SFT_CHECKPOINT OUTPUT_DIR [extra flags...]
# Ablation: add --rewards r_e  or  --rewards r_e r_f  (default r_e r_f r_c).
set -euo pipefail
DATASET_DIR=${1:?rl_hardset dir}; MODEL=${2:?SFT checkpoint}; OUTPUT_DIR=${3:?output dir}
shift 3
python -m train.grpo --config train/configs/grpo.yaml --dataset_dir "$DATASET_DIR" \
  --model_name_or_path "$MODEL" --output_dir "$OUTPUT_DIR" "$@"

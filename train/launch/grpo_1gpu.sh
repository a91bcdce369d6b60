#!/usr/bin/env bash
# E-MRL GRPO on one GPU: LoRA on the LLM + projector in full (grpo_lora.yaml; full-parameter 8B GRPO needs >= 4 GPUs, docs/training.md). Usage: train/launch/grpo_1gpu.sh HARDSET_DIR SFT_CHECKPOINT OUTPUT_DIR [extra flags...]
# Ablation: add --rewards r_e  or  --rewards r_e r_f  (default r_e r_f r_c).
set -euo pipefail
DATASET_DIR=${1:?rl_hardset dir}; MODEL=${2:?SFT checkpoint}; OUTPUT_DIR=${3:?output dir}
shift 3
${PYTHON:-python3} -m train.checks none train/configs/grpo_lora.yaml  # the launch checks, before any weight loads
${PYTHON:-python3} -m train.grpo --config train/configs/grpo_lora.yaml --dataset_dir "$DATASET_DIR" \
  --model_name_or_path "$MODEL" --output_dir "$OUTPUT_DIR" "$@"

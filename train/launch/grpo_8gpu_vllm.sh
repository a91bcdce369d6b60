#!/usr/bin/env bash
# E-MRL GRPO on 8 GPUs with rollouts and verifier queries through vLLM: one in-process engine per rank (tensor
# parallel 1; each rank generates its own rows), weights pushed after every optimizer step (ZeRO-3: gathered one layer
# at a time). ZeRO-2 by default; ACCEL_CONFIG=train/launch/zero3.yaml for ZeRO-3. Needs vLLM 0.32 in this Python
# (pip install 'vllm>=0.32,<0.33'; docs/training.md "GRPO rollouts through vLLM").
# VLLM_FRACTION: each GPU's share for its engine (bf16 weights + the rank's KV cache); 0.16 of an H200 for grpo.yaml's
# 8 rows per rank, from python -m train.tools.memory_plan (0.28 on an 80 GB card).
# Usage: train/launch/grpo_8gpu_vllm.sh HARDSET_DIR SFT_CHECKPOINT OUTPUT_DIR [extra flags...]
set -euo pipefail
DATASET_DIR=${1:?rl_hardset dir}; MODEL=${2:?SFT checkpoint}; OUTPUT_DIR=${3:?output dir}
shift 3
${PYTHON:-python3} -m train.checks "${ACCEL_CONFIG:-train/launch/zero2.yaml}" train/configs/grpo.yaml
accelerate launch --config_file "${ACCEL_CONFIG:-train/launch/zero2.yaml}" -m train.grpo \
  --config train/configs/grpo.yaml --dataset_dir "$DATASET_DIR" --model_name_or_path "$MODEL" \
  --output_dir "$OUTPUT_DIR" --use_vllm true --vllm_mode colocate --vllm_tensor_parallel_size 1 \
  --vllm_gpu_memory_utilization "${VLLM_FRACTION:-0.16}" --vllm_max_model_length "${VLLM_MAX_LEN:-8192}" "$@" || {
  rc=$?
  echo "error: a training process failed (exit $rc); its traceback above names it (exitcode -9 / Signal 9 is usually the host's OOM killer: see the host memory column in docs/training.md); accelerate stopped the other ranks." >&2
  exit $rc
}

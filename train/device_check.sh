#!/usr/bin/env bash
# Device check (issue 4 §5): one SFT step + one GRPO step with the verifier on a Qwen3-VL-8B-shaped random model,
# 32 frames of 448², on one GPU; prints tokens/s, step time, peak memory and writes a JSON. Budget: < 8 minutes.
# No internet on the device: the project venv (or wheels, see the device notes) must already hold torch/transformers/
# trl/accelerate/datasets. `--tiny` runs the same path on CPU in ~20 s.
#   train/device_check.sh [--tiny] [OUTPUT_JSON]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
TINY=()
if [ "${1:-}" = "--tiny" ]; then TINY=(--tiny); shift; fi
OUTPUT=${1:-${OUT:-.}/device_check.json}
timeout "${DEVICE_CHECK_TIMEOUT_S:-480}" "$PY" -m train.device_check "${TINY[@]}" --output "$OUTPUT"

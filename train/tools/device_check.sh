#!/usr/bin/env bash
# Device check: one SFT step + one E-MRL GRPO step (accumulation 2, r_c through the verifier in the loop, KL to the
# reference on) on a Qwen3-VL-8B-shaped random model, 32 frames of 448², G = 8, up to 512-token completions, on one
# GPU; asserts and prints one JSON line. It also checks that the processor saved as a checkpoint loads with stock
# AutoProcessor as Qwen3VLProcessor with a Qwen3VLVideoProcessor (needs torchvision) and encodes the frames as
# encode_ct_video; --tiny runs the same steps at the tiny shape on CPU and skips that check.
# A GPU machine without package-index access can take trl and datasets as wheels in .whl/ (train/tools/fetch_wheels.sh
# downloads them on a machine that has it); they are installed into /tmp/site for this run only.
# Timeout: DEVICE_CHECK_TIMEOUT_S (default 360 s).
#   train/tools/device_check.sh [--tiny] [OUTPUT_JSON]   (default OUTPUT_JSON: $OUT/device_check.json, OUT=. if unset)
set -euo pipefail
cd "$(dirname "$0")/../.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
TINY=()
if [ "${1:-}" = "--tiny" ]; then TINY=(--tiny); shift; fi
OUTPUT=${1:-${OUT:-.}/device_check.json}
PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True} \
  timeout "${DEVICE_CHECK_TIMEOUT_S:-360}" "$PY" -m train.tools.device_check "${TINY[@]}" --output "$OUTPUT"

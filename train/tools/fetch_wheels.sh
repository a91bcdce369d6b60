#!/usr/bin/env bash
# Wheels of trl and datasets (and their two dependencies) for a GPU machine without package-index access that has
# torch, transformers, accelerate, peft and pyarrow (Python 3.12, x86-64): run once in the repo root of a machine
# with access; copy .whl/ with the checkout. train/tools/device_check.sh installs them for its run.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> "$(git rev-parse --git-path info/exclude)"
for pkg in trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19; do
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl "$pkg"
done

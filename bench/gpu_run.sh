#!/usr/bin/env bash
# One device call on a lent GPU machine (it reaches no package index): the wheels bench/gpu_wheels.sh built, installed
# with --no-deps into a folder put first on PYTHONPATH (the carried versions win over the image's), the machine's
# facts, then bench/gpu_suite.py with the flags given. Models and runs (gigabytes) go to GPU_WORK (default
# /tmp/llmft-gpu-work, kept for a second suite in the same call); RESULTS_DIR (the call's $OUT) gets the machine's
# facts and the suite's results as they come. On a warm machine the install is kept from the call before.
#
#   bash bench/gpu_run.sh runs/gpu-wheels "$OUT/suite" --budget_s 420
#   bash bench/gpu_run.sh runs/gpu-wheels "$OUT/suite-2" --only 8b-lora prebuild startup
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: bash bench/gpu_run.sh WHEELS_DIR RESULTS_DIR [bench/gpu_suite.py flags]"
wheels=$(realpath "${1:?$usage}")
out=${2:?$usage}
work=${GPU_WORK:-/tmp/llmft-gpu-work}
shift 2
site=${GPU_SITE:-/tmp/llmft-site}
if [[ ! -f "$site/.llmft-installed" ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" "$wheels"/*.whl
  touch "$site/.llmft-installed"
fi
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1
# `llmft prebuild` (the suite's install-step row) reinstalls DeepSpeed from the carried source into the same folder
export PIP_NO_INDEX=1 PIP_FIND_LINKS="$wheels" PIP_TARGET="$site" PIP_UPGRADE=1
mkdir -p "$out"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  nvcc --version | tail -n 1 || true
  python3 -c 'import importlib.metadata as m
names = "torch transformers trl datasets deepspeed peft accelerate liger-kernel pyarrow triton".split()
print(", ".join(f"{n} {m.version(n)}" for n in names))'
} | tee "$out/machine.txt"
python3 bench/gpu_suite.py --out "$work" --results "$out" "$@"

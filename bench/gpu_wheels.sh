#!/usr/bin/env bash
# The packages a lent GPU machine lacks, or has at another version than .venv runs, as wheels to carry there (it
# reaches no package index). Its image (the device tool's KINDS.md) has torch, accelerate, pyarrow, pandas, xxhash,
# msgpack, ninja, einops, py-cpuinfo, psutil and tokenizers, but not deepspeed, trl, datasets (nor its dill and
# multiprocess), hjson, pydantic or Liger, and an older transformers (5.17). Versions are the ones .venv runs.
# DeepSpeed comes twice: a pure-Python wheel built here (DS_BUILD_OPS=0: its ops build there at first use) and its
# source, which `llmft prebuild` rebuilds there with FusedAdam and CPUAdam compiled in (the suite's install-step row).
# Binary wheels are for the GPU machine's Python (GPU_PYTHON, default 3.12) on x86-64 Linux. Installed there with
# --no-deps into a folder put first on PYTHONPATH, so the carried versions win over the image's:
#
#   bash bench/gpu_wheels.sh runs/gpu-wheels
#   # on the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site runs/gpu-wheels/*.whl
#   export PYTHONPATH=/tmp/site:$PWD PIP_NO_INDEX=1 PIP_FIND_LINKS=$PWD/runs/gpu-wheels PIP_TARGET=/tmp/site PIP_UPGRADE=1
#   python3 bench/gpu_suite.py --out "$OUT/gpu_suite"
#
# Prints each file's size and the total, and fails past the 64 MiB a device call carries.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash bench/gpu_wheels.sh DIR}
gpu_python=${GPU_PYTHON:-3.12}
limit_mib=64
py=.venv/bin/python
[[ -x "$py" ]] || { echo "bench/gpu_wheels.sh: .venv is missing; run make venv first" >&2; exit 1; }

installed() {  # installed NAME -> the version .venv runs
  "$py" -c 'import importlib.metadata, sys; print(importlib.metadata.version(sys.argv[1]))' "$1"
}

rm -rf "$out" && mkdir -p "$out"
ds_version=$(installed deepspeed)
DS_BUILD_OPS=0 "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$out" "deepspeed==$ds_version"
"$py" -m pip download -q --no-deps --no-binary :all: -d "$out" "deepspeed==$ds_version"
pins=("liger-kernel==0.8.5")  # setup.cfg's [gpu] pin (not installed on CPU machines)
for name in trl datasets dill multiprocess fsspec transformers peft hjson pydantic pydantic_core annotated-types \
  typing-inspection typing-extensions; do
  pins+=("$name==$(installed "$name")")
done
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$gpu_python" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$out" "${pins[@]}"
total=0
for wheel in "$out"/*; do
  bytes=$(stat -c %s "$wheel")
  total=$(( total + bytes ))
  awk -v b="$bytes" -v n="$(basename "$wheel")" 'BEGIN { printf "%8.1f MiB  %s\n", b / 1048576, n }'
done
awk -v b="$total" -v l="$limit_mib" 'BEGIN { printf "%8.1f MiB  in all (a device call carries %d MiB)\n", b / 1048576, l }'
if (( total > limit_mib * 1048576 )); then
  echo "bench/gpu_wheels.sh: the wheels exceed $limit_mib MiB; leave out what the GPU machine already has" >&2
  exit 1
fi

#!/usr/bin/env bash
# The packages a lent GPU machine lacks, as wheels to carry there (it reaches no package index): its Python has
# torch, transformers, accelerate and peft, not deepspeed, trl or datasets (nor datasets' pyarrow, pandas, dill,
# multiprocess and xxhash, nor the Liger kernels). Versions are the ones .venv runs (constraints.txt and its install).
# DeepSpeed is built here as a pure-Python wheel (DS_BUILD_OPS=0): its ops build on the GPU machine at first use.
# The rest are downloaded as binary wheels for the GPU machine's Python (GPU_PYTHON, default 3.12) on x86-64 Linux.
# Prints each wheel's size and the total, and fails past the 64 MiB a device call can carry.
#
#   bash bench/gpu_wheels.sh runs/gpu-wheels
#   # on the GPU machine:
#   pip install --no-index --find-links runs/gpu-wheels deepspeed trl datasets liger-kernel
#   python bench/gpu_suite.py --out "$OUT/gpu_suite"
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

mkdir -p "$out"
DS_BUILD_OPS=0 "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$out" "deepspeed==$(installed deepspeed)"
# pyarrow at the oldest version datasets accepts: the newest is 52.5 MiB, 24.0.0 is 46.6 MiB, and all must fit.
pyarrow_min=$("$py" -c 'import importlib.metadata as m, re
print(next(re.search(r">=([\d.]+)", r).group(1) for r in m.requires("datasets") if r.startswith("pyarrow")))')
pins=("pyarrow==$pyarrow_min" "liger-kernel==0.8.5")  # Liger: setup.cfg's [gpu] pin (not installed on CPU machines)
for name in trl datasets pandas dill multiprocess xxhash; do
  pins+=("$name==$(installed "$name")")
done
# GPU_HAS="pandas ...": packages the GPU machine already has, left out
read -r -a has <<< "${GPU_HAS:-}"
for name in "${has[@]}"; do
  for i in "${!pins[@]}"; do [[ "${pins[$i]%%==*}" == "$name" ]] && unset 'pins[i]'; done
done
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$gpu_python" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$out" "${pins[@]}"
total=0
for wheel in "$out"/*.whl; do
  bytes=$(stat -c %s "$wheel")
  total=$(( total + bytes ))
  awk -v b="$bytes" -v n="$(basename "$wheel")" 'BEGIN { printf "%8.1f MiB  %s\n", b / 1048576, n }'
done
awk -v b="$total" -v l="$limit_mib" 'BEGIN { printf "%8.1f MiB  in all (a device call carries %d MiB)\n", b / 1048576, l }'
if (( total > limit_mib * 1048576 )); then
  echo "bench/gpu_wheels.sh: the wheels exceed $limit_mib MiB; leave out what the GPU machine already has" >&2
  exit 1
fi

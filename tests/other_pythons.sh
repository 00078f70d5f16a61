#!/usr/bin/env bash
# The interpreter-dependent tests under every other Python 3.11+ this machine has.
#
# What a checkpoint holds depends on the Python that pickled it (Python 3.11.0-3.11.4 pickle enums by
# name, the others by value), and users train on one Python and read on another. `make test` covers
# the Python of .venv; this runs the checkpoint-reader and data tests once per other interpreter,
# each in its own virtual environment (.venv-pyX.Y.Z, built like .venv from constraints.txt).
# Interpreters are looked for on PATH (python3.N), under pyenv and uv, and in /usr/bin and /usr/local/bin.
# One that is absent or older than 3.11 (llmft's pinned stack needs 3.11: transformers 5.21+, trl 1.16) is
# skipped with a printed line, never a failure. Pickles written by 3.10 are covered by tests/test_safe_load.py.
#
# Disk: where no CPU torch wheel exists for an interpreter, pip installs PyPI's CUDA torch (about 5.3 GiB with
# its nvidia-* libraries), so each venv is built without pip's cache and removed once its tests have run
# (KEEP_OTHER_VENVS=1 keeps them): one such venv on disk at a time, not one per Python.
#
#   bash tests/other_pythons.sh            # or: make test-other-pythons
set -euo pipefail
cd "$(dirname "$0")/.."
me=tests/other_pythons.sh
TESTS=(tests/test_safe_load.py tests/test_zero_checkpoint.py tests/test_data.py tests/test_checkpoints.py)

version_of() {  # version_of PYTHON -> "3.12.1", or nothing if it does not run
  timeout 20 "$1" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null || true
}

free_gib() {  # free disk space where the venvs are built, in GiB
  df -Pk . | awk 'NR == 2 { printf "%.1f", $4 / 1048576 }'
}

remove_venv() {  # the venv of one Python is removed after its run unless KEEP_OTHER_VENVS=1
  [[ "${KEEP_OTHER_VENVS:-0}" == 1 ]] || rm -rf -- "$1"
}

main_version=$(version_of .venv/bin/python)
[[ -n "$main_version" ]] || { echo "$me: error: .venv is missing; run make venv first" >&2; exit 1; }

candidates=()
IFS=: read -r -a path_dirs <<< "${PATH:-}"
for dir in "${path_dirs[@]}" /usr/bin /usr/local/bin; do
  [[ -d "$dir" && "$dir" != */.pyenv/shims ]] || continue  # pyenv shims: their real targets are listed below
  for exe in "$dir"/python3.[0-9] "$dir"/python3.[0-9][0-9]; do
    [[ -x "$exe" ]] && candidates+=("$exe")
  done
done
for exe in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/*/bin/python3 "$HOME"/.local/share/uv/python/*/bin/python3; do
  [[ -x "$exe" ]] && candidates+=("$exe")
done

declare -A seen=(["$main_version"]=.venv)
tested=() failed=()
for exe in "${candidates[@]}"; do
  version=$(version_of "$exe")
  if [[ -z "$version" ]]; then
    echo "$me: skipping $exe: it does not run"
    continue
  fi
  [[ -z "${seen[$version]:-}" ]] || continue
  seen[$version]=$exe
  if [[ "$(printf '%s\n' "$version" 3.11.0 | sort -V | head -n 1)" != 3.11.0 ]]; then
    echo "$me: skipping $exe (Python $version): llmft needs Python 3.11 or newer (transformers 5.21+ and trl 1.16 do)"
    continue
  fi
  venv=".venv-py$version"
  echo "$me: Python $version ($exe): setting up $venv and running ${TESTS[*]}"
  if ! PIP_NO_CACHE_DIR=1 make --no-print-directory venv VENV="$venv" PYTHON="$exe" >"$venv.log" 2>&1; then
    echo "$me: FAILED to set up $venv with $exe (log: $venv.log):"; { grep -v '^WARNING: Location' "$venv.log" || true; } | tail -n 20  # a log of warnings only: grep exits 1
    if grep -q 'No space left on device' "$venv.log"; then
      echo "$me: $venv needs about 6 GiB of disk (torch with its CUDA libraries); $(free_gib) GiB free here: free disk space and re-run"
    fi
    failed+=("$version (set-up)")
    remove_venv "$venv"
    continue
  fi
  if "$venv/bin/python" -m pytest -q -p no:cacheprovider "${TESTS[@]}"; then
    tested+=("$version")
  else
    failed+=("$version")
  fi
  remove_venv "$venv"
done

echo "$me: main suite ran on Python $main_version; checkpoint and data tests passed on: ${tested[*]:-(no other Python 3.11+ found)}"
if (( ${#failed[@]} )); then
  echo "$me: FAILED on: ${failed[*]}" >&2
  exit 1
fi

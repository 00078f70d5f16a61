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
# The DeepSpeed checkpoints these tests read are written once, by .venv's Python (the one that trains), and every
# other interpreter reads those (tests/test_zero_checkpoint.py's SHARED_FIXTURE): what a user does who trains on one
# Python and reads on another, and one fixture run instead of one per interpreter.
#
# An interpreter of .venv's own minor version (3.11.7 beside .venv's 3.11.2) shares its ABI, so its venv reuses
# .venv's installed packages (a .pth that adds .venv's site-packages) instead of installing them again: the
# interpreter is what differs, and what is tested. Other minor versions get their own venv, built like .venv.
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
main_site=$(.venv/bin/python -c 'import sysconfig; print(repr(sysconfig.get_paths()["purelib"]))')  # a Python literal

since() {  # seconds since $1 (from $SECONDS)
  echo "$(( SECONDS - $1 )) s"
}

reuse_main_venv() {  # reuse_main_venv PYTHON VENV: a venv of PYTHON whose packages are .venv's (same minor version)
  rm -rf -- "$2"
  "$1" -m venv --without-pip "$2" || return 1
  local site
  site=$("$2/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 1
  # addsitedir, not a bare path line: .venv's own .pth files (llmft's editable install) are processed too
  printf 'import site; site.addsitedir(%s)\n' "$main_site" > "$site/llmft-main-venv.pth"
}

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
fixture=""
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
  if [[ -z "$fixture" ]]; then  # once, before the first interpreter that needs it
    started=$SECONDS
    fixture=$(mktemp -d "${TMPDIR:-/tmp}/llmft-other-pythons.XXXXXX")
    trap 'rm -rf -- "$fixture"' EXIT
    if ! .venv/bin/python tests/test_zero_checkpoint.py --fixture "$fixture" >"$fixture.log" 2>&1; then
      echo "$me: FAILED to write the shared checkpoints with .venv's Python $main_version (log: $fixture.log):"
      tail -n 30 "$fixture.log"
      exit 1
    fi
    rm -f "$fixture.log"
    echo "$me: checkpoints written once by .venv's Python $main_version, read by each Python below ($(since "$started"))"
  fi
  started=$SECONDS
  if [[ "${version%.*}" == "${main_version%.*}" ]]; then
    echo "$me: Python $version ($exe): $venv reuses .venv's packages (same minor version); running ${TESTS[*]}"
    setup=(reuse_main_venv "$exe" "$venv")
  else
    echo "$me: Python $version ($exe): setting up $venv and running ${TESTS[*]}"
    # PIP_COMPILE=0 (pip's --no-compile; PIP_NO_COMPILE=1 turns compiling on): pip's byte-compiling of every installed
    # module was 114 of the 196 CPU seconds a 3.13 venv took to build, on a machine it shares with the main suite;
    # the venv serves one test pass, which compiles only what it imports
    setup=(env PIP_NO_CACHE_DIR=1 PIP_COMPILE=0 make --no-print-directory venv VENV="$venv" PYTHON="$exe")
  fi
  if ! "${setup[@]}" >"$venv.log" 2>&1; then
    echo "$me: FAILED to set up $venv with $exe (log: $venv.log):"; { grep -v '^WARNING: Location' "$venv.log" || true; } | tail -n 20  # a log of warnings only: grep exits 1
    if grep -q 'No space left on device' "$venv.log"; then
      echo "$me: $venv needs about 6 GiB of disk (torch with its CUDA libraries); $(free_gib) GiB free here: free disk space and re-run"
    fi
    failed+=("$version (set-up)")
    remove_venv "$venv"
    continue
  fi
  echo "$me: $venv ready ($(since "$started"))"
  started=$SECONDS
  if LLMFT_TEST_DS_CHECKPOINTS="$fixture" "$venv/bin/python" -m pytest -q -p no:cacheprovider "${TESTS[@]}"; then
    tested+=("$version")
  else
    failed+=("$version")
  fi
  echo "$me: Python $version's tests took $(since "$started")"
  remove_venv "$venv"
done

echo "$me: main suite ran on Python $main_version; checkpoint and data tests passed on: ${tested[*]:-(no other Python 3.11+ found)}"
if (( ${#failed[@]} )); then
  echo "$me: FAILED on: ${failed[*]}" >&2
  exit 1
fi

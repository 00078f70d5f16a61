#!/usr/bin/env bash
# The system tools llmft's tests need, installed in one step before pytest starts (`make test` runs this):
#   - the shell-script checks: the shellcheck package
#   - the real two-node Slurm cluster of slurm/local/: slurmctld, slurmd, slurm-client, munge
#   - the tests' pyxis stand-in SPANK plugin (tests/pyxis_standin.c): gcc, libslurm-dev
# Present tools are left alone. Missing ones are installed with apt-get (as root, or through sudo -n);
# where that is impossible the script says what to install and exits 1, so the tests never start half-equipped.
set -euo pipefail

me=tests/system_deps.sh
export PATH="$PATH:/usr/sbin:/sbin"

# command -> the Debian package that provides it
declare -A package_of=(
  [shellcheck]=shellcheck [slurmctld]=slurmctld [slurmd]=slurmd
  [sbatch]=slurm-client [srun]=slurm-client [scontrol]=slurm-client [sinfo]=slurm-client
  [munged]=munge [mungekey]=munge [gcc]=gcc
)
# files (not commands) -> the package that provides them
declare -A package_of_file=([/usr/include/slurm/spank.h]=libslurm-dev)

missing_packages() {
  local cmd
  local cmd file
  {
    for cmd in "${!package_of[@]}"; do
      command -v "$cmd" >/dev/null 2>&1 || echo "${package_of[$cmd]}"
    done
    for file in "${!package_of_file[@]}"; do
      [[ -f "$file" ]] || echo "${package_of_file[$file]}"
    done
  } | sort -u
}

mapfile -t missing < <(missing_packages)
if (( ${#missing[@]} == 0 )); then
  echo "$me: shellcheck, Slurm, munge, gcc and Slurm's SPANK header are installed"
  exit 0
fi

fail() {
  echo "$me: error: $* ; install them yourself (sudo apt-get install -y ${missing[*]}) and rerun make test" >&2
  exit 1
}
command -v apt-get >/dev/null 2>&1 || fail "missing ${missing[*]} and there is no apt-get on this machine"
if [[ "$(id -u)" == 0 ]]; then
  as_root=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  as_root=(sudo -n)
else
  fail "missing ${missing[*]} and installing needs root (not root, no password-less sudo)"
fi

echo "$me: installing ${missing[*]} with apt-get ..."
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! "${as_root[@]}" apt-get update -qq >"$log" 2>&1; then
  fail "apt-get update failed ($(tail -n 1 "$log"))"
fi
if ! "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >"$log" 2>&1; then
  fail "apt-get install ${missing[*]} failed ($(tail -n 1 "$log"))"
fi
mapfile -t still < <(missing_packages)
(( ${#still[@]} == 0 )) || fail "still missing after apt-get: ${still[*]}"
echo "$me: installed ${missing[*]}"

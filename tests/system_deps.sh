#!/usr/bin/env bash
# The system tools llmft's tests need, installed in one step before pytest starts (`make test` runs this):
#   - the shell-script checks: the shellcheck package
#   - the real two-node Slurm cluster of slurm/local/: slurmctld, slurmd, slurm-client, munge
#   - the real enroot and pyxis (built from ../shared/vendor by tests/container_tools.sh) and the test image: gcc,
#     make, libbsd-dev, libslurm-dev (pyxis builds against its spank.h), squashfs-tools, jq, parallel (enroot's runtime
#     tools) and debootstrap (the image's Debian rootfs)
#   - the real two-node OpenPBS cluster of pbs/local/ (built from source by pbs/local/start.sh): its build tools and
#     headers, PostgreSQL (PBS's datastore) and iproute2 (its node addresses on lo)
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
  [g++]=g++ [make]=make [libtoolize]=libtool [autoconf]=autoconf [automake]=automake [pkg-config]=pkg-config
  [mksquashfs]=squashfs-tools [unsquashfs]=squashfs-tools [jq]=jq [parallel]=parallel [debootstrap]=debootstrap
  [perl]=perl [swig]=swig [pg_buildext]=postgresql-server-dev-all [tclsh]=tcl [wish]=tk [xmlwf]=expat [ip]=iproute2
)
# files (not commands; a pattern where the path names a version) -> the package that provides them
declare -A package_of_file=(
  [/usr/include/slurm/spank.h]=libslurm-dev [/usr/include/bsd/string.h]=libbsd-dev
  [/usr/include/hwloc.h]=libhwloc-dev [/usr/include/X11/Xlib.h]=libx11-dev [/usr/include/X11/Intrinsic.h]=libxt-dev
  [/usr/include/histedit.h]=libedit-dev [/usr/include/libical/ical.h]=libical-dev [/usr/include/ncurses.h]=libncurses-dev
  [/usr/lib/postgresql/*/bin/initdb]=postgresql [/usr/share/doc/postgresql-contrib/copyright]=postgresql-contrib
  [/usr/bin/python3]=python3 [/usr/bin/python3-config]=python3-dev [/usr/include/tcl/tcl.h]=tcl-dev
  [/usr/include/tk/tk.h]=tk-dev [/usr/include/expat.h]=libexpat1-dev [/usr/include/openssl/ssl.h]=libssl-dev
  [/usr/include/X11/extensions/Xext.h]=libxext-dev [/usr/include/X11/Xft/Xft.h]=libxft-dev
  [/usr/include/cjson/cJSON.h]=libcjson-dev [/usr/lib/*-linux-gnu/libical.so.3]=libical3
)

missing_packages() {
  local cmd
  local cmd file
  {
    for cmd in "${!package_of[@]}"; do
      command -v "$cmd" >/dev/null 2>&1 || echo "${package_of[$cmd]}"
    done
    for file in "${!package_of_file[@]}"; do
      compgen -G "$file" >/dev/null || echo "${package_of_file[$file]}"
    done
  } | sort -u
}

mapfile -t missing < <(missing_packages)
if (( ${#missing[@]} == 0 )); then
  echo "$me: shellcheck, Slurm, munge, gcc, Slurm's SPANK header, enroot's and the test image's tools and OpenPBS's build and runtime packages are installed"
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

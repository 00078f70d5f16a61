#!/usr/bin/env bash
# Real enroot and pyxis for the container tests, and their test image, each built once and cached:
#   - enroot 4.1.2 from ../shared/vendor/enroot-*.tar.gz (glibc build, Debian's libbsd; a few seconds);
#   - pyxis 0.24.0 from ../shared/vendor/pyxis-*.tar.gz against this machine's Slurm spank.h (a few seconds);
#   - the test image: a Debian 12 rootfs from debootstrap (minbase + python3), with /etc/llmft-test-image written in
#     it (a file only the image has: the tests read it from the ranks), squashed by mksquashfs.
# Each goes under /opt/llmft-containers/ (enroot compiles its prefix in; the job user llmftjob reads the image there),
# named by a key of what defines it: the source tarball's sha256 and this recipe (enroot, pyxis with the Slurm
# version too), or the debootstrap command line and package list (the image). A tree or image of another key is
# built anew beside it. Install trees are kept as tarballs in ${LLMFT_CONTAINER_CACHE:-~/.cache/llmft} too, as
# pbs/local/start.sh keeps OpenPBS's, and restored from there; the image is cached there as well.
#
#   tests/container_tools.sh            build or restore all three; print ENROOT_PREFIX=, PYXIS_PLUGIN=, TEST_IMAGE=
#
# Needs root (it writes /opt), gcc, make, libbsd-dev, libslurm-dev, squashfs-tools, debootstrap and Debian's
# archive (tests/system_deps.sh installs the packages).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
me=tests/container_tools.sh
die() { echo "$me: $*" >&2; exit 1; }
[[ "$(id -u)" == 0 ]] || die "needs root (it installs into /opt/llmft-containers and runs debootstrap)"
export PATH="$PATH:/usr/sbin:/sbin"

opt=/opt/llmft-containers
cache=${LLMFT_CONTAINER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llmft}
mkdir -p "$opt" "$cache"
chmod 755 "$opt"

vendored() {  # vendored NAME: the newest ../shared/vendor/NAME-*.tar.gz
  local found=("$repo"/../shared/vendor/"$1"-*.tar.gz)
  [[ -f "${found[-1]}" ]] || die "no ../shared/vendor/$1-*.tar.gz beside the repository (the sources of $1)"
  (cd "$(dirname "${found[-1]}")" && echo "$PWD/$(basename "${found[-1]}")")
}
key_of() { sha256sum | cut -c1-12; }

# Restore DIR from its cached tarball, or build it with the function BUILD (which fills DIR), then cache it.
restore_or_build() {
  local dir=$1 build=$2 tarball
  tarball=$cache/$(basename "$dir")-install.tar.gz
  [[ -f "$dir/.built" ]] && return 0
  rm -rf "$dir"
  if [[ -f "$tarball" ]] && tar -C "$opt" -xzf "$tarball" && [[ -f "$dir/.built" ]]; then
    echo "$me: restored $dir from $tarball" >&2
    return 0
  fi
  rm -rf "$dir"
  "$build" "$dir"
  : > "$dir/.built"
  tar -C "$opt" -czf "$tarball.tmp" "$(basename "$dir")" && mv "$tarball.tmp" "$tarball"
}

build_enroot() {
  local prefix=$1 src started=$SECONDS
  src=$(mktemp -d)
  tar -C "$src" --strip-components=1 -xzf "$enroot_tgz"
  # glibc instead of the empty deps/musl; glibc 2.36 lacks strlcpy/strlcat: Debian's libbsd (not deps' subset)
  mkdir -p "$src/deps/dist/linux/include"
  touch "$src/deps/linux-headers/.stamp"
  make -s -C "$src" FORCE_GLIBC=1 prefix="$prefix" LDLIBS='-l:libbsd.a -l:libbsd.so.0' install >"$src/build.log" 2>&1 \
    || die "enroot's build failed: $(tail -n 3 "$src/build.log")"
  rm -rf "$src"
  # As a site's enroot.conf does: a runtime and a cache path each user may write (enroot's defaults, /run/enroot and
  # ~/.cache, are root's or may be shared). The data path keeps enroot's default, ~/.local/share/enroot: a shared
  # $HOME, which llmft's per-node container names are made for; a job may set ENROOT_DATA_PATH (the tests do).
  cat >> "$prefix/etc/enroot/enroot.conf" <<'CONF'
ENROOT_RUNTIME_PATH ${TMPDIR:-/tmp}/enroot-runtime-$(id -u)
ENROOT_CACHE_PATH ${TMPDIR:-/tmp}/enroot-cache-$(id -u)
CONF
  echo "$me: built enroot into $prefix in $((SECONDS - started)) s" >&2
}

build_pyxis() {
  local prefix=$1 src started=$SECONDS
  src=$(mktemp -d)
  tar -C "$src" --strip-components=1 -xzf "$pyxis_tgz"
  make -s -C "$src" >"$src/build.log" 2>&1 || die "pyxis's build failed: $(tail -n 3 "$src/build.log")"
  mkdir -p "$prefix"
  install -m 644 "$src/spank_pyxis.so" "$prefix/spank_pyxis.so"
  rm -rf "$src"
  echo "$me: built pyxis into $prefix in $((SECONDS - started)) s" >&2
}

# The image: what defines it is this command line, its package list and the marker file's text.
release=bookworm
mirror=http://deb.debian.org/debian
packages=python3,python-is-python3
debootstrap_args=(--variant=minbase "--include=$packages" "$release")
marker="llmft test image: debootstrap ${debootstrap_args[*]} $mirror"

build_image() {
  local image=$1 work started=$SECONDS
  work=$(mktemp -d "$opt/.image-XXXXXX")
  debootstrap "${debootstrap_args[@]}" "$work/rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 \
    || die "debootstrap failed (Debian's archive $mirror unreachable?): $(tail -n 2 "$work/debootstrap.log")"
  echo "$marker" > "$work/rootfs/etc/llmft-test-image"
  # no device nodes: enroot mounts /dev itself, and an unprivileged `enroot create` (the PBS job user's) cannot
  # unsquash them (exit 2), as images exported from a registry have none
  find "$work/rootfs/dev" -mindepth 1 -delete
  rm -rf "$work/rootfs/var/cache/apt/archives/"*.deb "$work/rootfs/var/lib/apt/lists/"*
  mksquashfs "$work/rootfs" "$image.tmp" -noappend -comp lzo -quiet >"$work/mksquashfs.log" 2>&1 \
    || die "mksquashfs failed: $(tail -n 2 "$work/mksquashfs.log")"
  chmod 644 "$image.tmp"
  mv "$image.tmp" "$image"
  rm -rf "$work"
  echo "$me: built the test image $image in $((SECONDS - started)) s" >&2
}

enroot_tgz=$(vendored enroot)
pyxis_tgz=$(vendored pyxis)
recipe=2  # bump when enroot's or pyxis's build above changes
image_recipe=2  # bump when build_image changes
slurm_version=$(dpkg-query -W -f '${Version}' libslurm-dev 2>/dev/null) || die "libslurm-dev is missing (pyxis builds against its spank.h)"
enroot_prefix=$opt/enroot-$( { echo "$recipe"; sha256sum < "$enroot_tgz"; } | key_of)
pyxis_prefix=$opt/pyxis-$( { echo "$recipe $slurm_version"; sha256sum < "$pyxis_tgz"; } | key_of)
image=$opt/llmft-test-image-$(echo "$marker $image_recipe" | key_of).sqsh

restore_or_build "$enroot_prefix" build_enroot
restore_or_build "$pyxis_prefix" build_pyxis
if [[ ! -f "$image" ]]; then
  if [[ -f "$cache/$(basename "$image")" ]]; then
    cp "$cache/$(basename "$image")" "$image"
  else
    build_image "$image"
    cp "$image" "$cache/$(basename "$image")"
  fi
fi
echo "ENROOT_PREFIX=$enroot_prefix"
echo "PYXIS_PLUGIN=$pyxis_prefix/spank_pyxis.so"
echo "TEST_IMAGE=$image"

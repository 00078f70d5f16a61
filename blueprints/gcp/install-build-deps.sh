#!/bin/bash
# Startup script for the llmft Slurm cluster on Google Cloud (login and compute nodes).
# Installs what DeepSpeed needs to build its CUDA/C++ ops on the node: ninja, the Python
# headers (Python 3.11 on Rocky Linux 8, whose python3 is 3.6), and a GCC toolset that
# CUDA 12 and torch's C++17 extensions accept. Idempotent; runs as root at every boot
# (dynamic nodes are new VMs each time, so it also runs on their first boot).
#
# Overridable for tests: OS_RELEASE_FILE (default /etc/os-release), PROFILE_D (default /etc/profile.d).
set -euo pipefail

os_release=${OS_RELEASE_FILE:-/etc/os-release}
profile_d=${PROFILE_D:-/etc/profile.d}
gcc_toolset=gcc-toolset-12

if [[ ! -r "$os_release" ]]; then
    echo "llmft build deps: cannot read $os_release; cannot tell which package manager to use" >&2
    exit 1
fi
# os-release is a list of KEY=value lines; read the two keys we need without sourcing it.
os_id=$(sed -n 's/^ID=//p' "$os_release" | tr -d '"')
os_like=$(sed -n 's/^ID_LIKE=//p' "$os_release" | tr -d '"')

install_el() {
    # Rocky / RHEL / CentOS 8+: Python 3.11 from AppStream, GCC 12 toolset, ninja from PowerTools/CRB.
    dnf install -y python3.11 python3.11-devel python3.11-pip "$gcc_toolset-gcc" "$gcc_toolset-gcc-c++" make
    if ! dnf install -y --enablerepo=powertools ninja-build \
        && ! dnf install -y --enablerepo=crb ninja-build; then
        echo "llmft build deps: ninja-build package not found; installing ninja from PyPI instead" >&2
        python3.11 -m pip install --no-cache-dir ninja
    fi
}

install_deb() {
    # Debian 12 / Ubuntu 22.04+: the distribution python3 is >= 3.10 and GCC is new enough.
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout=600 update
    apt-get -o DPkg::Lock::Timeout=600 install -y python3-dev python3-venv python3-pip ninja-build build-essential
}

case " $os_id $os_like " in
    *" rhel "* | *" centos "* | *" rocky "* | *" fedora "*) install_el ;;
    *" debian "* | *" ubuntu "*) install_deb ;;
    *)
        echo "llmft build deps: unsupported OS '$os_id' (expected Rocky/RHEL 8+, Debian or Ubuntu)" >&2
        exit 1
        ;;
esac

# Make the toolset and CUDA visible to login shells, and so to jobs submitted from them
# (sbatch exports the submitting environment by default).
mkdir -p "$profile_d"
cat > "$profile_d/llmft-build-env.sh" <<PROFILE
# Written by llmft's install-build-deps.sh: compilers and CUDA for DeepSpeed op builds.
if [ -f /opt/rh/$gcc_toolset/enable ]; then
    . /opt/rh/$gcc_toolset/enable
fi
if [ -d /usr/local/cuda/bin ]; then
    export CUDA_HOME=/usr/local/cuda
    case ":\$PATH:" in
        *:/usr/local/cuda/bin:*) ;;
        *) export PATH="/usr/local/cuda/bin:\$PATH" ;;
    esac
fi
PROFILE
chmod 0644 "$profile_d/llmft-build-env.sh"
echo "llmft build deps: installed for $os_id"

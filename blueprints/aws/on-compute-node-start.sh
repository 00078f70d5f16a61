#!/bin/bash
# AWS ParallelCluster SlurmQueues/CustomActions/OnNodeStart script for llmft (compute nodes).
# Prepares the enroot and pyxis directories (pyxis itself is enabled cluster-wide by the
# head node's plugstack, see on-head-node-configured.sh) and installs what DeepSpeed needs
# to build its ops on the node: Python headers and ninja. Runs before slurmd starts.
#
# SYSROOT (default empty) prefixes every system path: only for tests.
set -euo pipefail

root=${SYSROOT:-}
examples="$root/opt/parallelcluster/examples"

if [[ ! -f "$examples/enroot/enroot.conf" ]]; then
    echo "llmft: $examples/enroot/enroot.conf not found: pyxis/enroot need an official ParallelCluster >= 3.11.1 AMI" >&2
    exit 1
fi

echo "llmft: configuring enroot and pyxis"
install -d -m 1777 "$root/var/enroot" "$root/run/enroot" "$root/run/pyxis"
install -d -m 0755 "$root/etc/enroot"
install -m 0644 "$examples/enroot/enroot.conf" "$root/etc/enroot/enroot.conf"

# Ubuntu 24.04's AppArmor blocks the unprivileged user namespaces enroot needs.
os_id=$(sed -n 's/^ID=//p' "$root/etc/os-release" 2>/dev/null | tr -d '"')
os_version=$(sed -n 's/^VERSION_ID=//p' "$root/etc/os-release" 2>/dev/null | tr -d '"')
if [[ "$os_id$os_version" == "ubuntu24.04" ]]; then
    echo "kernel.apparmor_restrict_unprivileged_userns = 0" \
        > "$root/etc/sysctl.d/99-llmft-enroot-userns.conf"
    sysctl --system
fi

echo "llmft: installing Python headers, venv and ninja for DeepSpeed op builds"
if command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout=600 update
    apt-get -o DPkg::Lock::Timeout=600 install -y python3-dev python3-venv ninja-build build-essential
elif command -v dnf >/dev/null 2>&1; then
    dnf install -y python3.11 python3.11-devel ninja-build gcc-c++ make
else
    echo "llmft: neither apt-get nor dnf found; install python3-dev and ninja in the AMI" >&2
    exit 1
fi
echo "llmft: compute node ready"

#!/bin/bash
# AWS ParallelCluster HeadNode/CustomActions/OnNodeConfigured script for llmft.
# Official ParallelCluster AMIs (>= 3.11.1) ship pyxis and enroot installed but disabled;
# this turns them on for the whole cluster (the Slurm plugstack lives on the head node and is
# shared with the compute nodes) using the sample configs in /opt/parallelcluster/examples,
# and installs what `make venv` and DeepSpeed op builds need on the head node.
#
# SYSROOT (default empty) prefixes every system path: only for tests.
set -euo pipefail

root=${SYSROOT:-}
examples="$root/opt/parallelcluster/examples"
slurm_etc="$root/opt/slurm/etc"

for f in enroot/enroot.conf spank/plugstack.conf pyxis/pyxis.conf; do
    if [[ ! -f "$examples/$f" ]]; then
        echo "llmft: $examples/$f not found: pyxis/enroot need an official ParallelCluster >= 3.11.1 AMI" >&2
        exit 1
    fi
done

echo "llmft: enabling enroot and pyxis"
# enroot: persistent and volatile directories, world-writable with sticky bit.
install -d -m 1777 "$root/var/enroot" "$root/run/enroot"
install -d -m 0755 "$root/etc/enroot"
install -m 0644 "$examples/enroot/enroot.conf" "$root/etc/enroot/enroot.conf"
# pyxis: runtime directory and the Slurm SPANK plugstack.
install -d -m 1777 "$root/run/pyxis"
install -d -m 0755 "$slurm_etc/plugstack.conf.d"
install -m 0644 "$examples/spank/plugstack.conf" "$slurm_etc/plugstack.conf"
install -m 0644 "$examples/pyxis/pyxis.conf" "$slurm_etc/plugstack.conf.d/pyxis.conf"

echo "llmft: installing Python headers, venv and ninja for DeepSpeed op builds"
if command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout=600 update
    apt-get -o DPkg::Lock::Timeout=600 install -y python3-dev python3-venv python3-pip ninja-build build-essential
elif command -v dnf >/dev/null 2>&1; then
    dnf install -y python3.11 python3.11-devel python3.11-pip ninja-build gcc-c++ make
else
    echo "llmft: neither apt-get nor dnf found; install python3-dev, python3-venv and ninja by hand" >&2
    exit 1
fi

# Make slurmctld pick up the plugstack (pyxis options for srun/sbatch). Custom actions do not
# get a login shell, so /opt/slurm/bin may not be on PATH.
scontrol_bin="$root/opt/slurm/bin/scontrol"
[[ -x "$scontrol_bin" ]] || scontrol_bin=scontrol
"$scontrol_bin" reconfigure
echo "llmft: head node ready"

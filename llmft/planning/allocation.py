"""What the job was given on a node, not what the node has: the memory it may use, its GPUs and CPUs.

A Slurm job may use less memory than the node's MemTotal: the step's memory cgroup enforces --mem, --mem-per-cpu,
--mem-per-gpu or the cluster's DefMemPerCPU, and the job is killed past it (pinned offload buffers cannot be
reclaimed). `job_memory` takes the smallest of MemTotal, the cgroup limit of this process (cgroup v2 memory.max,
v1 memory.limit_in_bytes, on its cgroup and every ancestor) and Slurm's per-node, per-CPU and per-GPU numbers.
Pure functions over the environment and the files' text, so the tests give them any node's facts.

slurm/run_llm.slurm runs this module once on every node of the job (`python -m llmft.planning.allocation`, one
task per node): each node prints one `llmft node:` line, and the script plans for the smallest node, refuses GPUs
spread unevenly over the nodes, and refuses a fabric profile whose NCCL plugin a node lacks.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from llmft.errors import LlmftError
from llmft.planning.fabric import fabric_missing
from llmft.planning.world import LaunchEnvError, parse_gpu_count, slurm_cpus_per_node

MIB = 2**20
GIB = 2**30
UNLIMITED = 2**60  # cgroup v1 writes "no limit" as PAGE_COUNTER_MAX pages (9223372036854771712 on x86-64)


@dataclass(frozen=True)
class MemoryLimit:
    """The memory a job may use on a node, and what sets it (shown in plans and errors)."""

    gib: float
    source: str  # "MemTotal", "cgroup memory.max", "SLURM_MEM_PER_CPU=3072 MB x 4 CPUs", ...
    node_gib: float | None = None  # the node's MemTotal: more than that no --mem can give

    @property
    def from_allocation(self) -> bool:
        """True when the job's allocation, not the node's size, is the limit: a bigger --mem fixes it."""
        return self.source not in ("MemTotal", "LLMFT_HOST_RAM_GB")


def meminfo_total_gib(meminfo_text: str) -> float | None:
    for line in meminfo_text.splitlines():
        if line.startswith("MemTotal:"):
            try:
                return int(line.split()[1]) * 1024 / GIB  # kB
            except (IndexError, ValueError):
                return None
    return None


def cgroup_memory_limit(
    proc_self_cgroup: str, read: Callable[[str], str | None], root: str = "/sys/fs/cgroup"
) -> tuple[int, str] | None:
    """The smallest memory limit (bytes, file) on this process's cgroup and its ancestors, or None when unlimited.

    `proc_self_cgroup` is /proc/self/cgroup's text; `read(path)` returns a file's text or None. cgroup v1 (and the
    hybrid layout, where the memory controller stays on v1): the `memory` line, under ROOT/memory. cgroup v2: the
    `0::` line, under ROOT. Ancestors count because Slurm limits the job's cgroup and the step's below it; inside a
    container the visible root is the container's own cgroup.
    """
    v1 = v2 = None
    for line in proc_self_cgroup.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if "memory" in controllers.split(","):
            v1 = path
        elif hierarchy == "0" and controllers == "":
            v2 = path
    if v1 is not None:
        base, name, path = f"{root}/memory", "memory.limit_in_bytes", v1
    elif v2 is not None:
        base, name, path = root, "memory.max", v2
    else:
        return None
    best = None
    parts = [p for p in path.split("/") if p]
    for depth in range(len(parts), -1, -1):
        file = "/".join([base, *parts[:depth], name])
        text = read(file)
        if text is None or not text.strip().isdigit():  # missing, or "max" (v2's no limit)
            continue
        value = int(text.strip())
        if value < UNLIMITED and (best is None or value < best[0]):
            best = (value, file)
    return best


def slurm_memory_limits(env: Mapping[str, str]) -> list[tuple[float, str]]:
    """(GiB, source) for each memory number Slurm gave this job per node: --mem, --mem-per-cpu x the CPUs on the
    node, --mem-per-gpu x the GPUs on the node (Slurm's MB are MiB)."""
    out = []

    def mb(name: str) -> int | None:
        value = env.get(name, "").strip()
        return int(value) if value.isdigit() and int(value) > 0 else None

    per_node = mb("SLURM_MEM_PER_NODE")
    if per_node:
        out.append((per_node * MIB / GIB, f"SLURM_MEM_PER_NODE={per_node} MB"))
    per_cpu = mb("SLURM_MEM_PER_CPU")
    if per_cpu:
        cpus = _cpus_on_node(env)
        if cpus:
            out.append((per_cpu * cpus * MIB / GIB, f"SLURM_MEM_PER_CPU={per_cpu} MB x {cpus} CPUs"))
    per_gpu = mb("SLURM_MEM_PER_GPU")
    if per_gpu:
        gpus = gpus_on_node(env)
        if gpus:
            out.append((per_gpu * gpus * MIB / GIB, f"SLURM_MEM_PER_GPU={per_gpu} MB x {gpus} GPUs"))
    return out


def _cpus_on_node(env: Mapping[str, str]) -> int | None:
    """The job's CPUs on this node: SLURM_CPUS_ON_NODE in the batch step or a step on every CPU; else the smallest
    node's (SLURM_JOB_CPUS_PER_NODE)."""
    value = env.get("SLURM_JOB_CPUS_PER_NODE", "").strip()
    if value and env.get("SLURM_NODEID", "").strip().isdigit():
        counts = _per_node_counts(value)
        node = int(env["SLURM_NODEID"])
        if counts and node < len(counts):
            return counts[node]
    try:
        return slurm_cpus_per_node(env)
    except LaunchEnvError:
        return None


def _per_node_counts(spec: str) -> list[int]:
    """'16(x2),8' -> [16, 16, 8]: SLURM_JOB_CPUS_PER_NODE in node order."""
    out = []
    for part in spec.split(","):
        count, _, repeat = part.strip().partition("(x")
        if not count.isdigit():
            return []
        out += [int(count)] * (int(repeat.rstrip(")")) if repeat.rstrip(")").isdigit() else 1)
    return out


def gpus_on_node(env: Mapping[str, str]) -> int:
    """The job's GPUs on this node (0 without any): SLURM_GPUS_ON_NODE, else the IDs in SLURM_JOB_GPUS
    (both are this node's, unlike SLURM_GPUS, which is the job's total); on PBS, the chunk's ngpus."""
    value = env.get("SLURM_GPUS_ON_NODE", "").strip()
    if value.isdigit():
        return int(value)
    ids = env.get("SLURM_JOB_GPUS", "").strip()
    if ids:
        return len([i for i in ids.split(",") if i.strip()])
    for name in ("SLURM_GPUS_PER_NODE", "SLURM_JOB_GPUS_PER_NODE"):
        if env.get(name, "").strip():
            try:
                return parse_gpu_count(env[name])
            except LaunchEnvError:
                return 0
    value = env.get("LLMFT_NODE_GPUS", "").strip()  # PBS: the select statement's ngpus (llmft.launch.pbs)
    return int(value) if value.isdigit() else 0


def job_memory(
    env: Mapping[str, str],
    meminfo_text: str | None,
    proc_self_cgroup: str,
    read: Callable[[str], str | None],
    root: str = "/sys/fs/cgroup",
) -> MemoryLimit:
    """The memory this job may use on this node: the smallest of MemTotal, LLMFT_HOST_RAM_GB (run_llm.slurm's
    smallest node, or a user's figure), the cgroup limit and Slurm's per-node/CPU/GPU memory.
    ValueError when nothing gives a number or LLMFT_HOST_RAM_GB is not one."""
    candidates: list[tuple[float, str]] = []
    total = meminfo_total_gib(meminfo_text) if meminfo_text else None
    if total:
        candidates.append((total, "MemTotal"))
    given = env.get("LLMFT_HOST_RAM_GB", "").strip()
    if given:
        try:
            value = float(given)
        except ValueError:
            value = float("nan")
        if not value > 0:
            raise ValueError(f"LLMFT_HOST_RAM_GB={given!r} is not a positive number of GiB")
        source = env.get("LLMFT_HOST_RAM_SOURCE", "").strip() or "LLMFT_HOST_RAM_GB"
        candidates.append((value, source))
    limit = cgroup_memory_limit(proc_self_cgroup, read, root)
    if limit is not None:
        candidates.append((limit[0] / GIB, f"cgroup {Path(limit[1]).name} ({limit[1]})"))
    candidates += slurm_memory_limits(env)
    if not candidates:
        raise ValueError("cannot tell this node's memory (no MemTotal in /proc/meminfo)")
    gib, source = min(candidates, key=lambda c: c[0])
    return MemoryLimit(round(gib, 1), source, None if total is None else round(total, 1))


def read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def this_node_memory(env: Mapping[str, str] | None = None, meminfo: str = "/proc/meminfo") -> MemoryLimit:
    """job_memory with this machine's files."""
    return job_memory(
        os.environ if env is None else env, read_text(meminfo), read_text("/proc/self/cgroup") or "", read_text
    )


def numa_nodes(sysfs: str = "/sys") -> int:
    """NUMA nodes on this machine (1 where sysfs does not say)."""
    try:
        return max(
            1,
            len(
                [
                    p
                    for p in Path(sysfs, "devices/system/node").iterdir()
                    if p.name[4:].isdigit() and p.name.startswith("node")
                ]
            ),
        )
    except OSError:
        return 1


NUMA_MODES = ("node", "socket", "exclusive", "core-complex")


def parse_cpulist(text: str) -> set[int]:
    """'0-3,8,10-11' (sysfs cpulist) -> {0, 1, 2, 3, 8, 10, 11}; an empty or unreadable list -> empty set."""
    out: set[int] = set()
    for part in text.strip().split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            return set() if part.strip() else out
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def cpulist(cpus: set[int]) -> str:
    """{0, 1, 2, 3, 8} -> '0-3,8' (the inverse of parse_cpulist); 'none' for no CPU."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs) or "none"


def numa_uncovered(gpu_numa: list[int] | None, numa_cpus: Mapping[int, set[int]], allowed: set[int]) -> str:
    """Why binding each process to its GPU's NUMA node would fail or misplace it here ('' where it is safe), from the
    node's facts: the NUMA node of each of the job's GPUs (in local rank order; None when not known), each NUMA node's
    CPUs, and the CPUs the job may use on the node. torch's `--numa-binding` binds a process to the CPUs of its GPU's
    NUMA node that the process may use: where the job holds none of them (a node shared with other jobs) torch stops
    with "Must bind to a non-empty set of CPU indices"; where it holds only some, the process is crammed onto those; and
    a GPU whose numa_node is -1 (no NUMA information) is bound to node 0, wherever it sits. So only a job whose CPUs
    cover every one of its GPUs' NUMA nodes, each known, is bound."""
    if not gpu_numa:
        return "its GPUs' NUMA nodes are not known (no NVIDIA GPU under /sys/bus/pci/drivers/nvidia)"
    for i, node in enumerate(gpu_numa):
        if node < 0:
            return (
                f"GPU {i} has no NUMA node (numa_node {node}), and torch would bind its process to NUMA node 0's CPUs"
            )
        cpus = numa_cpus.get(node, set())
        if not cpus:
            return f"GPU {i}'s NUMA node {node} lists no CPUs"
        if not cpus <= allowed:
            return (
                f"GPU {i}'s NUMA node {node} has CPUs {cpulist(cpus)}, of which the job holds {cpulist(cpus & allowed)} "
                f"(the job's CPUs there: {cpulist(allowed)}; a node shared with other jobs)"
            )
    return ""


def job_gpu_numa(env: Mapping[str, str], sysfs: str = "/sys") -> list[int] | None:
    """The NUMA node of each of the job's GPUs on this node (numa_node of its PCI device, -1 where the kernel knows
    none), in local rank order; None without NVIDIA GPUs in sysfs. The driver numbers its GPUs (/dev/nvidiaN, the IDs
    Slurm puts in SLURM_STEP_GPUS/SLURM_JOB_GPUS) in PCI order; IDs that do not fit that list mean every GPU counts."""
    driver = Path(sysfs, "bus/pci/drivers/nvidia")
    try:
        addresses = sorted(
            p.name for p in driver.iterdir() if re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.\d", p.name)
        )
    except OSError:
        return None
    if not addresses:
        return None
    ids = (env.get("SLURM_STEP_GPUS") or env.get("SLURM_JOB_GPUS") or "").split(",")
    minors = [int(i) for i in ids if i.strip().isdigit()]
    if not minors or max(minors) >= len(addresses):
        minors = list(range(len(addresses)))
    out = []
    for m in minors:
        node = read_text(str(driver / addresses[m] / "numa_node"))
        out.append(int(node) if node and node.strip().lstrip("-").isdigit() else -1)
    return out


def numa_node_cpus(sysfs: str = "/sys") -> dict[int, set[int]]:
    """Each NUMA node's CPUs (sysfs devices/system/node/nodeN/cpulist)."""
    out = {}
    try:
        for p in Path(sysfs, "devices/system/node").iterdir():
            if p.name.startswith("node") and p.name[4:].isdigit():
                out[int(p.name[4:])] = parse_cpulist(read_text(str(p / "cpulist")) or "")
    except OSError:
        pass
    return out


def this_node_numa_problem(env: Mapping[str, str], sysfs: str = "/sys") -> str:
    """numa_uncovered with this node's facts: its sysfs, and this process's CPUs (the probe runs as a step on all the
    job's CPUs on the node, srun --whole, as the training step does)."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    return numa_uncovered(job_gpu_numa(env, sysfs), numa_node_cpus(sysfs), set(allowed))


class AllocationError(LlmftError, ValueError):
    """The job's nodes cannot run the plan as allocated; the message names the node and the fix."""


@dataclass(frozen=True)
class NodeFacts:
    """One node of the job as the `llmft node:` probe saw it."""

    host: str
    gpus: int
    memory: MemoryLimit
    numa_nodes: int = 1
    numactl: bool = False
    fabric_missing: str = ""
    numa_problem: str = ""  # numa_uncovered's answer on this node ('' where binding is safe)

    def line(self) -> str:
        """The `llmft node:` line: tab-separated, free text last."""
        fields = [
            self.host,
            str(self.gpus),
            f"{self.memory.gib:g}",
            "" if self.memory.node_gib is None else f"{self.memory.node_gib:g}",
            str(self.numa_nodes),
            "1" if self.numactl else "0",
            self.memory.source,
            self.fabric_missing,
            self.numa_problem,
        ]
        return "\t".join(["llmft node:", *(f.replace("\t", " ").replace("\n", " ") for f in fields)])


def parse_node_lines(text: str) -> list[NodeFacts]:
    nodes = []
    for line in text.splitlines():
        parts = line.split("\t")
        if parts[0] != "llmft node:":
            continue
        if len(parts) != 10:
            raise AllocationError(
                f"cannot read the node probe's line {line!r}: is llmft on every node the same version?"
            )
        _, host, gpus, gib, node_gib, numa, numactl, source, missing, numa_problem = parts
        nodes.append(
            NodeFacts(
                host,
                int(gpus),
                MemoryLimit(float(gib), source, float(node_gib) if node_gib else None),
                int(numa),
                numactl == "1",
                missing,
                numa_problem,
            )
        )
    return sorted(nodes, key=lambda n: n.host)  # srun prints them as they finish


def job_nodes(nodes: list[NodeFacts]) -> MemoryLimit:
    """Check the job's nodes against each other and return the memory to plan with: the smallest node's, named.

    Every node runs the same number of processes (llmft's world is nodes x processes), so GPUs spread unevenly
    (`--gpus=N` can do that) are refused with the fix; a fabric profile a node cannot use is refused naming the node."""
    if not nodes:
        raise AllocationError("the node probe printed no `llmft node:` line")
    missing = [n for n in nodes if n.fabric_missing]
    if missing:
        raise AllocationError(f"node {missing[0].host}: {missing[0].fabric_missing}")
    counts = {n.gpus for n in nodes}
    if len(counts) > 1:
        spread = ", ".join(f"{n.host} {n.gpus}" for n in nodes)
        raise AllocationError(
            f"the job's GPUs are spread unevenly over its nodes ({spread}), and every node runs the same "
            "number of processes: ask for GPUs per node (#SBATCH --gpus-per-node=N, not --gpus=N)"
        )
    smallest = min(nodes, key=lambda n: n.memory.gib)
    source = f"node {smallest.host}: {smallest.memory.source}"
    node_gib = min((n.memory.node_gib for n in nodes if n.memory.node_gib is not None), default=None)
    return MemoryLimit(smallest.memory.gib, source if smallest.memory.from_allocation else "MemTotal", node_gib)


def numa_binding(requested: str, nodes: list[NodeFacts]) -> tuple[str | None, str]:
    """torchrun's --numa-binding for this job (None: not bound) and why. torchrun binds each worker to the CPUs near
    its GPU (torch.numa.binding: needs CUDA GPUs and the numactl tool). auto: `node` where every node has GPUs and
    more than one NUMA node (multi-socket machines, where CPU offload's optimizer step and the dataloaders otherwise
    cross sockets), and the job's CPUs on every node cover each of its GPUs' NUMA nodes (numa_uncovered: else torch
    fails to start the ranks, or crams them), else off, saying why. An explicit mode on nodes that cannot take it is
    refused."""
    if requested == "off":
        return None, "off (NUMA_BINDING=off)"
    if requested not in ("auto", *NUMA_MODES):
        raise AllocationError(f"NUMA_BINDING={requested} is unknown; use auto, off or one of {', '.join(NUMA_MODES)}")
    no_gpu = [n.host for n in nodes if n.gpus == 0]
    single = [n.host for n in nodes if n.numa_nodes < 2]
    no_numactl = [n.host for n in nodes if not n.numactl]
    if requested == "auto":
        if no_gpu:
            return None, f"off: no GPU on {', '.join(no_gpu)}"
        if single:
            return None, f"off: one NUMA node on {', '.join(single)}"
        if no_numactl:
            return None, f"off: numactl is missing on {', '.join(no_numactl)} (install it to bind)"
        uncovered = [n for n in nodes if n.numa_problem]
        if uncovered:
            return None, f"off: on {uncovered[0].host}, {uncovered[0].numa_problem}"
        return "node", "node: each process on the CPUs of its GPU's NUMA node"
    if no_gpu:
        raise AllocationError(
            f"NUMA_BINDING={requested} binds each process to its GPU's NUMA node, and "
            f"{', '.join(no_gpu)} has no GPU; use NUMA_BINDING=auto or off"
        )
    if no_numactl:
        raise AllocationError(
            f"NUMA_BINDING={requested} needs numactl (torch.numa.binding runs it), missing on "
            f"{', '.join(no_numactl)}: install numactl or use NUMA_BINDING=auto or off"
        )
    return requested, f"{requested} (NUMA_BINDING={requested})"


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m llmft.planning.allocation",
        allow_abbrev=False,
        description="Print this node's allocation as one `llmft node:` line.",
    )
    parser.add_argument(
        "--fabric", default="", help="also check this NCCL_PROFILE's plugin is here (aws-efa, gcp-tcpx)"
    )
    args = parser.parse_args(argv)
    try:
        memory = this_node_memory()
    except ValueError as e:
        print(f"llmft node: error: {e}")
        return 2
    missing = ""
    if args.fabric:
        missing = fabric_missing(args.fabric, os.environ) or ""
    # the scheduler's name for the node: Slurm's, or the one llmft.launch.pbs passes (several may share a hostname)
    host = os.environ.get("SLURMD_NODENAME") or os.environ.get("LLMFT_NODE_NAME") or socket.gethostname().split(".")[0]
    sysfs = os.environ.get("LLMFT_SYSFS_ROOT", "/sys")  # tests only: a /sys with other NUMA nodes
    print(
        NodeFacts(
            host,
            gpus_on_node(os.environ),
            memory,
            numa_nodes(sysfs),
            shutil.which("numactl") is not None,
            f"NCCL_PROFILE={args.fabric}: {missing}" if missing else "",
            this_node_numa_problem(os.environ, sysfs) if gpus_on_node(os.environ) else "",
        ).line()
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

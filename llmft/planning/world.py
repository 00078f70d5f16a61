"""Where are we running? The world (nodes x processes per node) from Slurm, torchrun or the local machine.

Pure functions over an environment mapping, so the same answer is computed on a login node
(planning a job), in the batch script, and inside each training process.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from typing import Mapping

from llmft.errors import LlmftError


class LaunchEnvError(LlmftError, ValueError):
    """An environment variable holds something llmft cannot interpret."""


@dataclass(frozen=True)
class World:
    nnodes: int
    procs_per_node: int
    source: str = "local"  # which variables decided it: torchrun, slurm, cuda, local

    @property
    def world_size(self) -> int:
        return self.nnodes * self.procs_per_node

    def describe(self) -> str:
        return (
            f"world size {self.world_size} ({self.nnodes} nodes x {self.procs_per_node} processes, from {self.source})"
        )


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise LaunchEnvError(f"{name}={value!r} is not a positive integer")
    return int(value)


def parse_gpu_count(spec: str) -> int:
    """GPUs in a Slurm GPU spec: '2', 'a100:2', 'gpu:a100:2', 'a100:2,l4:1' (summed), '(null)' -> 0."""
    spec = spec.strip()
    if not spec or spec in {"(null)", "N/A"}:
        return 0
    total = 0
    for part in spec.split(","):
        last = part.strip().split(":")[-1]
        last = last.split("(")[0]  # 'gpu:2(IDX:0-1)' as in SLURM_JOB_GPUS-like output
        if not last.isdigit():
            # 'gpu:a100' alone means one GPU of that type
            if re.fullmatch(r"[A-Za-z0-9_.-]+", last):
                total += 1
                continue
            raise LaunchEnvError(f"cannot read a GPU count from {spec!r}")
        total += int(last)
    return total


def slurm_gpus_on_node(env: Mapping[str, str]) -> int | None:
    """GPUs Slurm gave this node, from the most specific variable that is set."""
    if env.get("SLURM_GPUS_ON_NODE", "").strip():
        return _int(env, "SLURM_GPUS_ON_NODE")
    for name in ("SLURM_GPUS_PER_NODE", "SLURM_JOB_GPUS_PER_NODE"):
        if env.get(name, "").strip():
            return parse_gpu_count(env[name])
    if env.get("SLURM_GPUS", "").strip():  # --gpus=N over the whole job
        nnodes = _int(env, "SLURM_NNODES") or _int(env, "SLURM_JOB_NUM_NODES") or 1
        return max(1, parse_gpu_count(env["SLURM_GPUS"]) // nnodes)
    return None


def discover_world(env: Mapping[str, str] | None = None, cuda_device_count: int | None = None) -> World:
    """The world a run will have: torchrun's variables win (we are inside it), then Slurm's, then local CUDA.

    On a machine without GPUs (CPU runs, tests) a Slurm node runs one process.
    """
    env = os.environ if env is None else env
    world_size = _int(env, "WORLD_SIZE")
    if world_size is not None:
        local = _int(env, "LOCAL_WORLD_SIZE") or world_size
        if world_size % local:
            raise LaunchEnvError(f"WORLD_SIZE={world_size} is not a multiple of LOCAL_WORLD_SIZE={local}")
        return World(world_size // local, local, "torchrun")

    # The job's node count first: inside a one-node step (e.g. `llmft plan` run in a container by srun)
    # SLURM_NNODES is the step's, SLURM_JOB_NUM_NODES still the job's.
    nnodes = _int(env, "SLURM_JOB_NUM_NODES") or _int(env, "SLURM_NNODES")
    if nnodes is not None:
        gpus = slurm_gpus_on_node(env)
        if gpus:
            return World(nnodes, gpus, "slurm")
        ntasks = _int(env, "SLURM_NTASKS")
        if ntasks and ntasks > nnodes and ntasks % nnodes == 0:  # one task per process launch style
            return World(nnodes, ntasks // nnodes, "slurm")
        return World(nnodes, 1, "slurm")

    if cuda_device_count is None:
        cuda_device_count = _cuda_device_count()
    if cuda_device_count:
        return World(1, cuda_device_count, "cuda")
    return World(1, 1, "local")


@dataclass(frozen=True)
class CpuSplit:
    """How a node's CPUs are shared by the training processes on it (one decision: `cpu_split`)."""

    cpus_per_node: int
    procs_per_node: int
    threads_per_process: int  # OMP_NUM_THREADS (torch CPU ops, DeepSpeed's CPU Adam with offload)
    dataloader_workers: int  # --dataloader_num_workers per process
    dataset_num_proc: int  # --dataset_num_proc: tokenisation runs in one process per node while the others wait
    source: str = "local"

    def warning(self) -> str | None:
        if self.cpus_per_node < self.procs_per_node:
            return (
                f"only {self.cpus_per_node} CPU(s) per node for {self.procs_per_node} processes: they will share CPUs; "
                f"request more (#SBATCH --cpus-per-gpu=4 or more)"
            )
        return None

    def describe(self) -> str:
        return (
            f"CPUs {self.cpus_per_node} per node (from {self.source}): {self.threads_per_process} per process "
            f"(OMP_NUM_THREADS={self.threads_per_process}), {self.dataloader_workers} dataloader workers per process, "
            f"{self.dataset_num_proc} tokenisation processes"
        )


def slurm_cpus_per_node(env: Mapping[str, str]) -> int | None:
    """CPUs the job has on each node: SLURM_JOB_CPUS_PER_NODE ('16(x2)', '16,8'; the smallest node counts,
    since every node runs the same number of processes), else SLURM_CPUS_ON_NODE."""
    spec = env.get("SLURM_JOB_CPUS_PER_NODE", "").strip()
    if spec:
        counts = []
        for part in spec.split(","):
            m = re.fullmatch(r"(\d+)(?:\(x\d+\))?", part.strip())
            if not m:
                raise LaunchEnvError(f"cannot read a CPU count from SLURM_JOB_CPUS_PER_NODE={spec!r}")
            counts.append(int(m.group(1)))
        return min(counts)
    return _int(env, "SLURM_CPUS_ON_NODE")


def cpu_split(cpus_per_node: int, procs_per_node: int, source: str = "local") -> CpuSplit:
    """Share a node's CPUs between its training processes so none is starved and none oversubscribes.

    Each process gets an equal share for its threads; up to 2 dataloader workers where the share leaves room
    for them beside the process itself (the data is tokenised before training, so workers only collate);
    tokenisation uses every CPU of the node, since the other processes wait for it.
    """
    per_process = max(1, cpus_per_node // max(1, procs_per_node))
    workers = min(2, per_process - 2) if per_process >= 3 else 0
    return CpuSplit(cpus_per_node, procs_per_node, per_process, workers, max(1, cpus_per_node), source)


def discover_cpus(env: Mapping[str, str] | None = None) -> tuple[int, str]:
    """CPUs per node for this job: Slurm's allocation, PBS's (NCPUS), else the CPUs this process may run on."""
    env = os.environ if env is None else env
    cpus = slurm_cpus_per_node(env)
    if cpus:
        return cpus, "slurm"
    if env.get("PBS_JOBID") and _int(env, "NCPUS"):  # PBS: the ncpus of the job's chunk on this node
        return _int(env, "NCPUS"), "pbs"
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1), "affinity"


def launch_problem(
    env: Mapping[str, str], cuda_device_count: int, argv: list[str], module: str = "llmft.train"
) -> str | None:
    """None when this process may train as it was started; else why not, with the exact command to run instead.

    `llmft train` started directly (no torchrun) is one process. On a machine with several GPUs, or inside
    a Slurm allocation of several GPUs or nodes, the plan would count them all while one process trains,
    and Hugging Face's batch checks fail after the model has loaded. llmft stops before loading anything and
    prints the torchrun command rather than launching it: torchrun's agent (not a training process) then owns
    the workers, their signals and restarts, the command is visible in the log, and a Slurm job keeps using
    slurm/run_llm.slurm, which starts one torchrun per node.
    """
    world = discover_world(env, cuda_device_count)  # also checks the launcher's variables are numbers
    if world.source == "torchrun" or world.world_size <= 1:
        return None  # torchrun (or another launcher setting WORLD_SIZE) has set up the world, or there is one process
    command = " ".join(
        shlex.quote(a) for a in ["torchrun", "--nproc_per_node", str(world.procs_per_node), "-m", module, *argv]
    )
    if world.source == "slurm":
        if world.nnodes > 1:
            return (
                f"this Slurm job has {world.nnodes} nodes x {world.procs_per_node} processes, but llmft train was started "
                f"without torchrun and would train as one process: submit slurm/run_llm.slurm, which starts one torchrun per node"
            )
        return (
            f"this Slurm job has {world.procs_per_node} GPUs on its node, but llmft train was started without torchrun and "
            f"would train as one process: run {command}"
        )
    return (
        f"this machine has {world.procs_per_node} GPUs, but llmft train was started without torchrun and would train "
        f"as one process: run {command}   (or CUDA_VISIBLE_DEVICES=0 for one GPU)"
    )


def _cuda_device_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # torch missing or broken CUDA: a CPU world
        return 0


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm hostlist ('n[1-3,7]', 'gpu-[01-02],login') as `scontrol show hostnames` does."""
    hosts: list[str] = []
    for item in _split_top_level(hostlist.strip()):
        hosts.extend(_expand_one(item))
    return hosts


def _split_top_level(s: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise LaunchEnvError(f"unbalanced ']' in hostlist {s!r}")
        elif ch == "," and depth == 0:
            items.append(s[start:i])
            start = i + 1
    if depth:
        raise LaunchEnvError(f"unbalanced '[' in hostlist {s!r}")
    items.append(s[start:])
    return [i for i in items if i]


def _expand_one(item: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", item)
    if not m:
        return [item]
    prefix, suffix = item[: m.start()], item[m.end() :]
    out = []
    for rng in m.group(1).split(","):
        if "-" in rng:
            lo, hi = rng.split("-", 1)
            if not (lo.isdigit() and hi.isdigit()) or int(lo) > int(hi):
                raise LaunchEnvError(f"bad range {rng!r} in hostlist {item!r}")
            width = len(lo)
            numbers = [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
        elif rng.isdigit():
            numbers = [rng]
        else:
            raise LaunchEnvError(f"bad entry {rng!r} in hostlist {item!r}")
        for n in numbers:
            out.extend(_expand_one(prefix + n + suffix))
    return out


def rank0(env: Mapping[str, str] | None = None) -> bool:
    """True in the process that should print (global rank 0, or not distributed)."""
    env = os.environ if env is None else env
    return env.get("RANK", "0") == "0"


def log(msg: str) -> None:
    """A progress line from rank 0 only: `llmft: MSG` (the prefix other tools read)."""
    if rank0():
        print(f"llmft: {msg}", flush=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

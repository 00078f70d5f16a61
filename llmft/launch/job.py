"""What a job does on any scheduler: its run directory's name and state, the `llmft plan` and `llmft train`
arguments its knobs make, the plan's launch line, its container's mounts, its network (NCCL_PROFILE) and its data
preparation (PREPARE).

llmft.launch.slurm and llmft.launch.pbs are the two schedulers' jobs over this module; what differs between them
(reading the allocation, starting one launcher per node, stopping and continuing) stays in each.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from llmft.errors import LlmftError
from llmft.launch import sweep
from llmft.launch.knobs import Knobs
from llmft.planning import stop_request
from llmft.planning.methods import run_key_name


class JobError(LlmftError, RuntimeError):
    """The job cannot go on; said in one line after the script's name, exit 2."""


def run_key(k: Knobs) -> str:
    """The key of the knobs that define a run (the default run directory's suffix), the one the Slurm job's bash
    used to compute, byte for byte: an experiment keeps its directory, on either scheduler."""
    fields = [k[n] for n in ("MODEL", "DATASET", "DATA_PERCENTAGE", "ZERO_STAGE", "DS_CONFIG", "GLOBAL_BATCH")]
    fields += [k["LORA"], k["EXTRA_ARGS"]]
    if k["MIXTURE"]:
        fields.append(f"MIXTURE={k['MIXTURE']}")
    if k["SWEEP"]:  # joins the key only when given, so a run without one keeps its directory
        fields.append(f"SWEEP={k['SWEEP']}")
    if k["SEQUENCE_PARALLEL"] != "1":
        fields.append(f"SEQUENCE_PARALLEL={k['SEQUENCE_PARALLEL']}")
    method = run_key_name(k.values.get("METHOD"))  # "" for sft: an SFT run keeps its directory
    if method:
        fields.append(f"METHOD={method}")
    digest = hashlib.sha256(("\n".join(fields) + "\n").encode()).hexdigest()[:8]
    return f"{method}-{digest}" if method else digest


def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def port_taken(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def rendezvous_port(start: int, taken: Callable[[int], bool]) -> int:
    """The c10d rendezvous port: in 20000-29999 from `start` (each scheduler's number for the job, so that jobs sharing
    a first node do not collide), moving on past ports something there already listens on (`taken(port)`)."""
    for i in range(100):
        port = 20000 + (start + i) % 10000
        if not taken(port):
            return port
    raise JobError(f"no free rendezvous port in 20000-29999 after 100 tries from {20000 + start % 10000}")


def choose_python(k: Knobs, env: Mapping[str, str], fallback: str) -> str:
    """The Python llmft runs in: the container's (llmft.launch.job.container_python), VENV's, the virtual environment the job
    was submitted from (PBS passes it as PBS_O_VIRTUAL_ENV under `qsub -V`), else `fallback`."""
    if k["CONTAINER_IMAGE"]:
        return container_python(k)
    if k["VENV"]:
        return str(Path(k["VENV"]).absolute() / "bin" / "python")
    venv = env.get("VIRTUAL_ENV") or env.get("PBS_O_VIRTUAL_ENV")
    if venv and os.access(Path(venv, "bin", "python"), os.X_OK):
        return str(Path(venv) / "bin" / "python")
    return fallback


# enroot mounts GPUs only where its hook 98-nvidia.sh finds NVIDIA_VISIBLE_DEVICES (the job's environment first, else
# the image's), with the driver libraries NVIDIA_DRIVER_CAPABILITIES names (the hook's default is utility alone, no CUDA).
CONTAINER_GPU_VARIABLES = ("NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES")


def container_gpu_variables(env: Mapping[str, str], devices: str) -> dict[str, str]:
    """What a GPU job's container step needs for enroot to mount its GPUs, whatever the image sets: `devices` (PBS: this
    node's GPUs of the job; Slurm: all, since pyxis passes Slurm's CUDA_VISIBLE_DEVICES in and the job's device cgroup
    bounds what opens) and compute,utility (CUDA and nvidia-smi); a value the site or user set wins."""
    return {
        "NVIDIA_VISIBLE_DEVICES": env.get("NVIDIA_VISIBLE_DEVICES") or devices,
        "NVIDIA_DRIVER_CAPABILITIES": env.get("NVIDIA_DRIVER_CAPABILITIES") or "compute,utility",
    }


def container_mounts(k: Knobs, paths: Sequence[Path]) -> list[str]:
    """SRC:DST mounts at the same paths: CONTAINER_MOUNTS first, then each path the run reads or writes that none of
    them covers (the submit dir, CHECKPOINT_DIR, HF_HOME, LLMFT_CACHE, a local MODEL, DATASET or MIXTURE)."""
    mounts = list(k.mounts)
    paths = [p for p in paths if not any(q != p and q in p.parents for q in paths)]  # a parent mount covers it
    for path in paths:
        covered = False
        for m in mounts:
            dst = m.split(":")[1] if ":" in m else m
            if str(path) == dst or str(path).startswith(dst.rstrip("/") + "/"):
                covered = True
                break
        if not covered:
            mounts.append(f"{path}:{path}")
    return mounts


def container_python(k: Knobs) -> str:
    """The Python llmft runs inside a container: the image's own `python`, or with VENV a virtual environment built by
    the image's interpreter (the same Python at the same path, e.g. Debian 12's /usr/bin/python3.11), mounted at its
    real path (run_paths) and run there: its bin/python is a link to that interpreter, which inside the container is
    the image's, with the venv's packages. The path is resolved: a venv reached through a link is mounted where the link
    points."""
    return str(Path(k["VENV"]).resolve() / "bin" / "python") if k["VENV"] else "python"


# The PATH a Debian or Ubuntu image sets (their /etc/environment's), after a mounted VENV's bin (container_path)
IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def container_path(k: Knobs, outside: str = IMAGE_PATH) -> str | None:
    """PATH inside the container with VENV (container_python): the venv's bin first, as activating it does, so the
    tools it installs are found there (DeepSpeed runs the venv's `ninja` to load a JIT-built op, even one already
    built); `outside` after it. None without VENV: the image's own PATH."""
    return f"{Path(k['VENV']).resolve() / 'bin'}:{outside}" if k["VENV"] else None


def run_paths(k: Knobs, submit_dir: Path, run_dir: Path, node_env: Mapping[str, str]) -> list[Path]:
    paths = [submit_dir, run_dir, Path(node_env["HF_HOME"]), Path(node_env["LLMFT_CACHE"])]
    if k["CONTAINER_IMAGE"] and k["VENV"]:  # container_python runs VENV's python inside the container
        paths.append(Path(k["VENV"]).resolve())
    out = export_directory(k, submit_dir)
    if out is not None and out.parent.is_dir():  # EXPORT's parent, where the export job step writes
        paths.append(out.parent.resolve())
    for value in (k["MODEL"], k["DATASET"], k["MIXTURE"]):
        path = (submit_dir / value) if value else None
        if path is not None and path.is_dir():
            paths.append(path.resolve())
        elif path is not None and path.is_file():
            paths.append(path.resolve().parent)
    return paths


def export_directory(k: Knobs, submit_dir: Path) -> Path | None:
    """EXPORT as an absolute path (a relative one is under the submit directory); None when unset."""
    if not k["EXPORT"]:
        return None
    path = Path(k["EXPORT"])
    return path if path.is_absolute() else submit_dir / path


def export_command(k: Knobs, python: str, run_dir: Path, submit_dir: Path) -> list[str] | None:
    """`llmft export RUN --out EXPORT` (its checks included), run once the training has finished; None without EXPORT."""
    out = export_directory(k, submit_dir)
    return None if out is None else [python, "-m", "llmft.export", str(run_dir), "--out", str(out)]


def export_after_training(
    command: list[str] | None,
    prefix: Sequence[str],
    say: Callable[[str], None],
    env: Mapping[str, str] | None = None,
) -> int:
    """EXPORT: the finished run's final checkpoint exported (llmft export, its checks included) as one step where the
    job runs llmft's own steps (`prefix`: srun or the container), with the job's environment; the job's exit code is
    the export's."""
    if command is None:
        return 0
    say(f"exporting the final checkpoint: llmft export {command[-3]} --out {command[-1]}")
    rc = subprocess.run([*prefix, *command], env=None if env is None else dict(env)).returncode
    say(f"exported to {command[-1]}" if rc == 0 else f"error: llmft export exited {rc}; the run itself is complete")
    return rc


def newest_complete_step(run_dir: Path) -> int:
    steps = [
        int(d.name.split("-")[1])
        for d in run_dir.glob("checkpoint-*")
        if d.name.split("-")[1].isdigit() and (d / "llmft_complete.json").is_file()
    ]
    return max(steps, default=0)


def train_arguments(k: Knobs, run_dir: Path, report_to: str) -> list[str]:
    data = (
        ["--dataset_mixture", k["MIXTURE"]]
        if k["MIXTURE"]
        else ["--dataset_name", k["DATASET"], "--data_percentage", k["DATA_PERCENTAGE"]]
    )
    args = ["--model_name_or_path", k["MODEL"], *data, "--output_dir", str(run_dir), "--num_train_epochs", k["EPOCHS"]]
    args += ["--global_batch_size", k["GLOBAL_BATCH"], "--per_device_train_batch_size", k["MICRO_BATCH"]]
    args += ["--report_to", report_to, "--disable_tqdm", "true"]
    if k["DS_CONFIG"]:
        args += ["--deepspeed", k["DS_CONFIG"]]
    elif k["ZERO_STAGE"] == "auto":
        args += ["--auto"]
    else:
        args += ["--zero_stage", k["ZERO_STAGE"]]
    if k.flag("OFFLOAD"):
        args += ["--offload"]
    if k["MAX_STEPS"]:
        args += ["--max_steps", k["MAX_STEPS"]]
    if k["SAVE_STEPS"]:
        args += ["--save_steps", k["SAVE_STEPS"]]
    if k.flag("LORA"):
        args += ["--use_peft"]
    if k["SEQUENCE_PARALLEL"] != "1":
        args += ["--sequence_parallel", k["SEQUENCE_PARALLEL"]]
    return args + method_arguments(k)


def method_arguments(k: Knobs) -> list[str]:
    """--method for METHOD=, to llmft train and to llmft plan's memory check alike; SFT's arguments stay as they were."""
    name = run_key_name(k["METHOD"])  # "" for sft
    return ["--method", name] if name else []


def plan_arguments(
    k: Knobs, run_dir: Path, nodes_file: Path, nnodes: int | None = None, gpus: int | None = None
) -> list[str]:
    """`llmft plan`'s flags for this job: its knobs, and its world where the scheduler does not tell llmft plan
    (PBS: `nnodes` nodes, one process per GPU, one on a node without GPUs; Slurm: llmft plan reads SLURM_*)."""
    args = ["--global_batch_size", k["GLOBAL_BATCH"], "--per_device_train_batch_size", k["MICRO_BATCH"]]
    args += ["--output_dir", str(run_dir), "--print_launch", "--nodes", str(nodes_file)]
    args += ["--numa_binding", k["NUMA_BINDING"]]
    if nnodes is not None:
        args += ["--nnodes", str(nnodes), "--nproc_per_node", str(max(1, gpus or 0))]
    memory = memory_arguments(k.extra_args)
    if k["DS_CONFIG"]:
        args += ["--deepspeed", k["DS_CONFIG"]]
    elif k["ZERO_STAGE"] == "auto":
        args += ["--model", k["MODEL"], "--auto", *memory]
    else:
        args += ["--zero_stage", k["ZERO_STAGE"]]
    if k["ZERO_STAGE"] != "auto":
        args += ["--model", k["MODEL"], "--check_memory", *memory]
    if k.flag("LORA"):
        args += ["--use_peft"]
    if k.flag("OFFLOAD"):
        args += ["--offload"]
    if k["SEQUENCE_PARALLEL"] != "1":
        args += ["--sequence_parallel", k["SEQUENCE_PARALLEL"]]
    return args + method_arguments(k)


# The llmft train flags in EXTRA_ARGS that change the memory a setting needs :
# flags with a value, switches, and switches that may take true/false after them.
MEMORY_VALUE_FLAGS = ("--max_length", "--gradient_checkpointing", "--lora_r", "--attn_implementation")
MEMORY_SWITCHES = ("--load_in_4bit", "--save_consolidated", "--async_save")
MEMORY_BOOL_FLAGS = ("--tiled_mlp", "--activation_offloading", "--use_liger_kernel", "--precompute_ref_log_probs")
BOOL_WORDS = ("true", "false", "yes", "no", "on", "off", "1", "0")


def memory_arguments(extra: Sequence[str]) -> list[str]:
    """The llmft train flags in EXTRA_ARGS that change the memory a setting needs, for the plan's memory check."""
    out = []
    for i, arg in enumerate(extra):
        if arg in MEMORY_VALUE_FLAGS:
            out += extra[i : i + 2]
        elif "=" in arg and arg.split("=")[0] in MEMORY_VALUE_FLAGS + MEMORY_BOOL_FLAGS:
            out.append(arg)
        elif arg in MEMORY_SWITCHES:
            out.append(arg)
        elif arg in MEMORY_BOOL_FLAGS:
            given_value = i + 1 < len(extra) and extra[i + 1].lower() in BOOL_WORDS
            out += extra[i : i + 2] if given_value else [arg]
    return out


def given(extra: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in extra)


def launch_line(plan_out: str) -> dict[str, str]:
    for line in plan_out.splitlines():
        if line.startswith("llmft launch: "):
            pairs = dict(kv.split("=", 1) for kv in line[len("llmft launch: ") :].split())
            needed = ("nnodes", "nproc_per_node", "cpus_per_node", "omp_num_threads", "dataloader_num_workers")
            needed += ("dataset_num_proc", "host_ram_gb", "numa_binding")
            missing = [n for n in needed if n not in pairs]
            if missing:
                raise JobError(
                    f"llmft plan printed no '{missing[0]}' on its 'llmft launch:' line; is the llmft it ran older than "
                    "this launcher?"
                )
            return pairs
    raise JobError("llmft plan printed no 'llmft launch:' line")


# NCCL network profiles (NCCL_* you set yourself win).
NCCL_PROFILES: dict[str, tuple[tuple[str, str], ...]] = {
    # G2 (L4) VMs: no GPUDirect-TCPX; NCCL over plain TCP sockets on gVNIC
    "gcp-g2": (
        ("NCCL_NET", "Socket"),
        ("NCCL_IB_DISABLE", "1"),
        ("NCCL_SOCKET_IFNAME", "^lo,docker"),
        ("NCCL_NSOCKS_PERTHREAD", "4"),
        ("NCCL_SOCKET_NTHREADS", "2"),
    ),
    # EFA through libfabric and the aws-ofi-nccl plugin (installed with the EFA driver / DLAMI); every node is checked
    # for the plugin before launch, and NCCL_NET names it so NCCL never falls back to sockets
    "aws-efa": (
        ("NCCL_NET_PLUGIN", "ofi"),
        ("NCCL_NET", "AWS Libfabric"),
        ("FI_PROVIDER", "efa"),
        ("FI_EFA_USE_DEVICE_RDMA", "1"),
        ("FI_EFA_FORK_SAFE", "1"),
        ("NCCL_SOCKET_IFNAME", "^lo,docker"),
    ),
    # a3-highgpu-8g (8 x H100): GPUDirect-TCPX over its 4 data NICs, with Google's NCCL plugin and the
    # receive-datapath-manager (RxDM) on each node (checked before launch); values from Google's A3 guide
    "gcp-tcpx": (
        ("NCCL_NET", "GPUDirectTCPX_v7"),
        ("NCCL_SOCKET_IFNAME", "eth0"),
        ("NCCL_GPUDIRECTTCPX_CTRL_DEV", "eth0"),
        ("NCCL_GPUDIRECTTCPX_SOCKET_IFNAME", "eth1,eth2,eth3,eth4"),
        ("NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX", "/run/tcpx"),
        ("NCCL_CROSS_NIC", "0"),
        ("NCCL_ALGO", "Ring"),
        ("NCCL_PROTO", "Simple"),
        ("NCCL_NSOCKS_PERTHREAD", "4"),
        ("NCCL_SOCKET_NTHREADS", "1"),
        ("NCCL_NET_GDR_LEVEL", "PIX"),
        ("NCCL_P2P_PXN_LEVEL", "0"),
        ("NCCL_DYNAMIC_CHUNK_SIZE", "524288"),
        ("NCCL_P2P_NET_CHUNKSIZE", "524288"),
        ("NCCL_P2P_PCI_CHUNKSIZE", "524288"),
        ("NCCL_P2P_NVL_CHUNKSIZE", "1048576"),
        ("NCCL_BUFFSIZE", "4194304"),
        ("NCCL_GPUDIRECTTCPX_PROGRAM_FLOW_STEERING_WAIT_MICROS", "500000"),
    ),
    # InfiniBand (Mellanox/NVIDIA HCAs), GPUDirect RDMA where the topology allows
    "ib": (
        ("NCCL_IB_DISABLE", "0"),
        ("NCCL_IB_HCA", "mlx5"),
        ("NCCL_NET_GDR_LEVEL", "PHB"),
        ("NCCL_SOCKET_IFNAME", "^lo,docker"),
    ),
}


def network_variables(profile: str, run_dir: Path, job_id: str, existing: Mapping[str, str]) -> list[tuple[str, str]]:
    """Every rank's network variables: the NCCL profile's, then NCCL's flight recorder (torch reads these): each rank
    keeps its last 2000 collectives and, when one times out (llmft.planning.collective_timeout sizes it), dumps them to
    CHECKPOINT_DIR/nccl_trace/<job>_rank_<N> for `python -m torch.distributed.flight_recorder.fr_trace`. A variable
    already set in `existing` (yours) keeps its value."""
    pairs = NCCL_PROFILES.get(profile, ())
    pairs += (
        ("TORCH_FR_BUFFER_SIZE", "2000"),
        ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1"),
        ("TORCH_FR_DUMP_TEMP_FILE", f"{run_dir}/nccl_trace/{job_id}_rank_"),
    )
    return [(name, existing.get(name) or value) for name, value in pairs]


def has_efa(sysfs: str) -> bool:
    """An Elastic Fabric Adapter on this node: an RDMA device bound to the efa driver (LLMFT_SYSFS_ROOT: tests)."""
    root = Path(sysfs) / "class" / "infiniband"
    return any(Path(os.path.realpath(d / "device" / "driver")).name == "efa" for d in sorted(root.glob("*")))


def fabric_check(profile: str, env: Mapping[str, str]) -> None:
    """NCCL_PROFILE=aws-efa on a node without EFA, refused on the job's first node before anything else runs."""
    sysfs = env.get("LLMFT_SYSFS_ROOT") or "/sys"
    if profile == "aws-efa" and not has_efa(sysfs):
        raise JobError(
            f"NCCL_PROFILE=aws-efa, but node {socket.gethostname().split('.')[0]} has no EFA device (no RDMA device "
            f"with the efa driver in {sysfs}/class/infiniband); only some instance types have EFA (p4d, p5, ...; not "
            "g6): leave NCCL_PROFILE empty there"
        )


def fabric_probe(profile: str) -> list[str]:
    """The allocation probe's arguments that check every node has the profile's NCCL plugin (llmft plan refuses a
    node without it, naming it)."""
    return ["--fabric", profile] if profile in ("aws-efa", "gcp-tcpx") else []


def prepare_data(
    runner: Sequence[str], train: Sequence[str], say: Callable[[str], None], env: Mapping[str, str] | None = None
) -> bool:
    """PREPARE=1: the data tokenised once (llmft prepare with the training's flags, into LLMFT_CACHE) before the GPUs
    start. `runner` is the command that starts llmft's Python on this node (in the container where there is one)."""
    cache = (env or os.environ).get("LLMFT_CACHE", "")
    say(f"preparing the data (llmft prepare, cache {cache})")
    rc = subprocess.run([*runner, "-m", "llmft.prepare", *train], env=None if env is None else dict(env)).returncode
    if rc != 0:
        say(f"not launching: llmft prepare failed (exit {rc})")
    return rc == 0


class Stop:
    """A stop signal to the job's launcher (Slurm: USR1 before the time limit, TERM from scancel, a requeue or a
    preemption; PBS: TERM at the walltime, from qdel or qrerun, and USR1): the stop file makes every rank finish its
    step and write a checkpoint, and the signal is kept for what follows (USR1, the job's own, wins over TERM)."""

    def __init__(self, stop_file: Path, script: str):
        self.stop_file, self.script, self.signal = stop_file, script, ""

    def __call__(self, signum, _frame) -> None:
        name = signal.Signals(signum).name[3:]
        if not self.signal or name == "USR1":
            self.signal = name
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        print(
            f"{self.script}: got SIG{name} at {now}: asking every rank to finish its step and write a checkpoint",
            flush=True,
        )
        self.stop_file.touch()


@dataclass(frozen=True)
class Ending:
    """How a job's training ended, from what the ranks left and the signals the launcher got, the same on every
    scheduler; what follows each (requeue, continuation, nothing) is the scheduler's (its after_training).

    kind: done (llmft_done.json), term (a SIGTERM and no USR1: the scheduler, or a user, is acting), deadline
    (llmft's own final save before the time limit: the requeue file), usr1, llmft-stop (a request `llmft stop` wrote,
    its --continue in `go_on`), unfinished (every rank exited 0 but nothing says the training finished), failed."""

    kind: str
    rc: int
    step: int  # the newest complete checkpoint
    go_on: bool = False


def how_it_ended(run_dir: Path, rc: int, stop: Stop, requeue_file: Path) -> Ending:
    """The attempt's Ending; the stop and requeue files are read and removed (a rerun starts without them)."""
    asked = stop_request.read_request(stop.stop_file)  # llmft stop's request, before the file goes
    stop.stop_file.unlink(missing_ok=True)
    deadline = requeue_file.is_file()
    requeue_file.unlink(missing_ok=True)
    step = newest_complete_step(run_dir)
    if (run_dir / "llmft_done.json").is_file():
        return Ending("done", rc, step)
    if stop.signal == "TERM":
        return Ending("term", rc, step)
    if deadline:
        return Ending("deadline", rc, step)
    if stop.signal == "USR1":
        return Ending("usr1", rc, step)
    if asked is not None and asked.by == stop_request.BY and rc == 0:
        return Ending("llmft-stop", rc, step, go_on=asked.go_on)
    return Ending("unfinished" if rc == 0 else "failed", rc, step)


def cache_variables(env: Mapping[str, str], submit_dir: Path, node_cache: Path) -> dict[str, str]:
    """Where a job's caches live; yours win. Downloads (HF_HOME) and prepared data (LLMFT_CACHE: every run submitted
    from the same directory reuses it, so sweeps and reruns tokenise nothing again) on shared storage; DeepSpeed's
    JIT-built ops and Triton's kernels under `node_cache`, node-local, since builds would race on a shared /home."""
    return {
        "HF_HOME": env.get("HF_HOME") or str(Path(env.get("HOME") or submit_dir) / ".cache" / "huggingface"),
        "LLMFT_CACHE": env.get("LLMFT_CACHE") or str(submit_dir / ".llmft-cache"),
        "LLMFT_EXTENSIONS_ROOT": env.get("LLMFT_EXTENSIONS_ROOT") or str(node_cache / "torch_extensions"),
        "TRITON_CACHE_DIR": env.get("TRITON_CACHE_DIR") or str(node_cache / "triton"),
    }


def knobs_line(k: Knobs, run_dir: Path) -> str:
    """The knobs that define the run, said at its start by either scheduler's job."""
    data = f"DATA_PERCENTAGE={k['DATA_PERCENTAGE']} MODEL={k['MODEL']} DATASET={k['DATASET']}"
    if k["MIXTURE"]:
        data = f"MODEL={k['MODEL']} MIXTURE={k['MIXTURE']} (all of it: no DATASET, no DATA_PERCENTAGE)"
    sp = f" SEQUENCE_PARALLEL={k['SEQUENCE_PARALLEL']}" if k["SEQUENCE_PARALLEL"] != "1" else ""
    return (
        f"knobs EPOCHS={k['EPOCHS']} CHECKPOINT_DIR={run_dir} {data} ZERO_STAGE={k['ZERO_STAGE'] or '<DS_CONFIG>'} "
        f"DS_CONFIG={k['DS_CONFIG'] or '<none>'} OFFLOAD={k['OFFLOAD']} GLOBAL_BATCH={k['GLOBAL_BATCH']} "
        f"MICRO_BATCH={k['MICRO_BATCH']} MAX_STEPS={k['MAX_STEPS'] or '<none>'} "
        f"SAVE_STEPS={k['SAVE_STEPS'] or '<default>'} SAVE_TOTAL_LIMIT={k['SAVE_TOTAL_LIMIT']} LORA={k['LORA']} "
        f"NCCL_PROFILE={k['NCCL_PROFILE'] or '<none>'} CONTAINER_IMAGE={k['CONTAINER_IMAGE'] or '<none>'}{sp}"
    )


def run_directory(
    k: Knobs,
    submit_dir: Path,
    job_name: str,
    job_id: str,
    *,
    this_variant: Callable[[list[sweep.Variant]], sweep.Variant],
    live: Callable[[str], str],
    rename: str,
    say: Callable[[str], None],
) -> tuple[Path, sweep.Variant | None]:
    """CHECKPOINT_DIR (relative to the submit directory), else runs/<job name>-<run key> there; with SWEEP, the
    variant this array element trains (`this_variant`, from the scheduler's array index) in a directory of its own
    under it, its flags joining EXTRA_ARGS; claimed for this job (`live` asks the scheduler whether an owner is still
    running)."""
    if k["CHECKPOINT_DIR"]:
        run_dir = Path(k["CHECKPOINT_DIR"])
        run_dir = run_dir if run_dir.is_absolute() else submit_dir / run_dir
    else:
        run_dir = submit_dir / "runs" / f"{safe_name(job_name or 'llmft')}-{run_key(k)}"
    variant = None
    if k["SWEEP"]:
        variants = sweep.parse(k["SWEEP"], k["METHOD"])
        variant = this_variant(variants)
        try:
            sweep.record(run_dir, k["SWEEP"], variants)
        except OSError as e:
            raise JobError(f"could not write {run_dir}/{sweep.SWEEP_FILE}: {e}") from None
        say(f"sweep variant {variant.index} of {len(variants)}: {variant.describe()} in {run_dir}")
        run_dir = run_dir / variant.name
        k.extra_args += variant.flags()  # after EXTRA_ARGS: the variant's value wins
        k.values["LLMFT_SWEEP_VARIANT"] = variant.name
    run_dir.mkdir(parents=True, exist_ok=True)
    run_dir = run_dir.resolve()
    if not k.flag("DRY_RUN"):
        claim_run_dir(run_dir, job_id, live, rename)
    return run_dir, variant


def claim_run_dir(run_dir: Path, job_id: str, live: Callable[[str], str], rename: str) -> None:
    """Two live jobs never write one directory: the job that took it is recorded in .llmft-job (created exclusively,
    so of two jobs starting together one wins); a job still in the queue (`live(owner)` says its state; "" when it has
    ended) keeps it. A requeued or rerun job finds its own id there."""
    owner_file = run_dir / ".llmft-job"
    try:
        with open(owner_file, "x") as f:
            f.write(job_id + "\n")
        return
    except FileExistsError:
        owner = owner_file.read_text().strip() if owner_file.is_file() else ""
    if owner and owner != job_id:
        state = live(owner)
        if state:
            raise JobError(
                f"CHECKPOINT_DIR={run_dir} is in use by job {owner} ({state}); wait for it to end, or give this job "
                f"another name ({rename}) or CHECKPOINT_DIR"
            )
    owner_file.write_text(job_id + "\n")  # ours already, or left by a job that has ended


# ---- the job's environment, as a value: every node's ranks run with it ------------------------------------------


def report_to(k: Knobs) -> str:
    """llmft train's --report_to: W&B where WANDB_PROJECT is set and W&B is not disabled."""
    return "wandb" if k["WANDB_PROJECT"] and k["WANDB_MODE"] != "disabled" else "none"


def job_environment(
    k: Knobs, env: Mapping[str, str], submit_dir: Path, files: Mapping[str, Path], node_cache: Path
) -> dict[str, str]:
    """The variables llmft sets for every node's ranks, on any scheduler (each scheduler's job adds its own and hands
    the whole to its nodes: srun passes its environment, pbsdsh an env file): the files the ranks read (the stop
    request, the requeue file llmft writes after its final save before the time limit, the job's end), the caches
    (cache_variables), VENV's bin first on PATH outside a container (inside, the container's PATH: container_path),
    the sweep variant the run trains, and W&B's project and mode."""
    out = {
        "LLMFT_STOP_FILE": str(files["stop"]),
        "LLMFT_REQUEUE_FILE": str(files["requeue"]),
        "LLMFT_JOB_END_FILE": str(files["job-end"]),
    }
    out.update(cache_variables(env, submit_dir, node_cache))
    if k["VENV"] and not k["CONTAINER_IMAGE"]:
        venv = str(Path(k["VENV"]).absolute())
        out["VIRTUAL_ENV"], out["PATH"] = venv, f"{venv}/bin:{env.get('PATH') or os.defpath}"
    if k.values.get("LLMFT_SWEEP_VARIANT"):
        out["LLMFT_SWEEP_VARIANT"] = k.values["LLMFT_SWEEP_VARIANT"]
    if k["WANDB_PROJECT"]:
        out["WANDB_PROJECT"] = k["WANDB_PROJECT"]
    if k["WANDB_MODE"]:
        out["WANDB_MODE"] = k["WANDB_MODE"]
    return out


def network_environment(
    profile: str, run_dir: Path, job_id: str, existing: Mapping[str, str], say: Callable[[str], None]
) -> dict[str, str]:
    """The NCCL profile's variables and the flight recorder's (network_variables), each said; yours win."""
    out = dict(network_variables(profile, run_dir, job_id, existing))
    for name, value in out.items():
        say(f"nccl {name}={value}")
    return out


def wandb_environment(
    runner: Sequence[str], run_dir: Path, env: Mapping[str, str], say: Callable[[str], None]
) -> dict[str, str]:
    """The W&B run's name, id (the same after a requeue or a continuation), group (one per sweep) and mode (offline
    where the node cannot reach W&B), from `llmft.tracking job-env` run by `runner` (the Python llmft runs in, in the
    container where there is one); said in one line. The values are data: kept as they are, never evaluated."""
    proc = subprocess.run(
        [*runner, "-m", "llmft.tracking", "job-env", "--output_dir", str(run_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(env),
    )
    if proc.returncode != 0:
        raise JobError(f"llmft.tracking failed: {proc.stderr.strip()[-300:] or proc.stdout.strip()[-300:]}")
    out = {}
    for line in proc.stdout.splitlines():
        key, sep, value = line.partition("=")
        if not sep or not re.fullmatch(r"WANDB_[A-Z_]+", key):
            raise JobError(f"unexpected line from llmft.tracking: {line}")
        out[key] = value
    said = {**env, **out}
    say(
        f"W&B run {said.get('WANDB_NAME', '')} (id {said.get('WANDB_RUN_ID', '')}, group "
        f"{said.get('WANDB_RUN_GROUP', '')}) in project {said.get('WANDB_PROJECT', '')}, mode "
        f"{said.get('WANDB_MODE') or 'online'}"
    )
    return out


# ---- what every node runs: llmft train's flags and the torchrun around it ----------------------------------------


def train_flags(k: Knobs, run_dir: Path, launch: Mapping[str, str], report: str) -> list[str]:
    """llmft train's flags: the knobs', the plan's CPU split unless EXTRA_ARGS sets the same flag (yours wins),
    SAVE_TOTAL_LIMIT, then EXTRA_ARGS (a sweep variant's flags last: run_directory put them there)."""
    train = train_arguments(k, run_dir, report)
    for flag in ("dataloader_num_workers", "dataset_num_proc"):
        if not given(k.extra_args, f"--{flag}"):
            train += [f"--{flag}", launch[flag]]
    if k["SAVE_TOTAL_LIMIT"] != "0" and not given(k.extra_args, "--save_total_limit"):
        train += ["--save_total_limit", k["SAVE_TOTAL_LIMIT"]]
    return train + k.extra_args


def torchrun_command(
    python: str, launch: Mapping[str, str], endpoint: str, job_id: str, train: Sequence[str], rdzv_conf: str = ""
) -> list[str]:
    """The torchrun every node runs: the plan's world (nodes, processes per node, NUMA binding), a c10d rendezvous at
    `endpoint` with the job's id, and `rdzv_conf` where the scheduler can say which node hosts it."""
    numa = ["--numa-binding", launch["numa_binding"]] if launch["numa_binding"] != "off" else []
    torchrun = [python, "-m", "torch.distributed.run", "--nnodes", launch["nnodes"]]
    torchrun += ["--nproc_per_node", launch["nproc_per_node"], *numa, "--rdzv_backend", "c10d"]
    if rdzv_conf:
        torchrun += ["--rdzv_conf", rdzv_conf]
    return [*torchrun, "--rdzv_endpoint", endpoint, "--rdzv_id", job_id, "-m", "llmft.train", *train]

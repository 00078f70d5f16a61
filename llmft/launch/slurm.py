"""llmft on Slurm: one torchrun per node (srun), DeepSpeed ZeRO inside, preemption-safe.

  sbatch -J sft slurm/run_llm.slurm --export=ALL,MODEL=Qwen/Qwen2.5-0.5B,DATASET=data.jsonl   # after the script,
                                                                  # sbatch hands --export=... to it
  sbatch -J sft --export=ALL,DATASET=data.jsonl slurm/run_llm.slurm   # before it, sbatch's own --export sets the environment
  sbatch slurm/run_llm.slurm DATASET=data.jsonl MODEL=/models/llama   # plain KEY=VALUE arguments work too
  DRY_RUN=1 bash slurm/run_llm.slurm DATASET=data.jsonl               # outside Slurm: check what can be checked here

Knobs (KEY=VALUE; arguments override the environment; any other key is an error). A value cannot hold a
comma inside --export=... (sbatch splits there): CONTAINER_MOUNTS takes ';' between mounts, and any value
can be given as a plain KEY=VALUE argument instead. EPOCHS and DATA_PERCENTAGE default to `llmft train`'s, and the
learning rate is llmft train's own (2e-5, TRL's; --learning_rate in EXTRA_ARGS). GLOBAL_BATCH and MICRO_BATCH are
this script's: a global batch kept on any number of nodes, split into micro-batches of 4 (llmft train alone: 8 per
process, the global batch following the processes). The job's first lines name every default it applied
("defaults applied: ...").
  EPOCHS=3                        training epochs (a positive number; llmft train's default)
  CHECKPOINT_DIR=runs/<job name>-<run key>
                                  output and checkpoint directory on storage every node shares; a rerun
                                  (or a requeue) with the same directory resumes from its newest complete checkpoint.
                                  Default: under the submit directory, named by the job (sbatch -J NAME) and a
                                  key of MODEL DATASET DATA_PERCENTAGE ZERO_STAGE DS_CONFIG GLOBAL_BATCH LORA
                                  EXTRA_ARGS (and MIXTURE when given), so a different experiment never resumes
                                  another's checkpoints
  DATA_PERCENTAGE=100             use this percentage of the dataset (0 < p <= 100; default: all of it)
  MODEL=Qwen/Qwen2.5-0.5B         model: hub id or a local model directory (a local one must exist, checked before
                                  anything runs; DRY_RUN=1 also reads its config)
  DATASET=trl-lib/Capybara        dataset: hub id or a local .jsonl/.json/.parquet/.csv file; a local path that does
                                  not exist stops the job on the batch host before any srun
  MIXTURE=                        a --dataset_mixture YAML file (several datasets at chosen weights) instead of
                                  DATASET: the whole mixture trains (each source's percentage: is in the file), so
                                  DATASET and DATA_PERCENTAGE are refused beside it, as is --dataset_mixture in EXTRA_ARGS
  ZERO_STAGE=2                    DeepSpeed ZeRO stage 0-3 (ignored when DS_CONFIG is set), or auto: llmft's
                                  memory planner picks stage, offload, micro-batch (up to MICRO_BATCH) and
                                  gradient checkpointing for the GPUs and RAM this job got (llmft train --auto)
  DS_CONFIG=                      your own DeepSpeed JSON instead of llmft's ZeRO templates
  OFFLOAD=0                       1: ZeRO CPU offload (stage 2 or 3)
  GLOBAL_BATCH=32                 global batch; kept on any number of nodes/GPUs by adjusting accumulation (a
                                  multiple of MICRO_BATCH x the job's processes; llmft train alone: MICRO_BATCH x processes)
  MICRO_BATCH=4                   micro-batch per GPU process (only splits GLOBAL_BATCH: memory, not the result)
  MAX_STEPS=                      stop after this many optimizer steps (overrides EPOCHS)
  SAVE_STEPS=                     checkpoint every N steps (empty: llmft train's default)
  SAVE_TOTAL_LIMIT=2              complete checkpoints kept (0: all); the oldest is deleted only once a newer one is
                                  complete. --save_total_limit in EXTRA_ARGS wins
  MAX_RESTARTS=3                  a failed attempt (a rank died, a node failed, a collective timed out) is requeued
                                  at most this many times, without the nodes there is evidence against (dead, a GPU
                                  or fabric failure), and only when it wrote a new complete checkpoint; an
                                  application error (out of memory, an exception) is not requeued (0: never)
  LORA=0                          1: train LoRA adapters (PEFT) instead of all weights
  METHOD=sft                      llmft train --method: sft | dpo | kto | reward (llmft.planning.methods); the plan's
                                  memory check counts the method's pairs and reference; a SWEEP may vary the
                                  method's own flags (METHOD=dpo SWEEP=beta=0.05,0.1,0.3); see docs/preference.md
  WANDB_PROJECT=                  set to log to Weights & Biases (else --report_to none); the run is named
                                  <job-name>-<job-id>, and a requeued job continues it
  WANDB_MODE=                     online | offline | disabled; empty: offline when the node cannot reach W&B
  PREPARE=0                       1: tokenise the data with `llmft prepare` on the batch host before srun
                                  (cached in LLMFT_CACHE, default <submit dir>/.llmft-cache; reused by every run)
  EXPORT=                         after the training finishes, `llmft export` its final checkpoint into this new or
                                  empty directory (relative to the submit dir), as a job step with the export's checks
  CONTAINER_IMAGE=                run inside this image with pyxis (srun --container-image ...)
                                  The container is named llmft-<job id> (pyxis --container-name), so each node
                                  creates it once per job and every srun of the job reuses it
  CONTAINER_MOUNTS=               more pyxis mounts SRC:DST[:FLAGS], separated by ';' (or ',' outside --export=...);
                                  always mounted at the same paths: the submit dir, CHECKPOINT_DIR, HF_HOME,
                                  LLMFT_CACHE, and MODEL and DATASET where they are local paths
  NCCL_PROFILE=                   gcp-g2 (plain TCP, no GPUDirect) | aws-efa (EFA through the aws-ofi-nccl
                                  plugin; refused on nodes without an EFA device, e.g. g6, or where the plugin or
                                  libfabric is not on the library path) | gcp-tcpx (a3-highgpu-8g's GPUDirect-TCPX;
                                  refused where its NCCL plugin or receive-datapath-manager is missing) |
                                  ib (InfiniBand); empty: NCCL's own defaults. NCCL_* variables you set yourself win.
                                  aws-efa and gcp-tcpx name their plugin in NCCL_NET: NCCL fails at start rather
                                  than falling back to TCP sockets
  SWEEP=                          train variants as a job array, each in CHECKPOINT_DIR/<variant> (llmft.launch.sweep):
                                  e.g. SWEEP=learning_rate=1e-5,3e-5,1e-4 (3 variants; several flags:
                                  'learning_rate=1e-5,3e-5 lora_r=8,16', every combination); submit with
                                  sbatch --array=1-N (N variants; any other array is refused); a value with commas
                                  goes after the script as SWEEP=..., not inside --export=...
  SEQUENCE_PARALLEL=1             Ulysses sequence parallelism (llmft train --sequence_parallel N): each sample's
                                  sequence split over N ranks; GLOBAL_BATCH counts the ranks / N data-parallel
                                  groups (ZERO_STAGE=auto plans with this N; see docs/long-context.md)
  NUMA_BINDING=auto               torchrun --numa-binding: auto binds each process to its GPU's NUMA node where every
                                  node has GPUs, several NUMA nodes and numactl, and the job's CPUs there cover each of
                                  its GPUs' NUMA nodes (not on a shared node that misses one); off | node | socket |
                                  exclusive | core-complex
  VENV=                           virtual environment to run in; default: the Python environment sbatch was run from
  EXTRA_ARGS=                     more `llmft train` flags, split on spaces (e.g. "--logging_steps 5 --seed 1")
  DRY_RUN=0                       1: print the plan and the launch command, run nothing. Outside Slurm it checks
                                  what it can without GPUs: the knobs, that local MODEL/DATASET paths exist, that
                                  GLOBAL_BATCH divides by MICRO_BATCH x the processes the script's #SBATCH lines ask for
                                  (or sbatch's --nodes=N --gpus-per-node=G, given to the dry run as arguments), and
                                  that a local MODEL's config reads (with VENV's, or the current, Python)

Resources: change the #SBATCH lines of slurm/run_llm.slurm (e.g. --gpus-per-node=4); nothing else needs editing:
`llmft plan` decides the world from Slurm's allocation (each node runs one torchrun with one process per
GPU Slurm gave it, 1 on a node without GPUs) and llmft keeps GLOBAL_BATCH by adjusting gradient accumulation.
CPUs: --cpus-per-gpu=4 fits every node of the blueprints (g2-standard-4 has 4 vCPUs per L4); raise it where
nodes have more (a2-highgpu, p4d, g6.12xlarge: 12 per GPU). The training step gets all of the job's CPUs on
each node (srun --cpus-per-task, which srun no longer inherits from sbatch since Slurm 22.05), and llmft
plan splits them: OMP_NUM_THREADS and dataloader workers per process, tokenisation processes per node.
OMP_NUM_THREADS you export, or --dataloader_num_workers / --dataset_num_proc in EXTRA_ARGS, win.
Memory: #SBATCH --mem=0 asks for each node's whole memory. To share nodes, give what `llmft plan --model M
--write DIR` prints (sbatch --mem=NG). Every node reports what the job may use there (its memory cgroup,
--mem/--mem-per-cpu/--mem-per-gpu, MemTotal) and llmft plans with the smallest; whenever MODEL's config can be
read, the plan checks that the run's setting fits before anything launches, and names the limit and the
sbatch flag when it does not. sbatch refuses --mem-per-cpu/--mem-per-gpu beside --mem: to use them, replace the
#SBATCH --mem line. GPUs spread unevenly over the nodes (sbatch --gpus=N) are refused: every node runs
one process per GPU, the same number on each.
Caches: downloads go to the shared HF_HOME (default ~/.cache/huggingface; one process per job downloads, the
others wait); build caches that nodes would race on over a shared /home are node-local:
DeepSpeed's JIT-built ops (one cache per environment) and TRITON_CACHE_DIR under ${TMPDIR:-/tmp}/llmft-$USER.
Variables you export yourself win.
Preemption and time limits: llmft reads the job's end from Slurm, times its own checkpoints and starts the last
one early enough to finish before the time limit (1.5 x the longest save + a step + 60 s), then this job requeues
itself and resumes. As a backstop Slurm signals the batch shell 120 s before the end (--signal=B:USR1@120): every
rank finishes its step, a complete checkpoint is written, and the job requeues itself.
On SIGTERM (scancel, scontrol requeue, preemption) the ranks checkpoint too, and Slurm decides what follows.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from llmft.errors import LlmftError
from llmft.launch import failure_blame, kill_chain, scheduler, sweep
from llmft.launch.job import (
    IMAGE_PATH,
    Ending,
    JobError,
    Stop,
    choose_python,
    container_gpu_variables,
    container_mounts,
    container_path,
    fabric_check,
    port_taken,
    rendezvous_port,
    run_paths,
)
from llmft.launch.knobs import (
    NAMES,
    Knobs,
    default_dataset_warning,
    defaults_line,
    model_is_local,
    resolve,
    unknown_knob_message,
)
from llmft.planning.world import expand_hostlist

ME = "run_llm.slurm"
HELP = __doc__


class SlurmJobError(JobError):
    """The Slurm job cannot go on; one line, exit 2."""


def say(text: str) -> None:
    print(f"{ME}: {text}", flush=True)


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# ---- the arguments: KEY=VALUE, --export=..., and sbatch's world for a dry run -----------------------------------


def known() -> str:
    return "known knobs: " + " ".join(NAMES)


def split_export(text: str) -> list[str]:
    """An --export=... list split at commas outside quotes, as sbatch splits it."""
    items, item, quote = [], "", ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
            item += ch
        elif ch in "'\"":
            quote = ch
            item += ch
        elif ch == ",":
            items.append(item)
            item = ""
        else:
            item += ch
    return [*items, item]


def not_a_name(item: str, source: str) -> None:
    """An --export=... item that is neither KEY=VALUE nor a variable name is the rest of a value cut at a comma."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", item):
        raise SlurmJobError(
            f"'{item}' in '{source}' is not KEY=VALUE: a value was cut at a comma, which separates items in "
            "--export=...; separate CONTAINER_MOUNTS with ';', or pass the value as a plain KEY=VALUE argument after "
            "the script"
        )


def knob_item(item: str, source: str, into: dict[str, str]) -> None:
    key, sep, value = item.partition("=")
    if not sep:
        if item in NAMES:
            return  # --export=ALL,NAME: the variable as it is
        not_a_name(item, source)
        raise SlurmJobError(unknown_knob_message(item, source))
    if key not in NAMES:
        raise SlurmJobError(unknown_knob_message(key, source))
    into[key] = value


def read_arguments(argv: Sequence[str], in_job: bool) -> tuple[dict[str, str], list[str], bool]:
    """The knobs given as arguments, sbatch's --nodes=N/--gpus-per-node=G given to a dry run, and whether --help was
    asked; each argument checked in order, the first bad one named."""
    knobs: dict[str, str] = {}
    world: list[str] = []
    for arg in argv:
        if arg.startswith(("--nodes=", "--gpus-per-node=")):
            if in_job:
                raise SlurmJobError(
                    f"'{arg}' after the script reaches the script, not Slurm: give sbatch its options before the "
                    f"script (sbatch {arg} slurm/run_llm.slurm ...)"
                )
            value = arg.split("=", 1)[1]
            if not (re.fullmatch(r"[1-9][0-9]*", value) or arg == "--gpus-per-node=0"):
                raise SlurmJobError(
                    f"'{arg}': a dry run checks the batch for one number of nodes and of GPUs per node; give "
                    f"{arg.split('=')[0]}=N"
                )
            world.append(arg)
        elif arg in ("-h", "--help"):
            return knobs, world, True
        elif arg.startswith("--export="):
            for item in split_export(arg[len("--export=") :]):
                if item not in ("ALL", "NONE", "NIL", ""):
                    knob_item(item, arg, knobs)
        elif re.match(r"[A-Za-z_].*=", arg, re.S):
            knob_item(arg, arg, knobs)
        else:
            raise SlurmJobError(
                f"cannot read argument '{arg}'; pass knobs as KEY=VALUE or --export=ALL,KEY=VALUE; {known()}"
            )
    return knobs, world, False


def bash_quoted(arg: str) -> str:
    """An argument as bash's printf %q writes it (the launch line is read by people and by the tests, as before)."""
    if arg == "":
        return "''"
    quoted = re.sub(r"([^A-Za-z0-9_./:=+@%~#-])", r"\\\1", arg)
    return "\\" + quoted if quoted[0] in "~#" else quoted


# ---- outside a job: what a dry run can check ----------------------------------------------------------------


def sweep_lines(k: Knobs) -> list[sweep.Variant]:
    variants = sweep.parse(k["SWEEP"], k["METHOD"])
    for v in variants:
        say(f"sweep variant {v.index}: {v.describe()} -> {v.name}")
    return variants


def dry_run_checks(k: Knobs, world: Sequence[str], script: str) -> None:
    """DRY_RUN=1 outside Slurm: the batch for the world the #SBATCH lines ask for (or sbatch's --nodes=N /
    --gpus-per-node=G given as arguments), the sweep, and a local MODEL's config (read by llmft plan)."""
    nodes, gpus, where = "", 1, "the #SBATCH lines"
    text = Path(script).read_text() if script and Path(script).is_file() else ""
    for line in text.splitlines():
        m = re.fullmatch(r"#SBATCH\s+--nodes=([0-9]+)\s*", line)
        nodes = m.group(1) if m else nodes
        m = re.fullmatch(r"#SBATCH\s+--gpus-per-node=([0-9]+)\s*", line)
        gpus = int(m.group(1)) if m else gpus
    for arg in world:
        if arg.startswith("--nodes="):
            nodes = arg.split("=", 1)[1]
        else:
            gpus = int(arg.split("=", 1)[1])
        where = "given"
    n = int(nodes or 1)
    shape = f"{where}: --nodes={n}, --gpus-per-node={gpus}"
    procs = n * (gpus if gpus > 0 else 1)
    ranks = f"{procs} processes"
    sp, micro, batch = int(k["SEQUENCE_PARALLEL"]), int(k["MICRO_BATCH"]), int(k["GLOBAL_BATCH"])
    if sp != 1:
        if procs % sp:
            raise SlurmJobError(
                f"SEQUENCE_PARALLEL={sp} does not divide the {procs} processes ({shape}); use a SEQUENCE_PARALLEL "
                f"that divides {procs}"
            )
        ranks = f"{procs // sp} data-parallel groups of SEQUENCE_PARALLEL={sp}"
        procs //= sp
    per_step = micro * procs
    if k["ZERO_STAGE"] == "auto":
        say(
            f"batch: not checked here (ZERO_STAGE=auto picks the micro-batch, up to MICRO_BATCH={micro}, on the nodes)"
        )
    elif batch % per_step:
        lower = batch // per_step * per_step
        hint = f"GLOBAL_BATCH={lower + per_step}" + (f" or {lower}" if lower > 0 else "")
        raise SlurmJobError(
            f"GLOBAL_BATCH={batch} is not a multiple of MICRO_BATCH={micro} x {ranks} ({shape}) = {per_step}; use "
            f"{hint}, or another MICRO_BATCH"
        )
    else:
        say(
            f"batch: GLOBAL_BATCH={batch} = MICRO_BATCH {micro} x {ranks} ({shape}) x accumulation {batch // per_step}"
        )
    if k["SWEEP"]:
        n_variants = len(sweep_lines(k))
        say(f"submit the sweep as an array of {n_variants}: sbatch --array=1-{n_variants} ... slurm/run_llm.slurm")
    model = k["MODEL"]
    if not model_is_local(model):
        say(f"model: {model} is a hub id, read on the nodes (not checked here)")
    elif k["CONTAINER_IMAGE"]:
        say(f"model: {model} not checked here (llmft runs inside CONTAINER_IMAGE={k['CONTAINER_IMAGE']})")
    else:
        python = choose_python(k, os.environ, shutil.which("python3") or shutil.which("python") or "")
        rc, out = 127, ""
        if python:
            try:
                proc = subprocess.run(
                    [python, "-m", "llmft.plan", "--model", model, "--check_model"],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
                rc, out = proc.returncode, proc.stdout
            except OSError as e:
                rc, out = 127, str(e)
        error, last = "", ""
        for line in out.splitlines():  # data, never evaluated
            if line.startswith("llmft plan: error: "):
                error = line[len("llmft plan: error: ") :]
            if rc == 0 and line.startswith("llmft plan: model: "):
                say(line[len("llmft plan: ") :])
            last = line or last
        if error:
            raise SlurmJobError(error)  # llmft read the config and names what is wrong with it
        if rc != 0:
            said = f"exit {rc}" + (f": {last}" if last else "")
            say(
                f"model: the config of {model} not read here ({python or 'python3'} -m llmft.plan: {said}); set "
                "VENV=/path/to/venv with llmft installed"
            )


def outside_slurm(k: Knobs, world: Sequence[str], script: str) -> int:
    if not k.flag("DRY_RUN"):
        if world:
            raise SlurmJobError(
                f"{world[0]} is sbatch's option, for DRY_RUN=1 outside a job (the world its batch check uses); submit "
                f"with: sbatch {' '.join(world)} slurm/run_llm.slurm ..."
            )
        raise SlurmJobError(
            "not inside a Slurm job (SLURM_JOB_ID is unset); submit with: sbatch slurm/run_llm.slurm "
            "--export=ALL,DATASET=your.jsonl"
        )
    say(defaults_line(k))
    warn_default_dataset(k)
    dry_run_checks(k, world, script)
    say(
        "knobs are valid; not inside a Slurm job, so nothing to plan or launch (submit with: sbatch slurm/run_llm.slurm ...)"
    )
    return 0


def warn_default_dataset(k: Knobs) -> None:
    raw = "" if "DATASET" in k.defaulted else k["DATASET"]
    warning = default_dataset_warning(k, raw, "llmft plan --dataset_name ... --write DIR prints a complete line")
    if warning:
        say(warning)


# ---- inside the job --------------------------------------------------------------------------------------------


def run(cmd: Sequence[str], timeout: float | None = None) -> subprocess.CompletedProcess | None:
    """A Slurm client's answer (None when it could not run or timed out)."""
    try:
        return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None


def host_checks(k: Knobs, env: Mapping[str, str]) -> None:
    """What the batch host checks before it touches the run directory."""
    if env.get("SLURM_EXPORT_ENV"):  # sbatch's own --export=... drops what follows a comma inside a value
        for item in split_export(env["SLURM_EXPORT_ENV"]):
            if item not in ("ALL", "NONE", "NIL", "") and "=" not in item:
                not_a_name(item, f"sbatch --export={env['SLURM_EXPORT_ENV']}")
    if k["CONTAINER_IMAGE"]:
        out = run(["srun", "--help"])
        if out is None or "--container-image" not in out.stdout + out.stderr:
            raise SlurmJobError(
                f"CONTAINER_IMAGE={k['CONTAINER_IMAGE']} needs the pyxis SPANK plugin, and this cluster's srun has no "
                "--container-image"
            )
    fabric_check(k["NCCL_PROFILE"], env)


def live_state(owner: str) -> str:
    """The state of the job that holds a run directory ("" when it has ended, or is not a Slurm job id)."""
    if not re.fullmatch(r"[0-9_]+", owner):
        return ""
    out = run(["squeue", "-h", "-j", owner, "-o", "%T"])
    return out.stdout.strip().replace("\n", " ") if out is not None and out.returncode == 0 else ""


def job_hosts(env: Mapping[str, str]) -> list[str]:
    nodelist = env.get("SLURM_JOB_NODELIST", "")
    out = run(["scontrol", "show", "hostnames", nodelist])
    if out is None or out.returncode != 0:
        text = "" if out is None else (out.stdout + out.stderr).strip()
        raise SlurmJobError(
            f"cannot list the job's nodes: 'scontrol show hostnames {nodelist or '<SLURM_JOB_NODELIST unset>'}' "
            f"failed: {text.splitlines()[-1] if text else ''}"
        )
    hosts = out.stdout.split()
    if not hosts:
        raise SlurmJobError(f"cannot list the job's nodes: 'scontrol show hostnames {nodelist}' printed nothing")
    return hosts


def rendezvous(first: str, job_id: str) -> tuple[str, int]:
    """The c10d rendezvous on the first host, at the address Slurm itself uses to reach it, on a port from the job id
    (20000-29999, so jobs sharing a node do not collide), past ports something there already listens on."""
    host = first
    out = run(["scontrol", "show", "node", first, "-o"])
    m = re.search(r"NodeAddr=(\S+)", out.stdout if out is not None else "")
    host = m.group(1) if m else host
    try:
        return host, rendezvous_port(int(job_id), lambda port: port_taken(host, port))
    except JobError as e:
        raise SlurmJobError(f"{e} on {host}") from None


def container_arguments(
    k: Knobs, submit_dir: Path, run_dir: Path, job_id: str, job_env: Mapping[str, str]
) -> tuple[list[str], dict[str, str]]:
    """pyxis's options: the image, a container named by the job (each node creates it once at the job's first srun,
    and every later srun reuses it), and every path the run reads or writes mounted at the same path; and what the
    job's environment (`job_env`, which pyxis hands to enroot) needs for it: the GPU variables enroot's hook reads,
    and VENV's PATH."""
    if not k["CONTAINER_IMAGE"]:
        return [], {}
    for name in ("HF_HOME", "LLMFT_CACHE"):
        Path(job_env[name]).mkdir(parents=True, exist_ok=True)
    mounts = container_mounts(k, run_paths(k, submit_dir, run_dir, job_env))
    for m in mounts:
        if "," in m:
            raise SlurmJobError(
                f"the container mount '{m}' holds a comma, which pyxis cannot take; use a path without one"
            )
    variables = {}
    if int(job_env.get("SLURM_GPUS_ON_NODE") or 0) > 0:  # pyxis hands the step's environment to enroot
        variables = gpus = container_gpu_variables(job_env, "all")
        say(
            "container GPUs: "
            + " ".join(f"{name}={value}" for name, value in gpus.items())
            + " (enroot's nvidia hook)"
        )
    keep = []
    if k["VENV"]:  # pyxis sets the image's PATH over the job's, unless told to keep the job's (--container-env)
        variables["PATH"] = container_path(k, job_env.get("PATH") or IMAGE_PATH)
        keep = ["--container-env=PATH"]
    arguments = [
        f"--container-image={k['CONTAINER_IMAGE']}",
        f"--container-name=llmft-{job_id}",
        f"--container-mounts={','.join(mounts)}",
        f"--container-workdir={submit_dir}",
        *keep,
    ]
    return arguments, variables


def slurm_kill_chain(env: Mapping[str, str]) -> tuple[int, str]:
    """llmft.launch.kill_chain with Slurm's text (KillWait, the partition's and the QOS's GraceTime), read here on the
    batch host: torchrun's shutdown timeout goes past Slurm's SIGKILL, so only Slurm's limit cuts a stop save."""
    out = run(["scontrol", "show", "config"], timeout=10)
    config = out.stdout.rstrip("\n") if out is not None else ""
    partition, qos = env.get("SLURM_JOB_PARTITION", ""), env.get("SLURM_JOB_QOS", "")
    partition_text = qos_text = None
    qos_problem = ""
    if partition:
        out = run(["scontrol", "show", "partition", partition, "-o"], timeout=10)
        if out is not None and out.returncode == 0:
            partition_text = out.stdout.rstrip("\n")
    if qos:
        if not shutil.which("sacctmgr"):
            qos_problem = f"no sacctmgr on {socket.gethostname().split('.')[0]}"
        else:
            out = run(["sacctmgr", "-nP", "show", "qos", qos, "format=GraceTime"], timeout=10)
            if out is not None and out.returncode == 0:
                qos_text = (out.stdout + out.stderr).rstrip("\n")
            else:
                first = ((out.stdout + out.stderr) if out is not None else "timed out").split("\n")[0]
                qos_problem = f"sacctmgr: {first}"
    return kill_chain.kill_chain(config, partition, partition_text, qos, qos_text, qos_problem)


def write_job_end(path: Path, job_id: str) -> None:
    """'<Unix time asked> <squeue %L>' for rank 0 (llmft.training.job_deadline), which inside a container usually has
    no squeue; a failed squeue keeps the file as it was."""
    asked = int(time.time())
    out = run(["squeue", "-h", "-j", job_id, "-o", "%L"], timeout=10)
    left = out.stdout.strip() if out is not None and out.returncode == 0 else ""
    if not left:
        return
    try:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(f"{asked} {left}\n")
        tmp.replace(path)
    except OSError:
        pass


def requeue(job_id: str, why: str) -> None:
    say(why)
    out = run(["scontrol", "requeue", job_id])
    if out is None or out.returncode != 0:
        say("scontrol requeue failed; resubmit with the same CHECKPOINT_DIR to resume")


def shutdown_timeout(decided: tuple[int, str], env: dict[str, str]) -> None:
    """torchrun's wait for its ranks after a SIGTERM, as llmft.launch.kill_chain decided (yours wins)."""
    timeout, said = decided
    if env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        say(
            f"{said.split('; torchrun waits')[0]}; torchrun waits {env['TORCH_ELASTIC_SHUTDOWN_TIMEOUT']} s for its "
            f"ranks (your TORCH_ELASTIC_SHUTDOWN_TIMEOUT; llmft would set {timeout})"
        )
    else:
        env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(timeout)
        say(said)


JOB_END_EVERY_S = 60.0


class SlurmJob:
    """This Slurm job's facts and actions (llmft.launch.scheduler.Scheduler): srun steps on the job's nodes, pyxis
    containers, Slurm's time limit, and a requeue of the same job (without the nodes with evidence against them)."""

    script = ME
    rename = "sbatch -J NAME"
    resources = "the #SBATCH resources"
    restart = failure_blame.REQUEUE

    def __init__(self, k: Knobs, env: Mapping[str, str]):
        self.k, self.env = k, dict(env)
        self.job_id = env["SLURM_JOB_ID"]
        self.job_name = env.get("SLURM_JOB_NAME", "")
        self.submit_dir = Path(env.get("SLURM_SUBMIT_DIR") or Path.cwd())
        self.attempt = env.get("SLURM_RESTART_COUNT") or "0"
        self.default_python = shutil.which("python3") or shutil.which("python") or ""
        self.node_cache = Path(env.get("TMPDIR") or "/tmp") / f"llmft-{pwd.getpwuid(os.getuid()).pw_name}"
        self.hosts: list[str] = []
        self.runner: list[str] = []
        self.container_args: list[str] = []
        self.python = ""
        self.run_dir = self.submit_dir
        self.failure_restarts = 0  # requeues after failures so far (SLURM_RESTART_COUNT counts every requeue)

    def say(self, text: str) -> None:
        say(text)

    def check(self) -> None:
        host_checks(self.k, self.env)

    def variant(self, variants: list[sweep.Variant]) -> sweep.Variant:
        env = self.env
        return sweep.element(
            variants,
            env.get("SLURM_ARRAY_TASK_ID"),
            env.get("SLURM_ARRAY_TASK_MIN", ""),
            env.get("SLURM_ARRAY_TASK_MAX", ""),
            "sbatch --array=1-{n} ... slurm/run_llm.slurm",
        )

    def live(self, owner: str) -> str:
        return live_state(owner)

    def start(self, run_dir: Path, stop: Stop) -> str:
        """USR1 (Slurm's warning before the time limit) and TERM (scancel, a requeue, a preemption) ask the ranks to
        checkpoint from here on; the job's nodes; the requeues after failures so far."""
        self.run_dir = run_dir
        text = self.restarts_file.read_text().strip() if self.restarts_file.is_file() else ""
        self.failure_restarts = int(text) if text.isdigit() else 0
        signal.signal(signal.SIGUSR1, stop)
        signal.signal(signal.SIGTERM, stop)
        self.hosts = job_hosts(self.env)
        return (
            f"job {self.job_id} ({self.job_name}) restart {self.attempt}, submitted from {self.submit_dir}, started "
            f"{now()}; requeued after failures {self.failure_restarts} of at most {self.k['MAX_RESTARTS']} times"
        )

    @property
    def restarts_file(self) -> Path:
        return self.run_dir / f".llmft-failure-restarts-{self.job_id}"

    def environment(self) -> dict[str, str]:
        return dict(self.env)  # srun passes the batch step's whole environment to every node

    def container(self, run_dir: Path, python: str, job_env: dict[str, str]) -> dict[str, str]:
        self.python = python
        self.container_args, variables = container_arguments(self.k, self.submit_dir, run_dir, self.job_id, job_env)
        self.runner = ["srun", "--nodes=1", "--ntasks=1", *self.container_args] if self.container_args else []
        return variables

    def probe(self, command: list[str], job_env: Mapping[str, str], nodes_file: Path) -> None:
        """One probe per node (srun); --mem=0: all the job's memory on the node; --whole: all its CPUs there, as
        training gets (the NUMA check)."""
        srun = ["srun", f"--nodes={len(self.hosts)}", "--ntasks-per-node=1", "--mem=0", "--whole"]
        with open(nodes_file, "w") as out:
            rc = subprocess.run(
                [*srun, "--kill-on-bad-exit=1", *self.container_args, *command], stdout=out, env=dict(job_env)
            ).returncode
        if rc != 0:
            raise SlurmJobError(
                f"could not read the allocation on every node ('{' '.join(command[:3])}' in srun exited {rc}): "
                f"{nodes_file.read_text().replace(chr(10), ' ')}"
            )

    def plan_world(self) -> tuple[int | None, int | None, dict[str, str]]:
        return None, None, {}  # llmft plan reads Slurm's SLURM_* variables itself

    def kill_chain(self, job_env: dict[str, str]) -> None:
        shutdown_timeout(slurm_kill_chain(self.env), job_env)

    def rendezvous(self) -> tuple[str, str]:
        host, port = rendezvous(self.hosts[0], self.job_id)
        return f"{host}:{port}", ""

    def srun_arguments(self, launch: Mapping[str, str]) -> list[str]:
        """Every CPU the job has on a node goes to its torchrun, asked for explicitly: since Slurm 22.05 srun does
        not inherit sbatch's --cpus-per-task, and a step gets only the CPUs it asks for once --exact or
        --cpus-per-task is in play."""
        srun = [f"--nodes={launch['nnodes']}", "--ntasks-per-node=1", f"--cpus-per-task={launch['cpus_per_node']}"]
        return [*srun, "--mem=0", "--kill-on-bad-exit=1", *self.container_args]

    def launch_line(self, launch: Mapping[str, str], torchrun: list[str]) -> str:
        return (
            f"launch: srun {' '.join(self.srun_arguments(launch))} {''.join(bash_quoted(x) + ' ' for x in torchrun)}"
        )

    def stopped_before_launch(self, stop: Stop) -> int:
        """USR1 before anything trained: nothing to save, requeue; TERM: Slurm decides, nothing starts."""
        if stop.signal == "USR1":
            say(f"stop requested before launch; requeueing job {self.job_id}")
            out = run(["scontrol", "requeue", self.job_id])
            if out is None or out.returncode != 0:
                say("scontrol requeue failed; resubmit to run")
        else:
            say("terminated before launch; not starting training")
        return 0

    def train(self, launch, node: list[str], torchrun: list[str], job_env, stop: Stop) -> int:
        """srun, one node wrapper (in the container where there is one) and torchrun per node, with the job's
        environment; the job's end kept in its file every JOB_END_EVERY_S while it runs (inside a container rank 0
        usually has no squeue: a requeue and `scontrol update TimeLimit=` reach it so). A stop signal is handled while
        srun runs (the ranks save), and srun is waited for through it."""
        job_end = Path(job_env["LLMFT_JOB_END_FILE"])
        write_job_end(job_end, self.job_id)
        wrapper = [self.python, "-m", "llmft.launch.node", *node, "--"]
        proc = subprocess.Popen(["srun", *self.srun_arguments(launch), *wrapper, *torchrun], env=dict(job_env))
        done = threading.Event()

        def keep() -> None:
            while not done.wait(JOB_END_EVERY_S):
                write_job_end(job_end, self.job_id)

        threading.Thread(target=keep, daemon=True).start()
        try:
            return proc.wait()
        finally:
            done.set()

    def follow(self, ended: Ending, run_dir: Path) -> int:
        """After a success or a stop, each case said in one line: done; llmft's own stop before the time limit, a
        USR1 or `llmft stop --continue`, which requeue this job; `llmft stop` alone, which ends it; a SIGTERM, after
        which Slurm decides."""
        rc, job_id = ended.rc, self.job_id
        again = "to resume from the newest complete checkpoint"
        if ended.kind == "done":
            say(f"training finished (exit {rc}); results in {run_dir}")
            return rc
        if ended.kind == "deadline":
            why = f"llmft stopped for its final save before the time limit (exit {rc})"
            requeue(job_id, f"{why}; requeueing job {job_id} {again}")
        elif ended.kind == "usr1":
            requeue(job_id, f"stopped early (exit {rc}) after a checkpoint; requeueing job {job_id} {again}")
        elif ended.kind == "llmft-stop" and ended.go_on:
            requeue(
                job_id, f"stopped by llmft stop --continue (exit {rc}) after a checkpoint; requeueing job {job_id}"
            )
        elif ended.kind == "llmft-stop":
            say(
                f"stopped by llmft stop (exit {rc}) after a checkpoint; not requeued (no --continue): resubmit to resume"
            )
        elif ended.kind == "term":
            say(
                f"stopped by SIGTERM (exit {rc}) after a checkpoint; a preempted or requeued job resumes from it, a "
                "cancelled one ends here"
            )
        else:
            say(f"warning: training exited 0 but {run_dir}/llmft_done.json is missing")
        return 0

    def failure_facts(self) -> tuple[int, list[str], list[str] | None]:
        """The requeues after failures so far, the nodes the job already excludes, and those the partition (and
        reservation) can still offer (None: sinfo could not tell)."""
        out = run(["scontrol", "show", "job", self.job_id])
        m = re.search(r"ExcNodeList=(\S*)", out.stdout if out is not None else "")
        excluded = expand_hostlist(m.group(1)) if m and m.group(1) not in ("", "(null)") else []
        sinfo, reservation_text = None, ""
        partition, reservation = self.env.get("SLURM_JOB_PARTITION", ""), self.env.get("SLURM_JOB_RESERVATION", "")
        if partition:
            out = run(["sinfo", "-h", "-N", "-o", "%N %t", "-p", partition], timeout=30)
            if out is not None and out.returncode == 0:
                sinfo = out.stdout
        if reservation:
            out = run(["scontrol", "show", "reservation", reservation], timeout=30)
            if out is not None and out.returncode == 0:
                reservation_text = out.stdout
        usable = failure_blame.usable_nodes(sinfo, reservation_text) if sinfo is not None else None
        return self.failure_restarts, excluded, usable

    def run_again(self, rc: int, exclude: list[str], restarts: int) -> int:
        """The requeue after a failure, counted in the run directory, with the exclusion set while the job pends."""
        self.restarts_file.write_text(f"{restarts + 1}\n")
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the requeue signals this job; the exclusion must still be set
        out = run(["scontrol", "requeue", self.job_id])
        if out is None or out.returncode != 0:
            say("scontrol requeue failed; resubmit with the same CHECKPOINT_DIR to resume")
            return rc
        if exclude:  # Slurm takes the exclusion only while the job is pending
            out = run(["scontrol", "update", f"JobId={self.job_id}", f"ExcNodeList={','.join(exclude)}"])
            if out is None or out.returncode != 0:
                say(f"could not exclude {','.join(exclude)}; the requeued job may get it again")
        return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if os.environ.get("SLURM_JOB_ID"):  # Slurm's clients (scontrol, sinfo) may be in sbin
        os.environ["PATH"] = f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"
    env = dict(os.environ)
    in_job = bool(env.get("SLURM_JOB_ID"))
    try:
        given_knobs, world, wants_help = read_arguments(argv, in_job)
        if wants_help:
            print(HELP.rstrip("\n"))
            return 0
        knobs = resolve(env, [f"{key}={value}" for key, value in given_knobs.items()], Path.cwd())
        if not in_job:
            return outside_slurm(knobs, world, env.get("LLMFT_SLURM_SCRIPT", ""))
        return scheduler.run_job(knobs, env, SlurmJob(knobs, env))
    except LlmftError as e:
        print(f"{ME}: error: {e}", file=sys.stderr, flush=True)
        return 2
    except OSError as e:  # a run directory it cannot create or write: one line, as any other error
        print(f"{ME}: error: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

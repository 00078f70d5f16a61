"""llmft on PBS (OpenPBS, PBS Pro): the job pbs/run_llm.pbs runs, one torchrun per node, in tested Python.

    qsub -l select=2:ncpus=8:ngpus=4:mem=200gb -l place=scatter -l walltime=04:00:00 \\
         -v MODEL=meta-llama/Llama-3.2-1B,DATASET=data.jsonl,GLOBAL_BATCH=64 pbs/run_llm.pbs
    DRY_RUN=1 bash pbs/run_llm.pbs DATASET=data.jsonl          # outside PBS: the knobs and the local paths checked

The knobs are slurm/run_llm.slurm's (llmft.launch.knobs). What differs from Slurm, and why:
- The nodes come from PBS_NODEFILE (one line per chunk; a node is named once). One launcher per node is started with
  `pbsdsh -n INDEX`, through PBS's own task manager: no ssh, and the tasks are the job's, so PBS accounts for them and
  kills them at the walltime. Each task reads the environment this job decided from a file (pbsdsh passes only the
  job's own variables), then runs torchrun; a failing node writes its report (llmft.launch.failure_blame node).
- GPUs and CPUs per node come from the select statement (`ngpus`, `ncpus` of the chunk; a CPU-only chunk runs one
  process), the memory from its `mem` and what each node reports (llmft.planning.allocation).
- PBS gives no warning before the walltime: at the limit every process gets SIGTERM and, `kill_delay` seconds later
  (10 s by default), SIGKILL. So the job reads its walltime from `qstat -f` and keeps the time left in
  LLMFT_JOB_END_FILE for rank 0 (llmft.training.job_deadline), which starts the last checkpoint early enough.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from llmft.errors import LlmftError
from llmft.launch import continuation, failure_blame, scheduler, sweep
from llmft.launch.job import (
    CONTAINER_GPU_VARIABLES,
    Ending,
    JobError,
    Stop,
    container_mounts,
    container_path,
    fabric_check,
    port_taken,
    rendezvous_port,
    run_paths,
    safe_name,
)
from llmft.launch.knobs import (
    KnobError,
    Knobs,
    default_dataset_warning,
    defaults_line,
    help_text,
    resolve,
    unknown_in_variable_list,
)

ME = "run_llm.pbs"
USAGE = __doc__.split("\n\n")[1]


class PbsJobError(JobError):
    """The PBS job cannot go on; one line, exit 2."""


def say(text: str) -> None:
    print(f"{ME}: {text}", flush=True)


# ---- pure readers of PBS's facts -------------------------------------------------------------------


@dataclass(frozen=True)
class Chunk:
    count: int
    resources: dict[str, str]


def parse_select(select: str) -> list[Chunk]:
    """`2:ncpus=8:ngpus=4+1:ncpus=2` -> chunks (count and resources); a chunk without a leading count is one."""
    chunks = []
    for part in select.split("+"):
        fields = part.split(":")
        count = 1
        if fields and fields[0].isdigit():
            count = int(fields.pop(0))
        res = {}
        for f in fields:
            key, sep, value = f.partition("=")
            if not sep:
                raise PbsJobError(f"cannot read the select statement '{select}' (at '{f}')")
            res[key.strip()] = value.strip()
        chunks.append(Chunk(count, res))
    return chunks


def per_node(select: str, resource: str, default: int) -> int:
    """A resource every chunk asks for, as a count (ngpus, ncpus); chunks asking for different amounts are refused:
    every node runs the same number of processes."""
    values = {int(c.resources.get(resource, default) or default) for c in parse_select(select)}
    if len(values) > 1:
        raise PbsJobError(
            f"the select statement '{select}' asks for {resource} {sorted(values)} in different chunks, and every node "
            f"runs the same number of processes: ask for the same {resource} in every chunk"
        )
    return values.pop()


def memory_gib(text: str) -> float | None:
    """PBS sizes: `200gb`, `64GB`, `512mb`, `1tb`, `1048576kb`, a bare number of bytes."""
    m = re.fullmatch(r"(\d+)\s*([kmgtp]?)(b|w)?", text.strip().lower())
    if not m:
        return None
    scale = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "p": 2**50}[m.group(2)]
    return int(m.group(1)) * scale * (8 if m.group(3) == "w" else 1) / 2**30


def select_memory(select: str) -> dict[str, str]:
    """The chunk's `mem`, as a memory limit every node's probe takes (the smallest chunk's; none asked: {})."""
    asked = [
        (memory_gib(c.resources["mem"]), c.resources["mem"]) for c in parse_select(select) if "mem" in c.resources
    ]
    asked = [(gib, text) for gib, text in asked if gib]
    if not asked:
        return {}
    gib, text = min(asked)
    return {"LLMFT_HOST_RAM_GB": f"{gib:g}", "LLMFT_HOST_RAM_SOURCE": f"PBS select mem={text}"}


def seconds(hms: str) -> float | None:
    """PBS walltime `[[HH:]MM:]SS` (hours may exceed 24) -> seconds."""
    if not re.fullmatch(r"\d+(:\d+){0,2}", hms.strip()):
        return None
    total = 0
    for part in hms.strip().split(":"):
        total = total * 60 + int(part)
    return float(total)


def hms(value: float) -> str:
    value = max(0, int(value))
    return f"{value // 3600}:{value % 3600 // 60:02d}:{value % 60:02d}"


def hosts_of(nodefile_text: str) -> list[tuple[str, int]]:
    """Each node once, in PBS_NODEFILE's order, with the index pbsdsh -n takes for it (its first line)."""
    seen: dict[str, int] = {}
    for i, line in enumerate(nodefile_text.split()):
        seen.setdefault(line.strip(), i)
    return list(seen.items())


def rendezvous_start(job_id: str) -> int:
    """Where the job's rendezvous port search starts (llmft.launch.job.rendezvous_port): from the job's number and
    array index, since an array's elements run at once, on one node too."""
    m = re.match(r"(\d+)(?:\[(\d+)\])?", job_id)
    seq, index = (int(m.group(1)), int(m.group(2) or 0)) if m else (0, 0)
    return seq * 101 + index


def shutdown_timeout(kill_delay_s: float) -> int:
    """torchrun's wait for its ranks after a SIGTERM: past PBS's own SIGKILL, so only PBS's limit applies."""
    return int(kill_delay_s) + 30


# ---- containers: enroot, the way pyxis runs them on Slurm ----------------------------------------------

# What a job inside a container still takes from the host's environment (enroot start --env NAME): llmft's files and
# caches, W&B, NCCL and torch settings; never PATH or the host's Python environment.
CONTAINER_ENV_PREFIXES = ("LLMFT_", "WANDB_", "NCCL_", "TORCH_", "HF_", "TRITON_", "OMP_", "PBS_")


def container_name(job_id: str) -> str:
    """One container per job and node, named by both (`{node}`: each node's name, filled in per node): enroot's data
    path is often a shared $HOME, where nodes creating one name at once collide ("File already exists"), and a
    site's enroot.conf may say otherwise, so llmft never sets the data path and the names stay apart on any. A
    continuation is another job: another name. The container is removed at the job's end (remove_containers)."""
    return "llmft-" + safe_name(job_id.split(".")[0]) + "-{node}"


def enroot_start(enroot: str, name: str, mounts: Sequence[str], gpus: bool, env_names: Sequence[str]) -> list[str]:
    """The prefix that runs a command in the job's container: read-write (DeepSpeed and Triton write their caches),
    the run's paths mounted, llmft's variables passed, and on GPU nodes the two variables enroot's nvidia hook reads
    (their values are each node's own: llmft.launch.node.container_gpu_env). enroot takes GPUs through the container's environment, not
    an option: `enroot start` has no --nv, and exits 1 with its usage on it."""
    cmd = [enroot, "start", "--rw"]
    for m in mounts:
        cmd += ["--mount", m]
    for name_ in [*env_names, *(CONTAINER_GPU_VARIABLES if gpus else ())]:
        cmd += ["--env", name_]
    return [*cmd, name]


# ---- what this job is -------------------------------------------------------------------------------


def qstat_job(job_id: str) -> dict:
    """`qstat -f -F json JOB`'s record of this job ({} when qstat does not answer)."""
    try:
        proc = subprocess.run(["qstat", "-f", "-F", "json", job_id], capture_output=True, text=True, timeout=30)
        jobs = json.loads(proc.stdout).get("Jobs", {}) if proc.returncode == 0 else {}
    except (OSError, subprocess.SubprocessError, ValueError):
        return {}
    return next(iter(jobs.values()), {})


def queue_kill_delay(queue: str) -> float:
    try:
        proc = subprocess.run(["qstat", "-Q", "-f", "-F", "json", queue], capture_output=True, text=True, timeout=30)
        q = json.loads(proc.stdout).get("Queue", {}).get(queue, {})
        return float(q.get("kill_delay", 10))
    except (OSError, subprocess.SubprocessError, ValueError):
        return 10.0


def time_left(job: Mapping) -> float | None:
    """Seconds of walltime left: Resource_List.walltime less resources_used.walltime (None: no walltime)."""
    limit = seconds(str(job.get("Resource_List", {}).get("walltime", "")))
    if limit is None:
        return None
    used = seconds(str(job.get("resources_used", {}).get("walltime", "0"))) or 0.0
    return limit - used


def started_at(job: Mapping) -> float | None:
    """When this run of the job started, as PBS recorded it (`stime`, the server's ctime-style local time), in Unix
    seconds; None when qstat gave none or it cannot be read."""
    try:
        return time.mktime(time.strptime(str(job.get("stime", "")).strip(), "%a %b %d %H:%M:%S %Y"))
    except (ValueError, OverflowError):
        return None


def job_end(job: Mapping, now: float) -> tuple[float, float] | None:
    """(a moment, the walltime left at it) for LLMFT_JOB_END_FILE: the job's start (`stime`) and its whole
    `Resource_List.walltime`, so the deadline counts from when PBS started the clock, not from when this launcher got
    round to writing it (an image unpack, `llmft plan`, a W&B check come first; PBS's SIGTERM does not wait for them).
    Without a readable stime: now and the time left qstat reported (`time_left`). None: no walltime."""
    limit = seconds(str(job.get("Resource_List", {}).get("walltime", "")))
    start = started_at(job)
    if limit is not None and start is not None:
        return start, limit
    left = time_left(job)
    return None if left is None else (now, left)


SETUP_DELAY_ENV = "LLMFT_TEST_SETUP_DELAY_S"  # a test hook: the job's set-up takes this much longer (a slow unpack)


def setup_delay(env: Mapping[str, str]) -> None:
    """LLMFT_TEST_SETUP_DELAY_S: a slow set-up (a 3-minute image unpack), for the test that the deadline still counts
    from the job's start. Tests only."""
    delay = float(env.get(SETUP_DELAY_ENV) or 0)
    if delay > 0:
        say(f"{SETUP_DELAY_ENV}: waiting {delay:g} s (a test hook: a slow set-up)")
        time.sleep(delay)


def live_state(owner: str) -> str:
    """How the job that holds a run directory is said while it is queued or runs ("" once it has ended)."""
    state = job_is_live(owner)
    return f"state {state}" if state else ""


def job_is_live(job_id: str) -> str:
    """The state of another job that holds a run directory ('' when it has ended or is unknown)."""
    state = qstat_job(job_id).get("job_state", "")
    return state if state in ("Q", "R", "H", "W", "T", "E", "B", "S") else ""


# ---- the job ---------------------------------------------------------------------------------------


def outside_pbs(k: Knobs, raw_dataset: str) -> int:
    say(defaults_line(k))
    warning = default_dataset_warning(
        k, raw_dataset, "llmft plan --dataset_name ... --write DIR prints a complete line"
    )
    if warning:
        say(warning)
    if k["SWEEP"]:
        variants = sweep.parse(k["SWEEP"], k["METHOD"])
        for v in variants:
            say(f"sweep variant {v.index}: {v.describe()} -> {v.name}")
        say(f"submit the sweep as an array of {len(variants)}: qsub -J 1-{len(variants)} ... pbs/run_llm.pbs")
    if k.flag("DRY_RUN"):
        say(
            "knobs are valid; not inside a PBS job, so nothing to plan or launch (submit with: qsub pbs/run_llm.pbs ...)"
        )
        return 0
    raise PbsJobError(
        "not inside a PBS job (PBS_JOBID is unset); submit with: qsub -v DATASET=your.jsonl pbs/run_llm.pbs"
    )


def write_job_end(path: Path, job: Mapping) -> None:
    """The job's end for rank 0 (llmft.training.job_deadline reads `<Unix time> <walltime left then>`), counted from
    the job's start (job_end), and said."""
    now = time.time()
    end = job_end(job, now)
    if end is None:
        return
    start, left = end
    path.write_text(f"{start:.0f} {hms(left)}\n")
    iso = lambda t: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))  # noqa: E731
    say(
        f"walltime: {hms(start + left - now)} left (ends {iso(start + left)}: started {iso(start)} + walltime "
        f"{hms(left)}); llmft starts its last checkpoint early enough to finish before it"
    )


def stop_on_usr1(stop: Stop) -> None:
    """A USR1 to this launcher asks for a stop with a continuation. A USR1 to the whole job (`qsig -s USR1`) reaches
    every process of each of the job's task sessions (kill_session in mom_mach.c), and this launcher's own children
    (pbsdsh, llmft plan, the W&B check, llmft prepare, qsub), started with default handlers, would die of it (pbsdsh
    handles only HUP, INT and TERM). So USR1 is blocked here, which every child inherits across exec and so never dies
    of, and one thread of this process takes it (sigwait) and asks for the stop. The nodes' wrappers, which PBS's task
    manager starts, ignore it and so do their torchruns and the ranks until the ranks' own handler is in place
    (llmft.launch.node). (qsig's USR1 still ends the job: it also kills the login shell PBS runs the job script under, the
    job's top process; docs/pbs.md.)"""
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)  # an ignored signal is dropped, blocked or not: never taken
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})

    def take() -> None:
        while True:
            stop(signal.sigwait({signal.SIGUSR1}), None)

    threading.Thread(target=take, name="usr1", daemon=True).start()


def job_hosts(env: Mapping[str, str]) -> list[tuple[str, int]]:
    nodefile = env.get("PBS_NODEFILE", "")
    if not nodefile or not Path(nodefile).is_file():
        raise PbsJobError(f"PBS_NODEFILE={nodefile or '<unset>'} is not a file: cannot tell the job's nodes")
    hosts = hosts_of(Path(nodefile).read_text())
    if not hosts:
        raise PbsJobError(f"PBS_NODEFILE={nodefile} lists no node")
    return hosts


def this_variant(variants: list[sweep.Variant], env: Mapping[str, str]) -> sweep.Variant:
    """The variant this array element trains: PBS_ARRAY_INDEX within the array's indices (its parent's qstat)."""
    index, parent = env.get("PBS_ARRAY_INDEX"), env.get("PBS_ARRAY_ID", "")
    first = last = None
    if index:
        m = re.fullmatch(r"(\d+)-(\d+)(:1)?", str(qstat_job(parent).get("array_indices_submitted", "")))
        first, last = (m.group(1), m.group(2)) if m else (None, None)
    return sweep.element(variants, index, first, last, "qsub -J 1-{n} ... pbs/run_llm.pbs")


def container_prefix(k, env, job_id, paths, node_env, gpus, tell: bool = True) -> tuple[list[str], list[str]]:
    """The prefix of every command that runs llmft (none on the host; `{node}` in it is the node's name), and the
    node step's --create arguments. With VENV (a venv of the image's Python, container_python) its PYTHONPATH goes in
    too, and PATH starts at its bin (container_path): they belong to that environment; the host's own never go in."""
    if not k["CONTAINER_IMAGE"]:
        return [], []
    enroot = env.get("LLMFT_ENROOT") or "enroot"  # the enroot command (a site's wrapper)
    # the job's own PBS_* too (PBS_JOBID: rank 0's walltime deadline, llmft.training.job_deadline, needs it)
    names = sorted({n for n in (*node_env, *env) if n.startswith(CONTAINER_ENV_PREFIXES)})
    if k["VENV"] and os.environ.get("PYTHONPATH"):
        names.append("PYTHONPATH")
    inside = enroot_start(enroot, container_name(job_id), container_mounts(k, paths), gpus > 0, names)
    if k["VENV"]:  # the venv's bin first; set by env(1) inside, since enroot's login shell resets PATH (/etc/profile)
        inside += ["env", f"PATH={container_path(k)}"]
    if tell:
        say(f"container {container_name(job_id)} from {k['CONTAINER_IMAGE']} on each node: {' '.join(inside)}")
    return inside, ["--create", enroot, k["CONTAINER_IMAGE"], container_name(job_id)]


def on_this_node(command: list[str], hosts: list[tuple[str, int]]) -> list[str]:
    """A command for the first node, where the job's own steps run (the plan, the data preparation, the export)."""
    return [a.replace("{node}", hosts[0][0]) for a in command]


def node_wrapper(env_file: Path, *options: str) -> list[str]:
    """The node wrapper (llmft.launch.node) as pbsdsh starts it on each node, with the environment this job decided
    (pbsdsh passes only the job's own variables) and the node's name in PBS (`{node}`, filled in per node)."""
    wrapper = [sys.executable, "-m", "llmft.launch.node", "--job", ME, "--env_file", str(env_file)]
    return [*wrapper, "--node", "{node}", *options]


def remove_containers(hosts, env_file: Path, create: list[str]) -> None:
    """Every node's container of this job removed at the job's end, however it ends (success, a failure, a stop for
    the walltime, an error before the launch; run at the launcher's exit, atexit): an unpacked rootfs per node per job
    would otherwise pile up with each continuation. A node whose removal fails says so in the job's output."""
    if not create:
        return
    name = create[3]
    for (host, _), rc in zip(hosts, on_every_node(hosts, node_wrapper(env_file, "--remove", *create[1:4]))):
        if rc != 0:
            say(f"could not remove the container {name.replace('{node}', host)} on node {host} (exit {rc})")


def probe_nodes(hosts, env_file: Path, nodes_file: Path, command: list[str]) -> None:
    """What each node was given (llmft.planning.allocation), one probe per node through PBS's task manager; in a
    container, the node's container is created first. A task's output goes to the job's, not to pbsdsh: each node
    writes its line to a file."""
    on_every_node(hosts, [*node_wrapper(env_file, "--out", f"{nodes_file}.{{node}}"), *command])
    lines = []
    listed = set(os.listdir(nodes_file.parent))  # listed, not stat'ed: see node_exits
    for host, _ in hosts:
        out, failed = Path(f"{nodes_file}.{host}"), Path(f"{nodes_file}.{host}.failed")
        text = out.read_text() if out.name in listed else ""
        why = failed.read_text().strip() if failed.name in listed else ""
        out.unlink(missing_ok=True)
        failed.unlink(missing_ok=True)
        if why or out.name not in listed:  # pbsdsh returns 0 whatever its task did: only the node's file says
            raise PbsJobError(f"could not read the allocation on node {host}: {why or 'it reported nothing'}")
        lines.append(text)
    nodes_file.write_text("".join(lines))


WALLTIME_SIGTERM_MARGIN_S = 60.0  # a SIGTERM this close to the walltime (plus kill_delay) is the walltime's


def python_venv(k: Knobs) -> str:
    """The continuation's VENV: the knob, else the virtual environment this launcher runs in (pbs/run_llm.pbs chose
    it from VIRTUAL_ENV, as after `qsub -V`, which a continuation does not have), else none (python3)."""
    if k["VENV"]:
        return str(Path(k["VENV"]).absolute())
    return sys.prefix if sys.prefix != sys.base_prefix else ""


def go_on(k, env, job, job_id, run_dir, node_env, failure_restarts: int) -> None:
    """Submit the continuation (llmft.launch.continuation): this job again, after it ends, from the same run."""
    values = continuation.variables(job, env, run_dir, k.extra_args, node_env)
    if failure_restarts:
        values[continuation.RESTARTS_ENV] = str(failure_restarts)
    attempt = int(values.get("LLMFT_CONTINUATIONS", "0") or 0) + 1
    values["LLMFT_CONTINUATIONS"] = str(attempt)
    variables_file = run_dir / f".llmft-continue-{attempt}.json"
    continuation.write_variables(variables_file, values)
    cmd = continuation.qsub_command(
        job,
        job_id,
        run_dir / ".llmft-job.pbs",
        variables_file,
        attempt,
        python_venv(k),
        os.environ.get("PYTHONPATH", ""),
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=env.get("PBS_O_WORKDIR") or None)
    if proc.returncode != 0:
        say(
            f"could not submit the continuation ({' '.join(cmd)}: {proc.stderr.strip()}); resubmit with "
            f"CHECKPOINT_DIR={run_dir} to resume"
        )
        return
    say(f"continuation submitted: job {proc.stdout.strip()} starts after {job_id} ends, from {run_dir}")


NODE_EXIT_WAIT_S = 10.0  # how long an exit a node's wrapper has not recorded yet is waited for (no stop signalled)


def node_exits(failures: Path, hosts, wait_s: Callable[[], float]) -> list[int | None]:
    """Each node's exit status as its wrapper recorded it (`exit-<node>` in the failures directory); None for a node
    that recorded none. pbsdsh's own status says nothing (it returns 0 whatever its task did, 1 once signalled:
    pbsdsh.c), so a node without a record is no report: evidence that the node or its wrapper died, never a success
    (job_exit). The records are waited for up to `wait_s()` seconds, asked again each second: a stop signal arriving
    meanwhile lengthens it (after the job's SIGTERM or SIGUSR1 pbsdsh returns at once while the ranks still write
    their stop checkpoint, and this launcher, the job's top process, must stay until they have, or PBS ends the job
    and kills them mid-save). They are found by listing the directory, not by a stat of each name: an NFS client can
    answer a stat from a cached "no such file" for up to acdirmax (60 s), while listing revalidates (as the ranks
    look for the stop file, llmft.training.callbacks.stop_file_present)."""
    started = time.monotonic()
    names = [f"exit-{host}" for host, _ in hosts]
    while True:
        try:
            listed = set(os.listdir(failures))
        except OSError:
            listed = set()
        if all(n in listed for n in names) or time.monotonic() - started >= wait_s():
            break
        time.sleep(1)
    return [int((failures / n).read_text().strip() or 1) if n in listed else None for n in names]


def job_exit(exits: Sequence[int | None], hosts: Sequence[str]) -> tuple[int, list[str]]:
    """The attempt's exit status from each node's recorded exit (node_exits), and the nodes that recorded none: the
    first failing node's status; 1 when every node that recorded one succeeded but some recorded none (no report is
    no success: pbsdsh returns 0 for a dead node too)."""
    silent = [h for h, e in zip(hosts, exits) if e is None]
    rc = next((e for e in exits if e is not None and e != 0), 0)
    return (1 if rc == 0 and silent else rc), silent


def on_every_node(hosts: list[tuple[str, int]], command: list[str]) -> list[int]:
    """`command` once on each node through `pbsdsh -n INDEX` (PBS's task manager), all at once; pbsdsh's exit status
    for each, which says nothing of the task's (pbsdsh.c returns 0 whatever the task did, and 1 once it is signalled:
    its own handler for HUP, INT and TERM passes the signal on to the task with tm_kill and exits; any other signal,
    USR1 among them, ends pbsdsh alone and leaves the task running), so the caller reads what each node's wrapper
    recorded instead. `{node}` in an argument becomes the node's name (PBS's: all nodes may share one hostname), `{is_host}` 1 on
    the first node and 0 elsewhere.

    The tasks get the job's own environment, not this process's: a PYTHONPATH that makes llmft importable here
    (pbs/run_llm.pbs run from a checkout) is handed on explicitly."""
    if os.environ.get("PYTHONPATH"):
        command = ["/usr/bin/env", f"PYTHONPATH={os.environ['PYTHONPATH']}", *command]
    procs = [
        subprocess.Popen(
            [
                "pbsdsh",
                "-n",
                str(index),
                "--",
                *(a.replace("{node}", host).replace("{is_host}", "1" if i == 0 else "0") for a in command),
            ],
        )
        for i, (host, index) in enumerate(hosts)
    ]
    return [p.wait() for p in procs]


class PbsJob:
    """This PBS job's facts and actions (llmft.launch.scheduler.Scheduler): pbsdsh tasks on the job's nodes (they
    get only the job's own variables, so the job's environment goes to them in a file), enroot containers made and
    removed per node, the walltime from `qstat -f`, and a continuation job after a stop or a failure (qsub cannot
    exclude nodes)."""

    script = ME
    rename = "qsub -N NAME"
    resources = "the select statement"
    restart = failure_blame.CONTINUE

    def __init__(self, k: Knobs, env: Mapping[str, str]):
        self.k, self.env = k, dict(env)
        self.job_id = env["PBS_JOBID"]
        self.job_name = env.get("PBS_JOBNAME", "")
        self.submit_dir = Path(env.get("PBS_O_WORKDIR") or Path.cwd())
        self.job = qstat_job(self.job_id)
        self.attempt = str(int(self.job.get("run_count", 1) or 1))
        self.select = str(self.job.get("Resource_List", {}).get("select", "1:ncpus=1"))
        self.default_python = sys.executable
        # Build caches are node-local and outlive the job: not under TMPDIR, which PBS makes per job and deletes
        # after it (DeepSpeed would compile its ops again in every job).
        self.node_cache = Path("/tmp") / f"llmft-{env.get('USER') or os.getuid()}"
        self.pairs: list[tuple[str, int]] = []  # each node and the index pbsdsh -n takes for it
        self.hosts: list[str] = []
        self.runner: list[str] = []
        self.create: list[str] = []
        self.python = ""
        self.run_dir = self.submit_dir
        self.env_file = self.submit_dir
        self.gpus = 0
        self.kill_delay = 10.0
        self.job_env: dict[str, str] = {}

    def say(self, text: str) -> None:
        say(text)

    def check(self) -> None:
        unknown_in_variable_list(list(self.job.get("Variable_List", {})), "qsub -v")
        fabric_check(self.k["NCCL_PROFILE"], self.env)
        self.gpus = per_node(self.select, "ngpus", 0)
        self.pairs = job_hosts(self.env)
        self.hosts = [h for h, _ in self.pairs]

    def variant(self, variants: list[sweep.Variant]) -> sweep.Variant:
        return this_variant(variants, self.env)

    def live(self, owner: str) -> str:
        return live_state(owner)

    def start(self, run_dir: Path, stop: Stop) -> str:
        """TERM (the walltime, qdel, qrerun) and USR1 ask the ranks to checkpoint from here on; the job script kept
        in the run directory for a continuation to submit."""
        self.run_dir, self.env_file = run_dir, run_dir / f".llmft-env-{self.job_id}.json"
        script = self.env.get("LLMFT_PBS_SCRIPT")
        if script and Path(script).is_file():
            shutil.copyfile(script, run_dir / ".llmft-job.pbs")
        signal.signal(signal.SIGTERM, stop)
        stop_on_usr1(stop)
        return (
            f"job {self.job_id} ({self.job_name}) run {self.attempt}, submitted from {self.submit_dir}, started "
            f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"
        )

    def environment(self) -> dict[str, str]:
        """What the nodes' environment starts from: PATH, the job's settings the ranks read, the tests' hooks and
        the NCCL settings you exported, each node's GPUs and the select statement's memory."""
        env = self.env
        out = {"PATH": env.get("PATH", os.defpath)}
        for name in ("HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM", "OMP_NUM_THREADS", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
            if env.get(name):
                out[name] = env[name]
        out.update({n: v for n, v in env.items() if n.startswith(("LLMFT_TEST_", "NCCL_"))})
        out["LLMFT_NODE_GPUS"] = str(self.gpus)
        return {**out, **select_memory(self.select)}

    def inside(self, job_env: Mapping[str, str], tell: bool = False) -> list[str]:
        """The prefix that runs a command in the node's container (none without CONTAINER_IMAGE), passing the
        variables the job's environment holds now."""
        paths = run_paths(self.k, self.submit_dir, self.run_dir, job_env)
        inside, self.create = container_prefix(self.k, self.env, self.job_id, paths, job_env, self.gpus, tell)
        return inside

    def container(self, run_dir: Path, python: str, job_env: dict[str, str]) -> dict[str, str]:
        """Each node's container is made by its probe (llmft.launch.node --create) and removed at the job's end,
        however it ends (atexit)."""
        self.python = python
        self.runner = on_this_node(self.inside(job_env, tell=True), self.pairs)
        atexit.register(remove_containers, self.pairs, self.env_file, self.create)
        return {}

    def probe(self, command: list[str], job_env: Mapping[str, str], nodes_file: Path) -> None:
        self.env_file.write_text(json.dumps(job_env))
        probe_nodes(self.pairs, self.env_file, nodes_file, [*self.create, "--", *self.inside(job_env), *command])
        setup_delay(self.env)

    def plan_world(self) -> tuple[int | None, int | None, dict[str, str]]:
        """PBS's world for llmft plan: the nodes, one process per GPU (one on a node without GPUs), the CPUs."""
        return len(self.hosts), self.gpus, {"NCPUS": str(per_node(self.select, "ncpus", 1))}

    def kill_chain(self, job_env: dict[str, str]) -> None:
        self.kill_delay = queue_kill_delay(str(self.job.get("queue", "workq")))
        job_env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(shutdown_timeout(self.kill_delay)))
        say(
            f"kill chain: PBS sends SIGKILL {self.kill_delay:g} s after SIGTERM (kill_delay); torchrun waits "
            f"{job_env['TORCH_ELASTIC_SHUTDOWN_TIMEOUT']} s for its ranks"
        )

    def rendezvous(self) -> tuple[str, str]:
        """The first node of PBS_NODEFILE hosts the rendezvous, said to torchrun (is_host) rather than guessed from
        its addresses (torch's guess fails where the node's hostname resolves elsewhere, as on a node with several
        networks), on a port from the job's number and array index."""
        host = self.hosts[0]
        try:
            host = socket.gethostbyname(host)
        except OSError:
            pass
        port = rendezvous_port(rendezvous_start(self.job_id), lambda p: port_taken(host, p))
        return f"{host}:{port}", "is_host={is_host}"

    def launch_line(self, launch: Mapping[str, str], torchrun: list[str]) -> str:
        return f"launch: pbsdsh -n INDEX -- {' '.join(shlex.quote(a) for a in torchrun)}"

    def stopped_before_launch(self, stop: Stop) -> int:
        say(f"SIG{stop.signal} before launch; not starting training")
        return 0

    def train(self, launch, node: list[str], torchrun: list[str], job_env, stop: Stop) -> int:
        """One node wrapper per node through pbsdsh (on the host: it starts the node's container), with the job's
        environment from its file; the attempt's exit status from what each node's wrapper recorded (pbsdsh returns
        0 whatever its task did)."""
        self.job_env = job_env
        self.env_file.write_text(json.dumps(job_env))
        write_job_end(Path(job_env["LLMFT_JOB_END_FILE"]), self.job)
        on_every_node(self.pairs, [*node_wrapper(self.env_file, *node), "--", *self.inside(job_env), *torchrun])
        failures = Path(node[node.index("--failures") + 1])
        wait = lambda: shutdown_timeout(self.kill_delay) if stop.signal else NODE_EXIT_WAIT_S  # noqa: E731
        rc, silent = job_exit(node_exits(failures, self.pairs, wait), self.hosts)
        for host in silent:
            say(f"node {host} recorded no exit: its launcher did not finish (the node died, or PBS killed its task)")
        return rc

    def follow(self, ended: Ending, run_dir: Path) -> int:
        """After a success or a stop, each case said in one line: done; stopped for the walltime (llmft's own final
        save, or PBS's SIGTERM at the limit), by SIGUSR1 or by `llmft stop --continue`, which a continuation resumes;
        `llmft stop` alone, which ends the run's job; SIGTERM from qdel or qrerun, where PBS decides."""
        rc = ended.rc
        at = f"(exit {rc}) after a complete checkpoint at step {ended.step}"
        if ended.kind == "done":
            say(f"training finished (exit {rc}); results in {run_dir}")
            return rc
        if ended.kind in ("deadline", "usr1") or (ended.kind == "llmft-stop" and ended.go_on):
            why = {"deadline": "for its final save before the walltime", "usr1": "on SIGUSR1"}.get(ended.kind)
            say(f"llmft stopped {why or 'by llmft stop'} {at}; continuing in a new job")
            self.go_on(0)
            return 0
        if ended.kind == "llmft-stop":
            say(
                f"llmft stopped by llmft stop {at}; not continued (no --continue): resubmit with CHECKPOINT_DIR={run_dir} to resume"
            )
            return 0
        if ended.kind == "term":
            left = time_left(qstat_job(self.job_id))
            if left is not None and left <= self.kill_delay + WALLTIME_SIGTERM_MARGIN_S:
                say(f"stopped by the walltime's SIGTERM {at}; continuing in a new job")
                self.go_on(0)
                return 0
            say(f"stopped by SIGTERM {at}; a job PBS reruns (qrerun) resumes from it, a deleted one (qdel) ends here")
            return 0
        # unfinished: not a success, nothing says the training finished
        say(f"error: every node's torchrun exited 0, but {run_dir}/llmft_done.json is missing: the run did not finish")
        return 1

    def failure_facts(self) -> tuple[int, list[str], list[str] | None]:
        """The continuations after failures so far (carried by each continuation); qsub excludes no node."""
        return int(self.env.get(continuation.RESTARTS_ENV, "0") or 0), [], None

    def run_again(self, rc: int, exclude: list[str], restarts: int) -> int:
        self.go_on(restarts + 1)
        return rc

    def go_on(self, failure_restarts: int) -> None:
        go_on(self.k, self.env, self.job, self.job_id, self.run_dir, self.job_env, failure_restarts)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(help_text(ME, USAGE))
        return 0
    try:
        env = continuation.load(os.environ)  # a continuation (llmft.launch.continuation) starts with its variables
        cwd = Path(env.get("PBS_O_WORKDIR") or Path.cwd()) if env.get("PBS_JOBID") else Path.cwd()
        knobs = resolve(env, argv, cwd)
        if not env.get("PBS_JOBID"):
            return outside_pbs(
                knobs, env.get("DATASET", "") or next((a for a in argv if a.startswith("DATASET=")), "")
            )
        os.chdir(cwd)
        return scheduler.run_job(knobs, env, PbsJob(knobs, env))
    except (KnobError, PbsJobError, LlmftError, OSError) as e:  # OSError: a run directory it cannot create or write
        print(f"{ME}: error: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

"""A job on any scheduler, as named steps, and the interface each scheduler gives it.

`run_job(k, env, scheduler)` is everything slurm/run_llm.slurm and pbs/run_llm.pbs do inside a job, written once: the
run directory (a sweep's element, claimed for this job), the stop signals, the Python llmft runs in, the job's
environment as a value (llmft's files and caches, the network's, the container's, W&B's), each node's allocation and
`llmft plan` for it, llmft train's and torchrun's arguments, the data prepared, one node wrapper (llmft.launch.node)
and torchrun per node, how the training ended (llmft.launch.job.how_it_ended) and what follows: EXPORT after a
finished run, the scheduler's own action after a stop, and after a failure llmft.launch.failure_blame.decide's.

What differs is behind `Scheduler`, as torchx splits materializing a job from scheduling it: llmft.launch.slurm's
`SlurmJob` (srun steps, pyxis containers, Slurm's time limit and requeue) and llmft.launch.pbs's `PbsJob` (pbsdsh
tasks, enroot containers, the walltime and a continuation job). Each holds the scheduler's facts about this job
(submitit's job environments are the model) and acts on them; neither decides anything the other must too.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

from llmft.launch import failure_blame, sweep
from llmft.launch.job import (
    Ending,
    JobError,
    Stop,
    choose_python,
    export_after_training,
    export_command,
    fabric_probe,
    how_it_ended,
    job_environment,
    knobs_line,
    launch_line,
    network_environment,
    newest_complete_step,
    plan_arguments,
    prepare_data,
    report_to,
    run_directory,
    torchrun_command,
    train_flags,
    wandb_environment,
)
from llmft.launch.knobs import Knobs, default_dataset_warning, defaults_line


@runtime_checkable
class Scheduler(Protocol):
    """One scheduler's facts about this job and its actions on it."""

    script: str  # the job script's name, said before each line
    job_id: str
    job_name: str
    submit_dir: Path
    attempt: str  # this run of the job (Slurm: its restart count; PBS: its run count), naming its failures directory
    hosts: list[str]  # the job's nodes; the first hosts the rendezvous and llmft's own steps
    rename: str  # how a job is given another name (said when a live job holds the run directory)
    resources: str  # where the job's resources are asked for (said when llmft plan refuses them)
    restart: failure_blame.Restart  # how the job runs again after a failure
    node_cache: Path  # node-local build caches (llmft.launch.job.cache_variables)
    default_python: str  # the Python llmft runs in without CONTAINER_IMAGE, VENV or a submitting venv
    runner: list[str]  # what starts llmft's own steps (the plan, the data, the export) on the first node

    def say(self, text: str) -> None: ...
    def check(self) -> None: ...  # the scheduler's checks before the run directory is touched
    def variant(self, variants: list[sweep.Variant]) -> sweep.Variant: ...  # a sweep's element of this array job
    def live(self, owner: str) -> str: ...  # the state of another job holding the run directory ("": ended)
    def start(self, run_dir: Path, stop: Stop) -> str: ...  # the stop signals taken; the start line
    def environment(self) -> dict[str, str]: ...  # what the nodes' environment starts from
    def container(self, run_dir: Path, python: str, job_env: dict[str, str]) -> dict[str, str]: ...
    def probe(self, command: list[str], job_env: Mapping[str, str], nodes_file: Path) -> None: ...
    def plan_world(self) -> tuple[int | None, int | None, dict[str, str]]: ...  # nodes, GPUs; variables for the plan
    def kill_chain(self, job_env: dict[str, str]) -> None: ...  # torchrun's wait after a SIGTERM, said
    def rendezvous(self) -> tuple[str, str]: ...  # (host:port, torchrun's --rdzv_conf or "")
    def launch_line(self, launch: Mapping[str, str], torchrun: list[str]) -> str: ...
    def stopped_before_launch(self, stop: Stop) -> int: ...
    def train(self, launch: Mapping[str, str], node: list[str], torchrun: list[str], job_env, stop: Stop) -> int: ...
    def follow(self, ended: Ending, run_dir: Path) -> int: ...  # after a success or a stop: its exit status
    def failure_facts(self) -> tuple[int, list[str], list[str] | None]: ...  # restarts, excluded, usable nodes
    def run_again(self, rc: int, exclude: list[str], restarts: int) -> int: ...  # after a failure; the exit status


def run_job(k: Knobs, env: Mapping[str, str], s: Scheduler) -> int:
    """Inside a job, as named steps (the module's docstring); the job script's exit status."""
    s.check()
    run_dir, _ = run_directory(
        k, s.submit_dir, s.job_name, s.job_id, this_variant=s.variant, live=s.live, rename=s.rename, say=s.say
    )
    files = {n: run_dir / f".llmft-{n}-{s.job_id}" for n in ("stop", "requeue", "job-end", "nodes")}
    for f in files.values():
        f.unlink(missing_ok=True)  # stale from an earlier run of this job
    stop = Stop(files["stop"], s.script)
    started = s.start(run_dir, stop)
    python = choose_python(k, env, s.default_python)
    if not python:
        raise JobError("no python3 on PATH; set VENV=/path/to/venv")
    job_env = {**s.environment(), **job_environment(k, env, s.submit_dir, files, s.node_cache)}
    say_start(k, env, s, started, run_dir, python, job_env)
    job_env.update(network_environment(k["NCCL_PROFILE"], run_dir, s.job_id, job_env, s.say))
    job_env.update(s.container(run_dir, python, job_env))
    launch = plan(k, s, run_dir, python, job_env, files["nodes"])
    if launch is None:
        return 2
    here = {**os.environ, **job_env}  # llmft's own steps on this node
    train = train_flags(k, run_dir, launch, report_to(k))
    if k.flag("PREPARE") and not k.flag("DRY_RUN") and not prepare_data([*s.runner, python], train, s.say, here):
        return 2
    if report_to(k) == "wandb":
        job_env.update(wandb_environment([*s.runner, python], run_dir, here, s.say))
    s.kill_chain(job_env)
    endpoint, rdzv_conf = s.rendezvous()
    torchrun = torchrun_command(python, launch, endpoint, s.job_id, train, rdzv_conf)
    s.say(f"rendezvous c10d at {endpoint} (first host {s.hosts[0]}), id {s.job_id}")
    s.say(s.launch_line(launch, torchrun))
    if k.flag("DRY_RUN"):
        s.say("DRY_RUN=1: not launching")
        return 0
    if stop.signal:
        stop.stop_file.unlink(missing_ok=True)
        return s.stopped_before_launch(stop)
    try:
        return train_and_follow(k, s, run_dir, python, launch, torchrun, job_env, stop, files["requeue"])
    finally:
        if report_to(k) == "wandb":
            wandb_sync_hint(run_dir, job_env, s.say)


def say_start(k: Knobs, env: Mapping[str, str], s: Scheduler, started: str, run_dir, python, job_env) -> None:
    s.say(started)
    s.say(knobs_line(k, run_dir))
    s.say(defaults_line(k))
    raw = "" if "DATASET" in k.defaulted else k["DATASET"]
    warning = default_dataset_warning(k, raw, "llmft plan --dataset_name ... --write DIR prints a complete line")
    if warning:
        s.say(warning)
    s.say(f"python {python}")
    s.say(
        f"caches HF_HOME={job_env['HF_HOME']} (shared: downloads) LLMFT_EXTENSIONS_ROOT="
        f"{job_env['LLMFT_EXTENSIONS_ROOT']} TRITON_CACHE_DIR={job_env['TRITON_CACHE_DIR']} (node-local: "
        "builds, one op cache per environment)"
    )


def plan(k: Knobs, s: Scheduler, run_dir: Path, python: str, job_env: dict[str, str], nodes_file: Path):
    """What each node was given (llmft.planning.allocation, one probe per node), then `llmft plan` for it, before
    anything expensive runs: the plan's launch line (its values set in the job's environment and said), or None when
    the plan refused the job (it said why)."""
    s.probe([python, "-m", "llmft.planning.allocation", *fabric_probe(k["NCCL_PROFILE"])], job_env, nodes_file)
    nnodes, gpus, variables = s.plan_world()
    step = subprocess.run(
        [*s.runner, python, "-m", "llmft.plan", *plan_arguments(k, run_dir, nodes_file, nnodes, gpus)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **job_env, **variables},
    )
    nodes_file.unlink(missing_ok=True)
    if step.stdout.strip():
        print(step.stdout.rstrip("\n"), flush=True)
    if step.returncode == 2:
        s.say(
            "not launching: change what llmft plan names above (knobs such as GLOBAL_BATCH, MICRO_BATCH, ZERO_STAGE, "
            f"DS_CONFIG, OFFLOAD, or {s.resources})"
        )
        return None
    if step.returncode != 0:
        raise JobError(
            f"could not run 'llmft plan' with {python} (exit {step.returncode}); is llmft installed there? Set "
            "VENV=/path/to/venv"
        )
    launch = launch_line(step.stdout)
    for key, value in launch.items():
        if not re.fullmatch(r"[A-Za-z0-9._-]+", value):
            raise JobError(f"cannot read '{key}={value}' in llmft plan's 'llmft launch:' line")
    # Every rank plans (llmft train --auto) and checks with the smallest node's memory, so all pick the same setting.
    job_env["LLMFT_HOST_RAM_GB"] = launch["host_ram_gb"]
    job_env["OMP_NUM_THREADS"] = job_env.get("OMP_NUM_THREADS") or launch["omp_num_threads"]  # else torchrun sets 1
    s.say(
        f"nodes {launch['nnodes']}: {' '.join(s.hosts)}; processes per node {launch['nproc_per_node']}; CPUs per node "
        f"{launch['cpus_per_node']}; OMP_NUM_THREADS={job_env['OMP_NUM_THREADS']}"
    )
    return launch


def train_and_follow(k, s: Scheduler, run_dir, python, launch, torchrun, job_env, stop: Stop, requeue_file) -> int:
    """One node wrapper (llmft.launch.node: its options here) and torchrun per node; then what follows how the
    training ended."""
    failures = run_dir / f".llmft-failures-{s.job_id}-{s.attempt}"
    (run_dir / "nccl_trace").mkdir(exist_ok=True)  # the flight recorder's dumps
    failures.mkdir(exist_ok=True)  # the nodes' failure reports and exit records
    start_step = newest_complete_step(run_dir)
    rc = s.train(launch, ["--job", s.script, "--failures", str(failures)], torchrun, job_env, stop)
    ended = how_it_ended(run_dir, rc, stop, requeue_file)
    if ended.kind == "failed":
        return after_failure(k, s, run_dir, ended, start_step, failures)
    code = s.follow(ended, run_dir)
    if code == 0 and ended.kind == "done":
        command = export_command(k, python, run_dir, s.submit_dir)
        code = export_after_training(command, s.runner, s.say, {**os.environ, **job_env})
    return code


def after_failure(k: Knobs, s: Scheduler, run_dir: Path, ended: Ending, start_step: int, failures: Path) -> int:
    """The failure in one line and whether to run again, by llmft.launch.failure_blame.decide (its docstring says
    why): from the nodes' reports, this attempt's progress, and the nodes the scheduler can still offer."""
    restarts, excluded, usable = s.failure_facts()
    attempt = failure_blame.Attempt(
        job=s.job_id,
        rc=ended.rc,
        hosts=list(s.hosts),
        restarts=restarts,
        max_restarts=int(k["MAX_RESTARTS"]),
        start_step=start_step,
        end_step=ended.step,
        already_excluded=excluded,
        usable=usable,
        trace_dir=str(run_dir / "nccl_trace"),
        restart=s.restart,
    )
    lines, again, exclude = failure_blame.decide(failure_blame.read_reports(failures), attempt)
    for line in lines:
        s.say(line)
    return s.run_again(ended.rc, exclude, restarts) if again else ended.rc


def wandb_sync_hint(run_dir: Path, job_env: Mapping[str, str], say) -> None:
    """The job's last lines: how to upload an offline run (every attempt of this job, in order)."""
    if job_env.get("WANDB_MODE") != "offline":
        return
    run_id = job_env.get("WANDB_RUN_ID", "")
    runs = sorted(Path(job_env.get("WANDB_DIR") or run_dir).joinpath("wandb").glob(f"offline-run-*-{run_id}"))
    if not runs:
        say(f"W&B: no offline run directory for id {run_id} yet")
        return
    say(
        f"W&B ran offline; upload from a machine with internet: wandb sync --id {run_id} -p "
        f"{job_env.get('WANDB_PROJECT', '')} {' '.join(map(str, runs))}"
    )

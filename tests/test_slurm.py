"""slurm/run_llm.slurm on a real local Slurm cluster (slurm/local: munge, slurmctld, slurmd n1 + n2, and n3 in
a hidden partition).

Jobs are submitted with sbatch exactly as a user would, run srun + torchrun + DeepSpeed for real on
two Slurm nodes, and are preempted the way Slurm does it (USR1 to the batch shell, scontrol requeue).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from slurm_cluster import REPO, SCRIPT, SHORT_JOB_S, TRAINING_JOB_S, start_cluster, step_lines, stop_cluster

from llmft.planning.world import expand_hostlist


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    state = tmp_path_factory.mktemp("slurm")
    c = start_cluster(state)
    yield c
    stop_cluster(state)
    pids = (state / "run" / "started.pids").read_text()
    assert pids == "", f"stop.sh left pids recorded: {pids}"
    assert not job_processes(state / "slurm.conf"), "stop.sh left processes of the cluster's jobs running"


def job_processes(conf: Path) -> list[int]:
    """Processes of a job of the cluster whose configuration is `conf` (a hung rank's, reparented when Slurm killed
    its torchrun, survives the job under proctrack/linuxproc: stop.sh ends them)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            variables = environ.read_bytes().split(b"\0")
        except OSError:
            continue
        if f"SLURM_CONF={conf}".encode() in variables and any(v.startswith(b"SLURM_JOB_ID=") for v in variables):
            found.append(int(environ.parent.name))
    return found


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def optim_shards(tag_dir: Path) -> list[str]:
    return sorted(p.name for p in tag_dir.glob("*optim_states.pt"))


def signal_when_training(cluster, job: str, log: Path, min_step: int, command: list[str]) -> dict:
    """In the background: once rank 0 has reported `min_step`, preempt the job with `command`."""
    result: dict = {}

    def watch():
        deadline = time.time() + TRAINING_JOB_S
        try:
            while time.time() < deadline:
                steps = step_lines(read(log))
                if steps and max(steps) >= min_step:
                    result["at_step"] = max(steps)
                    result["at_time"] = time.time()
                    result["proc"] = cluster.cmd(command, check=False)
                    return
                state = cluster.job(job).get("JobState")
                if state not in ("PENDING", "CONFIGURING", "RUNNING"):
                    result["error"] = f"job {job} was {state} before step {min_step}"
                    return
                time.sleep(0.3)
            result["error"] = f"job {job} reached no step {min_step} in 600 s"
        except Exception as e:  # reported by the test that waits for this job
            result["error"] = repr(e)

    result["thread"] = threading.Thread(target=watch, daemon=True)
    result["thread"].start()
    return result


@pytest.fixture(scope="module")
def jobs(cluster, tiny_model, tiny_data, tmp_path_factory):
    """The training jobs, submitted together so they overlap (each takes one CPU per node)."""
    submitted = {}
    # The user's command: sbatch slurm/run_llm.slurm --export=ALL,EPOCHS=1,... (sbatch hands --export=... to the script).
    cwd = tmp_path_factory.mktemp("users_job")
    knobs = (
        f"--export=ALL,EPOCHS=1,MODEL={tiny_model},DATASET={tiny_data},DATA_PERCENTAGE=25,GLOBAL_BATCH=4,MICRO_BATCH=2"
    )
    # Its own llmft cache: the other jobs here train on the same file at the same time, and the one that hashes it
    # first keeps the fingerprint for all (the test counts this job's hashing).
    submitted["users"] = (
        cluster.sbatch([str(SCRIPT), knobs], cwd=cwd, LLMFT_CACHE=str(cwd / "llmft-cache")),
        cwd,
        None,
    )

    # Preemption twice over: Slurm's time-limit signal (USR1 to the batch shell, as --signal=B:USR1@120 sends it,
    # with no periodic checkpoints, so the only one before the end is the one the signal asks for), and an
    # outside `scontrol requeue` (SIGTERM to every process of the job, checkpoints every 2 steps).
    # The USR1 job holds at step 2 until the stop file appears (sent once step 1 is logged): the stop lands at step 2
    # however loaded the machine (it once finished all its steps before the signal arrived).
    # The requeued job also logs to W&B, with the mode left to the job: the server (a closed local port) does not answer.
    wandb = {"WANDB_MODE": "", "WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_API_KEY": WANDB_SECRET}
    for name, save_steps, min_step, command, extra, env in (
        ("usr1", 1000, 1, ["scancel", "--signal=USR1", "--batch"], "", {"LLMFT_TEST_HOLD_AT_STEP": "2"}),
        # every checkpoint kept (the script keeps 2 by default), so the test can inspect the one resumed from
        ("requeue", 2, 5, ["scontrol", "requeue"], ",WANDB_PROJECT=llmft-test,SAVE_TOTAL_LIMIT=0", wandb),
    ):
        cwd = tmp_path_factory.mktemp(name)
        knobs = (
            f"--export=ALL,MAX_STEPS={TOTAL},GLOBAL_BATCH=16,MICRO_BATCH=2,SAVE_STEPS={save_steps},DATA_PERCENTAGE=100,"
            f"MODEL={tiny_model},DATASET={tiny_data},CHECKPOINT_DIR={cwd / 'ckpt'},VENV={sys.prefix},EXTRA_ARGS=--logging_steps 1{extra}"
        )
        job = cluster.sbatch([str(SCRIPT), knobs], cwd=cwd, **env)
        submitted[name] = (
            job,
            cwd,
            signal_when_training(cluster, job, cwd / f"llmft-{job}.out", min_step, [*command, job]),
        )

    # The time limit, with a checkpoint that takes longer to write (12 s) than the USR1 lead (5 s): at step 3 the job's
    # time left becomes 40 s (a test hook; the job's real limit is 30 min, read from squeue at the start), less than
    # the run's final-save lead (1.5 x the estimated save + a step + 60 s): it stops, saves, and requeues itself.
    cwd = tmp_path_factory.mktemp("time_limit")
    knobs = (
        f"--export=ALL,MAX_STEPS={TOTAL},GLOBAL_BATCH=16,MICRO_BATCH=2,SAVE_STEPS=1000,DATA_PERCENTAGE=100,MODEL={tiny_model},"
        f"DATASET={tiny_data},CHECKPOINT_DIR={cwd / 'ckpt'},VENV={sys.prefix},EXTRA_ARGS=--logging_steps 1"
    )
    job = cluster.sbatch(
        ["--time=30", "--signal=B:USR1@5", str(SCRIPT), knobs],
        cwd=cwd,
        LLMFT_TEST_TIME_LEFT_AT_STEP="3:40",
        LLMFT_TEST_SAVE_DELAY_S="12",
    )
    submitted["time_limit"] = (job, cwd, None)

    # A user's plain `scancel`: the job must end, not requeue itself.
    cwd = tmp_path_factory.mktemp("cancel")
    knobs = f"--export=ALL,MAX_STEPS=200,MODEL={tiny_model},DATASET={tiny_data},GLOBAL_BATCH=4,MICRO_BATCH=2,EXTRA_ARGS=--logging_steps 1"
    job = cluster.sbatch([str(SCRIPT), knobs], cwd=cwd)
    submitted["cancel"] = (job, cwd, signal_when_training(cluster, job, cwd / f"llmft-{job}.out", 2, ["scancel", job]))
    return submitted


TOTAL = 20
STOP_TOTAL = 6  # the llmft stop job's steps
WANDB_SECRET = "wandb-secret-0123456789abcdef0123456789abcdef"


def finished_preempted_job(cluster, job, cwd, signal) -> tuple[str, Path]:
    info = cluster.wait(job, timeout=TRAINING_JOB_S)
    signal["thread"].join(timeout=5)
    text = read(cwd / f"llmft-{job}.out")
    assert "error" not in signal, f"{signal['error']}\n{text}"
    assert signal["proc"].returncode == 0, signal["proc"].stderr
    assert info["JobState"] == "COMPLETED", f"{info}\n{text}"
    assert info["ExitCode"] == "0:0"
    assert info["Restarts"] == "1", f"the job should have been requeued exactly once: {info}\n{text}"
    assert re.search(rf"run_llm.slurm: job {job} \(llmft\) restart 1,", text), text
    return text, cwd / "ckpt"


def assert_resumed_without_losing_or_repeating(text: str, ckpt: Path) -> int:
    """The second run resumed from the newest complete checkpoint K and trained exactly K+1..TOTAL."""
    m = re.search(r"llmft: resuming from (\S+)/checkpoint-(\d+)\n", text)
    assert m and m.group(1) == str(ckpt), text
    resumed = int(m.group(2))
    restart = text.index("restart 1,")
    first_run, second_run = text[:restart], text[restart:]
    first_steps = step_lines(first_run)
    assert first_steps == list(range(1, len(first_steps) + 1)) and len(first_steps) >= resumed, first_steps
    assert step_lines(second_run) == list(range(resumed + 1, TOTAL + 1))
    # The checkpoint resumed from was complete: every rank's shard, then the marker.
    tag = ckpt / f"checkpoint-{resumed}" / f"global_step{resumed}"
    assert optim_shards(tag) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    assert json.loads((ckpt / f"checkpoint-{resumed}" / "llmft_complete.json").read_text())["world_size"] == 2
    # The persisted history agrees: one loss entry per step, 1..TOTAL, none twice.
    history = json.loads((ckpt / f"checkpoint-{TOTAL}" / "trainer_state.json").read_text())["log_history"]
    assert [h["step"] for h in history if "loss" in h] == list(range(1, TOTAL + 1))
    assert json.loads((ckpt / "llmft_done.json").read_text())["global_step"] == TOTAL
    assert f"training complete at step {TOTAL}" in text
    assert not list(ckpt.glob(".llmft-stop-*")), "the stop file must be cleaned up"
    return resumed


def test_time_limit_signal_checkpoints_every_rank_requeues_and_resumes(cluster, jobs):
    job, cwd, signal = jobs["usr1"]
    text, ckpt = finished_preempted_job(cluster, job, cwd, signal)
    m = re.search(r"llmft: stop requested; saved checkpoint-(\d+)\n", text)
    assert m, text
    stop = int(m.group(1))
    assert signal["at_step"] < stop == 2  # held at step 2 until the signal's stop file appeared
    assert "got SIGUSR1" in text
    assert f"requeueing job {job}" in text
    # Every rank exited cleanly after its stop checkpoint (a rank whose DataLoader workers outlived it once held
    # torchrun's exit barrier for 300 s and turned the stop into exit 1: past a real time limit, no requeue).
    assert "stopped early (exit 0) after a checkpoint" in text and "exit barrier" not in text, text
    # It resumed from exactly the checkpoint the signal asked for, and the first run trained up to it.
    assert assert_resumed_without_losing_or_repeating(text, ckpt) == stop
    assert step_lines(text[: text.index("restart 1,")]) == list(range(1, stop + 1))


def test_llmft_stop_continue_checkpoints_every_rank_and_the_job_requeues_and_resumes(
    cluster, tiny_model, tiny_data, tmp_path
):
    """`llmft stop CKPT --continue` on the submit host while the job trains: every rank stops at step 2 (held there
    until the request, which is sent once step 1 is logged) with a complete checkpoint, the job requeues itself, and
    the requeued job trains 3..6."""
    cwd = tmp_path
    knobs = (
        f"--export=ALL,MAX_STEPS={STOP_TOTAL},GLOBAL_BATCH=16,MICRO_BATCH=2,SAVE_STEPS=1000,DATA_PERCENTAGE=100,"
        f"MODEL={tiny_model},DATASET={tiny_data},CHECKPOINT_DIR={cwd / 'ckpt'},VENV={sys.prefix},"
        "EXTRA_ARGS=--logging_steps 1"
    )
    job = cluster.sbatch([str(SCRIPT), knobs], cwd=cwd, LLMFT_TEST_HOLD_AT_STEP="2")
    stop = [sys.executable, "-m", "llmft.cli", "stop", str(cwd / "ckpt"), "--continue"]
    signal = signal_when_training(cluster, job, cwd / f"llmft-{job}.out", 1, stop)
    text, ckpt = finished_preempted_job(cluster, job, cwd, signal)
    assert signal["proc"].stdout.startswith(f"llmft stop: asked Slurm job {job} to stop"), signal["proc"].stdout
    assert "then the job requeues itself" in signal["proc"].stdout
    assert "llmft: stop requested; saved checkpoint-2\n" in text, text
    assert f"stopped by llmft stop --continue (exit 0) after a checkpoint; requeueing job {job}" in text, text
    first, second = text.split("restart 1,", 1)
    assert step_lines(first) == [1, 2] and step_lines(second) == list(range(3, STOP_TOTAL + 1)), text
    assert f"llmft: resuming from {ckpt}/checkpoint-2\n" in second, second
    assert optim_shards(ckpt / "checkpoint-2" / "global_step2") == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    assert json.loads((ckpt / "llmft_done.json").read_text())["global_step"] == STOP_TOTAL
    assert "got SIGUSR1" not in text and not list(ckpt.glob(".llmft-stop-*"))


def test_a_save_longer_than_the_usr1_lead_starts_early_enough_and_the_job_requeues_and_resumes(cluster, jobs):
    job, cwd, _ = jobs["time_limit"]
    info = cluster.wait(job, timeout=TRAINING_JOB_S)
    text = read(cwd / f"llmft-{job}.out")
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", f"{info}\n{text}"
    first = text[: text.index("restart 1,")]
    # The kill chain: torchrun waits longer for its ranks than Slurm's KillWait (10 s in slurm/local).
    assert "kill chain: Slurm's KillWait 10 s, partition debug GraceTime 0 s, " in first, first
    assert "torchrun waits 40 s for its ranks (TORCH_ELASTIC_SHUTDOWN_TIMEOUT)" in first, first
    # The job's end, read from squeue: 30 min from its start, less the start-up before rank 0 asks (356 s seen in a
    # CI run beside another pytest worker: a bound on the start-up would race the machine's load).
    m = re.search(rf"llmft: Slurm job {job} ends in (\d+) s; the final save starts (\d+) s before that", first)
    assert m and 600 < int(m.group(1)) <= 1800 and 60 <= int(m.group(2)) < 120, first
    assert re.search(
        rf"llmft: Slurm job {job} ends in 40 s: starting the final save now, \d+ s before the time limit "
        r"\(no save measured yet, estimated 0 s; x1.5 \+ a [\d.]+ s step \+ 60 s\)",
        first,
    ), first
    saved = re.search(
        r"llmft: checkpoint-3 written and published in ([\d.]+) s; the final save now starts (\d+) s before", first
    )
    assert saved and float(saved.group(1)) >= 12 and int(saved.group(2)) >= 1.5 * 12 + 60, first
    assert "llmft: stopped for the time limit; saved checkpoint-3\n" in first
    assert f"llmft stopped for its final save before the time limit (exit 0); requeueing job {job}" in first
    assert "got SIGUSR1" not in text  # the USR1 (5 s before a 30 min limit) never came: the run stopped itself
    # The requeued attempt starts from the save the first one measured, not from the estimate.
    again = re.search(
        rf"llmft: Slurm job {job} ends in \d+ s; the final save starts (\d+) s before that \(the longest "
        r"save so far took ([\d.]+) s",
        text[len(first) :],
    )
    assert again and abs(float(again.group(2)) - float(saved.group(1))) <= 0.1 and int(again.group(1)) >= 78, text[
        len(first) :
    ]
    assert assert_resumed_without_losing_or_repeating(text, cwd / "ckpt") == 3
    assert not list((cwd / "ckpt").glob(".llmft-requeue-*")), "the requeue file must be cleaned up"


def test_the_job_end_is_read_from_slurm_and_again_after_a_time_limit_change(cluster, tmp_path, monkeypatch):
    from llmft.training.job_deadline import UNANSWERED, query_time_left

    job = cluster.cmd(["sbatch", "--parsable", "--time=5", "--wrap", "sleep 300"], cwd=tmp_path).stdout.strip()
    try:
        deadline = time.time() + SHORT_JOB_S
        while cluster.job(job)["JobState"] != "RUNNING" and time.time() < deadline:
            time.sleep(0.5)
        monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
        assert 240 < query_time_left(job) <= 300
        cluster.cmd(["scontrol", "update", f"JobId={job}", "TimeLimit=10"])
        assert 540 < query_time_left(job) <= 600
    finally:
        cluster.cmd(["scancel", job])
    assert query_time_left("999999") == UNANSWERED  # no such job: squeue fails, and says nothing of a limit


def test_scontrol_requeue_resumes_from_the_newest_complete_checkpoint(cluster, jobs):
    job, cwd, signal = jobs["requeue"]
    text, ckpt = finished_preempted_job(cluster, job, cwd, signal)
    resumed = assert_resumed_without_losing_or_repeating(text, ckpt)
    # Checkpoints every 2 steps: at least the one before the requeue (step >= 5 had been reported).
    assert resumed >= 4, text


def test_a_job_stopped_on_two_nodes_resumes_on_one_node(cluster, tiny_model, tiny_data, tmp_path):
    """Trained on 2 nodes, stopped (scancel: every rank checkpoints), resubmitted with `sbatch --nodes=1` and the same
    CHECKPOINT_DIR: the checkpoint written by 2 ranks is converted to a universal checkpoint and training continues on
    1 rank with the same global batch, neither repeating nor skipping a step. (Room for the stop: scancel asked at
    step 3 has landed as late as step 7 on a loaded machine, and a stop at the last step is a finished run.)"""
    max_steps = 20
    ckpt = tmp_path / "ckpt"
    knobs = (
        f"--export=ALL,MAX_STEPS={max_steps},GLOBAL_BATCH=8,MICRO_BATCH=2,SAVE_STEPS=2,DATA_PERCENTAGE=100,MODEL={tiny_model},"
        f"DATASET={tiny_data},CHECKPOINT_DIR={ckpt},VENV={sys.prefix},EXTRA_ARGS=--logging_steps 1"
    )
    first = cluster.sbatch([str(SCRIPT), knobs], cwd=tmp_path)
    log = tmp_path / f"llmft-{first}.out"
    signal = signal_when_training(cluster, first, log, 3, ["scancel", first])
    signal["thread"].join(timeout=TRAINING_JOB_S)
    assert "error" not in signal and signal["proc"].returncode == 0, (signal, read(log))
    assert cluster.wait(first, timeout=SHORT_JOB_S)["JobState"] == "CANCELLED"
    before = read(log)
    assert "llmft plan: world size 2 (2 nodes x 1 processes" in before and "gradient accumulation 2" in before, before

    second = cluster.sbatch(["--nodes=1", str(SCRIPT), knobs], cwd=tmp_path)
    info = cluster.wait(second, timeout=TRAINING_JOB_S)
    text = read(tmp_path / f"llmft-{second}.out")
    assert info["JobState"] == "COMPLETED" and info["NodeList"] in ("n1", "n2"), f"{info}\n{text}"
    assert "run_llm.slurm: nodes 1: n" in text and "llmft plan: world size 1 (1 nodes x 1 processes" in text, text
    m = re.search(
        r"llmft: resuming checkpoint-(\d+) written by 2 ranks on 1 ranks: universal checkpoint (\S+) "
        r"\(converted in \d+ s\), accumulation 2 -> 4, global batch 8 kept\n",
        text,
    )
    assert m, text
    resumed = int(m.group(1))
    assert m.group(2) == str(ckpt / f"checkpoint-{resumed}" / f"universal_step{resumed}")
    # The conversion was sized for the node it ran on: its workers and their memory said before it ran.
    assert re.search(
        rf"llmft: converting {ckpt}/checkpoint-{resumed} \(2 ranks, ZeRO stage 2\) to a universal checkpoint with "
        r"[12] extract and [12] merge worker\(s\) \(about [\d.]+ GiB host RAM of the [\d.]+ free for it here\)\n",
        text,
    ), text
    assert step_lines(before)[-1] >= resumed >= 2
    assert resumed < max_steps, before
    assert step_lines(text) == list(range(resumed + 1, max_steps + 1))  # nothing trained twice, nothing skipped
    assert json.loads((ckpt / f"checkpoint-{max_steps}" / "llmft_complete.json").read_text())["world_size"] == 1
    assert json.loads((ckpt / "llmft_done.json").read_text())["global_step"] == max_steps


def test_wandb_offline_run_is_named_by_the_job_and_the_requeued_job_appends_to_it(cluster, jobs):
    from wandb_file import run_info

    job, cwd, _ = jobs["requeue"]
    info = cluster.wait(job, timeout=TRAINING_JOB_S)
    text = read(cwd / f"llmft-{job}.out")
    assert info["JobState"] == "COMPLETED", text
    m = re.search(rf"W&B run llmft-{job} \(id (\S+), group llmft\) in project llmft-test, mode offline\n", text)
    assert m, text
    run_id = m.group(1)
    assert text.count(f"W&B run llmft-{job} (id {run_id}, group llmft)") == 2  # the requeued attempt: the same run
    runs = sorted((cwd / "ckpt" / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 2, list((cwd / "ckpt" / "wandb").iterdir())
    attempts = [run_info(next(r.glob("*.wandb"))) for r in runs]
    resumed = int(re.search(r"llmft: resuming from \S+/checkpoint-(\d+)\n", text).group(1))
    steps = []
    for attempt in attempts:
        assert (attempt["run_id"], attempt["name"], attempt["group"]) == (run_id, f"llmft-{job}", "llmft")
        steps.append(sorted({int(h["train/global_step"]) for h in attempt["history"] if "train/loss" in h}))
    # SIGTERM ends W&B's service with the job step: the first attempt keeps what it flushed (every 2 s) before that,
    # in order and never past the checkpoint; on a loaded machine the signal can come before the first flush (seen
    # in a full-suite run at load 4 on 2 cores), so an empty first attempt is allowed.
    assert steps[0] == list(range(1, len(steps[0]) + 1)) and (not steps[0] or steps[0][-1] <= resumed), steps
    assert steps[1] == list(range(resumed + 1, TOTAL + 1))  # the metrics after the requeue continue the run
    # The dead service did not end the run through the training loop (llmft.training.wandb_env.guard_wandb): the stop's
    # checkpoint was written and the run was resumed from it. (wandb's own exit hook may still print its error.)
    assert "llmft/train.py" not in text and text.count("llmft: W&B stopped logging") <= 1
    assert f"stop requested; saved checkpoint-{resumed}" in text
    last = text.rstrip().splitlines()[-1]
    assert last == (
        f"run_llm.slurm: W&B ran offline; upload from a machine with internet: wandb sync --id {run_id} "
        f"-p llmft-test {runs[0]} {runs[1]}"
    )
    assert WANDB_SECRET not in text


# ---- the user's command on two nodes ------------------------------------------------------------


def test_users_sbatch_command_trains_on_two_nodes_and_the_checkpoint_serves_inference(cluster, jobs, tiny_data):
    job, cwd, _ = jobs["users"]
    info = cluster.wait(job, timeout=TRAINING_JOB_S)
    log = cwd / f"llmft-{job}.out"  # %x-%j.out in the submit directory
    text = read(log)
    assert info["JobState"] == "COMPLETED", f"{info}\n{text}"
    # The default CHECKPOINT_DIR: runs/<job name>-<run key> under the submit directory.
    [ckpt] = (cwd / "runs").iterdir()
    assert re.fullmatch(r"llmft-[0-9a-f]{8}", ckpt.name), ckpt
    assert info["ExitCode"] == "0:0"
    assert info["NodeList"] == "n[1-2]"

    # The first lines: the resolved plan, before anything is launched.
    lines = text.splitlines()
    launch = next(i for i, line in enumerate(lines) if line.startswith("run_llm.slurm: launch: srun"))
    head = "\n".join(lines[:launch])
    assert lines[0].startswith(f"run_llm.slurm: job {job} (llmft) restart 0")
    for expected in (
        "run_llm.slurm: nodes 2: n1 n2; processes per node 1; CPUs per node 4",
        "llmft launch: nnodes=2 nproc_per_node=1 cpus_per_node=4 ",
        f"python {sys.prefix}/bin/python",  # the environment it was submitted from
        "llmft plan: world size 2 (2 nodes x 1 processes",
        "llmft plan: micro-batch 2 per process",
        "llmft plan: gradient accumulation 1",
        "llmft plan: global batch 4 = micro-batch 2 x accumulation 1 x world size 2",
        "llmft plan: ZeRO stage 2",
        f"llmft plan: checkpoint dir {ckpt}",
        f"rendezvous c10d at 127.0.0.1:{20000 + int(job) % 10000} (first host n1)",
    ):
        assert expected in head, f"{expected!r} not in the job's first lines:\n{head}"
    assert "--nnodes 2 --nproc_per_node 1 --rdzv_backend c10d" in lines[launch]
    assert "srun --nodes=2 --ntasks-per-node=1 --cpus-per-task=4 " in lines[launch]  # #SBATCH --cpus-per-gpu=4 x 1 GPU
    # One torchrun per Slurm node with the job's CPUs there (as Slurm reports them inside the step), and the
    # run's world spans both.
    assert "run_llm.slurm: node n1 (node rank 0): torchrun with 1 GPU(s) and 4 CPU(s)" in text
    assert "run_llm.slurm: node n2 (node rank 1): torchrun with 1 GPU(s) and 4 CPU(s)" in text
    assert "llmft plan: world size 2 (2 nodes x 1 processes, from torchrun)" in text
    # The data is read once for both ranks' fingerprints (prepared data and the run's identity): one process hashed it.
    assert text.count(f"llmft: hashed dataset {tiny_data}: 1 file(s)") == 1, text

    # One shard per rank in a complete checkpoint; the run is marked done.
    done = json.loads((ckpt / "llmft_done.json").read_text())
    step = done["global_step"]
    assert step == 16  # 25% of 256 examples = 64, global batch 4
    tag = ckpt / f"checkpoint-{step}" / f"global_step{step}"
    assert optim_shards(tag) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    assert json.loads((ckpt / f"checkpoint-{step}" / "llmft_complete.json").read_text())["world_size"] == 2

    # Inference straight from the ZeRO checkpoint.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmft.infer",
            str(tag),
            "--prompt",
            "What is 2 plus 3?",
            "--max_new_tokens",
            "8",
            "--json",
        ],
        cwd=REPO,
        env=cluster.env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert result["world_size"] == 2 and result["step"] == step
    assert len(result["generations"]) == 1 and result["generations"][0]["prompt"].startswith("What is 2 plus 3?")


def test_a_cancelled_job_ends_and_is_not_requeued(cluster, jobs):
    job, cwd, signal = jobs["cancel"]
    signal["thread"].join(timeout=TRAINING_JOB_S)
    assert "error" not in signal and signal["proc"].returncode == 0, signal
    info = cluster.wait(job, timeout=SHORT_JOB_S)
    assert info["JobState"] == "CANCELLED", info
    # Longer than the local cluster's requeue delay (cred_expire=20 s) after the cancel: it stays cancelled.
    time.sleep(max(0.0, signal["at_time"] + 35 - time.time()))
    info = cluster.job(job)
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", info
    text = read(cwd / f"llmft-{job}.out")
    assert "requeueing" not in text and "restart 1" not in text, text
    assert "training complete" not in text


# ---- bad knobs fail in the job's first lines ------------------------------------------------------


BAD = [
    # (sbatch arguments, message in the log)
    (
        ["{script}", "--export=ALL,EPOCHS=abc"],
        "run_llm.slurm: error: EPOCHS=abc is not a positive number (default 3)",
    ),
    (
        ["--export=ALL,EPOCHS=abc", "{script}"],
        "run_llm.slurm: error: EPOCHS=abc is not a positive number (default 3)",
    ),
    (
        ["{script}", "--export=ALL,EPOCHS=1,EPOCH=3"],
        "run_llm.slurm: error: unknown knob 'EPOCH' in '--export=ALL,EPOCHS=1,EPOCH=3'; did you mean EPOCHS? known "
        "knobs: EPOCHS CHECKPOINT_DIR",
    ),
    (
        ["{script}", "--export=ALL,ZERO_STAGE=7"],
        "run_llm.slurm: error: ZERO_STAGE=7 is not a ZeRO stage; use 0, 1, 2 or 3",
    ),
    # A local dataset that does not exist: the batch host says so before any srun, as the job's only line.
    (
        ["{script}", "--export=ALL,DATASET=missing.jsonl"],
        "run_llm.slurm: error: DATASET=missing.jsonl: no such file or directory (looked in ",
    ),
    # sbatch's own --export splits a value at its commas and drops the rest; the job names what was lost.
    (
        ["--export=ALL,CONTAINER_IMAGE=img,CONTAINER_MOUNTS=/data:/data,/models:/models", "{script}"],
        "'/models:/models' in 'sbatch --export=ALL,CONTAINER_IMAGE=img,CONTAINER_MOUNTS=/data:/data,/models:/models' is not KEY=VALUE",
    ),
    # The EFA profile on a node without EFA (like a g6): refused, not silently slow.
    (["{script}", "--export=ALL,NCCL_PROFILE=aws-efa"], "NCCL_PROFILE=aws-efa, but node"),
    # Knobs that look fine alone but make an impossible plan: llmft plan says so before torchrun starts.
    (["{script}", "--export=ALL,GLOBAL_BATCH=3,MICRO_BATCH=2"], "llmft plan: error:"),
    # Less memory than the run needs (sbatch --mem below the plan's host RAM): stopped before any model loads, naming
    # the limit and the flag, for the default ZERO_STAGE=2 as for auto.
    (
        ["--mem=300", "{script}", "--export=ALL,MODEL={model},GLOBAL_BATCH=4,MICRO_BATCH=2"],
        "llmft plan: error: memory: ZeRO-2, micro-batch 2 x accumulation 1, gradient checkpointing on does not fit on 2 x 1 CPU "
        "process per node (no GPU), 0.3 GiB host RAM per node (the job's limit: SLURM_MEM_PER_NODE=300 MB): host RAM: needs ",
    ),
    (
        ["--mem=300", "{script}", "--export=ALL,MODEL={model},GLOBAL_BATCH=4,MICRO_BATCH=2,ZERO_STAGE=auto"],
        "llmft plan: error: nothing fits: the closest, ZeRO-3, micro-batch 1 x accumulation 2, gradient checkpointing on, "
        "breaks host RAM: needs ",
    ),
    # a3's GPUDirect-TCPX without its plugin and RxDM (every node is checked): refused, not silently TCP.
    (
        ["{script}", "--export=ALL,NCCL_PROFILE=gcp-tcpx"],
        "llmft plan: error: node n1: NCCL_PROFILE=gcp-tcpx: the GPUDirect-TCPX NCCL plugin (libnccl-net.so) is not on the "
        "library path; install it (Google's nccl-plugin-gpudirecttcpx puts it in /var/lib/tcpx/lib64); no "
        "receive-datapath-manager (RxDM) socket directory /run/tcpx",
    ),
]


def test_bad_knobs_fail_in_the_jobs_first_lines_with_one_clear_message(cluster, tiny_model, tmp_path):
    jobs = []
    for i, (args, message) in enumerate(BAD):
        args = [a.replace("{model}", str(tiny_model)) for a in args]
        cwd = tmp_path / str(i)
        cwd.mkdir()
        # A /sys without EFA, whatever the machine running the tests has.
        jobs.append(
            (
                cluster.sbatch(
                    [a.replace("{script}", str(SCRIPT)) for a in args], cwd=cwd, LLMFT_SYSFS_ROOT=str(tmp_path)
                ),
                cwd,
                args,
                message,
            )
        )
    for job, cwd, args, message in jobs:
        info = cluster.wait(job, timeout=SHORT_JOB_S)
        text = read(cwd / f"llmft-{job}.out")
        assert info["JobState"] == "FAILED", f"{args}: {info}\n{text}"
        assert info["ExitCode"] == "2:0", f"{args}: {info}"
        assert message in text, f"{args}: {message!r} not in\n{text}"
        assert "launch: srun" not in text and "torch.distributed.run" not in text, text
        assert text.count("error:") == 1, text
        if not message.startswith("llmft plan"):
            assert text.splitlines()[0].startswith("run_llm.slurm: error:"), text  # before anything else
        else:
            assert re.search(r"nearest|use|try|install", text.split("llmft plan: error:")[1]), text
        if "DATASET=missing.jsonl" in message:  # and the job's last line: no rank, no srun blamed after it
            assert text.strip().splitlines() == [text.splitlines()[0]] and str(cwd) in text, text
        if "--mem=300" in args:  # the limit and the flag that fixes it
            assert re.search(
                r"the job's allocation is the limit \(SLURM_MEM_PER_NODE=300 MB\): ask Slurm for \d+ GiB per node "
                r"with sbatch --mem=\d+G \(or --mem=0 for the whole node\)\n",
                text,
            ), text


def test_prepare_runs_llmft_prepare_before_srun_and_its_failure_stops_the_launch(cluster, tiny_model, tmp_path):
    """PREPARE=1 (llmft.launch.job.prepare_data, shared with the PBS job): llmft prepare with the training's flags runs
    on the batch host after the plan; data it cannot read stops the job there, exit 2, before any training step."""
    (tmp_path / "bad.jsonl").write_text('{"foo": "bar"}\n')
    job = cluster.sbatch(
        [
            str(SCRIPT),
            f"--export=ALL,MODEL={tiny_model},DATASET=bad.jsonl,PREPARE=1,MAX_STEPS=1,GLOBAL_BATCH=2,MICRO_BATCH=1",
        ],
        cwd=tmp_path,
    )
    info = cluster.wait(job, timeout=SHORT_JOB_S)
    text = read(tmp_path / f"llmft-{job}.out")
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", f"{info}\n{text}"
    assert "run_llm.slurm: preparing the data (llmft prepare, cache " in text, text
    assert "llmft prepare: error: dataset has columns foo but llmft needs" in text, text
    assert "run_llm.slurm: not launching: llmft prepare failed (exit 2)\n" in text, text
    assert "rendezvous c10d" not in text and "launch: srun" not in text, text


# ---- resources: change #SBATCH --gpus-per-node only ---------------------------------------------


def fake_sysfs_with_efa(root: Path) -> Path:
    """/sys as an EFA instance (p4d, p5) shows it: an RDMA device bound to the efa driver."""
    device = root / "class" / "infiniband" / "rdmap16s27" / "device"
    device.mkdir(parents=True)
    driver = root / "bus" / "pci" / "drivers" / "efa"
    driver.mkdir(parents=True)
    (device / "driver").symlink_to(driver)
    return root


def fake_libraries(root: Path, *names: str) -> Path:
    """A library directory holding these (empty) files: what the loader-path checks look for, not what NCCL loads."""
    root.mkdir(parents=True)
    for name in names:
        (root / name).touch()
    return root


def test_more_gpus_per_node_needs_no_other_edit_and_keeps_the_global_batch(cluster, tmp_path):
    edited = tmp_path / "run_llm_4gpu.slurm"
    original = SCRIPT.read_text()
    assert "#SBATCH --gpus-per-node=1\n" in original and "#SBATCH --cpus-per-gpu=4\n" in original
    edited.write_text(original.replace("#SBATCH --gpus-per-node=1\n", "#SBATCH --gpus-per-node=4\n"))
    knobs = "--export=ALL,DRY_RUN=1,GLOBAL_BATCH=32,MICRO_BATCH=4,NCCL_PROFILE=aws-efa"
    efa = str(fake_sysfs_with_efa(tmp_path / "sys"))
    # The aws-ofi-nccl plugin and libfabric where the loader finds them (LD_LIBRARY_PATH), as on a DLAMI.
    libs = str(fake_libraries(tmp_path / "ofi", "libnccl-net-ofi.so", "libfabric.so.1"))
    # sbatch's own --export: knobs in the environment; no OMP_NUM_THREADS of the user's, so llmft's split decides.
    one = cluster.sbatch(
        [knobs, str(SCRIPT)], cwd=tmp_path, LLMFT_SYSFS_ROOT=efa, OMP_NUM_THREADS="", LD_LIBRARY_PATH=libs
    )
    two = cluster.sbatch(
        [
            str(edited),
            knobs
            + ",LORA=1,WANDB_PROJECT=llmft-test,EXTRA_ARGS=--seed 7 --logging_steps 5 --dataloader_num_workers 0 --save_total_limit 3",
        ],
        cwd=tmp_path,
        NCCL_SOCKET_IFNAME="eth9",
        LLMFT_SYSFS_ROOT=efa,
        OMP_NUM_THREADS="3",
        LD_LIBRARY_PATH=libs,
    )
    for job in (one, two):
        assert cluster.wait(job, timeout=SHORT_JOB_S)["JobState"] == "COMPLETED", read(tmp_path / f"llmft-{job}.out")
    a, b = read(tmp_path / f"llmft-{one}.out"), read(tmp_path / f"llmft-{two}.out")

    # The world and the CPU split come from llmft plan (one decision), read off the job's allocation.
    assert "world size 2 (2 nodes x 1 processes, from slurm)" in a and "gradient accumulation 4" in a
    assert "processes per node 1; CPUs per node 4; OMP_NUM_THREADS=4" in a
    assert "--cpus-per-task=4 " in a and "--dataloader_num_workers 2 --dataset_num_proc 4" in a
    assert "world size 8 (2 nodes x 4 processes, from slurm)" in b and "gradient accumulation 1" in b
    assert "--nnodes 2 --nproc_per_node 4 " in b
    # --cpus-per-gpu=4 x 4 GPUs: the step gets all 16 CPUs; the user's OMP_NUM_THREADS and workers flag win.
    assert "processes per node 4; CPUs per node 16; OMP_NUM_THREADS=3" in b and "--cpus-per-task=16 " in b
    assert "4 per process (OMP_NUM_THREADS=4), 2 dataloader workers per process, 16 tokenisation processes" in b
    assert (
        "--dataset_num_proc 16 " in b
        and b.count("--dataloader_num_workers") == 1
        and "--dataloader_num_workers 0" in b
    )
    for text in (a, b):
        assert "global batch 32 = " in text
        assert "DRY_RUN=1: not launching" in text
        assert "nccl FI_PROVIDER=efa" in text
        # NCCL is told to use the plugin by name: it fails at start rather than falling back to sockets.
        assert "nccl NCCL_NET_PLUGIN=ofi" in text and "nccl NCCL_NET=AWS Libfabric" in text
    assert "nccl NCCL_SOCKET_IFNAME=eth9" in b  # a setting the user exported wins over the profile
    # Knobs become llmft train flags; EXTRA_ARGS are passed as separate words.
    assert "--report_to none" in a and "--use_peft" not in a
    # Two complete checkpoints kept by default; the user's own --save_total_limit wins.
    assert "--save_total_limit 2 " in a and b.count("--save_total_limit") == 1 and "--save_total_limit 3" in b
    assert "--report_to wandb" in b and "--use_peft" in b and "--seed 7 --logging_steps 5" in b
    # Rendezvous ports derive from the job id: two jobs sharing a node do not collide.
    ports = [re.search(r"rendezvous c10d at [^:]+:(\d+)", t).group(1) for t in (a, b)]
    assert ports == [str(20000 + int(one) % 10000), str(20000 + int(two) % 10000)] and ports[0] != ports[1]


def test_the_allocation_on_each_node_decides_memory_gpus_numa_and_the_fabric(cluster, tiny_model, tmp_path):
    """Every node reports what the job got there (one srun task per node): memory from --mem-per-cpu x that node's
    CPUs changes the plan; GPUs spread unevenly by --gpus=N are refused; NUMA binding is asked of torchrun where the
    nodes have several NUMA nodes and numactl and the job's CPUs cover its GPUs' NUMA nodes, and not where they do not
    (a shared node); the EFA profile is refused where the plugin is not on the library path."""
    original = SCRIPT.read_text()
    assert "#SBATCH --mem=0\n" in original
    per_cpu = tmp_path / "run_llm_per_cpu.slurm"  # sbatch refuses --mem-per-cpu beside the script's --mem=0
    per_cpu.write_text(original.replace("#SBATCH --mem=0\n", ""))
    uneven = tmp_path / "run_llm_gpus.slurm"
    uneven.write_text(original.replace("#SBATCH --gpus-per-node=1\n", "#SBATCH --gpus=3\n"))
    # A two-socket machine whose four GPUs sit on NUMA node 0, which holds the CPUs the job's steps run on here
    # (node 1's CPUs are none of them); and the same machine with its GPUs on node 1, as a job on a shared node sees it.
    here = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    sysfs, shared = tmp_path / "sys", tmp_path / "sys-shared"
    for root, gpu_node in ((sysfs, 0), (shared, 1)):
        for node, cpus in (("node0", here), ("node1", "1000-1001")):
            (root / "devices" / "system" / "node" / node).mkdir(parents=True)
            (root / "devices" / "system" / "node" / node / "cpulist").write_text(cpus + "\n")
        for gpu in range(4):
            (root / "bus/pci/drivers/nvidia" / f"0000:{0x17 + gpu:02x}:00.0").mkdir(parents=True)
            (root / "bus/pci/drivers/nvidia" / f"0000:{0x17 + gpu:02x}:00.0" / "numa_node").write_text(f"{gpu_node}\n")
    fake_sysfs_with_efa(sysfs)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "numactl").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "numactl").chmod(0o755)
    model = f"MODEL={tiny_model},GLOBAL_BATCH=4,MICRO_BATCH=2,DRY_RUN=1"
    jobs = {
        "per cpu": cluster.sbatch(["--mem-per-cpu=2048", str(per_cpu), f"--export=ALL,{model}"], cwd=tmp_path),
        "tight": cluster.sbatch(["--mem-per-cpu=100", str(per_cpu), f"--export=ALL,{model}"], cwd=tmp_path),
        "uneven": cluster.sbatch([str(uneven), f"--export=ALL,{model}"], cwd=tmp_path),
        "numa": cluster.sbatch(
            [str(SCRIPT), f"--export=ALL,{model}"],
            cwd=tmp_path,
            LLMFT_SYSFS_ROOT=str(sysfs),
            PATH=f"{bin_dir}:{cluster.env()['PATH']}",
        ),
        "numa shared": cluster.sbatch(
            [str(SCRIPT), f"--export=ALL,{model}"],
            cwd=tmp_path,
            LLMFT_SYSFS_ROOT=str(shared),
            PATH=f"{bin_dir}:{cluster.env()['PATH']}",
        ),
        "no plugin": cluster.sbatch(
            [str(SCRIPT), f"--export=ALL,{model},NCCL_PROFILE=aws-efa"],
            cwd=tmp_path,
            LLMFT_SYSFS_ROOT=str(sysfs),
            LD_LIBRARY_PATH="",
        ),
    }
    out = {}
    for name, job in jobs.items():
        info = cluster.wait(job, timeout=SHORT_JOB_S)
        out[name] = (info, read(tmp_path / f"llmft-{job}.out"))
    info, text = out["per cpu"]
    assert info["JobState"] == "COMPLETED", text
    assert (
        "llmft plan: nodes: 2 x 1 GPU(s); memory the job may use: n1 8 GiB (SLURM_MEM_PER_CPU=2048 MB x 4 CPUs), "
        "n2 8 GiB (SLURM_MEM_PER_CPU=2048 MB x 4 CPUs); planning with 8 GiB per node"
    ) in text
    assert (
        "llmft plan: memory: ZeRO-2, micro-batch 2 x accumulation 1, gradient checkpointing on fits (per process 2.47 GiB, "
        "host 3.47 GiB per node) on 2 x 1 CPU process per node (no GPU), 8 GiB host RAM per node (the job's limit: node n1: "
        "SLURM_MEM_PER_CPU=2048 MB x 4 CPUs)"
    ) in text and "llmft launch: nnodes=2 nproc_per_node=1 cpus_per_node=4 " in text
    assert "host_ram_gb=8 numa_binding=off" in text and "--mem=0 --kill-on-bad-exit=1 " in text
    info, text = out["tight"]
    assert info["ExitCode"] == "2:0", text
    assert re.search(
        r"llmft plan: error: memory: .* 0.4 GiB host RAM per node \(the job's limit: (node n1: )?SLURM_MEM_PER_CPU=100 MB x 4 "
        r"CPUs\): host RAM: needs .* ask Slurm for \d+ GiB per node with sbatch --mem=\d+G",
        text,
    ), text
    info, text = out["uneven"]
    assert info["ExitCode"] == "2:0", text
    assert re.search(
        r"llmft plan: error: the job's GPUs are spread unevenly over its nodes \(n1 [12], n2 [12]\), and every "
        r"node runs the same number of processes: ask for GPUs per node \(#SBATCH --gpus-per-node=N, not "
        r"--gpus=N\)\n",
        text,
    ), text
    info, text = out["numa"]
    assert info["JobState"] == "COMPLETED", text
    assert "llmft plan: NUMA binding node: each process on the CPUs of its GPU's NUMA node" in text
    assert re.search(
        r"launch: srun .* -m torch.distributed.run --nnodes 2 --nproc_per_node 1 --numa-binding node "
        r"--rdzv_backend c10d ",
        text,
    ), text
    info, text = out["numa shared"]
    assert info["JobState"] == "COMPLETED", text
    assert re.search(
        r"llmft plan: NUMA binding off: on n1, GPU 0's NUMA node 1 has CPUs 1000-1001, of which the job holds none "
        r"\(the job's CPUs there: \S+; a node shared with other jobs\)\n",
        text,
    ), text
    assert "--numa-binding" not in text, text
    info, text = out["no plugin"]
    assert info["ExitCode"] == "2:0", text
    assert (
        "llmft plan: error: node n1: NCCL_PROFILE=aws-efa: the aws-ofi-nccl plugin NCCL_NET_PLUGIN=ofi loads "
        "(libnccl-net-ofi.so) is not on the library path; install aws-ofi-nccl"
    ) in text
    assert "launch: srun" not in text


def test_zero_stage_auto_plans_for_the_jobs_nodes_and_launches_train_auto(cluster, tiny_model, tmp_path):
    """ZERO_STAGE=auto: the memory plan runs on the allocation (its nodes, their RAM) before anything launches, and
    llmft train gets --auto (it decides again, on the GPUs it got, and prints why)."""
    knobs = f"--export=ALL,DRY_RUN=1,ZERO_STAGE=auto,MODEL={tiny_model},GLOBAL_BATCH=8,MICRO_BATCH=2,LORA=1"
    job = cluster.sbatch([str(SCRIPT), knobs], cwd=tmp_path)
    assert cluster.wait(job, timeout=SHORT_JOB_S)["JobState"] == "COMPLETED", read(tmp_path / f"llmft-{job}.out")
    text = read(tmp_path / f"llmft-{job}.out")
    assert "LoRA: " in text and "world size 2" in text and "per node; world size 2" in text
    assert re.search(r"llmft plan: recommended ZeRO-\d, micro-batch [12] x accumulation \d", text), text
    assert re.search(r"hardware 2 x 1 CPU process per node \(no GPU\), [\d.]+ GiB host RAM per node", text), text
    assert "--auto" in text and "--zero_stage" not in text and "--use_peft" in text
    assert "DRY_RUN=1: not launching" in text


def test_a_mixture_trains_whole_and_torchrun_waits_past_the_partitions_grace_time(
    cluster, tiny_model, tiny_data, tmp_path
):
    """MIXTURE=FILE passes --dataset_mixture and neither --dataset_name nor --data_percentage, and the log says the
    mixture trains; on a partition with GraceTime=600 (slurm/local's spare) torchrun waits past GraceTime + KillWait.
    The local cluster keeps no accounting, so the QOS's grace time cannot be read: the line says so."""
    (tmp_path / "mix.yaml").write_text(f"datasets:\n  - path: {tiny_data}\n    weight: 1\n    percentage: 50\n")
    knobs = "--export=ALL,MIXTURE=mix.yaml,MAX_STEPS=2,GLOBAL_BATCH=4,MICRO_BATCH=2,SAVE_STEPS=1000,MODEL=" + str(
        tiny_model
    )
    job = cluster.sbatch(["-p", "spare", str(SCRIPT), knobs], cwd=tmp_path)
    info = cluster.wait(job, timeout=TRAINING_JOB_S)
    text = read(tmp_path / f"llmft-{job}.out")
    assert info["JobState"] == "COMPLETED", f"{info}\n{text}"
    assert "MIXTURE=mix.yaml (all of it: no DATASET, no DATA_PERCENTAGE)" in text, text
    assert "no DATASET given" not in text and "trl-lib/Capybara" not in text, text
    launch = next(line for line in text.splitlines() if line.startswith("run_llm.slurm: launch: srun"))
    assert "--dataset_mixture mix.yaml" in launch, launch
    assert "--dataset_name" not in launch and "--data_percentage" not in launch, launch
    assert re.search(r"llmft: dataset mixture mix.yaml: \d+ records \(prompt_completion, 128 from ", text), text
    assert re.search(
        r"run_llm.slurm: kill chain: Slurm's KillWait 10 s, partition spare GraceTime 600 s, (no QOS|QOS \S+ GraceTime "
        r"not read \(.*\): partition only); a preempted job's ranks may save for up to 610 s after the SIGTERM; "
        r"torchrun waits 640 s for its ranks \(TORCH_ELASTIC_SHUTDOWN_TIMEOUT\)\n",
        text,
    ), text


def test_a_busy_rendezvous_port_moves_to_the_next_one_in_range(cluster, tmp_path):
    """The job id's port and the next ones are taken on the first host: the script takes the next free port
    in 20000-29999 (it used to add 10000 per try, past 65535 after five)."""
    job = cluster.sbatch(["--hold", str(SCRIPT), "--export=ALL,DRY_RUN=1"], cwd=tmp_path)
    taken = [20000 + (int(job) + i) % 10000 for i in range(6)]
    listeners = []
    try:
        for port in taken:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
            sock.listen()
            listeners.append(sock)
        cluster.cmd(["scontrol", "release", job])
        info = cluster.wait(job, timeout=SHORT_JOB_S)
    finally:
        for sock in listeners:
            sock.close()
    text = read(tmp_path / f"llmft-{job}.out")
    assert info["JobState"] == "COMPLETED", text
    port = int(re.search(r"rendezvous c10d at 127.0.0.1:(\d+)", text).group(1))
    assert port == 20000 + (int(job) + 6) % 10000 and 20000 <= port <= 29999, text


def test_the_default_checkpoint_dir_is_one_per_experiment(cluster, tmp_path):
    """runs/<job name>-<key of the knobs that define the run>: a rerun of the same experiment finds its
    checkpoints; another model, dataset or job name never resumes them."""
    base = "--export=ALL,DRY_RUN=1,DATASET=data.jsonl,MODEL="
    (tmp_path / "data.jsonl").write_text('{"text": "x"}\n')  # a local dataset must exist (checked before any srun)
    submitted = {
        "exp": cluster.sbatch(["-J", "exp", str(SCRIPT), base + "org/a"], cwd=tmp_path),
        "other model": cluster.sbatch(["-J", "exp", str(SCRIPT), base + "org/b"], cwd=tmp_path),
        "other name": cluster.sbatch(["-J", "exp2", str(SCRIPT), base + "org/a"], cwd=tmp_path),
        "rerun": cluster.sbatch(
            ["-J", "exp", str(SCRIPT), base + "org/a", "EPOCHS=3"], cwd=tmp_path
        ),  # more epochs: same run
    }
    dirs = {}
    for what, job in submitted.items():
        info = cluster.wait(job, timeout=SHORT_JOB_S)
        text = read(tmp_path / f"{'exp2' if what == 'other name' else 'exp'}-{job}.out")  # %x-%j.out
        assert info["JobState"] == "COMPLETED", text
        dirs[what] = Path(re.search(r"llmft plan: checkpoint dir (\S+)", text).group(1))
    assert dirs["exp"].parent == tmp_path / "runs" and re.fullmatch(r"exp-[0-9a-f]{8}", dirs["exp"].name), dirs
    assert dirs["rerun"] == dirs["exp"]
    assert len({dirs["exp"], dirs["other model"], dirs["other name"]}) == 3, dirs
    assert dirs["other name"].name.startswith("exp2-")


def test_a_sweep_array_gives_each_element_its_variant_and_refuses_an_array_that_does_not_match(
    cluster, tiny_model, tmp_path
):
    """sbatch --array=1-2 with SWEEP: each element plans its own variant in <run dir>/<variant>, with the variant's
    flags after EXTRA_ARGS, and the sweep's directory records it for llmft report; an array of another size is refused
    in its first lines (one line, exit 2). DRY_RUN=1 runs each job up to the launch."""
    (tmp_path / "data.jsonl").write_text('{"text": "x"}\n')
    knobs = [
        f"MODEL={tiny_model}",
        "DATASET=data.jsonl",
        "DRY_RUN=1",
        f"VENV={sys.prefix}",
        f"CHECKPOINT_DIR={tmp_path / 'sweep'}",
        "EXTRA_ARGS=--seed 1",
        "SWEEP=learning_rate=1e-4,3e-4",
    ]
    out = "-o", str(tmp_path / "%x-%A_%a.out")
    array = cluster.sbatch(["-J", "sw", "--array=1-2", "--nodes=1", *out, str(SCRIPT), *knobs], cwd=tmp_path)
    for index, lr in ((1, "1e-4"), (2, "3e-4")):
        info = cluster.wait(f"{array}_{index}", timeout=SHORT_JOB_S)
        text = read(tmp_path / f"sw-{array}_{index}.out")
        assert info["JobState"] == "COMPLETED", text
        assert f"run_llm.slurm: sweep variant {index} of 2: learning_rate={lr} in {tmp_path / 'sweep'}" in text, text
        assert f"llmft plan: checkpoint dir {tmp_path / 'sweep' / f'learning_rate-{lr}'}" in text, text
        assert re.search(rf"launch: srun .* --seed 1 --learning_rate {lr}\s*$", text, re.M), text
    recorded = json.loads((tmp_path / "sweep" / "llmft_sweep.json").read_text())
    assert [v["name"] for v in recorded["variants"]] == ["learning_rate-1e-4", "learning_rate-3e-4"]
    wrong = cluster.sbatch(["-J", "sw3", "--array=1-3", "--nodes=1", *out, str(SCRIPT), *knobs], cwd=tmp_path)
    info = cluster.wait(f"{wrong}_1", timeout=SHORT_JOB_S)
    text = read(tmp_path / f"sw3-{wrong}_1.out")
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", text
    assert (
        "run_llm.slurm: error: SWEEP has 2 variants, and this array's indices are 1-3: submit it as sbatch --array=1-2"
        in text
    )


def test_export_dir_exports_the_finished_run_in_the_job_with_its_checks(cluster, plain_model, tiny_data, tmp_path):
    """EXPORT=DIR in a real job: after 4 steps on two nodes, `llmft export RUN --out DIR` runs as the job's last step;
    DIR (relative to the submit directory) holds the served model and the job's log shows its checks passed."""
    knobs = (
        f"--export=ALL,MAX_STEPS=4,GLOBAL_BATCH=4,MICRO_BATCH=2,MODEL={plain_model},DATASET={tiny_data},"
        f"CHECKPOINT_DIR={tmp_path / 'ckpt'},VENV={sys.prefix},EXPORT=exported/final"
    )
    job = cluster.sbatch([str(SCRIPT), knobs], cwd=tmp_path, PYTHONPATH=str(REPO))  # this checkout's llmft
    info = cluster.wait(job, timeout=TRAINING_JOB_S)
    text = read(tmp_path / f"llmft-{job}.out")
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{text}"
    ckpt, out = tmp_path / "ckpt", tmp_path / "exported" / "final"
    assert "quantization_settings" in json.loads((ckpt / "llmft_run.json").read_text())  # recorded by this checkout
    assert f"exporting the final checkpoint: llmft export {ckpt} --out {out}" in text, text
    assert f"llmft export: checks passed: {out} loads in a fresh process" in text, text
    assert text.index("training complete at step 4") < text.index("checks passed") < text.index(f"exported to {out}")
    for name in ("config.json", "model.safetensors", "generation_config.json", "README.md", "tokenizer.json"):
        assert (out / name).is_file(), sorted(p.name for p in out.iterdir())
    record = json.loads((out / "llmft_export.json").read_text())
    assert record["source"] == str(ckpt / "checkpoint-4" / "global_step4") and record["step"] == 4
    assert all(not p["chat"] for p in record["prompts"]) and record["tokens"]  # no template: plain prompts alone
    assert "llmft" in (out / "README.md").read_text()


def test_a_checkpoint_dir_in_use_by_a_live_job_is_refused(cluster, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    holder = cluster.cmd(["sbatch", "--parsable", "--wrap", "sleep 120"], cwd=tmp_path).stdout.strip()
    (ckpt / ".llmft-job").write_text(f"{holder}\n")  # as a run_llm.slurm job that took the directory leaves it
    try:
        deadline = time.time() + SHORT_JOB_S
        while cluster.job(holder)["JobState"] != "RUNNING" and time.time() < deadline:
            time.sleep(0.5)
        # GLOBAL_BATCH=3 makes an impossible plan: a job that gets past the directory stops there, cheaply.
        knobs = f"--export=ALL,CHECKPOINT_DIR={ckpt},GLOBAL_BATCH=3,MICRO_BATCH=2"
        job = cluster.sbatch([str(SCRIPT), knobs], cwd=tmp_path)
        assert cluster.wait(job, timeout=SHORT_JOB_S)["ExitCode"] == "2:0"
        text = read(tmp_path / f"llmft-{job}.out")
        assert f"run_llm.slurm: error: CHECKPOINT_DIR={ckpt} is in use by job {holder} (RUNNING)" in text, text
        assert (ckpt / ".llmft-job").read_text().strip() == holder
    finally:
        cluster.cmd(["scancel", holder])
    cluster.wait(holder, timeout=60)
    job = cluster.sbatch([str(SCRIPT), knobs], cwd=tmp_path)  # the holder has ended: the directory is free
    cluster.wait(job, timeout=SHORT_JOB_S)
    text = read(tmp_path / f"llmft-{job}.out")
    assert "is in use" not in text and "llmft plan: error:" in text, text
    assert (ckpt / ".llmft-job").read_text().strip() == job


# ---- the local cluster itself -------------------------------------------------------------------


hostlist_items = st.tuples(
    st.sampled_from(["n", "gpu-", "a100-node", "x"]),
    st.lists(st.tuples(st.integers(0, 40), st.integers(0, 4)), min_size=1, max_size=3),
    st.sampled_from([1, 2, 3]),
)


@settings(max_examples=25, deadline=None)
@given(st.lists(hostlist_items, min_size=1, max_size=3))
def test_expand_hostlist_agrees_with_scontrol_show_hostnames(cluster, items):
    parts = []
    for prefix, ranges, width in items:
        rs = [f"{lo:0{width}d}" if span == 0 else f"{lo:0{width}d}-{lo + span:0{width}d}" for lo, span in ranges]
        parts.append(f"{prefix}[{','.join(rs)}]")
    hostlist = ",".join(parts)
    out = cluster.cmd(["scontrol", "show", "hostnames", hostlist]).stdout.split()
    assert expand_hostlist(hostlist) == out


def test_stop_ends_only_the_daemons_its_cluster_started(cluster, tmp_path):
    other = tmp_path / "other"
    start_cluster(other)
    pids = [line.split() for line in (other / "run" / "started.pids").read_text().splitlines()]
    assert [name for name, _ in pids] == ["munged", "slurmctld", "slurmd", "slurmd", "slurmd"]
    stop_cluster(other)
    for name, pid in pids:
        assert not Path(f"/proc/{pid}").exists() or name not in Path(f"/proc/{pid}/comm").read_text(), (name, pid)
    # The session's cluster is untouched.
    nodes = sorted(set(cluster.cmd(["sinfo", "-a", "-h", "-N", "-o", "%N %t"]).stdout.splitlines()))
    assert nodes == ["n1 idle", "n2 idle", "n3 idle"], nodes


def kill_hook_env(how: str, after: Path, record: Path, **extra: str) -> dict[str, str]:
    """The environment that makes tests/kill_hook fail the rank on n2 (`how`: KILL, HANG or OOM) once `after` exists,
    writing that rank and the time to `record`."""
    hook = os.pathsep.join([str(REPO / "tests" / "kill_hook"), os.environ.get("PYTHONPATH", "")])
    return dict(
        LLMFT_TEST_KILL_NODE="n2",
        LLMFT_TEST_KILL_SIGNAL=how,
        LLMFT_TEST_KILL_AFTER=str(after),
        LLMFT_TEST_KILL_RECORD=str(record),
        PYTHONPATH=hook,
        **extra,
    )


def run_with_a_failing_rank(
    cluster, tmp_path, knobs: str, how: str, after: Path, partition: str = "spare"
) -> tuple[dict, str, float | None]:
    """Submit a 2-node job to `partition` (default spare: n1-n3), tests/kill_hook failing the rank on n2 (`how`: KILL or
    HANG) once `after` exists, its GPU falling off the bus (an Xid 79 in n2's test kernel log: evidence against n2);
    (the job's final scontrol fields, its log, when its log first said it requeued)."""
    job = cluster.sbatch(
        [f"--partition={partition}", "--nodes=2", str(SCRIPT), knobs],
        cwd=tmp_path,
        **kill_hook_env(how, after, tmp_path / "failed_rank", LLMFT_TEST_KERNEL_LOG_DIR=str(tmp_path / "kernel-log")),
    )
    log = tmp_path / f"llmft-{job}.out"
    requeued_at = None
    deadline = time.time() + TRAINING_JOB_S
    while requeued_at is None and time.time() < deadline:
        if f"requeueing job {job} (restart 1 of at most 3 after failures)" in read(log):
            requeued_at = time.time()
        time.sleep(0.2)
    info = cluster.wait(job, timeout=TRAINING_JOB_S)
    return info, read(log), requeued_at


def test_a_rank_killed_mid_run_names_its_node_and_the_job_requeues_once_without_it(
    cluster, tiny_model, tiny_data, tmp_path
):
    """A rank dies (SIGKILL from tests/kill_hook, once checkpoint-2 is complete: the attempt made progress) on node n2
    of a 2-node job in the partition with a spare node. The job ends within seconds, not at a collective timeout; it
    names the rank and the node in one line, requeues itself once with n2 excluded, and the restart trains on n1
    and the spare n3 from the newest complete checkpoint to the end."""
    max_steps = 12
    ckpt = tmp_path / "ckpt"
    marker = ckpt / "checkpoint-2" / "llmft_complete.json"
    knobs = (
        f"--export=ALL,MAX_STEPS={max_steps},GLOBAL_BATCH=8,MICRO_BATCH=2,SAVE_STEPS=2,DATA_PERCENTAGE=100,"
        f"MODEL={tiny_model},DATASET={tiny_data},CHECKPOINT_DIR={ckpt},VENV={sys.prefix},EXTRA_ARGS=--logging_steps 1"
    )
    info, text, requeued_at = run_with_a_failing_rank(cluster, tmp_path, knobs, "KILL", marker)
    job = info["JobId"]
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", f"{info}\n{text}"
    assert info["ExcNodeList"] == "n2" and info["NodeList"] == "n[1,3]", info
    rank, killed_at = (tmp_path / "failed_rank").read_text().split()
    # not torch's 30-minute default: far sooner however loaded the machine (a minute or two on a quiet one)
    assert requeued_at is not None and requeued_at - float(killed_at) < 600, text
    failed = rf"run_llm.slurm: training failed \(exit \d+\): rank {rank} on node n2 failed first \(exit code -9, SIGKILL\)\n"
    assert len(re.findall(failed, text)) == 1, text
    requeue = re.search(
        rf"requeueing job {job} \(restart 1 of at most 3 after failures\) from checkpoint-(\d+), excluding node\(s\) n2\n",
        text,
    )
    assert requeue, text
    assert "requeued after failures 0 of at most 3 times\n" in text, text
    first, second = text.split("restart 1, submitted", 1)
    assert second.split("\n", 1)[0].endswith("requeued after failures 1 of at most 3 times"), second
    assert "run_llm.slurm: nodes 2: n1 n2;" in first and "run_llm.slurm: nodes 2: n1 n3;" in second, text
    resumed = int(re.search(r"llmft: resuming from \S+/checkpoint-(\d+)\n", second).group(1))
    assert resumed >= int(requeue.group(1)) >= 2
    assert step_lines(second) == list(range(resumed + 1, max_steps + 1))
    assert json.loads((ckpt / "llmft_done.json").read_text())["global_step"] == max_steps


def test_a_node_with_evidence_is_not_excluded_when_the_partition_could_not_run_the_job_without_it(
    cluster, tiny_model, tiny_data, tmp_path
):
    """As above (a rank on n2 killed once checkpoint-2 is complete, its GPU's Xid 79 in n2's kernel log), but in the
    default partition, n1 and n2 only: without n2 the requeued 2-node job would pend forever, so sinfo's answer keeps
    it, one line says so, and the restart runs on n1 and n2 again to the end."""
    max_steps = 8
    ckpt = tmp_path / "ckpt"
    marker = ckpt / "checkpoint-2" / "llmft_complete.json"
    knobs = (
        f"--export=ALL,MAX_STEPS={max_steps},GLOBAL_BATCH=8,MICRO_BATCH=2,SAVE_STEPS=2,DATA_PERCENTAGE=100,"
        f"MODEL={tiny_model},DATASET={tiny_data},CHECKPOINT_DIR={ckpt},VENV={sys.prefix}"
    )
    info, text, _ = run_with_a_failing_rank(cluster, tmp_path, knobs, "KILL", marker, partition="debug")
    job = info["JobId"]
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", f"{info}\n{text}"
    assert info["ExcNodeList"] == "(null)" and info["NodeList"] == "n[1-2]", info
    assert "run_llm.slurm: node n2: GPU failure: NVRM: Xid (PCI:0000:3b:00): 79," in text, text
    assert (
        "run_llm.slurm: not excluding node(s) n2: the job's partition has 2 usable node(s) (sinfo), and without it 1 "
        "would remain for the job's 2; the restart may run there again\n"
    ) in text, text
    assert re.search(rf"requeueing job {job} \(restart 1 of at most 3 after failures\) from checkpoint-\d+\n", text), (
        text
    )
    assert json.loads((ckpt / "llmft_done.json").read_text())["global_step"] == max_steps


def test_a_failed_attempt_that_wrote_no_checkpoint_is_not_requeued(cluster, tiny_model, tiny_data, tmp_path):
    """A rank on n2 dies before the first checkpoint: a restart would fail the same way, so the job fails once,
    names the rank and node, and says why it is not requeued."""
    ckpt = tmp_path / "ckpt"
    knobs = (
        f"--export=ALL,MAX_STEPS=4,GLOBAL_BATCH=8,MICRO_BATCH=2,SAVE_STEPS=2,DATA_PERCENTAGE=100,"
        f"MODEL={tiny_model},DATASET={tiny_data},CHECKPOINT_DIR={ckpt},VENV={sys.prefix}"
    )
    # tiny_model's config.json is there from the start: the rank is killed as it starts
    job = cluster.sbatch(
        [str(SCRIPT), knobs], cwd=tmp_path, **kill_hook_env("KILL", tiny_model / "config.json", tmp_path / "killed")
    )
    info = cluster.wait(job, timeout=TRAINING_JOB_S)
    text = read(tmp_path / f"llmft-{job}.out")
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", f"{info}\n{text}"
    rank = (tmp_path / "killed").read_text().split()[0]
    failed = rf"run_llm.slurm: training failed \(exit \d+\): rank {rank} on node n2 failed first \(exit code -9, SIGKILL\)\n"
    assert re.search(failed, text), text
    assert (
        "run_llm.slurm: not requeueing: this attempt wrote no new complete checkpoint (newest: none), "
        "so another would fail the same way\n"
    ) in text, text


def test_a_hung_rank_ends_the_job_at_the_collective_timeout_and_the_job_requeues_without_its_node(
    cluster, tiny_model, tiny_data, tmp_path
):
    """A rank on n2 hangs (tests/kill_hook: its next all_reduce once checkpoint-2 is complete never returns) without
    dying: its peer on n1 waits in ZeRO's gradient all-reduce until the collective timeout (--ddp_timeout 30, which before this reached only the default
    group: DeepSpeed's own groups kept torch's 30 minutes). The line blames n2, whose rank stopped answering, not n1,
    whose rank timed out waiting for it, and the job requeues without n2."""
    max_steps = 12
    ckpt = tmp_path / "ckpt"
    knobs = (
        f"--export=ALL,MAX_STEPS={max_steps},GLOBAL_BATCH=8,MICRO_BATCH=2,SAVE_STEPS=2,DATA_PERCENTAGE=100,"
        f"MODEL={tiny_model},DATASET={tiny_data},CHECKPOINT_DIR={ckpt},VENV={sys.prefix},"
        "EXTRA_ARGS=--logging_steps 1 --ddp_timeout 30"
    )
    after = ckpt / "checkpoint-2" / "llmft_complete.json"
    info, text, requeued_at = run_with_a_failing_rank(cluster, tmp_path, knobs, "HANG", after)
    job = info["JobId"]
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", f"{info}\n{text}"
    assert info["ExcNodeList"] == "n2" and info["NodeList"] == "n[1,3]", info
    first, second = text.split("restart 1, submitted", 1)
    assert "llmft: collective timeout 30 s (--ddp_timeout, as given: not sized from the run)\n" in first, first
    assert re.search(r"Timed out waiting 30000ms for (recv|send)", first), first  # gloo's timeout: 30 s, not 1800
    hung_rank, hung_at = (tmp_path / "failed_rank").read_text().split()
    waiting_rank = 1 - int(hung_rank)  # the other rank of 2
    # n2's line depends on who ends first: its torchrun (then "stopped answering") or Slurm's SIGKILL after KillWait,
    # which leaves n2 nothing written (then "reported nothing"); either way n2 is named and n1 is not
    blamed = (
        r"run_llm.slurm: training failed \(exit \d+\): node n2 (stopped answering \((a rank|rank \d) there hung or died\)|"
        r"reported nothing \(it died, or its processes hung\)): "
        rf"rank {waiting_rank} on node n1 timed out waiting for it in a collective\n"
    )
    assert len(re.findall(blamed, first)) == 1, first
    assert re.search(
        rf"requeueing job {job} \(restart 1 of at most 3 after failures\) from checkpoint-\d+, excluding node\(s\) n2\n",
        first,
    )
    # The requeue came from the 30 s timeout, not torch's default 30 min: far sooner than that however loaded the
    # machine (the timeout, then a minute or two on a quiet one)
    assert requeued_at is not None and requeued_at - float(hung_at) < 600, text
    resumed = int(re.search(r"llmft: resuming from \S+/checkpoint-(\d+)\n", second).group(1))
    assert step_lines(second) == list(range(resumed + 1, max_steps + 1))
    assert json.loads((ckpt / "llmft_done.json").read_text())["global_step"] == max_steps


def test_an_out_of_memory_error_in_a_rank_is_named_with_its_cause_and_the_job_stops_without_excluding_a_node(
    cluster, tiny_model, tiny_data, tmp_path
):
    """A rank on n2 raises torch.OutOfMemoryError once checkpoint-2 is complete (tests/kill_hook OOM): the attempt
    made progress, but an application error fails the same way on any node, so the job is not requeued and excludes
    nothing; one line names the rank, the node and the exception, and the next says how to fix it and resume."""
    ckpt = tmp_path / "ckpt"
    knobs = (
        f"--export=ALL,MAX_STEPS=12,GLOBAL_BATCH=8,MICRO_BATCH=2,SAVE_STEPS=2,DATA_PERCENTAGE=100,"
        f"MODEL={tiny_model},DATASET={tiny_data},CHECKPOINT_DIR={ckpt},VENV={sys.prefix}"
    )
    after = ckpt / "checkpoint-2" / "llmft_complete.json"
    job = cluster.sbatch([str(SCRIPT), knobs], cwd=tmp_path, **kill_hook_env("OOM", after, tmp_path / "failed_rank"))
    info = cluster.wait(job, timeout=TRAINING_JOB_S)
    text = read(tmp_path / f"llmft-{job}.out")
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", f"{info}\n{text}"
    assert info["ExcNodeList"] == "(null)", info
    rank = (tmp_path / "failed_rank").read_text().split()[0]
    failed = (
        rf"run_llm.slurm: training failed \(exit \d+\): rank {rank} on node n2 failed first \(exit code 1\): "
        r"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB \(tests/kill_hook\)\n"
    )
    assert len(re.findall(failed, text)) == 1, text
    assert re.search(
        r"run_llm.slurm: not requeueing: an application error fails the same way on any node; out of memory: lower "
        r"MICRO_BATCH .*, then resubmit with the same CHECKPOINT_DIR to resume from checkpoint-\d+\n",
        text,
    ), text
    assert "requeueing job" not in text and "excluding" not in text, text

"""Stopping a PBS job on purpose, on the real local OpenPBS (pbs/local/): `llmft stop --continue` stops a running
two-node job at a checkpoint, and its continuation finishes the run with no step lost or trained twice; `qsig -s
USR1` ends a job at once, without a continuation (what PBS does with it, measured); the job's deadline counts from
its start (`stime`), not from the end of a slow set-up.

Every stop lands at a known step: the ranks hold at step 3 (LLMFT_TEST_HOLD_AT_STEP) until it comes, and it is sent
once checkpoint-2 is complete. The two jobs are submitted together by a module fixture, so they overlap.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from pbs_cluster import JOB_USER, PbsCluster
from slurm_cluster import step_lines as steps_trained
from test_pbs import SCRIPT, TRAINING_JOB_S, common, optim_shards, own, read, seed_the_job_users_op_cache

REPO = Path(__file__).resolve().parents[1]
TOTAL = 6
HELD = 3
SETUP_DELAY_S = 20  # the llmft stop job's set-up is this much slower (LLMFT_TEST_SETUP_DELAY_S)


@pytest.fixture(scope="module")
def stop_jobs(pbs_cluster: PbsCluster, tiny_model, tiny_data, tmp_path_factory):
    """Two held jobs, stopped at step 3 from a thread once checkpoint-2 is complete: one by `qsig -s USR1`, one by
    `llmft stop RUN_DIR --continue` run as the job user (a two-node job). {name: (job id, directory, what the thread
    saw)}."""
    import shutil

    pbs_cluster.cmd([str(pbs_cluster.bin / "qmgr"), "-c", "set queue workq kill_delay = 60"])
    base = pbs_cluster.job_dir(tmp_path_factory.mktemp("pbs_stop_inputs"))
    shutil.copytree(tiny_model, base / "model")
    shutil.copy(tiny_data, base / "train.jsonl")
    own(base)
    seed_the_job_users_op_cache()
    inputs = {"model": base / "model", "data": base / "train.jsonl"}
    out = {}
    two_nodes = ["-l", "select=2:ncpus=1", "-l", "place=scatter", "-l", "walltime=00:30:00"]

    def submit(name: str, variables: str, stop, nodes: list[str]) -> None:
        d = pbs_cluster.job_dir(tmp_path_factory.mktemp(name))
        given = (
            f"{common(inputs, d)},MAX_STEPS={TOTAL},GLOBAL_BATCH=8,MICRO_BATCH=2,SAVE_STEPS=2,SAVE_TOTAL_LIMIT=0,"
            f"CHECKPOINT_DIR={d / 'ckpt'},EXTRA_ARGS=--logging_steps 1,LLMFT_TEST_HOLD_AT_STEP={HELD}{variables}"
        )
        job = pbs_cluster.qsub([*nodes, "-o", str(d / "out"), "-v", given, str(SCRIPT)], cwd=d)
        seen: dict = {}

        def at_checkpoint_2() -> None:
            try:
                done = d / "ckpt" / "checkpoint-2" / "llmft_complete.json"
                pbs_cluster.wait_for("checkpoint-2", done.is_file, TRAINING_JOB_S)
                time.sleep(2)  # the ranks are held at step 3: the stop lands there however slow the machine
                seen["proc"] = stop(job, d)
            except BaseException as e:  # noqa: BLE001 - reported by the test
                seen["error"] = repr(e)

        seen["thread"] = threading.Thread(target=at_checkpoint_2, daemon=True)
        seen["thread"].start()
        out[name] = (job, d, seen)

    def qsig(job: str, d: Path):
        return pbs_cluster.cmd([str(pbs_cluster.bin / "qsig"), "-s", "USR1", job], check=False)

    def llmft_stop(job: str, d: Path):
        cmd = ["runuser", "-u", JOB_USER, "--", sys.executable, "-m", "llmft.cli", "stop", str(d / "ckpt")]
        env = pbs_cluster.env(PYTHONPATH=str(REPO))
        return subprocess.run([*cmd, "--continue"], capture_output=True, text=True, env=env, cwd=d, timeout=120)

    # qsig's job on one node: what PBS does with the signal needs no second one, and the machine is shared
    submit("usr1", "", qsig, ["-l", "select=1:ncpus=1", "-l", "walltime=00:30:00"])
    submit("llmft_stop", f",LLMFT_TEST_SETUP_DELAY_S={SETUP_DELAY_S}", llmft_stop, two_nodes)
    return out


def running_with(text: str) -> list[str]:
    """The processes still running (not ended and unreaped) whose command line holds `text`."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if text in cmdline and state != "Z":
            found.append(f"{proc.name}: {cmdline}")
    return found


def finished_in_a_continuation(pbs_cluster: PbsCluster, job: str, d: Path, said: str) -> tuple[str, str, int]:
    """The first job stopped at the held step with a complete checkpoint, said `said`, and submitted its continuation,
    which resumed from that checkpoint and trained the rest: (first output, second output, the step stopped at)."""
    info = pbs_cluster.wait(job, timeout=TRAINING_JOB_S)
    first = pbs_cluster.wait_for("the first job's output", lambda: read(d / "out"))
    assert info["Exit_status"] == 0, first
    assert re.search(said, first), first
    m = re.search(r"continuation submitted: job (\S+) starts after", first)
    assert m, first
    second_info = pbs_cluster.wait(m.group(1), timeout=TRAINING_JOB_S)
    second = pbs_cluster.wait_for("the continuation's output", lambda: read(d / "out.1"))
    assert second_info["Exit_status"] == 0, second
    resumed = re.search(r"llmft: resuming from (\S+)/checkpoint-(\d+)\n", second)
    assert resumed and resumed.group(1) == str((d / "ckpt").resolve()), second
    k = int(resumed.group(2))
    assert k == HELD, (first, second)  # the stop checkpoint at the held step, not checkpoint-2
    logged = steps_trained(first)
    assert logged == list(range(1, len(logged) + 1)) and len(logged) <= k, logged
    assert steps_trained(second) == list(range(k + 1, TOTAL + 1)), second
    assert optim_shards(d / "ckpt" / f"checkpoint-{k}" / f"global_step{k}") == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    assert json.loads((d / "ckpt" / "llmft_done.json").read_text())["global_step"] == TOTAL
    return first, second, k


def test_qsig_usr1_ends_the_job_at_once_and_submits_no_continuation(pbs_cluster, stop_jobs):
    """What `qsig -s USR1 JOB` does to a running job, measured on OpenPBS 23.06: PBS runs a batch job under the user's
    login shell, which reads the job script's path on its standard input and runs the script as its child
    (SHELL_INVOKE in src/resmom/start_exec.c). The mom sends USR1 to every process of the job's sessions, that shell
    among them, which dies of it (its default action); with its top task gone the mom kills every process of the job
    at once (`Exit_status` 256 + 10). No continuation is submitted; a stop checkpoint being written may be cut, and the
    complete checkpoints before it stand, so a resubmission resumes from them. docs/pbs.md says so, and names
    `llmft stop RUN_DIR --continue` for a stop with a continuation."""
    job, d, seen = stop_jobs["usr1"]
    seen["thread"].join(timeout=TRAINING_JOB_S)
    assert "error" not in seen and seen["proc"].returncode == 0, seen
    info = pbs_cluster.wait(job, timeout=TRAINING_JOB_S)
    first = pbs_cluster.wait_for("the job's output", lambda: read(d / "out"))
    assert info["Exit_status"] == 256 + signal.SIGUSR1, (info["Exit_status"], first)
    assert "continuation submitted" not in first and "llmft stopped" not in first, first
    assert not list((d / "ckpt").glob(".llmft-continue-*.json")), first
    assert (d / "ckpt" / "checkpoint-2" / "llmft_complete.json").is_file()
    assert not (d / "ckpt" / "llmft_done.json").exists()
    # torchrun starts its ranks in sessions of their own, which the mom's kill misses: each rank ends with its
    # torchrun (llmft.training.launcher.end_with_the_agent), so none is left running the job (a hang guard, not a race)
    deadline = time.monotonic() + 60
    while running_with(str(d / "ckpt")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not running_with(str(d / "ckpt")), running_with(str(d / "ckpt"))


def test_llmft_stop_continue_stops_a_pbs_job_and_its_continuation_finishes_the_run(pbs_cluster, stop_jobs):
    """`llmft stop RUN_DIR --continue`, as the job's user on the submit host: the job stops at its next step with a
    complete checkpoint and submits its continuation, which finishes the run with no step lost or repeated.

    The same job's set-up is slowed by SETUP_DELAY_S (a test hook): the deadline it hands rank 0 still counts from
    the job's start as PBS recorded it (`stime` + `Resource_List.walltime`), not from the end of the set-up."""
    job, d, seen = stop_jobs["llmft_stop"]
    seen["thread"].join(timeout=TRAINING_JOB_S)
    proc = seen.get("proc")
    assert "error" not in seen and proc is not None and proc.returncode == 0, seen
    assert proc.stdout.startswith(f"llmft stop: asked PBS job {job} to stop"), proc.stdout + proc.stderr
    first, _, _ = finished_in_a_continuation(
        pbs_cluster, job, d, rf"llmft stopped by llmft stop \(exit 0\) after a complete checkpoint at step {HELD};"
    )
    m = re.search(r"run_llm.pbs: walltime: \S+ left \(ends (\S+): started (\S+) \+ walltime 0:30:00\)", first)
    assert m, first
    stime = pbs_cluster.job(job)["stime"]
    started = time.mktime(time.strptime(stime, "%a %b %d %H:%M:%S %Y"))
    iso = lambda t: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))  # noqa: E731
    assert (m.group(2), m.group(1)) == (iso(started), iso(started + 1800)), (stime, first)
    end_file = d / "ckpt" / f".llmft-job-end-{job}"
    assert end_file.read_text() == f"{started:.0f} 0:30:00\n"  # what rank 0 reads: the start and the whole walltime
    assert f"LLMFT_TEST_SETUP_DELAY_S: waiting {SETUP_DELAY_S} s" in first, first

"""`llmft stop RUN_DIR [--continue]`: the stop request the ranks poll, written for a run that trains now, and what each
scheduler's job does after it (llmft.planning.stop_request, llmft.stop, the launchers' after_training); a real
2-process `llmft train` from a login shell stopped at its next step. The PBS and Slurm jobs it stops are in
tests/test_pbs_stop.py and tests/test_slurm.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import PYTHON, subprocess_env
from test_launch import Outcome, pbs_follow
from test_launch_slurm import after_training, attempt

from llmft.launch import job, knobs, slurm
from llmft.planning import stop_request

REPO = Path(__file__).resolve().parents[1]


def llmft_stop(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYTHON, "-m", "llmft.cli", "stop", *args], capture_output=True, text=True, env=subprocess_env(), cwd=cwd
    )


def test_the_stop_file_is_the_flags_the_jobs_or_the_runs_own(tmp_path):
    assert stop_request.stop_file("/x/flag", {"LLMFT_STOP_FILE": "/x/job"}, tmp_path) == "/x/flag"
    assert stop_request.stop_file(None, {"LLMFT_STOP_FILE": "/x/job"}, tmp_path) == "/x/job"
    assert stop_request.stop_file(None, {}, tmp_path) == str(tmp_path / ".llmft-stop")


def test_a_request_says_who_asked_and_whether_to_go_on_and_a_signals_empty_file_is_a_signal(tmp_path):
    stop = tmp_path / ".llmft-stop-7"
    assert stop_request.read_request(stop) is None
    stop.touch()  # the launcher's own handler (llmft.launch.job.Stop) touches it
    assert stop_request.read_request(stop) == stop_request.Request("signal", False)
    stop_request.ask(stop, True, "me")
    assert stop_request.read_request(stop) == stop_request.Request("llmft stop", True)
    stop_request.ask(stop, False, "me")
    assert stop_request.read_request(stop) == stop_request.Request("llmft stop", False)


def test_a_new_run_of_its_own_drops_a_stale_request_but_never_a_jobs(tmp_path):
    own = tmp_path / ".llmft-stop"
    own.write_text("{}")
    stop_request.record_training(tmp_path, str(own), {})
    assert not own.exists()
    record = stop_request.read_training(tmp_path)
    assert record["stop_file"] == str(own) and record["scheduler"] == "" and record["pid"] == os.getpid()
    jobs = tmp_path / ".llmft-stop-12.pbs-head"
    jobs.touch()  # the launcher's SIGTERM came before the ranks started: it stands
    stop_request.record_training(tmp_path, str(jobs), {"PBS_JOBID": "12.pbs-head"})
    assert jobs.exists() and stop_request.read_training(tmp_path)["scheduler"] == "pbs"
    stop_request.forget_training(tmp_path)
    assert stop_request.read_training(tmp_path) is None


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda d: d / "missing",
            r"^llmft stop: error: \S+/missing does not exist: give the --output_dir of a running",
        ),
        (lambda d: d, r"^llmft stop: error: \S+ is not an llmft run \(no llmft_run.json\)"),
        (
            lambda d: (d / "llmft_run.json").write_text("{}") and d,
            r"^llmft stop: error: no llmft train is training in",
        ),
    ],
)
def test_a_bad_run_dir_is_one_line_and_exit_2(tmp_path, make, message):
    import re

    proc = llmft_stop(str(make(tmp_path)))
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert len(proc.stderr.splitlines()) == 1 and re.match(message, proc.stderr), proc.stderr


def test_a_record_left_by_a_process_that_died_here_stops_nothing(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    record = {"stop_file": str(tmp_path / ".llmft-stop"), "scheduler": "", "job": "", "host": socket.gethostname()}
    (tmp_path / stop_request.TRAINING_RECORD).write_text(json.dumps({**record, "pid": int(dead.stdout)}))
    proc = llmft_stop(str(tmp_path))
    assert proc.returncode == 2 and "is no longer running: nothing to stop" in proc.stderr, proc
    assert not (tmp_path / ".llmft-stop").exists()


def test_a_jobs_run_gets_its_jobs_stop_file_and_the_line_says_what_the_job_does(tmp_path):
    stop = tmp_path / ".llmft-stop-42"
    for scheduler, then in (("slurm", "the job requeues itself"), ("pbs", "the job submits its continuation")):
        record = {"stop_file": str(stop), "scheduler": scheduler, "job": "42", "host": "elsewhere", "pid": 1}
        (tmp_path / stop_request.TRAINING_RECORD).write_text(json.dumps(record))
        proc = llmft_stop(str(tmp_path), "--continue")
        assert proc.returncode == 0 and then in proc.stdout, proc
        assert stop_request.read_request(stop) == stop_request.Request("llmft stop", True)
        proc = llmft_stop(str(tmp_path))
        assert proc.returncode == 0 and "then the job ends; resubmit with CHECKPOINT_DIR=" in proc.stdout, proc
        assert stop_request.read_request(stop) == stop_request.Request("llmft stop", False)


def test_after_llmft_stop_a_pbs_job_goes_on_only_with_continue(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    (run / "checkpoint-3").mkdir(parents=True)
    (run / "checkpoint-3" / "llmft_complete.json").write_text("{}")
    stop, failures = job.Stop(run / ".llmft-stop-7", "run_llm.pbs"), run / "failures"
    failures.mkdir()
    k = knobs.resolve({}, [])

    def decide(go_on: bool):
        stop_request.ask(stop.stop_file, go_on, "me")
        out = pbs_follow(monkeypatch, k, {}, run, 0, stop, run / "requeue", 0, failures, ["pbs-n0"])
        assert not stop.stop_file.exists()
        return out

    assert decide(True) == Outcome(0, go_on=True)
    said = capsys.readouterr().out
    assert (
        "llmft stopped by llmft stop (exit 0) after a complete checkpoint at step 3; continuing in a new job" in said
    )
    assert decide(False) == Outcome(0)
    assert "not continued (no --continue): resubmit with CHECKPOINT_DIR=" in capsys.readouterr().out


def test_after_llmft_stop_a_slurm_job_requeues_only_with_continue(tmp_path, monkeypatch, capsys):
    requeued = []
    monkeypatch.setattr(
        slurm, "run", lambda cmd, timeout=None: requeued.append(cmd) or subprocess.CompletedProcess(cmd, 0)
    )
    a = attempt(tmp_path)
    stop_request.ask(a.files["stop"], True, "me")
    assert after_training(a, 0) == 0 and requeued == [["scontrol", "requeue", "7"]]
    assert "stopped by llmft stop --continue (exit 0) after a checkpoint; requeueing job 7" in capsys.readouterr().out
    stop_request.ask(a.files["stop"], False, "me")
    assert after_training(a, 0) == 0 and len(requeued) == 1
    assert "not requeued (no --continue): resubmit to resume" in capsys.readouterr().out


def test_llmft_stop_stops_a_login_shell_run_at_its_next_step_with_a_complete_checkpoint(
    tiny_model, tiny_data, tmp_path
):
    """`llmft train --nproc_per_node 2` from a shell, no job and no --stop_file; every rank holds at step 2 until a
    stop is requested (LLMFT_TEST_HOLD_AT_STEP), and `llmft stop RUN --continue` is run once step 1 is logged: the
    run saves a complete checkpoint-2 and ends (exit 0, not done), the line says there is no job to go on in, and
    the run's record is gone, so a second `llmft stop` refuses in one line."""
    out = tmp_path / "run"
    cmd = [PYTHON, "-m", "llmft.cli", "train", "--nproc_per_node", "2", "--model_name_or_path", str(tiny_model)]
    cmd += ["--dataset_name", str(tiny_data), "--output_dir", str(out), "--report_to", "none", "--zero_stage", "2"]
    cmd += ["--max_steps", "6", "--global_batch_size", "4", "--per_device_train_batch_size", "2", "--logging_steps"]
    cmd += ["1", "--disable_tqdm", "true", "--max_length", "64", "--save_strategy", "no"]
    env = subprocess_env(LLMFT_TEST_HOLD_AT_STEP="2")
    env.pop("LLMFT_STOP_FILE", None)
    log_path = tmp_path / "train.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        until = time.monotonic() + 600  # a hang guard: the ranks hold at step 2 for the stop however slow the machine
        while proc.poll() is None and time.monotonic() < until:
            if "llmft: step 1/6 loss" in log_path.read_text() and (out / stop_request.TRAINING_RECORD).exists():
                break
            time.sleep(0.5)
        stopped = llmft_stop(str(out), "--continue")
        rc = proc.wait(timeout=600)
    text = log_path.read_text()
    assert stopped.returncode == 0, stopped
    assert stopped.stdout.startswith(f"llmft stop: asked the llmft train in {out.resolve()} (pid "), stopped.stdout
    assert "a run started from a login shell has no job to go on in" in stopped.stdout, stopped.stdout
    assert rc == 0 and "stop requested; saved checkpoint-2" in text, text[-5000:]
    assert (out / "checkpoint-2" / "llmft_complete.json").is_file() and not (out / "llmft_done.json").exists()
    assert not (out / "checkpoint-3").exists() and not (out / stop_request.TRAINING_RECORD).exists()
    again = llmft_stop(str(out))
    assert again.returncode == 2 and "no llmft train is training in" in again.stderr, again


def test_the_pbs_launcher_takes_usr1_and_its_children_do_not_die_of_it(tmp_path):
    """qsig sends USR1 to every process of the job's session: the launcher asks for the stop (its stop file, and the
    signal kept for what follows), and a child it started (pbsdsh, llmft plan, ...) lives on. Run in a process of
    its own: the launcher blocks USR1 for the process."""
    code = f"""
import os, signal, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, {str(REPO)!r})
from llmft.launch import job, pbs
stop = job.Stop(Path({str(tmp_path)!r}) / "stop", "run_llm.pbs")
pbs.stop_on_usr1(stop)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
time.sleep(1)
os.kill(child.pid, signal.SIGUSR1)
os.kill(os.getpid(), signal.SIGUSR1)
for _ in range(50):
    if stop.signal:
        break
    time.sleep(0.1)
time.sleep(0.5)
print(stop.signal, stop.stop_file.exists(), child.poll())
child.kill()
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.splitlines()[-1] == "USR1 True None", proc.stdout + proc.stderr
    assert "run_llm.pbs: got SIGUSR1 at " in proc.stdout

"""W&B settings for Slurm jobs (llmft.tracking, what slurm/run_llm.slurm exports): names, ids that survive a requeue,
offline detection that never hangs. The real job, requeued, is in test_slurm.py."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from conftest import REPO, subprocess_env

from llmft.training.wandb_env import reachable, server_url, slurm_wandb_env

JOB = {"SLURM_JOB_ID": "1234", "SLURM_JOB_NAME": "llmft", "SLURM_CLUSTER_NAME": "c1", "SLURM_RESTART_COUNT": "0"}


def test_runs_are_named_by_job_grouped_and_keep_their_id_across_requeues(tmp_path):
    first = slurm_wandb_env(JOB, str(tmp_path / "ckpt"), online=False)
    assert first["WANDB_NAME"] == "llmft-1234" and first["WANDB_RUN_GROUP"] == "llmft"
    assert first["WANDB_RUN_ID"].startswith("llmft-1234-") and first["WANDB_RESUME"] == "allow"
    assert first["WANDB_MODE"] == "offline" and first["WANDB_DIR"] == str(tmp_path / "ckpt")
    assert first["WANDB__TRANSACTION_LOG_FLUSH_INTERVAL"] == "2"  # what a SIGTERM'd service had not written is lost
    requeued = slurm_wandb_env({**JOB, "SLURM_RESTART_COUNT": "1"}, str(tmp_path / "ckpt"), online=False)
    assert requeued == first  # the requeued job resumes the same run
    assert (
        slurm_wandb_env({**JOB, "SLURM_JOB_ID": "1235"}, str(tmp_path / "ckpt"))["WANDB_RUN_ID"]
        != first["WANDB_RUN_ID"]
    )
    # A recycled job id (another cluster, or another output directory) is another run.
    assert slurm_wandb_env(JOB, str(tmp_path / "other"))["WANDB_RUN_ID"] != first["WANDB_RUN_ID"]
    assert (
        slurm_wandb_env({**JOB, "SLURM_CLUSTER_NAME": "c2"}, str(tmp_path / "ckpt"))["WANDB_RUN_ID"]
        != first["WANDB_RUN_ID"]
    )


def test_array_tasks_user_settings_and_odd_job_names(tmp_path):
    array = slurm_wandb_env(
        {**JOB, "SLURM_JOB_ID": "1240", "SLURM_ARRAY_JOB_ID": "1234", "SLURM_ARRAY_TASK_ID": "6"}, str(tmp_path)
    )
    assert array["WANDB_NAME"] == "llmft-1234_6" and array["WANDB_RUN_GROUP"] == "llmft-1234"  # one group per sweep
    mine = slurm_wandb_env(
        {**JOB, "WANDB_MODE": "online", "WANDB_NAME": "mine", "WANDB_RUN_GROUP": "g"}, str(tmp_path), online=None
    )
    assert (
        "WANDB_MODE" not in mine and "WANDB_NAME" not in mine and "WANDB_RUN_GROUP" not in mine
    )  # the user's values win
    odd = slurm_wandb_env({**JOB, "SLURM_JOB_NAME": "my job/$(rm -rf ~)"}, str(tmp_path))
    assert odd["WANDB_RUN_ID"].startswith("my-job-rm--rf-1234-") and set(odd["WANDB_RUN_ID"]) <= set(
        "abcdefghijklmnopqrstuvwxyz0123456789-_.ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    )
    assert slurm_wandb_env(JOB, str(tmp_path), online=True)["WANDB_MODE"] == "online"
    with pytest.raises(ValueError, match="not inside a Slurm job"):
        slurm_wandb_env({}, str(tmp_path))


def test_the_connectivity_check_is_quick_either_way():
    import http.server
    import threading

    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)  # answers 501: it is there
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        assert reachable(f"http://127.0.0.1:{port}", timeout=3)
    finally:
        server.shutdown()
        server.server_close()
    assert not reachable(f"http://127.0.0.1:{port}", timeout=2)  # nothing listens any more
    with socket.socket() as silent:  # accepts the connection, never answers: bounded by the timeout
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        t0 = time.time()
        assert not reachable(f"http://127.0.0.1:{silent.getsockname()[1]}", timeout=1.5)
        assert time.time() - t0 < 10  # bounded (forever without the timeout)
    assert server_url({}) == "https://api.wandb.ai"
    assert server_url({"WANDB_BASE_URL": "http://wandb.internal:8080"}) == "http://wandb.internal:8080"


def test_the_script_helper_prints_only_wandb_lines_and_never_the_key(tmp_path):
    secret = "wandb-secret-0123456789abcdef0123456789abcdef"
    env = subprocess_env(**JOB, WANDB_API_KEY=secret, WANDB_BASE_URL="http://127.0.0.1:9")
    env.pop("WANDB_MODE")
    proc = subprocess.run(
        [sys.executable, "-m", "llmft.tracking", "slurm-env", "--output_dir", str(tmp_path), "--timeout", "2"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert all(line.split("=", 1)[0].startswith("WANDB_") for line in lines)
    assert "WANDB_MODE=offline" in lines and "WANDB_NAME=llmft-1234" in lines
    assert "http://127.0.0.1:9 did not answer" in proc.stderr
    assert secret not in proc.stdout + proc.stderr


def test_a_dead_wandb_service_is_reported_once_and_does_not_end_training():
    from transformers.integrations import WandbCallback

    from llmft.training.wandb_env import guard_wandb

    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise ConnectionResetError("Connection lost")

    callback = WandbCallback()
    callback.on_log = broken
    trainer = SimpleNamespace(callback_handler=SimpleNamespace(callbacks=[object(), callback]))
    lines = []
    assert guard_wandb(trainer, lines.append)
    assert callback.on_log(None, None, None, logs={"loss": 1.0}) is None
    assert callback.on_log(None, None, None, logs={"loss": 0.9}) is None
    assert calls == [1] and len(lines) == 1 and "W&B stopped logging (ConnectionResetError" in lines[0]
    assert not guard_wandb(SimpleNamespace(callback_handler=SimpleNamespace(callbacks=[])), lines.append)


def test_a_pbs_jobs_sweep_element_is_named_by_its_variant_and_grouped_by_its_array(tmp_path):
    """A PBS array element (qsub -J) of a SWEEP: named by job, variant and element, one group per sweep, and the
    same run again after a rerun (qrerun keeps the job id)."""
    element = {
        "PBS_JOBID": "12[2].pbs-head",
        "PBS_JOBNAME": "sft",
        "PBS_ARRAY_ID": "12[].pbs-head",
        "PBS_ARRAY_INDEX": "2",
        "PBS_SERVER": "pbs-head",
        "LLMFT_SWEEP_VARIANT": "learning_rate-3e-5",
    }
    first = slurm_wandb_env(element, str(tmp_path / "sweep" / "learning_rate-3e-5"), online=False)
    assert first["WANDB_NAME"] == "sft-learning_rate-3e-5-12_2" and first["WANDB_RUN_GROUP"] == "sft-12"
    assert first["WANDB_RUN_ID"].startswith("sft-12-2-") and set(first["WANDB_RUN_ID"]) <= set(
        "abcdefghijklmnopqrstuvwxyz0123456789-_.ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    )
    assert slurm_wandb_env(element, str(tmp_path / "sweep" / "learning_rate-3e-5"), online=False) == first
    plain = slurm_wandb_env({"PBS_JOBID": "13.pbs-head", "PBS_JOBNAME": "sft"}, str(tmp_path), online=False)
    assert plain["WANDB_NAME"] == "sft-13" and plain["WANDB_RUN_GROUP"] == "sft"

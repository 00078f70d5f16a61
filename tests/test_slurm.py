"""slurm/run_llm.slurm on a real local Slurm cluster (slurm/local: munge, slurmctld, slurmd n1 + n2).

Jobs are submitted with sbatch exactly as a user would, run srun + torchrun + DeepSpeed for real on
two Slurm nodes, and are preempted the way Slurm does it (USR1 to the batch shell, scontrol requeue).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmft.launch_env import expand_hostlist
from slurm_cluster import SCRIPT, REPO, start_cluster, step_lines, stop_cluster



@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    state = tmp_path_factory.mktemp("slurm")
    c = start_cluster(state)
    yield c
    stop_cluster(state)
    pids = (state / "run" / "started.pids").read_text()
    assert pids == "", f"stop.sh left pids recorded: {pids}"


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def optim_shards(tag_dir: Path) -> list[str]:
    return sorted(p.name for p in tag_dir.glob("*optim_states.pt"))


def signal_when_training(cluster, job: str, log: Path, min_step: int, command: list[str]) -> dict:
    """In the background: once rank 0 has reported `min_step`, preempt the job with `command`."""
    result: dict = {}

    def watch():
        deadline = time.time() + 600
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
    knobs = f"--export=ALL,EPOCHS=1,MODEL={tiny_model},DATASET={tiny_data},DATA_PERCENTAGE=25,GLOBAL_BATCH=4,MICRO_BATCH=2"
    submitted["users"] = (cluster.sbatch([str(SCRIPT), knobs], cwd=cwd), cwd, None)

    # Preemption twice over: Slurm's time-limit signal (USR1 to the batch shell, as --signal=B:USR1@120 sends it,
    # with no periodic checkpoints, so the only one before the end is the one the signal asks for), and an
    # outside `scontrol requeue` (SIGTERM to every process of the job, checkpoints every 2 steps).
    # The requeued job also logs to W&B, with the mode left to the job: the server (a closed local port) does not answer.
    wandb = {"WANDB_MODE": "", "WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_API_KEY": WANDB_SECRET}
    for name, save_steps, min_step, command, extra, env in (
        ("usr1", 1000, 2, ["scancel", "--signal=USR1", "--batch"], "", {}),
        ("requeue", 2, 5, ["scontrol", "requeue"], ",WANDB_PROJECT=llmft-test", wandb),
    ):
        cwd = tmp_path_factory.mktemp(name)
        knobs = (
            f"--export=ALL,MAX_STEPS={TOTAL},GLOBAL_BATCH=16,MICRO_BATCH=2,SAVE_STEPS={save_steps},DATA_PERCENTAGE=100,"
            f"MODEL={tiny_model},DATASET={tiny_data},CHECKPOINT_DIR={cwd / 'ckpt'},VENV={sys.prefix},EXTRA_ARGS=--logging_steps 1{extra}"
        )
        job = cluster.sbatch([str(SCRIPT), knobs], cwd=cwd, **env)
        submitted[name] = (job, cwd, signal_when_training(cluster, job, cwd / f"llmft-{job}.out", min_step, [*command, job]))

    # A user's plain `scancel`: the job must end, not requeue itself.
    cwd = tmp_path_factory.mktemp("cancel")
    knobs = f"--export=ALL,MAX_STEPS=200,MODEL={tiny_model},DATASET={tiny_data},GLOBAL_BATCH=4,MICRO_BATCH=2,EXTRA_ARGS=--logging_steps 1"
    job = cluster.sbatch([str(SCRIPT), knobs], cwd=cwd)
    submitted["cancel"] = (job, cwd, signal_when_training(cluster, job, cwd / f"llmft-{job}.out", 2, ["scancel", job]))
    return submitted


TOTAL = 20
WANDB_SECRET = "wandb-secret-0123456789abcdef0123456789abcdef"


def finished_preempted_job(cluster, job, cwd, signal) -> tuple[str, Path]:
    info = cluster.wait(job, timeout=600)
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
    assert optim_shards(tag) == ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
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
    assert signal["at_step"] <= stop < TOTAL
    assert "got SIGUSR1" in text
    assert f"requeueing job {job}" in text
    # It resumed from exactly the checkpoint the signal asked for, and the first run trained up to it.
    assert assert_resumed_without_losing_or_repeating(text, ckpt) == stop
    assert step_lines(text[: text.index("restart 1,")]) == list(range(1, stop + 1))


def test_scontrol_requeue_resumes_from_the_newest_complete_checkpoint(cluster, jobs):
    job, cwd, signal = jobs["requeue"]
    text, ckpt = finished_preempted_job(cluster, job, cwd, signal)
    resumed = assert_resumed_without_losing_or_repeating(text, ckpt)
    # Checkpoints every 2 steps: at least the one before the requeue (step >= 5 had been reported).
    assert resumed >= 4, text


def test_wandb_offline_run_is_named_by_the_job_and_the_requeued_job_appends_to_it(cluster, jobs):
    from wandb_file import run_info

    job, cwd, _ = jobs["requeue"]
    info = cluster.wait(job, timeout=600)
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
    # SIGTERM ends W&B's service with the job step: the first attempt keeps what it flushed (every 2 s) before that.
    assert steps[0] and steps[0] == list(range(1, len(steps[0]) + 1)) and steps[0][-1] <= resumed, steps
    assert steps[1] == list(range(resumed + 1, TOTAL + 1))  # the metrics after the requeue continue the run
    # The dead service did not end the run through the training loop (llmft.tracking.guard_wandb): the stop's
    # checkpoint was written and the run was resumed from it. (wandb's own exit hook may still print its error.)
    assert "llmft/train.py" not in text and text.count("llmft: W&B stopped logging") <= 1
    assert f"stop requested; saved checkpoint-{resumed}" in text
    last = text.rstrip().splitlines()[-1]
    assert last == (f"run_llm.slurm: W&B ran offline; upload from a machine with internet: wandb sync --id {run_id} "
                    f"-p llmft-test {runs[0]} {runs[1]}")
    assert WANDB_SECRET not in text


# ---- the user's command on two nodes ------------------------------------------------------------


def test_users_sbatch_command_trains_on_two_nodes_and_the_checkpoint_serves_inference(cluster, jobs):
    job, cwd, _ = jobs["users"]
    ckpt = cwd / "my_llm_checkpoint"  # the default CHECKPOINT_DIR, relative to the submit directory
    info = cluster.wait(job, timeout=400)
    log = cwd / f"llmft-{job}.out"  # %x-%j.out in the submit directory
    text = read(log)
    assert info["JobState"] == "COMPLETED", f"{info}\n{text}"
    assert info["ExitCode"] == "0:0"
    assert info["NodeList"] == "n[1-2]"

    # The first lines: the resolved plan, before anything is launched.
    lines = text.splitlines()
    launch = next(i for i, line in enumerate(lines) if line.startswith("run_llm.slurm: launch: srun"))
    head = "\n".join(lines[:launch])
    assert lines[0].startswith(f"run_llm.slurm: job {job} (llmft) restart 0")
    for expected in (
        "run_llm.slurm: nodes 2: n1 n2; GPUs per node 1; processes per node 1",
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
    # One torchrun per Slurm node, and the run's world spans both.
    assert "run_llm.slurm: node n1 (node rank 0): torchrun with 1 GPU(s)" in text
    assert "run_llm.slurm: node n2 (node rank 1): torchrun with 1 GPU(s)" in text
    assert "llmft plan: world size 2 (2 nodes x 1 processes, from torchrun)" in text

    # One shard per rank in a complete checkpoint; the run is marked done.
    done = json.loads((ckpt / "llmft_done.json").read_text())
    step = done["global_step"]
    assert step == 16  # 25% of 256 examples = 64, global batch 4
    tag = ckpt / f"checkpoint-{step}" / f"global_step{step}"
    assert optim_shards(tag) == ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert json.loads((ckpt / f"checkpoint-{step}" / "llmft_complete.json").read_text())["world_size"] == 2

    # Inference straight from the ZeRO checkpoint.
    proc = subprocess.run(
        [sys.executable, "-m", "llmft.infer", str(tag), "--prompt", "What is 2 plus 3?", "--max_new_tokens", "8", "--json"],
        cwd=REPO, env=cluster.env(), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert result["world_size"] == 2 and result["step"] == step
    assert len(result["generations"]) == 1 and result["generations"][0]["prompt"].startswith("What is 2 plus 3?")


def test_a_cancelled_job_ends_and_is_not_requeued(cluster, jobs):
    job, cwd, signal = jobs["cancel"]
    signal["thread"].join(timeout=600)
    assert "error" not in signal and signal["proc"].returncode == 0, signal
    info = cluster.wait(job, timeout=120)
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
    (["{script}", "--export=ALL,EPOCHS=abc"], "run_llm.slurm: error: EPOCHS=abc is not a positive number (default 10)"),
    (["--export=ALL,EPOCHS=abc", "{script}"], "run_llm.slurm: error: EPOCHS=abc is not a positive number (default 10)"),
    (["{script}", "--export=ALL,EPOCHS=1,EPOCH=3"], "run_llm.slurm: error: unknown knob 'EPOCH' in '--export=ALL,EPOCHS=1,EPOCH=3'; known knobs: EPOCHS CHECKPOINT_DIR"),
    (["{script}", "--export=ALL,ZERO_STAGE=7"], "run_llm.slurm: error: ZERO_STAGE=7 is not a ZeRO stage; use 0, 1, 2 or 3"),
    (["{script}", "--export=ALL,CONTAINER_IMAGE=nvcr.io#nvidia/pytorch:24.05-py3"], "needs the pyxis SPANK plugin"),
    # Knobs that look fine alone but make an impossible plan: llmft plan says so before torchrun starts.
    (["{script}", "--export=ALL,GLOBAL_BATCH=3,MICRO_BATCH=2"], "llmft plan: error:"),
]


def test_bad_knobs_fail_in_the_jobs_first_lines_with_one_clear_message(cluster, tmp_path):
    jobs = []
    for i, (args, message) in enumerate(BAD):
        cwd = tmp_path / str(i)
        cwd.mkdir()
        jobs.append((cluster.sbatch([a.replace("{script}", str(SCRIPT)) for a in args], cwd=cwd), cwd, args, message))
    for job, cwd, args, message in jobs:
        info = cluster.wait(job, timeout=120)
        text = read(cwd / f"llmft-{job}.out")
        assert info["JobState"] == "FAILED", f"{args}: {info}\n{text}"
        assert info["ExitCode"] == "2:0", f"{args}: {info}"
        assert message in text, f"{args}: {message!r} not in\n{text}"
        assert "launch: srun" not in text and "torch.distributed.run" not in text, text
        assert text.count("error:") == 1, text
        if not message.startswith("llmft plan"):
            assert text.splitlines()[0].startswith("run_llm.slurm: error:"), text  # before anything else
        else:
            assert re.search(r"nearest|use|try", text.split("llmft plan: error:")[1]), text


# ---- resources: change #SBATCH --gpus-per-node only ---------------------------------------------


def test_more_gpus_per_node_needs_no_other_edit_and_keeps_the_global_batch(cluster, tmp_path):
    edited = tmp_path / "run_llm_4gpu.slurm"
    original = SCRIPT.read_text()
    assert "#SBATCH --gpus-per-node=1\n" in original
    edited.write_text(original.replace("#SBATCH --gpus-per-node=1\n", "#SBATCH --gpus-per-node=4\n"))
    knobs = "--export=ALL,DRY_RUN=1,GLOBAL_BATCH=32,MICRO_BATCH=4,NCCL_PROFILE=aws-efa"
    one = cluster.sbatch([knobs, str(SCRIPT)], cwd=tmp_path)  # sbatch's own --export: knobs in the environment
    two = cluster.sbatch(
        [str(edited), knobs + ",LORA=1,WANDB_PROJECT=llmft-test,EXTRA_ARGS=--seed 7 --logging_steps 5"],
        cwd=tmp_path, NCCL_SOCKET_IFNAME="eth9",
    )
    for job in (one, two):
        assert cluster.wait(job, timeout=120)["JobState"] == "COMPLETED", read(tmp_path / f"llmft-{job}.out")
    a, b = read(tmp_path / f"llmft-{one}.out"), read(tmp_path / f"llmft-{two}.out")

    assert "world size 2 (2 nodes x 1 processes" in a and "gradient accumulation 4" in a
    assert "GPUs per node 4; processes per node 4" in b
    assert "world size 8 (2 nodes x 4 processes" in b and "gradient accumulation 1" in b
    assert "--nnodes 2 --nproc_per_node 4 " in b
    for text in (a, b):
        assert "global batch 32 = " in text
        assert "DRY_RUN=1: not launching" in text
        assert "nccl FI_PROVIDER=efa" in text
    assert "nccl NCCL_SOCKET_IFNAME=eth9" in b  # a setting the user exported wins over the profile
    # Knobs become llmft train flags; EXTRA_ARGS are passed as separate words.
    assert "--report_to none" in a and "--use_peft" not in a
    assert "--report_to wandb" in b and "--use_peft" in b and "--seed 7 --logging_steps 5" in b
    # Rendezvous ports derive from the job id: two jobs sharing a node do not collide.
    ports = [re.search(r"rendezvous c10d at [^:]+:(\d+)", t).group(1) for t in (a, b)]
    assert ports == [str(20000 + int(one) % 10000), str(20000 + int(two) % 10000)] and ports[0] != ports[1]


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
    assert [name for name, _ in pids] == ["munged", "slurmctld", "slurmd", "slurmd"]
    stop_cluster(other)
    for name, pid in pids:
        assert not Path(f"/proc/{pid}").exists() or name not in Path(f"/proc/{pid}/comm").read_text(), (name, pid)
    # The session's cluster is untouched.
    assert cluster.cmd(["sinfo", "-h", "-N", "-o", "%N %t"]).stdout.split() == ["n1", "idle", "n2", "idle"]

"""pbs/run_llm.pbs on a real OpenPBS cluster (pbs/local/: a server, a scheduler and two moms, pbs-n0 and pbs-n1):
jobs submitted with qsub as the job user train on two nodes, stop for their walltime and go on in a continuation,
lose a rank and go on in a continuation, are rerun by qrerun, run a sweep as an array, and refuse bad knobs. Jobs in
a container, through the real enroot: tests/test_container_jobs.py.

The jobs are submitted together by a module fixture, so they overlap (each takes one CPU per node).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest
from pbs_cluster import JOB_USER, PbsCluster
from slurm_cluster import step_lines as steps_trained

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "pbs" / "run_llm.pbs"
TRAINING_JOB_S = 1800  # guards against hangs, not a speed claim (see tests/pbs_cluster.py)
TOTAL = 8


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def optim_shards(tag_dir: Path) -> list[str]:
    return sorted(p.name for p in tag_dir.glob("*optim_states.pt"))


def own(path: Path) -> None:
    """The job user's: a job writes where it trains."""
    shutil.chown(path, JOB_USER, JOB_USER)
    for p in path.rglob("*"):
        shutil.chown(p, JOB_USER, JOB_USER)


def seed_the_job_users_op_cache() -> None:
    """The DeepSpeed ops this environment's own tests built (llmft keys one op cache per environment), copied into the
    job user's node-local cache when it has none: as on a cluster whose nodes keep their op caches, the first PBS job
    loads them instead of compiling them again (140 s of the 2-core CI machine). Nothing built yet: the job builds."""
    import deepspeed
    import torch

    from llmft.training.build_locks import extensions_root
    from llmft.training.upstream_noise import keyed_extensions_dir

    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    ours = keyed_extensions_dir(env, sys.prefix, torch.__version__, deepspeed.__version__, extensions_root(env))
    theirs = keyed_extensions_dir(
        {"LLMFT_EXTENSIONS_ROOT": f"/tmp/llmft-{JOB_USER}/torch_extensions"},
        sys.prefix,
        torch.__version__,
        deepspeed.__version__,
        extensions_root(env),
    )
    for op in ours.glob("*") if ours.is_dir() else []:
        built = any(op.glob("*.so")) and not (op / "lock").exists()
        if built and not (theirs / op.name).exists():
            shutil.copytree(op, theirs / op.name)  # copy2: the build's mtimes kept, so nothing is out of date
    for path in (theirs.parent.parent, theirs.parent, theirs) if theirs.is_dir() else ():
        own(path)


@pytest.fixture(scope="module")
def inputs(pbs_cluster: PbsCluster, tiny_model, tiny_data, tmp_path_factory) -> dict[str, Path]:
    """The tiny model and data where the job user can read them (pytest's tmp_path is root's, mode 700)."""
    d = pbs_cluster.job_dir(tmp_path_factory.mktemp("pbs_inputs"))
    shutil.copytree(tiny_model, d / "model")
    shutil.copy(tiny_data, d / "train.jsonl")
    own(d)
    seed_the_job_users_op_cache()
    return {"model": d / "model", "data": d / "train.jsonl", "dir": d}


def common(inputs, d: Path, pythonpath: str = str(REPO)) -> str:
    """The -v items every training job here gets: offline, the inputs, the job's own caches, llmft's venv, and
    PYTHONPATH with this checkout first (its launcher and llmft, whichever checkout the venv's editable install names;
    the ranks get it too, as the job's own variable)."""
    return (
        f"MODEL={inputs['model']},DATASET={inputs['data']},VENV={sys.prefix},HF_HUB_OFFLINE=1,"
        f"TOKENIZERS_PARALLELISM=false,LLMFT_CACHE={d / 'cache'},HF_HOME={d / 'hf'},PYTHONPATH={pythonpath}"
    )


@pytest.fixture(scope="module")
def jobs(pbs_cluster: PbsCluster, inputs, tmp_path_factory):
    """The training jobs, submitted together: {name: (job id, directory)}."""
    # The queue's kill_delay: PBS's SIGKILL comes this long after its SIGTERM (walltime, qrerun, qdel). 10 s by default;
    # the stop checkpoint of two ranks on this loaded 2-core machine needs more.
    pbs_cluster.cmd([str(pbs_cluster.bin / "qmgr"), "-c", "set queue workq kill_delay = 60"])
    out = {}

    def submit(name: str, resources: list[str], variables: str, pythonpath: str = str(REPO)) -> None:
        d = pbs_cluster.job_dir(tmp_path_factory.mktemp(name))
        output = d / ("out.^array_index^" if "-J" in resources else "out")  # an array: one file per element
        given = f"{common(inputs, d, pythonpath)},{variables.format(d=d)}"
        args = [*resources, "-o", str(output), "-v", given, str(SCRIPT)]
        out[name] = (pbs_cluster.qsub(args, cwd=d), d)

    two_nodes = ["-l", "select=2:ncpus=1", "-l", "place=scatter", "-l", "walltime=00:30:00"]
    # The exact form: two CPU-only nodes, 4 steps, ZeRO-2.
    submit(
        "two_nodes",
        two_nodes,
        "MAX_STEPS=4,GLOBAL_BATCH=4,MICRO_BATCH=2,ZERO_STAGE=2,CHECKPOINT_DIR={d}/ckpt",
    )
    # The walltime: at step 3 the time left becomes 40 s (a test hook; the job's walltime, 30 min, is read from qstat),
    # less than the final-save lead with a 12 s save: llmft stops, saves, and the job submits its continuation.
    submit(
        "walltime",
        two_nodes,
        f"MAX_STEPS={TOTAL},GLOBAL_BATCH=8,MICRO_BATCH=2,SAVE_STEPS=1000,CHECKPOINT_DIR={{d}}/ckpt,"
        "EXTRA_ARGS=--logging_steps 1,LLMFT_TEST_TIME_LEFT_AT_STEP=3:40,LLMFT_TEST_SAVE_DELAY_S=12",
    )
    # qrerun (an operator's): every rank holds at step 3 until the stop; checkpoints every 2 steps, all kept. The
    # qrerun is sent from a thread once checkpoint-2 is complete, so the held job never waits on the other tests.
    submit(
        "qrerun",
        two_nodes,
        f"MAX_STEPS={TOTAL},GLOBAL_BATCH=8,MICRO_BATCH=2,SAVE_STEPS=2,SAVE_TOTAL_LIMIT=0,CHECKPOINT_DIR={{d}}/ckpt,"
        "EXTRA_ARGS=--logging_steps 1,LLMFT_TEST_HOLD_AT_STEP=3",
    )
    job, d = out["qrerun"]
    rerun: dict = {}

    def qrerun_at_checkpoint_2() -> None:
        try:
            done = d / "ckpt" / "checkpoint-2" / "llmft_complete.json"
            pbs_cluster.wait_for("checkpoint-2", done.is_file, TRAINING_JOB_S)
            time.sleep(2)  # the ranks are held at step 3: the stop lands there however slow the machine
            rerun["proc"] = pbs_cluster.qrerun(job)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            rerun["error"] = repr(e)

    rerun["thread"] = threading.Thread(target=qrerun_at_checkpoint_2, daemon=True)
    rerun["thread"].start()
    out["qrerun"] = (job, d, rerun)
    # A rank dies: tests/kill_hook SIGKILLs the rank on pbs-n1 once checkpoint-2 is complete (the attempt made
    # progress), once; the job names it in one line and goes on in a continuation, which resumes and finishes.
    submit(
        "killed",
        two_nodes,
        f"MAX_STEPS={TOTAL},GLOBAL_BATCH=8,MICRO_BATCH=2,SAVE_STEPS=2,CHECKPOINT_DIR={{d}}/ckpt,"
        "EXTRA_ARGS=--logging_steps 1,LLMFT_TEST_KILL_NODE=pbs-n1,"
        "LLMFT_TEST_KILL_AFTER={d}/ckpt/checkpoint-2/llmft_complete.json,LLMFT_TEST_KILL_RECORD={d}/failed_rank",
        pythonpath=f"{REPO}:{REPO / 'tests' / 'kill_hook'}",
    )
    # A sweep: one variant per element, each on one node.
    submit(
        "sweep",
        ["-J", "1-2", "-l", "select=1:ncpus=1", "-l", "walltime=00:30:00"],
        "MAX_STEPS=2,GLOBAL_BATCH=4,MICRO_BATCH=2,CHECKPOINT_DIR={d}/sweep,SWEEP='learning_rate=1e-4,3e-4'",
    )
    return out


def test_two_cpu_nodes_train_to_a_complete_checkpoint_with_both_ranks_shards(pbs_cluster, jobs):
    """qsub -l select=2:ncpus=1 -l place=scatter -v MODEL=...,MAX_STEPS=4,... pbs/run_llm.pbs: one torchrun per node,
    the rendezvous at the first node of PBS_NODEFILE, and checkpoint-4/global_step4/ holds both ranks' shards."""
    job, d = jobs["two_nodes"]
    info = pbs_cluster.wait(job, timeout=TRAINING_JOB_S)
    text = pbs_cluster.wait_for("the job's output", lambda: read(d / "out"))
    assert info["Exit_status"] == 0, text
    assert "run_llm.pbs: nodes 2: pbs-n0 pbs-n1; processes per node 1; CPUs per node 1" in text, text
    assert "run_llm.pbs: node" not in text or text.count("torchrun") >= 2
    assert re.search(r"run_llm.pbs: rendezvous c10d at 198\.51\.100\.\d+:\d+ \(first host pbs-n0\)", text), text
    tag = d / "ckpt" / "checkpoint-4" / "global_step4"
    assert optim_shards(tag) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    assert json.loads((d / "ckpt" / "llmft_done.json").read_text())["global_step"] == 4
    assert "run_llm.pbs: training finished (exit 0)" in text


def test_a_walltime_stop_saves_and_the_continuation_resumes_without_losing_or_repeating_a_step(pbs_cluster, jobs):
    job, d = jobs["walltime"]
    info = pbs_cluster.wait(job, timeout=TRAINING_JOB_S)
    first = pbs_cluster.wait_for("the first job's output", lambda: read(d / "out"))
    assert info["Exit_status"] == 0, first
    assert "run_llm.pbs: walltime: 0:29:" in first or "run_llm.pbs: walltime: 0:30:" in first, first
    m = re.search(r"continuation submitted: job (\S+) starts after", first)
    assert m and "llmft stopped for its final save before the walltime" in first, first
    second_job = m.group(1)
    second_info = pbs_cluster.wait(second_job, timeout=TRAINING_JOB_S)
    second = pbs_cluster.wait_for("the continuation's output", lambda: read(d / "out.1"))
    assert second_info["Exit_status"] == 0, second
    # submitted by the first job to start after it ended (PBS clears `depend` once it is met)
    assert f"-W depend=afterany:{job} " in second_info["Submit_arguments"], second_info
    resumed = re.search(r"llmft: resuming from (\S+)/checkpoint-(\d+)\n", second)
    assert resumed and resumed.group(1) == str((d / "ckpt").resolve()), second
    k = int(resumed.group(2))
    assert steps_trained(first) == list(range(1, k + 1)) and steps_trained(second) == list(range(k + 1, TOTAL + 1))
    assert optim_shards(d / "ckpt" / f"checkpoint-{k}" / f"global_step{k}") == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    assert json.loads((d / "ckpt" / "llmft_done.json").read_text())["global_step"] == TOTAL


def test_a_rank_killed_mid_run_is_named_in_one_line_and_the_run_goes_on_in_a_continuation(pbs_cluster, jobs):
    """The rank on pbs-n1 is SIGKILLed after checkpoint-2: the job names that rank and node in one line (the rules of
    the Slurm job, llmft.launch.failure_blame), counts the failure, and its continuation resumes from the newest
    complete checkpoint and trains to the end, no step lost or trained twice."""
    job, d = jobs["killed"]
    info = pbs_cluster.wait(job, timeout=TRAINING_JOB_S)
    first = pbs_cluster.wait_for("the first job's output", lambda: read(d / "out"))
    rank = (d / "failed_rank").read_text().split()[0]
    assert info["Exit_status"] != 0, first  # the attempt failed; the run goes on in the continuation
    failed = rf"run_llm.pbs: training failed \(exit \d+\): rank {rank} on node pbs-n1 failed first \(exit code -9, SIGKILL\)\n"
    assert len(re.findall(failed, first)) == 1, first
    assert re.search(r"continuing in a new job \(after failures 1 of at most MAX_RESTARTS=3\)", first), first
    m = re.search(r"continuation submitted: job (\S+) starts after", first)
    assert m, first
    second_info = pbs_cluster.wait(m.group(1), timeout=TRAINING_JOB_S)
    second = pbs_cluster.wait_for("the continuation's output", lambda: read(d / "out.1"))
    assert second_info["Exit_status"] == 0, second
    resumed = re.search(r"llmft: resuming from \S+/checkpoint-(\d+)\n", second)
    assert resumed and int(resumed.group(1)) >= 2, second
    k = int(resumed.group(1))
    assert steps_trained(second) == list(range(k + 1, TOTAL + 1)), second
    assert json.loads((d / "ckpt" / "llmft_done.json").read_text())["global_step"] == TOTAL


def test_qrerun_stops_every_rank_at_a_checkpoint_and_the_rerun_resumes_from_it(pbs_cluster, jobs):
    job, d, rerun = jobs["qrerun"]
    ckpt = d / "ckpt"
    rerun["thread"].join(timeout=TRAINING_JOB_S)
    # qrerun returns once PBS requeued the job, or says it is still in progress when the ranks' stop checkpoint
    # outlasts its wait for the server's reply; either way the job runs again (run_count below)
    proc = rerun.get("proc")
    assert "error" not in rerun and proc is not None, rerun
    assert proc.returncode == 0 or "Job rerun request still in progress" in proc.stderr, proc
    info = pbs_cluster.wait(job, timeout=TRAINING_JOB_S)
    text = pbs_cluster.wait_for("the rerun's output", lambda: read(d / "out"))
    assert info["Exit_status"] == 0 and int(info["run_count"]) == 2, (info, text)
    assert f"run_llm.pbs: job {job} (" in text and ") run 2," in text, text
    first, second = text.split(") run 2,", 1)  # the rerun's output follows the first run's in the same file
    resumed = re.search(r"llmft: resuming from \S+/checkpoint-(\d+)\n", second)
    assert resumed and int(resumed.group(1)) >= 3, text  # the stop checkpoint at the held step, not checkpoint-2
    k = int(resumed.group(1))
    # the first run's own lines stop where PBS closed its output at the SIGTERM; the stop checkpoint is the launcher's
    logged = steps_trained(first)
    assert logged == list(range(1, len(logged) + 1)) and len(logged) <= k, logged
    assert steps_trained(second) == list(range(k + 1, TOTAL + 1))
    assert re.search(
        rf"run_llm.pbs: stopped by SIGTERM \(exit \d+\) after a complete checkpoint at step {k}; a job PBS", first
    )
    assert optim_shards(ckpt / f"checkpoint-{k}" / f"global_step{k}") == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    assert json.loads((ckpt / "llmft_done.json").read_text())["global_step"] == TOTAL
    assert "continuation submitted" not in text  # PBS reran the job itself


def test_a_sweep_trains_each_variant_in_its_own_directory_and_report_compares_them(pbs_cluster, jobs, tmp_path):
    job, d = jobs["sweep"]
    pbs_cluster.wait(job, timeout=TRAINING_JOB_S)
    subjobs = {jid: i for jid, i in pbs_cluster.qstat(job, subjobs=True).items() if jid != job}
    assert sorted(i["Exit_status"] for i in subjobs.values()) == [0, 0], subjobs
    sweep_dir = d / "sweep"
    assert json.loads((sweep_dir / "llmft_sweep.json").read_text())["sweep"] == "learning_rate=1e-4,3e-4"
    for name, lr in (("learning_rate-1e-4", 1e-4), ("learning_rate-3e-4", 3e-4)):
        run = sweep_dir / name
        assert json.loads((run / "llmft_done.json").read_text())["global_step"] == 2
        assert json.loads((run / "llmft_run.json").read_text())["hyperparameters"]["learning_rate"] == lr
    first, second = read(d / "out.1"), read(d / "out.2")
    assert f"run_llm.pbs: sweep variant 1 of 2: learning_rate=1e-4 in {sweep_dir}" in first, first
    assert f"run_llm.pbs: sweep variant 2 of 2: learning_rate=3e-4 in {sweep_dir}" in second, second
    from llmft import report

    written = report.report([sweep_dir], tmp_path / "report")
    assert [r.name for r in written["runs"]] == ["learning_rate-1e-4", "learning_rate-3e-4"]


def test_export_dir_exports_the_finished_run_in_the_job_with_its_checks(pbs_cluster, plain_model, tiny_data, tmp_path):
    """qsub -v EXPORT=exported/final,...: after 4 steps on two nodes, `llmft export RUN --out DIR` runs as the job's
    last step; DIR (relative to the job's directory) holds the served model and the job's output its checks."""
    d = pbs_cluster.job_dir(tmp_path)
    shutil.copytree(plain_model, d / "model")  # no chat template: the checks compare plain prompts' greedy tokens
    shutil.copy(tiny_data, d / "train.jsonl")
    own(d)
    seed_the_job_users_op_cache()
    variables = (
        f"{common({'model': d / 'model', 'data': d / 'train.jsonl'}, d)},MAX_STEPS=4,GLOBAL_BATCH=4,MICRO_BATCH=2,"
        f"CHECKPOINT_DIR={d / 'ckpt'},EXPORT=exported/final,PYTHONPATH={REPO}"  # this checkout's llmft in the job
    )
    resources = ["-l", "select=2:ncpus=1", "-l", "place=scatter", "-l", "walltime=00:30:00"]
    job = pbs_cluster.qsub([*resources, "-o", str(d / "out"), "-v", variables, str(SCRIPT)], cwd=d)
    info = pbs_cluster.wait(job, timeout=TRAINING_JOB_S)
    text = pbs_cluster.wait_for("the job's output", lambda: read(d / "out"))
    assert info["Exit_status"] == 0, text
    ckpt, out = d / "ckpt", d / "exported" / "final"
    assert "quantization_settings" in json.loads((ckpt / "llmft_run.json").read_text())  # recorded by this checkout
    assert f"exporting the final checkpoint: llmft export {ckpt} --out {out}" in text, text
    assert f"llmft export: checks passed: {out} loads in a fresh process" in text, text
    assert text.index("run_llm.pbs: training finished (exit 0)") < text.index("checks passed")
    assert text.index("checks passed") < text.index(f"exported to {out}")
    for name in ("config.json", "model.safetensors", "generation_config.json", "README.md", "tokenizer.json"):
        assert (out / name).is_file(), sorted(p.name for p in out.iterdir())
    record = json.loads((out / "llmft_export.json").read_text())
    assert record["source"] == str(ckpt / "checkpoint-4" / "global_step4") and record["step"] == 4
    assert all(not p["chat"] for p in record["prompts"]) and record["tokens"]  # no template: plain prompts alone
    assert "llmft" in (out / "README.md").read_text()


@pytest.mark.parametrize(
    "variables, message",
    [
        ("EPOCHS=abc", "run_llm.pbs: error: EPOCHS=abc is not a positive number (default 3)"),
        ("EPOCH=3", "run_llm.pbs: error: unknown knob 'EPOCH' in 'qsub -v'; did you mean EPOCHS?"),
        ("VENV=/nonexistent", "run_llm.pbs: error: VENV=/nonexistent is not a virtual environment"),
        # no EFA device under LLMFT_SYSFS_ROOT: refused on the job's first node before anything else, as on Slurm
        ("NCCL_PROFILE=aws-efa,LLMFT_SYSFS_ROOT=/nonexistent", "run_llm.pbs: error: NCCL_PROFILE=aws-efa, but node "),
    ],
)
def test_bad_knobs_end_the_job_with_one_line_and_exit_2(pbs_cluster, tmp_path, variables, message):
    d = pbs_cluster.job_dir(tmp_path)
    # PYTHONPATH: this checkout's launcher, whichever checkout the venv's editable install names
    venv = "" if variables.startswith("VENV=") else f"VENV={sys.prefix},PYTHONPATH={REPO},"
    job = pbs_cluster.qsub(
        [
            "-l",
            "select=1:ncpus=1",
            "-l",
            "walltime=00:10:00",
            "-o",
            str(d / "out"),
            "-v",
            venv + variables,
            str(SCRIPT),
        ],
        cwd=d,
    )
    info = pbs_cluster.wait(job)
    text = pbs_cluster.wait_for("the job's output", lambda: read(d / "out"))
    assert info["Exit_status"] == 2, text
    ours = [line for line in text.splitlines() if line.startswith("run_llm.pbs")]
    assert len(ours) == 1 and ours[0].startswith(message), text
    assert "Traceback" not in text


def test_nccl_profile_and_prepare_take_effect_on_pbs(pbs_cluster, inputs, tmp_path):
    """NCCL_PROFILE=gcp-g2 and PREPARE=1 in a real PBS job: the profile's variables are in the environment every node
    runs with (the job's env file) and said; llmft prepare runs on the first node before any torchrun, and its
    failure (data it cannot read) stops the launch, exit 2."""
    d = pbs_cluster.job_dir(tmp_path)
    (d / "bad.jsonl").write_text('{"foo": "bar"}\n')
    own(d)
    variables = f"{common(inputs, d)},DATASET={d / 'bad.jsonl'},NCCL_PROFILE=gcp-g2,PREPARE=1"
    variables += f",CHECKPOINT_DIR={d / 'ckpt'},MAX_STEPS=1,GLOBAL_BATCH=2,MICRO_BATCH=2"
    args = ["-l", "select=1:ncpus=1", "-l", "walltime=00:10:00", "-o", str(d / "out"), "-v", variables, str(SCRIPT)]
    job = pbs_cluster.qsub(args, cwd=d)
    info = pbs_cluster.wait(job)
    text = pbs_cluster.wait_for("the job's output", lambda: read(d / "out"))
    assert info["Exit_status"] == 2, text
    assert "run_llm.pbs: nccl NCCL_NET=Socket\n" in text and "run_llm.pbs: nccl NCCL_IB_DISABLE=1\n" in text, text
    [env_file] = (d / "ckpt").glob(".llmft-env-*.json")
    node_env = json.loads(env_file.read_text())
    assert node_env["NCCL_NET"] == "Socket" and node_env["NCCL_SOCKET_IFNAME"] == "^lo,docker", node_env
    assert f"run_llm.pbs: preparing the data (llmft prepare, cache {d / 'cache'})\n" in text, text
    assert "llmft prepare: error: dataset has columns foo but llmft needs" in text, text
    assert "run_llm.pbs: not launching: llmft prepare failed (exit 2)\n" in text, text
    assert "torch.distributed.run" not in text.split("preparing the data", 1)[1] and "): torchrun" not in text, text


def test_a_continuation_keeps_the_account_project_group_resources_and_python_of_the_job(pbs_cluster, tmp_path):
    """A held job submitted with -A, -P, -W group_list and a -l resource beside select and walltime: the continuation
    llmft builds from its `qstat -f` (llmft.launch.continuation.qsub_command, VENV from llmft.launch.pbs.python_venv
    as go_on passes them), submitted to the real server, has each of them in its own `qstat -f`."""
    from llmft.launch import continuation, knobs, pbs

    d = pbs_cluster.job_dir(tmp_path)
    script = d / "job.sh"
    script.write_text("#!/bin/bash\ntrue\n")
    script.chmod(0o755)
    own(d)
    first = pbs_cluster.qsub(
        ["-h", "-A", "acct42", "-P", "proj42", "-W", f"group_list={JOB_USER}", "-l", "select=1:ncpus=1"]
        + ["-l", "walltime=00:05:00", "-l", "cput=00:10:00", "-N", "cont", "-o", str(d / "out"), str(script)],
        cwd=d,
    )
    try:
        job = pbs_cluster.job(first)
        cmd = continuation.qsub_command(job, first, script, d / "c.json", 1, pbs.python_venv(knobs.resolve({}, [])))
        assert cmd[0] == "qsub"
        second = pbs_cluster.qsub(cmd[1:], cwd=d)
        try:
            cont = pbs_cluster.job(second)
            assert (cont["Account_Name"], cont["project"], cont["group_list"]) == ("acct42", "proj42", JOB_USER), cont
            resources = cont["Resource_List"]
            assert resources["cput"] == "00:10:00" and resources["walltime"] == "00:05:00", resources
            assert resources["select"] == "1:ncpus=1", resources
            assert cont["Variable_List"]["VENV"] == sys.prefix, cont["Variable_List"]
            assert f"depend=afterany:{first}" in cont["Submit_arguments"], cont
        finally:
            pbs_cluster.qdel(second)
    finally:
        pbs_cluster.qdel(first)

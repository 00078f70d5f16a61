"""llmft.launch without a scheduler: the knobs the PBS job takes are the Slurm job's (same names, defaults, checks and
words), and PBS's facts (select statements, walltimes, node files) are read right."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_slurm_script import run_script

from llmft.launch import continuation, job, knobs, node, pbs, scheduler, slurm, sweep

REPO = Path(__file__).resolve().parents[1]


QSTAT_JOB = pbs.qstat_job


@dataclass(frozen=True)
class Outcome:
    """What a PBS job does after its training: its exit status, and whether it submitted a continuation."""

    rc: int
    go_on: bool = False
    failure_restarts: int = 0  # counted for MAX_RESTARTS, in the continuation's variables


def pbs_job(monkeypatch, k, env: dict, run_dir: Path, hosts=("pbs-n0",)) -> pbs.PbsJob:
    """A PbsJob of job 7.head as run_job has it after its start (no PBS server: qstat answers nothing), whose
    continuation is recorded instead of submitted."""
    if pbs.qstat_job is QSTAT_JOB:  # a test's own qstat answer stays
        monkeypatch.setattr(pbs, "qstat_job", lambda _job: {})
    j = pbs.PbsJob(k, {"PBS_JOBID": "7.head", **env})
    j.run_dir, j.hosts, j.pairs = run_dir, list(hosts), [(h, i) for i, h in enumerate(hosts)]
    j.continued = []
    monkeypatch.setattr(j, "go_on", j.continued.append)
    return j


def pbs_follow(monkeypatch, k, env, run_dir, rc, stop, requeue, start_step, failures, hosts) -> Outcome:
    """What follows a PBS job's training (llmft.launch.scheduler.train_and_follow, after its pbsdsh step): how it
    ended, then PbsJob.follow, or after a failure llmft.launch.failure_blame.decide through scheduler.after_failure."""
    j = pbs_job(monkeypatch, k, env, run_dir, hosts)
    ended = job.how_it_ended(run_dir, rc, stop, requeue)
    if ended.kind == "failed":
        code = scheduler.after_failure(k, j, run_dir, ended, start_step, failures)
    else:
        code = j.follow(ended, run_dir)
    return Outcome(code, bool(j.continued), j.continued[0] if j.continued else 0)


def pbs_node_environment(monkeypatch, k, env: dict, run_dir: Path, files) -> dict[str, str]:
    """The environment a PBS job hands its nodes before the container and the plan (llmft.launch.scheduler.run_job's
    steps): PbsJob's own, llmft's (job_environment), the network's."""
    j = pbs_job(monkeypatch, k, env, run_dir)
    node_env = {**j.environment(), **job.job_environment(k, env, run_dir, files, j.node_cache)}
    node_env.update(job.network_environment(k["NCCL_PROFILE"], run_dir, j.job_id, node_env, j.say))
    return node_env


PBS_SCRIPT = REPO / "pbs" / "run_llm.pbs"


def run_pbs_script(*args: str, **env: str) -> subprocess.CompletedProcess:
    """pbs/run_llm.pbs run by bash outside PBS, in this test's environment."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PBS_", "SLURM_")) and k not in knobs.NAMES}
    clean.update(env)
    return subprocess.run(
        ["bash", str(PBS_SCRIPT), f"VENV={Path(sys.executable).parents[1]}", *args],
        capture_output=True,
        text=True,
        env=clean,
        timeout=120,
        cwd=REPO,
    )


# Each bad knob in its plain KEY=VALUE form (qsub -v sets the same variables), with the words both scripts say.
BAD_KNOBS = [
    (["EPOCHS=abc"], "EPOCHS=abc is not a positive number (default 3)"),
    (["EPOCHS=0"], "EPOCHS=0 is not a positive number"),
    (["ZERO_STAGE=7"], "ZERO_STAGE=7 is not a ZeRO stage; use 0, 1, 2 or 3"),
    (["DATA_PERCENTAGE=150"], "0 < DATA_PERCENTAGE <= 100"),
    (["GLOBAL_BATCH=-4"], "GLOBAL_BATCH=-4 is not a positive integer"),
    (["MICRO_BATCH=1.5"], "MICRO_BATCH=1.5 is not a positive integer"),
    (["MAX_STEPS=ten"], "MAX_STEPS=ten is not a positive integer"),
    (
        ["SAVE_TOTAL_LIMIT=-1"],
        "SAVE_TOTAL_LIMIT=-1 is not a number of checkpoints; use 0 (keep all) or more (default 2)",
    ),
    (["MAX_RESTARTS=three"], "MAX_RESTARTS=three is not a number of restarts"),
    (["OFFLOAD=maybe"], "OFFLOAD=maybe is not a boolean"),
    (["OFFLOAD=1", "ZERO_STAGE=1"], "OFFLOAD=1 needs ZERO_STAGE=2 or 3"),
    (["OFFLOAD=1", "ZERO_STAGE=auto"], "ZERO_STAGE=auto chooses the offload itself; drop OFFLOAD=1"),
    (["ZERO_STAGE=3", "DS_CONFIG=ds_configs/zero3.json"], "give either ZERO_STAGE or DS_CONFIG, not both"),
    (["DS_CONFIG=/nonexistent/ds.json"], "DS_CONFIG=/nonexistent/ds.json: no such file"),
    (["NCCL_PROFILE=azure"], "NCCL_PROFILE=azure is unknown; use gcp-g2, aws-efa, gcp-tcpx or ib"),
    (["WANDB_MODE=loud"], "WANDB_MODE=loud: use online, offline or disabled"),
    (["CONTAINER_IMAGE=img", "CONTAINER_MOUNTS=/data /models"], "'/data /models' is not a mount SRC[:DST[:FLAGS]]"),
    (["CONTAINER_MOUNTS=/data:/data"], "CONTAINER_MOUNTS=/data:/data needs CONTAINER_IMAGE"),
    (["MIXTURE=pyproject.toml", "DATASET=data.jsonl"], "give either MIXTURE or DATASET, not both"),
    (["EXTRA_ARGS=--dataset_mixture=mix.yaml"], "give the mixture as MIXTURE=FILE"),
    (["MIXTURE=/nonexistent/mix.yaml"], "MIXTURE=/nonexistent/mix.yaml: no such file"),
    (["DATASET=/nonexistent/data.jsonl"], "DATASET=/nonexistent/data.jsonl: no such file or directory (looked in "),
    (["MODEL=./models/mine"], "MODEL=./models/mine: no such directory (looked in "),
    (["SEQUENCE_PARALLEL=0"], "SEQUENCE_PARALLEL=0 is not a positive integer (default 1)"),
    (["EXPORT=pyproject.toml"], "EXPORT=pyproject.toml is a file: give a new or empty directory"),
    (["EXPORT=docs"], "EXPORT=docs is a directory that is not empty: give a new or empty directory"),
]


@pytest.mark.parametrize("args, message", BAD_KNOBS)
def test_a_bad_knob_is_refused_by_the_pbs_job_as_by_the_slurm_job(args, message):
    """One line, exit 2, and the same words after the script's name on both schedulers."""
    proc = run_pbs_script(*args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("run_llm.pbs: error: "), proc.stderr
    assert message in proc.stderr
    slurm = run_script(*args)
    assert slurm.stderr.removeprefix("run_llm.slurm: ") == proc.stderr.removeprefix("run_llm.pbs: ")


def test_an_unknown_or_misspelt_knob_is_named_with_the_fix():
    proc = run_pbs_script("EPOCH=3")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "unknown knob 'EPOCH' in 'EPOCH=3'; did you mean EPOCHS?" in proc.stderr
    assert "known knobs: EPOCHS CHECKPOINT_DIR DATA_PERCENTAGE" in proc.stderr
    slurm = run_script("EPOCH=3")  # the same line, "did you mean" included
    assert proc.stderr.rstrip("\n").endswith(knobs.known_knobs())
    assert slurm.returncode == 2 and slurm.stderr.removeprefix("run_llm.slurm: ") == proc.stderr.removeprefix(
        "run_llm.pbs: "
    )
    assert "; known knobs: EPOCHS" in run_pbs_script("HF_TOKEN=x").stderr  # nothing close: the list alone
    assert "cannot read argument '--epochs'" in run_pbs_script("--epochs", "3").stderr
    # qsub -v NAME=... also carries variables a job needs (HF_TOKEN, NCCL_DEBUG); a misspelt knob is refused
    with pytest.raises(knobs.KnobError, match="unknown knob 'GLOBAL_BACTH' in 'qsub -v'; did you mean GLOBAL_BATCH"):
        knobs.unknown_in_variable_list(["PBS_O_HOME", "HF_TOKEN", "NCCL_DEBUG", "GLOBAL_BACTH"], "qsub -v")
    knobs.unknown_in_variable_list(["PBS_O_HOME", "HF_TOKEN", "NCCL_DEBUG", "EPOCHS"], "qsub -v")


def test_valid_knobs_outside_pbs_name_the_defaults_and_say_to_submit_with_qsub():
    proc = run_pbs_script("EPOCHS=3", "LORA=yes", "OFFLOAD=true", "ZERO_STAGE=3", "DATA_PERCENTAGE=2.5", DRY_RUN="1")
    assert proc.returncode == 0, proc.stderr
    assert "knobs are valid; not inside a PBS job" in proc.stdout and "qsub pbs/run_llm.pbs" in proc.stdout
    slurm = run_script("EPOCHS=3", "LORA=yes", "OFFLOAD=true", "ZERO_STAGE=3", "DATA_PERCENTAGE=2.5", DRY_RUN="1")
    pbs_lines = [line.removeprefix("run_llm.pbs: ") for line in proc.stdout.splitlines()[:2]]
    slurm_lines = [line.removeprefix("run_llm.slurm: ") for line in slurm.stdout.splitlines()[:2]]
    assert pbs_lines == slurm_lines  # "defaults applied: ..." and the default-dataset warning, word for word
    assert pbs_lines[0].startswith("defaults applied: MODEL=Qwen/Qwen2.5-0.5B DATASET=trl-lib/Capybara")
    proc = run_pbs_script("EPOCHS=3")
    assert (
        proc.returncode == 2 and "not inside a PBS job (PBS_JOBID is unset)" in proc.stderr and "qsub" in proc.stderr
    )


def test_values_are_data_never_code(tmp_path):
    marker = tmp_path / "pwned"
    run_pbs_script(f"MODEL=$(touch {marker})", f"EXTRA_ARGS=`touch {marker}`", DRY_RUN="1")
    run_pbs_script(f"$(touch {marker})=1")
    assert not marker.exists()


def test_help_documents_every_knob_with_its_default():
    proc = run_pbs_script("--help")
    assert proc.returncode == 0
    for knob in knobs.KNOBS:
        assert f"  {knob.name}={knob.default}" in proc.stdout
    assert "qsub" in proc.stdout


def test_a_run_directory_is_keyed_like_the_slurm_jobs():
    """The same experiment lands in runs/<name>-<key> with the same key on either scheduler (slurm/run_llm.slurm
    computes it with printf | sha256sum)."""
    k = knobs.resolve({}, ["MODEL=org/m", "DATASET=org/d", "EXTRA_ARGS=--seed 1"])
    fields = ["org/m", "org/d", "100", "2", "", "32", "0", "--seed 1"]
    assert job.run_key(k) == hashlib.sha256(("\n".join(fields) + "\n").encode()).hexdigest()[:8]
    other = knobs.resolve({}, ["MODEL=org/m", "DATASET=org/d", "EXTRA_ARGS=--seed 2"])
    assert job.run_key(other) != job.run_key(k)
    # SEQUENCE_PARALLEL joins the key only when it is not 1 (a run without it keeps its directory): its checkpoints
    # resume only under the same N
    sp = knobs.resolve({}, ["MODEL=org/m", "DATASET=org/d", "EXTRA_ARGS=--seed 1", "SEQUENCE_PARALLEL=2"])
    keyed = hashlib.sha256(("\n".join([*fields, "SEQUENCE_PARALLEL=2"]) + "\n").encode()).hexdigest()[:8]
    assert job.run_key(sp) == keyed
    assert job.run_key(
        knobs.resolve({}, ["MODEL=org/m", "DATASET=org/d", "EXTRA_ARGS=--seed 1", "SEQUENCE_PARALLEL=1"])
    ) == job.run_key(k)
    assert job.safe_name("my job/1") == "my_job_1"


def test_pbs_facts_are_read_from_the_select_statement_walltime_and_node_file():
    assert pbs.per_node("2:ncpus=8:ngpus=4:mem=200gb", "ngpus", 0) == 4
    assert pbs.per_node("2:ncpus=8:ngpus=4", "ncpus", 1) == 8
    assert pbs.per_node("2:ncpus=1", "ngpus", 0) == 0  # CPU-only nodes: one process each
    assert pbs.per_node("1:ncpus=8:ngpus=4+1:ncpus=8:ngpus=4", "ngpus", 0) == 4
    with pytest.raises(pbs.PbsJobError, match="asks for ngpus \\[2, 4\\] in different chunks"):
        pbs.per_node("1:ngpus=4+1:ngpus=2", "ngpus", 0)
    assert pbs.memory_gib("200gb") == 200 and pbs.memory_gib("512mb") == 0.5 and pbs.memory_gib("1tb") == 1024
    assert pbs.select_memory("2:ncpus=8:mem=200gb") == {
        "LLMFT_HOST_RAM_GB": "200",
        "LLMFT_HOST_RAM_SOURCE": "PBS select mem=200gb",
    }  # the plan's limit on every node (llmft.planning.allocation takes the smallest of it and the node's own)
    assert pbs.select_memory("2:ncpus=8") == {}
    assert pbs.seconds("04:00:00") == 14400 and pbs.seconds("90:00") == 5400 and pbs.seconds("30") == 30
    assert pbs.seconds("forever") is None and pbs.hms(3725) == "1:02:05"
    info = {"Resource_List": {"walltime": "00:10:00"}, "resources_used": {"walltime": "00:01:30"}}
    assert pbs.time_left(info) == 510 and pbs.time_left({"Resource_List": {}}) is None
    # one line per chunk; a node with two chunks is one node, started at its first line
    assert pbs.hosts_of("pbs-n0\npbs-n1\npbs-n0\n") == [("pbs-n0", 0), ("pbs-n1", 1)]
    assert pbs.shutdown_timeout(10) > 10  # torchrun never SIGKILLs ranks PBS itself would still let save
    # an array's elements start together, maybe on one node: each its own rendezvous port, past ports in use
    free = lambda port: False  # noqa: E731
    ports = {
        job.rendezvous_port(pbs.rendezvous_start(j), free) for j in ("12.head", "12[1].head", "12[2].head", "13.head")
    }
    assert len(ports) == 4 and all(20000 <= p < 30000 for p in ports)
    first = job.rendezvous_port(pbs.rendezvous_start("12[2].head"), free)
    assert job.rendezvous_port(pbs.rendezvous_start("12[2].head"), lambda port: port == first) == first + 1
    with pytest.raises(job.JobError, match="no free rendezvous port"):
        job.rendezvous_port(pbs.rendezvous_start("12.head"), lambda port: True)


def test_the_plan_and_torchrun_get_the_knobs_as_the_slurm_job_gives_them(tmp_path):
    k = knobs.resolve({}, ["MODEL=org/m", "DATASET=org/d", "LORA=1", "MAX_STEPS=4", "EXTRA_ARGS=--max_length 512"])
    train = job.train_arguments(k, tmp_path, "none")
    assert train[:4] == ["--model_name_or_path", "org/m", "--dataset_name", "org/d"]
    assert ["--zero_stage", "2"] == train[train.index("--zero_stage") : train.index("--zero_stage") + 2]
    assert "--use_peft" in train and train[train.index("--max_steps") + 1] == "4"
    plan = job.plan_arguments(k, tmp_path, tmp_path / "nodes", 2, 0)
    assert plan[plan.index("--nnodes") + 1] == "2" and plan[plan.index("--nproc_per_node") + 1] == "1"
    assert "--check_memory" in plan and plan[-3:] == ["--max_length", "512", "--use_peft"]
    line = "llmft launch: nnodes=2 nproc_per_node=1 cpus_per_node=1 omp_num_threads=1 dataloader_num_workers=0 "
    line += "dataset_num_proc=1 host_ram_gb=23 numa_binding=off"
    assert job.launch_line(f"llmft plan: x\n{line}\n")["host_ram_gb"] == "23"
    with pytest.raises(job.JobError, match="no 'numa_binding'"):
        job.launch_line(line.replace(" numa_binding=off", ""))
    # SEQUENCE_PARALLEL reaches both, as --sequence_parallel (the plan's batch over data-parallel groups)
    k = knobs.resolve({}, ["MODEL=org/m", "DATASET=org/d", "SEQUENCE_PARALLEL=2"])
    for args in (job.train_arguments(k, tmp_path, "none"), job.plan_arguments(k, tmp_path, tmp_path / "n", 1, 2)):
        assert args[args.index("--sequence_parallel") + 1] == "2"
    assert "--sequence_parallel" not in job.train_arguments(knobs.resolve({}, ["MODEL=org/m"]), tmp_path, "none")
    # the long-context memory savers in EXTRA_ARGS reach the memory check, with or without a value after them
    k = knobs.resolve({}, ["MODEL=org/m", "EXTRA_ARGS=--tiled_mlp --activation_offloading true --max_length 131072"])
    plan = job.plan_arguments(k, tmp_path, tmp_path / "n", 1, 1)
    assert plan[plan.index("--check_memory") + 1 :] == [
        "--tiled_mlp",
        "--activation_offloading",
        "true",
        "--max_length",
        "131072",
    ]
    # ZERO_STAGE=auto plans with it (the planner keeps the N it is given)
    k = knobs.resolve({}, ["MODEL=org/m", "SEQUENCE_PARALLEL=2", "ZERO_STAGE=auto"])
    train = job.train_arguments(k, tmp_path, "none")
    assert "--auto" in train and train[train.index("--sequence_parallel") + 1] == "2"


def test_nccl_profile_and_the_flight_recorder_reach_every_pbs_node_as_every_slurm_rank(tmp_path, monkeypatch, capsys):
    """NCCL_PROFILE on PBS: the profile's variables (yours win) and the flight recorder's are in the environment each
    node's torchrun runs with (llmft.launch.job.network_variables, the Slurm job's too), each said; aws-efa is refused
    on a node without EFA, and the allocation probe checks each node's plugin, on both schedulers."""
    k = knobs.resolve({}, ["NCCL_PROFILE=gcp-g2"])
    files = {n: tmp_path / f".llmft-{n}-7" for n in ("stop", "requeue", "job-end", "nodes")}
    env = {"HOME": str(tmp_path), "PATH": "/bin", "NCCL_SOCKET_IFNAME": "ens4"}
    node_env = pbs_node_environment(monkeypatch, k, env, tmp_path, files)
    assert node_env["NCCL_NET"] == "Socket" and node_env["NCCL_IB_DISABLE"] == "1"
    assert node_env["NCCL_SOCKET_IFNAME"] == "ens4"  # yours wins
    assert node_env["TORCH_FR_DUMP_TEMP_FILE"] == f"{tmp_path}/nccl_trace/7.head_rank_"
    pairs = job.network_variables("gcp-g2", tmp_path, "7.head", env)
    assert pairs and all(node_env[name] == value for name, value in pairs)
    out = capsys.readouterr().out
    assert "run_llm.pbs: nccl NCCL_NET=Socket\n" in out and "run_llm.pbs: nccl NCCL_SOCKET_IFNAME=ens4\n" in out
    plain = pbs_node_environment(monkeypatch, knobs.resolve({}, []), env, tmp_path, files)
    assert "NCCL_NET" not in plain and plain["TORCH_FR_BUFFER_SIZE"] == "2000"  # no profile: NCCL's defaults
    assert job.fabric_probe("aws-efa") == ["--fabric", "aws-efa"] and job.fabric_probe("gcp-g2") == []
    with pytest.raises(job.JobError, match=r"^NCCL_PROFILE=aws-efa, but node \S+ has no EFA device"):
        job.fabric_check("aws-efa", {"LLMFT_SYSFS_ROOT": str(tmp_path)})
    job.fabric_check("gcp-g2", {"LLMFT_SYSFS_ROOT": str(tmp_path)})


def test_prepare_runs_llmft_prepare_with_the_trainings_flags_and_stops_the_launch_when_it_fails(tmp_path, capsys):
    """PREPARE=1 on either scheduler (llmft.launch.job.prepare_data): `llmft prepare` with llmft train's flags, in
    the node's environment, started by the command that starts llmft's Python there; a failure stops the launch."""
    said = []
    record = tmp_path / "argv"
    runner = [sys.executable, "-c", "import sys, os; open(sys.argv[1], 'w').write(repr(sys.argv[2:]) + os.environ['LLMFT_CACHE']); sys.exit(int(os.environ['RC']))", str(record)]  # fmt: skip
    env = {**os.environ, "LLMFT_CACHE": str(tmp_path / "cache"), "RC": "0"}
    assert job.prepare_data(runner, ["--dataset_name", "d.jsonl"], said.append, env)
    assert record.read_text() == "['-m', 'llmft.prepare', '--dataset_name', 'd.jsonl']" + str(tmp_path / "cache")
    assert said == [f"preparing the data (llmft prepare, cache {tmp_path / 'cache'})"]
    assert not job.prepare_data(runner, ["--dataset_name", "d.jsonl"], said.append, {**env, "RC": "2"})
    assert said[-1] == "not launching: llmft prepare failed (exit 2)"


def test_both_schedulers_forward_the_memory_flags_of_extra_args_to_the_plans_memory_check(tmp_path):
    """The Slurm and the PBS job build `llmft plan`'s flags with one function (llmft.launch.job.plan_arguments): the
    llmft train flags in EXTRA_ARGS that change a setting's memory reach the memory check in the three forms a user
    writes them, and nothing else does."""
    extra = (
        "--max_length 4096 --seed 1 --tiled_mlp --activation_offloading false --lora_r=16 --load_in_4bit "
        "--use_liger_kernel false --logging_steps 5"
    )
    k = knobs.resolve({}, ["MODEL=org/m", f"EXTRA_ARGS={extra}"])
    forwarded = [
        "--max_length",
        "4096",
        "--tiled_mlp",
        "--activation_offloading",
        "false",
        "--lora_r=16",
        "--load_in_4bit",
        "--use_liger_kernel",  # Liger's kernels keep fewer activations: the check counts them as the run will
        "false",
    ]
    for world in ({}, {"nnodes": 2, "gpus": 4}):  # Slurm's (llmft plan reads SLURM_*), PBS's (said)
        plan = job.plan_arguments(k, tmp_path, tmp_path / "nodes", **world)
        check = plan.index("--check_memory")
        assert plan[check + 1 :] == forwarded, plan
        assert ("--nnodes" in plan) == bool(world)


def test_a_sweep_is_every_combination_in_array_order_each_with_its_own_directory():
    variants = sweep.parse("learning_rate=1e-5,3e-5 lora_r=8,16")
    assert [v.describe() for v in variants] == [
        "learning_rate=1e-5 lora_r=8",
        "learning_rate=1e-5 lora_r=16",
        "learning_rate=3e-5 lora_r=8",
        "learning_rate=3e-5 lora_r=16",
    ]
    assert [v.index for v in variants] == [1, 2, 3, 4]
    assert variants[1].name == "learning_rate-1e-5_lora_r-16"
    assert variants[1].flags() == ["--learning_rate", "1e-5", "--lora_r", "16"]
    assert [v.name for v in sweep.parse("--learning_rate=1e-5,3e-5,1e-4")] == [
        "learning_rate-1e-5",
        "learning_rate-3e-5",
        "learning_rate-1e-4",
    ]
    assert sweep.parse("learning_rate=1e-5,3e-5;lora_r=8,16") == variants  # ';' too, where a space cannot go
    # each element checks the array it is in: no variant left out, none trained twice
    assert sweep.element(variants, "3", "1", "4", "qsub -J 1-{n}").describe() == "learning_rate=3e-5 lora_r=8"
    with pytest.raises(sweep.SweepError, match="this array's indices are 1-3: submit it as qsub -J 1-4"):
        sweep.element(variants, "3", "1", "3", "qsub -J 1-{n} ... pbs/run_llm.pbs")
    with pytest.raises(sweep.SweepError, match="this job is not an array: submit it as one, sbatch --array=1-4"):
        sweep.element(variants, None, None, None, "sbatch --array=1-{n} ... slurm/run_llm.slurm")


@pytest.mark.parametrize(
    "value, message",
    [
        ("learning_rate", "'learning_rate' is not FLAG=VALUE,VALUE,...; e.g. SWEEP=learning_rate=1e-5,3e-5,1e-4"),
        ("learning_rate=1e-5", "has one variant: that is one run; drop SWEEP and give the flag in EXTRA_ARGS"),
        ("output_dir=a,b", "--output_dir is set by the job from its knobs and cannot vary within one sweep"),
        ("learning_rate=1e-5,,3e-5", "holds an empty value or one with '/'"),
        ("model_name_or_path=../x,y", "holds an empty value or one with '/'"),  # a value names a directory
        ("lora_r=1,2 lora_r=3,4", "lora_r is given twice"),
        ("lerning_rate=1e-5,2e-5", "--lerning_rate is not a flag of llmft train; did you mean learning_rate?"),
        ("lora_alpa=8,16", "--lora_alpa is not a flag of llmft train; did you mean lora_alpha?"),
        ("zzz=1,2", "--zzz is not a flag of llmft train; llmft train --help lists its flags"),
        (
            "dataset_streaming=true,false",
            "llmft train refuses --dataset_streaming other than its default: llmft reads",
        ),
        ("Learning-Rate=1,2", "is not FLAG=VALUE,VALUE,..."),
    ],
)
def test_a_bad_sweep_is_refused_in_the_same_words_by_both_scripts(value, message):
    proc = run_pbs_script(f"SWEEP={value}", DRY_RUN="1")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stdout + proc.stderr
    assert proc.stderr.startswith(f"run_llm.pbs: error: SWEEP={value}: ") or "one variant" in proc.stderr
    assert message in proc.stderr
    slurm = run_script(f"SWEEP={value}", DRY_RUN="1", VIRTUAL_ENV=str(Path(sys.executable).parents[1]))
    assert slurm.returncode == 2
    assert slurm.stderr.removeprefix("run_llm.slurm: ") == proc.stderr.removeprefix("run_llm.pbs: ")


def test_a_dry_run_lists_the_variants_and_the_array_to_submit_on_either_scheduler():
    value = "SWEEP=learning_rate=1e-5,3e-5,1e-4"
    proc = run_pbs_script(value, "DATASET=org/d", DRY_RUN="1")
    assert proc.returncode == 0, proc.stderr
    assert "run_llm.pbs: sweep variant 2: learning_rate=3e-5 -> learning_rate-3e-5" in proc.stdout
    assert "learning rate from SWEEP" in proc.stdout
    assert "submit the sweep as an array of 3: qsub -J 1-3 ... pbs/run_llm.pbs" in proc.stdout
    slurm = run_script(value, "DATASET=org/d", DRY_RUN="1", VIRTUAL_ENV=str(Path(sys.executable).parents[1]))
    assert slurm.returncode == 0, slurm.stderr
    assert "run_llm.slurm: sweep variant 2: learning_rate=3e-5 -> learning_rate-3e-5" in slurm.stdout
    assert "submit the sweep as an array of 3: sbatch --array=1-3 ... slurm/run_llm.slurm" in slurm.stdout


def test_llmft_report_over_a_sweeps_directory_compares_its_variants(tmp_path, capsys):
    from test_report import fake_run

    from llmft import report

    variants = sweep.parse("learning_rate=1e-5,3e-5,1e-4")
    sweep.record(tmp_path / "sweep", "learning_rate=1e-5,3e-5,1e-4", variants)
    for v, lr in zip(variants[:2], (0.05, 0.15)):
        fake_run(tmp_path / "sweep" / v.name, lr)
    written = report.report([tmp_path / "sweep"], tmp_path / "sweep" / "report")
    assert [r.name for r in written["runs"]] == ["learning_rate-1e-5", "learning_rate-3e-5"]
    assert "not started yet, left out: learning_rate-1e-4" in capsys.readouterr().out
    assert "learning_rate-3e-5" in written["summary"].read_text()
    empty = tmp_path / "empty"
    sweep.record(empty, "lora_r=8,16", sweep.parse("lora_r=8,16"))
    with pytest.raises(report.ReportError, match="no variant of this sweep has a run directory yet"):
        report.report([empty], tmp_path / "out")


def test_a_continuation_is_the_same_job_after_this_one_with_its_variables_as_data(tmp_path):
    """PBS lets only operators requeue a job: a run stopped for its walltime submits itself again, after it ends
    (afterany), with its resources and options, and variables (commas included) in a file, not in qsub -v."""
    job = {
        "Job_Name": "sft",
        "queue": "workq",
        "Resource_List": {"select": "2:ncpus=8:ngpus=4", "place": "scatter", "walltime": "04:00:00", "ncpus": 16},
        "Rerunable": "True",
        "Join_Path": "oe",
        "Output_Path": "login1:/home/u/logs/sft.log",
        "Error_Path": "login1:/home/u/sft.e12",
        "Variable_List": {"PBS_O_HOME": "/home/u", "SWEEP": "learning_rate=1e-5,3e-5", "HF_TOKEN": "x", "EPOCHS": "2"},
    }
    cmd = continuation.qsub_command(job, "12[2].head", tmp_path / "job.pbs", tmp_path / "c.json", 1, "/v")
    assert cmd == [
        "qsub", "-W", "depend=afterany:12[2].head", "-N", "sft", "-q", "workq",
        "-l", "select=2:ncpus=8:ngpus=4", "-l", "place=scatter", "-l", "walltime=04:00:00", "-r", "y", "-j", "oe",
        "-o", "/home/u/logs/sft.log.1", "-e", "/home/u/sft.e12.1",
        "-v", f"LLMFT_CONTINUE={tmp_path / 'c.json'},VENV=/v", str(tmp_path / "job.pbs"),
    ]  # fmt: skip
    # the job's PYTHONPATH too (the launcher imports llmft before it reads the file); a value with a comma stays in it
    with_path = continuation.qsub_command(job, "12.head", tmp_path / "job.pbs", tmp_path / "c.json", 1, "/v", "/src")
    assert with_path[-2] == f"LLMFT_CONTINUE={tmp_path / 'c.json'},VENV=/v,PYTHONPATH=/src"
    comma = continuation.qsub_command(job, "12.head", tmp_path / "job.pbs", tmp_path / "c.json", 1, "", "/a,/b")
    assert comma[-2] == f"LLMFT_CONTINUE={tmp_path / 'c.json'}"
    node_env = {"WANDB_RUN_ID": "sft-12-abc", "LLMFT_SWEEP_VARIANT": "learning_rate-3e-5", "PATH": "/bin"}
    extra = ["--seed", "1", "--learning_rate", "3e-5"]
    values = continuation.variables(job, {}, tmp_path / "sweep" / "learning_rate-3e-5", extra, node_env)
    assert values == {
        "HF_TOKEN": "x",
        "EPOCHS": "2",
        "CHECKPOINT_DIR": str(tmp_path / "sweep" / "learning_rate-3e-5"),
        "EXTRA_ARGS": "--seed 1 --learning_rate 3e-5",  # the element's variant, no longer an array
        "WANDB_RUN_ID": "sft-12-abc",  # the same W&B run goes on
        "LLMFT_SWEEP_VARIANT": "learning_rate-3e-5",
    }
    continuation.write_variables(tmp_path / "c.json", {**values, "EXTRA_ARGS": "$(touch pwned), --a"})
    loaded = continuation.load({"LLMFT_CONTINUE": str(tmp_path / "c.json"), "EPOCHS": "9"})
    assert loaded["EPOCHS"] == "2" and loaded["EXTRA_ARGS"] == "$(touch pwned), --a"  # data, read back as it was


def test_a_continuation_keeps_the_account_project_group_and_every_resource_the_job_was_submitted_with(tmp_path):
    """-A, -P, -W group_list and every -l of the submission (Submit_arguments, values as PBS holds them) go to the
    continuation; a chunk resource the select statement carries (PBS made it part of the select) is left to it."""
    job = {
        "Job_Name": "sft",
        "Account_Name": "acct42",
        "project": "proj42",
        "group_list": "ml",
        "Resource_List": {"select": "1:ncpus=8:mem=10gb", "place": "free", "walltime": "01:00:00", "cput": "02:00:00",
                          "ncpus": 8, "mem": "10gb", "nodect": 1, "software": "abaqus"},
        "Submit_arguments": "-A acct42 -l select=1:ncpus=8:mem=10gb -l walltime=1:00:00,cput=2:00:00 -lsoftware=abaqus "
                            "-l mem=10gb -N sft job.pbs",
    }  # fmt: skip
    cmd = continuation.qsub_command(job, "12.head", tmp_path / "job.pbs", tmp_path / "c.json", 1)
    assert cmd == [
        "qsub", "-W", "depend=afterany:12.head", "-N", "sft",
        "-l", "select=1:ncpus=8:mem=10gb", "-l", "place=free", "-l", "walltime=01:00:00", "-l", "cput=02:00:00",
        "-l", "software=abaqus", "-A", "acct42", "-P", "proj42", "-W", "group_list=ml", "-r", "y",
        "-v", f"LLMFT_CONTINUE={tmp_path / 'c.json'}", str(tmp_path / "job.pbs"),
    ]  # fmt: skip
    assert "-P" not in continuation.qsub_command({"project": "_pbs_project_default"}, "1.h", tmp_path, tmp_path, 1)
    assert continuation.user_resources("-l 'a=1,b=2' -lc=3 -l") == {"a": "1", "b": "2", "c": "3"}
    assert continuation.user_resources("-l 'unclosed") == {}


def test_a_continuation_keeps_the_launchers_python_when_venv_is_not_given(tmp_path):
    """After `qsub -V` pbs/run_llm.pbs runs the launcher in the submitting shell's venv (VIRTUAL_ENV); the continuation
    has no -V, so VENV is the launcher's own sys.prefix; the knob wins; outside a venv, none (python3, as before)."""
    assert sys.prefix != sys.base_prefix  # the tests run in a venv
    assert pbs.python_venv(knobs.resolve({}, [])) == sys.prefix
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").touch()
    assert pbs.python_venv(knobs.resolve({}, [f"VENV={tmp_path}"])) == str(tmp_path)
    code = f"import sys; sys.path.insert(0, {str(REPO)!r}); from llmft.launch import knobs, pbs; print(repr(pbs.python_venv(knobs.resolve({{}}, []))))"
    base = Path(sys.base_prefix) / "bin" / "python3"
    assert subprocess.run([str(base), "-I", "-S", "-c", code], capture_output=True, text=True).stdout == "''\n"


def test_what_follows_the_training_is_decided_from_the_run_directory_and_the_signal(tmp_path, monkeypatch, capsys):
    """Done; a stop for the walltime or SIGUSR1 goes on in a continuation; SIGTERM near the walltime too, far from it
    (qrerun, qdel) PBS decides; a failure goes on only after progress and up to MAX_RESTARTS, naming each node."""
    run = tmp_path / "run"
    run.mkdir()
    k = knobs.resolve({}, ["MAX_RESTARTS=2"])
    stop, requeue, failures = job.Stop(run / "stop", "run_llm.pbs"), run / "requeue", run / "failures"
    failures.mkdir()

    def decide(rc, signal="", start=0, restarts="0", left=None):
        stop.signal = signal
        monkeypatch.setattr(pbs, "qstat_job", lambda _job: {} if left is None else {
            "Resource_List": {"walltime": "01:00:00"}, "resources_used": {"walltime": pbs.hms(3600 - left)}})  # fmt: skip
        env = {"LLMFT_FAILURE_RESTARTS": restarts}
        return pbs_follow(monkeypatch, k, env, run, rc, stop, requeue, start, failures, ["pbs-n0", "pbs-n1"])

    def checkpoint(step):
        (run / f"checkpoint-{step}").mkdir()
        (run / f"checkpoint-{step}" / "llmft_complete.json").write_text("{}")

    assert decide(0) == Outcome(1)  # exit 0 and no llmft_done.json: not a success
    assert "the run did not finish" in capsys.readouterr().out
    checkpoint(2)
    requeue.write_text("")
    assert decide(0) == Outcome(0, go_on=True) and not requeue.exists()
    assert "llmft stopped for its final save before the walltime" in capsys.readouterr().out
    assert decide(0, "USR1") == Outcome(0, go_on=True)
    assert decide(0, "TERM", left=30) == Outcome(0, go_on=True)  # within kill_delay + 60 s of the walltime
    assert decide(0, "TERM", left=1800) == Outcome(0)  # qrerun or qdel: PBS decides
    assert "a job PBS reruns (qrerun) resumes from it" in capsys.readouterr().out
    killed = {"node": "pbs-n1", "rc": 1, "rank": 1, "exitcode": -9, "kind": "signal", "time": "2026-11-28_02:00:00"}
    (failures / "node-1.json").write_text(json.dumps(killed))
    assert decide(1, start=0, restarts="1") == Outcome(1, go_on=True, failure_restarts=2)
    out = capsys.readouterr().out
    # one line names the rank and node that failed first (llmft.launch.failure_blame, as on Slurm)
    assert "run_llm.pbs: training failed (exit 1): rank 1 on node pbs-n1 failed first (exit code -9, SIGKILL)\n" in out
    assert "after failures 2 of at most MAX_RESTARTS=2" in out
    assert decide(1, start=0, restarts="2") == Outcome(1)  # the limit
    assert "not continued: the run was continued in a new job after failures 2 times, and MAX_RESTARTS=2" in (
        capsys.readouterr().out
    )
    assert decide(1, start=2) == Outcome(1)  # no new complete checkpoint: it would fail again
    assert "no new complete checkpoint" in capsys.readouterr().out
    # an application error fails the same way anywhere: not continued, whatever the progress, and the fix is said
    oom = {
        "node": "pbs-n0",
        "rank": 0,
        "exitcode": 1,
        "kind": "app",
        "cause": "torch.OutOfMemoryError: CUDA out of memory",
    }
    (failures / "node-1.json").write_text(json.dumps(oom))
    assert decide(1, start=0) == Outcome(1)
    out = capsys.readouterr().out
    assert "rank 0 on node pbs-n0 failed first (exit code 1): torch.OutOfMemoryError" in out
    assert (
        "not continued: an application error fails the same way on any node; out of memory: lower MICRO_BATCH" in out
    )
    (run / "llmft_done.json").write_text("{}")
    assert decide(0) == Outcome(0)


def test_each_nodes_exit_is_its_wrappers_record_and_a_node_without_one_is_no_report(tmp_path):
    """pbsdsh returns 0 whatever its task did (pbsdsh.c), and at once after the job's SIGTERM while the ranks still
    save: the launcher takes each node's exit from the record its wrapper writes when torchrun has ended; a node with
    none is no report (None), and the attempt's status then is no success."""
    (tmp_path / "exit-pbs-n0").write_text("0\n")
    (tmp_path / "exit-pbs-n1").write_text("1\n")
    hosts = [("pbs-n0", 0), ("pbs-n1", 1), ("pbs-n2", 2)]
    assert pbs.node_exits(tmp_path, hosts, lambda: 0) == [0, 1, None]
    names = ["pbs-n0", "pbs-n1", "pbs-n2"]
    assert pbs.job_exit([0, 1, None], names) == (1, ["pbs-n2"])  # the first failure's status, the silent node named
    assert pbs.job_exit([0, 0, None], names) == (1, ["pbs-n2"])  # no record is no success
    assert pbs.job_exit([0, -9, 0], names) == (-9, [])
    assert pbs.job_exit([0, 0, 0], names) == (0, [])


def test_a_nodes_probe_is_read_from_its_own_file_and_a_node_without_one_is_no_report(tmp_path, monkeypatch):
    """The allocation probe on each node (pbsdsh returns 0 whatever it did): the wrapper writes the probe's output
    on success and `<file>.failed` with its exit status otherwise; the launcher refuses a node with either a failure
    or no file at all, in one line naming the node."""
    env_file = tmp_path / "env.json"
    env_file.write_text("{}")
    ok, bad = tmp_path / "nodes.pbs-n0", tmp_path / "nodes.pbs-n1"
    say = [sys.executable, "-c", "print('node pbs-n0 ok')"]
    fail = [sys.executable, "-c", "print('no such device'); raise SystemExit(3)"]
    usr1 = signal.getsignal(signal.SIGUSR1)
    try:  # the wrapper ignores USR1 (a job's qsig): not this test process, after it
        assert node.main(["--env_file", str(env_file), "--out", str(ok), "--", *say]) == 0
        assert node.main(["--env_file", str(env_file), "--out", str(bad), "--", *fail]) == 3
    finally:
        signal.signal(signal.SIGUSR1, usr1)
    assert ok.read_text() == "node pbs-n0 ok\n"
    assert not bad.exists() and Path(f"{bad}.failed").read_text() == "exit 3: no such device"
    monkeypatch.setattr(pbs, "on_every_node", lambda hosts, command: [0] * len(hosts))  # pbsdsh: 0 whatever happened
    hosts = [("pbs-n0", 0), ("pbs-n1", 1)]
    with pytest.raises(
        pbs.PbsJobError, match=r"^could not read the allocation on node pbs-n1: exit 3: no such device$"
    ):
        pbs.probe_nodes(hosts, env_file, tmp_path / "nodes", ["true"])
    ok.write_text("node pbs-n0 ok\n")
    with pytest.raises(pbs.PbsJobError, match=r"^could not read the allocation on node pbs-n1: it reported nothing$"):
        pbs.probe_nodes(hosts, env_file, tmp_path / "nodes", ["true"])


def test_node_exits_are_waited_for_longer_once_a_stop_signal_comes(tmp_path):
    """The wait is asked again each second: a stop that comes while the launcher waits (pbsdsh, signalled first,
    returned before the launcher's own signal) lengthens it, and a record written meanwhile is found."""
    hosts = [("pbs-n0", 0)]
    asked = []

    def wait_s() -> float:
        asked.append(1)
        if len(asked) == 2:  # the stop arrives, and the node's wrapper records its exit a little later
            (tmp_path / "exit-pbs-n0").write_text("0\n")
        return 0.5 if len(asked) < 2 else 30.0

    assert pbs.node_exits(tmp_path, hosts, wait_s) == [0] and len(asked) >= 2


def test_a_record_is_found_by_listing_its_directory_not_by_a_stat(tmp_path, monkeypatch):
    """NFS may answer a stat of a name from a cached "no such file"; listing the directory revalidates it. The exit
    records are found in the listing: a stat that says no does not hide one."""
    (tmp_path / "exit-pbs-n0").write_text("3\n")
    monkeypatch.setattr(Path, "is_file", lambda self: False)
    monkeypatch.setattr(Path, "exists", lambda self: False)
    assert pbs.node_exits(tmp_path, [("pbs-n0", 0)], lambda: 0) == [3]


def test_the_deadline_counts_from_the_jobs_start_not_from_the_end_of_its_set_up(tmp_path, capsys):
    """LLMFT_JOB_END_FILE gets PBS's `stime` and the whole walltime: rank 0's time left is the same however long the
    set-up took; without a readable stime, now and qstat's time left."""
    from llmft.training.job_deadline import time_left_from_file

    stime = "Sat Nov 28 10:00:00 2026"
    start = time.mktime(time.strptime(stime, "%a %b %d %H:%M:%S %Y"))
    job = {"stime": stime, "Resource_List": {"walltime": "01:00:00"}, "resources_used": {"walltime": "00:00:05"}}
    assert pbs.job_end(job, now=start + 300) == (start, 3600.0)
    end_file = tmp_path / "job-end"
    pbs.write_job_end(end_file, job)
    assert time_left_from_file(end_file.read_text(), now_unix=start + 300) == 3300.0  # a 5-minute set-up
    assert "walltime: " in capsys.readouterr().out
    no_stime = {**job, "stime": ""}
    assert pbs.job_end(no_stime, now=start + 300) == (start + 300, 3595.0)
    assert pbs.job_end({"Resource_List": {}}, now=start) is None


def test_the_node_wrapper_reports_a_failing_command_and_records_every_nodes_exit(tmp_path):
    """llmft.launch.node, each node's wrapper on both schedulers: it says the node, its rank and resources; a failing
    command's stderr passes through and becomes the node's report (node-<rank>.json, llmft.launch.failure_blame);
    every exit is recorded (exit-<node>), a command killed by a signal as a shell gives it (128 + N)."""
    failures, logs = tmp_path / "failures", tmp_path / "kernel"
    failures.mkdir()
    logs.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "LLMFT_TEST_KERNEL_LOG_DIR": str(logs)}
    env.update(SLURMD_NODENAME="n2", SLURM_NODEID="1", SLURM_GPUS_ON_NODE="1", SLURM_CPUS_ON_NODE="4")
    wrapper = [sys.executable, "-m", "llmft.launch.node", "--job", "run_llm.slurm", "--failures", str(failures), "--"]

    def run(code: str) -> subprocess.CompletedProcess:
        return subprocess.run([*wrapper, sys.executable, "-c", code], capture_output=True, text=True, env=env)

    done = run("print('trained')")
    assert done.returncode == 0 and "trained\n" in done.stdout, done
    assert "run_llm.slurm: node n2 (node rank 1): torchrun with 1 GPU(s) and 4 CPU(s)\n" in done.stdout
    assert (failures / "exit-n2").read_text() == "0\n" and not (failures / "node-1.json").exists()
    failed = run("import sys; sys.stderr.write('AssertionError: a bad record\\n'); sys.exit(3)")
    assert failed.returncode == 3 and "AssertionError: a bad record\n" in failed.stderr, failed
    report = json.loads((failures / "node-1.json").read_text())
    assert report["node"] == "n2" and report["rc"] == 3 and (failures / "exit-n2").read_text() == "3\n"
    killed = run("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert killed.returncode == 128 + 9 and (failures / "exit-n2").read_text() == "137\n"


def test_the_node_wrapper_outlives_a_sigterm_until_its_command_has_saved(tmp_path):
    """The scheduler signals every process of the node's task; the wrapper stays until the command (torchrun, whose
    ranks write their stop checkpoint) has ended, and records the command's exit, not its own death."""
    failures, ready, saved = tmp_path / "failures", tmp_path / "ready", tmp_path / "saved"
    failures.mkdir()
    code = (
        "import pathlib, signal, sys, time\n"
        f"signal.signal(signal.SIGTERM, lambda *_: (time.sleep(1), pathlib.Path({str(saved)!r}).write_text('x'), "
        "sys.exit(0)))\n"
        f"pathlib.Path({str(ready)!r}).write_text('x')\n"
        "time.sleep(120)\n"
    )
    wrapper = [sys.executable, "-m", "llmft.launch.node", "--failures", str(failures), "--node", "pbs-n0", "--"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([*wrapper, sys.executable, "-c", code], env=env, start_new_session=True)
    try:
        for _ in range(600):
            if ready.exists() or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert ready.exists(), "the command never started"
        os.killpg(proc.pid, signal.SIGTERM)  # every process of the task, as Slurm and PBS signal it
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert saved.exists() and (failures / "exit-pbs-n0").read_text() == "0\n"


def test_both_schedulers_give_the_whole_scheduler_interface_with_its_signatures(monkeypatch):
    """llmft.launch.scheduler.run_job drives a job on either scheduler through one interface: SlurmJob and PbsJob
    each give every member of Scheduler, each method with the interface's parameters, and nothing the steps rely on is
    missing on one of them (a step added for one scheduler alone fails here)."""
    k = knobs.resolve({}, [])
    monkeypatch.setattr(pbs, "qstat_job", lambda _job: {})
    jobs = [slurm.SlurmJob(k, {"SLURM_JOB_ID": "7"}), pbs.PbsJob(k, {"PBS_JOBID": "7.head"})]
    members = [n for n in dir(scheduler.Scheduler) if not n.startswith("_")] + list(
        scheduler.Scheduler.__annotations__
    )
    for j in jobs:
        assert isinstance(j, scheduler.Scheduler), type(j)
        for name in members:
            wanted = getattr(scheduler.Scheduler, name, None)
            if callable(wanted):
                given = inspect.signature(getattr(j, name)).parameters
                assert list(given) == list(inspect.signature(wanted).parameters)[1:], (type(j).__name__, name)
            else:
                assert hasattr(j, name), (type(j).__name__, name)

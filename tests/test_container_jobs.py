"""Real container jobs: pbs/run_llm.pbs on the local OpenPBS through the real enroot 4.1.2, and slurm/run_llm.slurm on
the local Slurm cluster through the real pyxis 0.24.0, both built from ../shared/vendor by tests/container_tools.sh,
with its test image (Debian 12 from debootstrap, squashed). The ranks run on the image's own Python 3.11.2 with the
test venv (built by the same Python) mounted: VENV with CONTAINER_IMAGE (llmft.launch.job.container_python). A test
hook (tests/image_hook) has each rank record /etc/llmft-test-image, a file only the image has."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from pbs_cluster import JOB_USER, PbsCluster, pbs_cluster  # noqa: F401 - the fixture
from slurm_cluster import step_lines as steps_trained

from llmft.launch import node as node_wrapper
from llmft.launch import pbs

REPO = Path(__file__).resolve().parents[1]
PBS_SCRIPT = REPO / "pbs" / "run_llm.pbs"
HOOK = REPO / "tests" / "image_hook"
TRAINING_JOB_S = 1800  # guards against hangs, not a speed claim (see tests/pbs_cluster.py)
BOTH_SHARDS = ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]


@pytest.fixture(scope="session")
def tools() -> dict[str, Path]:
    """enroot's install tree, pyxis's plugin and the test image: built once, then restored from their cache."""
    proc = subprocess.run(["bash", str(REPO / "tests" / "container_tools.sh")], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f"tests/container_tools.sh failed (make test-setup runs it):\n{proc.stderr}", pytrace=False)
    found = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    return {name: Path(value) for name, value in found.items()}


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def own(path: Path) -> None:
    shutil.chown(path, JOB_USER, JOB_USER)
    for p in path.rglob("*"):
        shutil.chown(p, JOB_USER, JOB_USER)


def enroot_list(tools, data: Path) -> list[str]:
    """`enroot list` on a data path, as the job user whose containers live there."""
    env = {"PATH": f"{tools['ENROOT_PREFIX'] / 'bin'}:/usr/bin:/bin", "ENROOT_DATA_PATH": str(data), "HOME": "/tmp"}
    proc = subprocess.run(
        [shutil.which("runuser") or "runuser", "-u", JOB_USER, "--", "enroot", "list"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def ranks_in_the_image(record: Path, tools) -> list[dict]:
    """What each rank wrote (tests/image_hook): every one ran on the image's Python, in the image."""
    marker = subprocess.run(
        ["unsquashfs", "-cat", str(tools["TEST_IMAGE"]), "etc/llmft-test-image"], capture_output=True, text=True
    ).stdout
    assert marker.startswith("llmft test image: debootstrap --variant=minbase"), marker
    assert not Path("/etc/llmft-test-image").exists()  # the host has none: only the image
    ranks = [json.loads(p.read_text()) for p in sorted(record.glob("rank-*.json"))]
    for r in ranks:
        assert r["image"] == marker, r
        assert r["version"] == "3.11.2" and r["real_executable"] == "/usr/bin/python3.11", r
        assert r["executable"] == str(Path(sys.prefix).resolve() / "bin" / "python"), r
    return ranks


# ---- PBS: enroot, from llmft's own calls -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pbs_jobs(pbs_cluster: PbsCluster, tools, tiny_model, tiny_data, tmp_path_factory):  # noqa: F811
    """The issue's command line with CONTAINER_IMAGE, on a data path both nodes share ({d}/enroot-data): a walltime
    stop at step 2 (a test hook: 40 s left there, under the final save's lead) and its continuation to step 4; and a
    job whose plan refuses its batch after each node created its container. Submitted together."""
    pbs_cluster.cmd([str(pbs_cluster.bin / "qmgr"), "-c", "set queue workq kill_delay = 60"])
    inputs = pbs_cluster.job_dir(tmp_path_factory.mktemp("container_inputs"))
    shutil.copytree(tiny_model, inputs / "model")
    shutil.copy(tiny_data, inputs / "train.jsonl")
    # enroot as a site installs it: its helpers (enroot-nsenter, ...) on PATH beside it (LLMFT_ENROOT: a site's wrapper)
    enroot = inputs / "enroot"
    bin_dir = tools["ENROOT_PREFIX"] / "bin"
    enroot.write_text(f'#!/bin/sh\nPATH={bin_dir}:$PATH exec {bin_dir}/enroot "$@"\n')
    enroot.chmod(0o755)
    own(inputs)
    out = {}
    for name, batch in (("walltime", "GLOBAL_BATCH=4"), ("refused", "GLOBAL_BATCH=6")):
        d = pbs_cluster.job_dir(tmp_path_factory.mktemp(f"container_{name}"))
        for sub in ("enroot-data", "ranks"):
            (d / sub).mkdir()
        own(d)
        variables = (
            f"MODEL={inputs / 'model'},DATASET={inputs / 'train.jsonl'},MAX_STEPS=4,{batch},MICRO_BATCH=2,"
            f"ZERO_STAGE=2,CHECKPOINT_DIR={d / 'ckpt'},CONTAINER_IMAGE={tools['TEST_IMAGE']},"
            f"VENV={sys.prefix},CONTAINER_MOUNTS={REPO}:{REPO},PYTHONPATH={REPO}:{HOOK},HF_HUB_OFFLINE=1,"
            f"TOKENIZERS_PARALLELISM=false,LLMFT_CACHE={d / 'cache'},HF_HOME={d / 'hf'},"
            f"LLMFT_ENROOT={enroot},ENROOT_DATA_PATH={d / 'enroot-data'},"
            f"LLMFT_TEST_IMAGE_RECORD={d / 'ranks'},EXTRA_ARGS=--logging_steps 1,"
            "LLMFT_TEST_TIME_LEFT_AT_STEP=2:40,LLMFT_TEST_SAVE_DELAY_S=12"
        )
        resources = ["-l", "select=2:ncpus=1", "-l", "place=scatter", "-l", "walltime=00:30:00"]
        args = [*resources, "-o", str(d / "out"), "-v", variables, str(PBS_SCRIPT)]
        out[name] = (pbs_cluster.qsub(args, cwd=d), d)
    # The founding workflow's sweep: three learning rates, an array of one-node jobs, each in its container.
    d = pbs_cluster.job_dir(tmp_path_factory.mktemp("container_sweep"))
    (d / "enroot-data").mkdir()
    own(d)
    variables = (
        f"MODEL={inputs / 'model'},DATASET={inputs / 'train.jsonl'},MAX_STEPS=2,GLOBAL_BATCH=4,MICRO_BATCH=2,"
        f"CHECKPOINT_DIR={d / 'sweep'},SWEEP='learning_rate=1e-4,2e-4,3e-4',CONTAINER_IMAGE={tools['TEST_IMAGE']},"
        "EXTRA_ARGS=--logging_steps 1,"
        f"VENV={sys.prefix},CONTAINER_MOUNTS={REPO}:{REPO},PYTHONPATH={REPO},HF_HUB_OFFLINE=1,"
        f"TOKENIZERS_PARALLELISM=false,LLMFT_CACHE={d / 'cache'},HF_HOME={d / 'hf'},"
        f"LLMFT_ENROOT={enroot},ENROOT_DATA_PATH={d / 'enroot-data'}"
    )
    resources = ["-J", "1-3", "-l", "select=1:ncpus=1", "-l", "walltime=00:30:00"]
    args = [*resources, "-o", str(d / "out.^array_index^"), "-v", variables, str(PBS_SCRIPT)]
    out["sweep"] = (pbs_cluster.qsub(args, cwd=d), d)
    return out


def test_pbs_container_job_trains_in_the_image_stops_for_its_walltime_and_its_continuation_ends_at_step_4(
    pbs_cluster,  # noqa: F811
    pbs_jobs,
    tools,
):
    """qsub -l select=2:ncpus=1 -l place=scatter -v MODEL=...,MAX_STEPS=4,GLOBAL_BATCH=4,MICRO_BATCH=2,ZERO_STAGE=2,
    CHECKPOINT_DIR=...,CONTAINER_IMAGE=image.sqsh pbs/run_llm.pbs through the real enroot: each node creates its own
    container (per-node names, on a data path both share), both ranks run in the image, the walltime stop saves at
    step 2 and the continuation (another job: other names) trains 3-4 in its containers; checkpoint-4/global_step4/
    holds both ranks' shards, and no container is left after either job."""
    job, d = pbs_jobs["walltime"]
    info = pbs_cluster.wait(job, timeout=TRAINING_JOB_S)
    first = pbs_cluster.wait_for("the first job's output", lambda: read(d / "out"))
    assert info["Exit_status"] == 0, first
    first_id = job.split(".")[0]
    assert f"container llmft-{first_id}-{{node}} from {tools['TEST_IMAGE']} on each node: " in first, first
    assert "DeepSpeed's CPU FusedAdam needs a C++ compiler (c++) to load and none is here" in first, first
    m = re.search(r"continuation submitted: job (\S+) starts after", first)
    assert m and "llmft stopped for its final save before the walltime" in first, first
    assert enroot_list(tools, d / "enroot-data") == []  # the first job's, removed at its end (the walltime stop)
    second_job = m.group(1)
    second_info = pbs_cluster.wait(second_job, timeout=TRAINING_JOB_S)
    second = pbs_cluster.wait_for("the continuation's output", lambda: read(d / "out.1"))
    assert second_info["Exit_status"] == 0, second
    assert f"container llmft-{second_job.split('.')[0]}-{{node}} from " in second, second
    resumed = re.search(r"llmft: resuming from (\S+)/checkpoint-(\d+)\n", second)
    assert resumed and resumed.group(2) == "2", second
    assert steps_trained(first) == [1, 2] and steps_trained(second) == [3, 4], (first, second)
    tag = d / "ckpt" / "checkpoint-4" / "global_step4"
    assert sorted(p.name for p in tag.glob("*optim_states.pt")) == BOTH_SHARDS
    assert json.loads((d / "ckpt" / "llmft_done.json").read_text())["global_step"] == 4
    ranks = ranks_in_the_image(d / "ranks", tools)
    assert sorted(r["rank"] for r in ranks) == [0, 0, 1, 1]  # both ranks, in each job
    assert enroot_list(tools, d / "enroot-data") == []  # nor the continuation's


def test_pbs_container_job_that_fails_after_creating_its_containers_removes_them(
    pbs_cluster,  # noqa: F811
    pbs_jobs,
    tools,
):
    """A job that ends in a failure (its plan refuses GLOBAL_BATCH=6 for 2 ranks of MICRO_BATCH=2) after each node
    created its container still removes both."""
    job, d = pbs_jobs["refused"]
    info = pbs_cluster.wait(job, timeout=TRAINING_JOB_S)
    text = pbs_cluster.wait_for("the job's output", lambda: read(d / "out"))
    assert info["Exit_status"] != 0, text
    assert "on each node: " in text, text  # its containers were made
    assert enroot_list(tools, d / "enroot-data") == [], text


def test_the_founding_workflow_in_a_container_sweep_eval_and_report(pbs_cluster, pbs_jobs, tools):  # noqa: F811
    """The founding workflow on the local OpenPBS, in the container: `qsub -J 1-3` trains a sweep of three learning
    rates, `llmft eval` scores each variant on GSM8K-format local task data inside the image (as the job user), and
    `llmft report` over the sweep gives one comparison table and plot."""
    from test_eval import gsm8k_records

    from llmft.data.synthetic import write_jsonl

    job, d = pbs_jobs["sweep"]
    pbs_cluster.wait(job, timeout=TRAINING_JOB_S)
    subjobs = {jid: i for jid, i in pbs_cluster.qstat(job, subjobs=True).items() if jid != job}
    assert sorted(i["Exit_status"] for i in subjobs.values()) == [0, 0, 0], [read(p) for p in d.glob("out.*")]
    sweep_dir = d / "sweep"
    names = ["learning_rate-1e-4", "learning_rate-2e-4", "learning_rate-3e-4"]
    for name in names:
        assert json.loads((sweep_dir / name / "llmft_done.json").read_text())["global_step"] == 2
    assert enroot_list(tools, d / "enroot-data") == []
    task = write_jsonl(gsm8k_records(4, seed=5), d / "gsm8k" / "test.jsonl")
    own(d / "gsm8k")
    python = str(Path(sys.prefix).resolve() / "bin" / "python")
    env = {
        "PATH": f"{tools['ENROOT_PREFIX'] / 'bin'}:/usr/bin:/bin",
        "HOME": str(d),
        "ENROOT_DATA_PATH": str(d / "enroot-data"),
        "PYTHONPATH": str(REPO),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    as_job_user = [shutil.which("runuser") or "runuser", "-u", JOB_USER, "--"]
    name = "llmft-founding-eval"
    created = subprocess.run([*as_job_user, "enroot", "create", "--name", name, str(tools["TEST_IMAGE"])], env=env)
    assert created.returncode == 0
    try:
        mounts = [f"{REPO}:{REPO}", f"{Path(sys.prefix).resolve()}:{Path(sys.prefix).resolve()}", f"{d}:{d}"]
        start = pbs.enroot_start(
            "enroot", name, mounts, False, ["PYTHONPATH", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"]
        )
        for variant in names:
            args = ["-m", "llmft.eval", str(sweep_dir / variant), "--tasks", "gsm8k", "--task_data", f"gsm8k={task}"]
            args += ["--num_fewshot", "0", "--limit", "4", "--gen_kwargs", "max_gen_toks=8", "--batch_size", "4"]
            proc = subprocess.run([*as_job_user, *start, python, *args], capture_output=True, text=True, env=env)
            assert proc.returncode == 0, proc.stderr[-3000:]
            assert "llmft eval: gsm8k (0-shot, n=4) step 2: exact_match" in proc.stderr, proc.stderr[-3000:]
    finally:
        subprocess.run([*as_job_user, "enroot", "remove", "-f", name], capture_output=True, env=env)
    assert enroot_list(tools, d / "enroot-data") == []
    report = d / "report"
    proc = subprocess.run(
        [sys.executable, "-m", "llmft.report", str(sweep_dir), "--output", str(report)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    text = (report / "report.md").read_text()
    for variant in names:  # one row per variant in the runs' table, and its scores in the benchmarks' table
        assert re.search(rf"^\| {variant} \| GPT2LMHeadModel \| .* \| ZeRO-2 \| 2 \| yes \|", text, re.M), text
        assert re.search(rf"^\| {variant} \| 2 \| gsm8k \| 0 \| 4 \| exact_match", text, re.M), text
    assert (report / "loss.png").is_file() and (report / "benchmarks.png").is_file(), text


def test_the_gpu_command_line_llmft_builds_reaches_enroots_nvidia_hook(tools, tmp_path):
    """The exact `enroot start` a GPU node's step runs (llmft.launch.pbs: NVIDIA_VISIBLE_DEVICES and
    NVIDIA_DRIVER_CAPABILITIES in the container's environment, no --nv), through the real enroot: its option parser
    takes it, and its 98-nvidia.sh hook then runs, which on this CPU machine stops at the missing nvidia-container-cli
    (a GPU node needs libnvidia-container-tools, docs/pbs.md). The CPU command line runs in the image."""
    enroot = str(tools["ENROOT_PREFIX"] / "bin" / "enroot")
    env = {
        "PATH": f"{tools['ENROOT_PREFIX'] / 'bin'}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "ENROOT_DATA_PATH": str(tmp_path / "data"),
        "LLMFT_STOP_FILE": str(tmp_path / "stop"),
    }
    name = pbs.container_name("7.pbs-head").replace("{node}", "pbs-n0")
    created = subprocess.run(
        [enroot, "create", "--name", name, str(tools["TEST_IMAGE"])], capture_output=True, env=env
    )
    assert created.returncode == 0, created.stderr[-2000:]
    try:
        command = ["cat", "/etc/llmft-test-image"]
        gpu = [*pbs.enroot_start(enroot, name, [f"{tmp_path}:{tmp_path}"], True, ["LLMFT_STOP_FILE"]), *command]
        gpu_env = {**env, **node_wrapper.container_gpu_env(gpu, {"CUDA_VISIBLE_DEVICES": "GPU-1a,GPU-2b"})}
        assert gpu_env["NVIDIA_VISIBLE_DEVICES"] == "GPU-1a,GPU-2b"
        proc = subprocess.run(gpu, capture_output=True, text=True, env=gpu_env)
        assert proc.returncode == 1 and "Usage" not in proc.stdout + proc.stderr, proc
        assert "Command not found: nvidia-container-cli" in proc.stderr and "98-nvidia.sh" in proc.stderr, proc
        cpu = [*pbs.enroot_start(enroot, name, [f"{tmp_path}:{tmp_path}"], False, ["LLMFT_STOP_FILE"]), *command]
        proc = subprocess.run(cpu, capture_output=True, text=True, env=env)
        assert proc.returncode == 0 and proc.stdout.startswith("llmft test image: "), proc
        bad = subprocess.run([enroot, "start", "--nv", name, "true"], capture_output=True, text=True, env=env)
        assert bad.returncode == 1 and "Usage: enroot start" in bad.stdout + bad.stderr, bad  # no --nv
    finally:
        subprocess.run([enroot, "remove", "-f", name], capture_output=True, env=env)
    assert os.listdir(tmp_path / "data") == []


# ---- Slurm: pyxis, from slurm/run_llm.slurm's srun options -------------------------------------------------------


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A local Slurm cluster of this module, with the real pyxis loaded and each node's own enroot data path."""
    from slurm_cluster import start_cluster, stop_cluster

    state = tmp_path_factory.mktemp("slurm_containers")
    cluster = start_cluster(state)
    yield cluster
    stop_cluster(state)


def test_slurm_container_job_through_the_real_pyxis_requeues_at_its_time_limit_and_ends_at_step_4(
    slurm, tiny_model, tiny_data, tmp_path
):
    """sbatch --nodes=2 slurm/run_llm.slurm --export=ALL,...,CONTAINER_IMAGE=image.sqsh through the real pyxis: two
    mounts separated by ';' in sbatch's --export arrive as pyxis's comma list, each node creates the job's container
    once per run (pyxis_<job>_llmft-<job>: container_scope=job), both ranks run in the image, where there is no
    squeue (rank 0 reads the job's end from the batch shell's file), the time-limit stop at step 2 requeues the job
    and its second run trains 3-4; checkpoint-4/global_step4/ holds both ranks' shards, and pyxis's epilog leaves no
    container on either node."""
    extra = tmp_path / "extra"
    extra.mkdir()
    (tmp_path / "ranks").mkdir()
    ckpt = tmp_path / "ckpt"
    knobs = (
        f"--export=ALL,MODEL={tiny_model},DATASET={tiny_data},MAX_STEPS=4,GLOBAL_BATCH=4,MICRO_BATCH=2,ZERO_STAGE=2,"
        f"CHECKPOINT_DIR={ckpt},CONTAINER_IMAGE={slurm.tools['TEST_IMAGE']},VENV={sys.prefix},"
        f"CONTAINER_MOUNTS={REPO}:{REPO};{extra}:{extra}:ro,SAVE_STEPS=1000,EXTRA_ARGS=--logging_steps 1"
    )
    job = slurm.sbatch(
        ["--nodes=2", "--time=30", str(REPO / "slurm" / "run_llm.slurm"), knobs],
        cwd=tmp_path,
        PYTHONPATH=f"{REPO}:{HOOK}",
        LLMFT_TEST_IMAGE_RECORD=str(tmp_path / "ranks"),
        LLMFT_TEST_TIME_LEFT_AT_STEP="2:40",
        LLMFT_TEST_SAVE_DELAY_S="12",
        NVIDIA_VISIBLE_DEVICES="void",  # the job's own value wins: no GPU (these nodes' GPUs are Slurm's fakes)
    )
    info = slurm.wait(job, timeout=TRAINING_JOB_S)
    text = read(tmp_path / f"llmft-{job}.out")
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", f"{info}\n{text}"
    image = slurm.tools["TEST_IMAGE"]
    assert "container GPUs: NVIDIA_VISIBLE_DEVICES=void NVIDIA_DRIVER_CAPABILITIES=compute,utility" in text, text
    mounts = f"--container-mounts={REPO}:{REPO},{extra}:{extra}:ro,{tmp_path}:{tmp_path},"
    assert f"--container-image={image} --container-name=llmft-{job} {mounts}" in text, text
    first = text[: text.index("restart 1,")]
    assert f"llmft stopped for its final save before the time limit (exit 0); requeueing job {job}" in first, first
    assert steps_trained(first) == [1, 2] and steps_trained(text[len(first) :]) == [3, 4], text
    assert re.search(rf"llmft: Slurm job {job} ends in \d+ s; the final save starts", first), first
    assert (ckpt / f".llmft-job-end-{job}").is_file()  # the batch shell's: rank 0 had no squeue inside
    tag = ckpt / "checkpoint-4" / "global_step4"
    assert sorted(p.name for p in tag.glob("*optim_states.pt")) == BOTH_SHARDS
    ranks = ranks_in_the_image(tmp_path / "ranks", slurm.tools)
    assert sorted(r["rank"] for r in ranks) == [0, 0, 1, 1] and all(r["squeue"] is None for r in ranks), ranks
    for node in ("n1", "n2"):
        log = read(slurm.state / "log" / f"slurmd-{node}.log")
        assert log.count(f"pyxis: creating container filesystem: pyxis_{job}_llmft-{job}\n") == 2, node  # each run
        listed = subprocess.run(
            ["/usr/local/bin/enroot", "list"],
            capture_output=True,
            text=True,
            env={**os.environ, "SLURMD_NODENAME": node},
        )  # the node's own data path (slurm/local/start.sh --enroot): pyxis's job epilog removed the job's container
        assert listed.returncode == 0 and f"pyxis_{job}_llmft-{job}" not in listed.stdout.split(), (node, listed)


def test_a_nodes_container_is_made_afresh_over_a_killed_runs_leftover_and_removed(tools, tmp_path):
    """Each node's step (llmft.launch.node --create/--remove) through the real enroot: a container of the job's
    name left by a killed run, with what that run wrote, is replaced by a fresh one from the image; --remove removes
    it, and a second --remove finds nothing to do."""
    env_file = tmp_path / "env.json"
    env_file.write_text(json.dumps({}))
    data = tmp_path / "data"
    env = {
        "PATH": f"{tools['ENROOT_PREFIX'] / 'bin'}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "ENROOT_DATA_PATH": str(data),
    }
    enroot, image = str(tools["ENROOT_PREFIX"] / "bin" / "enroot"), str(tools["TEST_IMAGE"])
    name = pbs.container_name("9.pbs-head").replace("{node}", "pbs-n1")
    assert name == "llmft-9-pbs-n1"
    wrapper = [sys.executable, "-m", "llmft.launch.node", "--env_file", str(env_file), "--node", "pbs-n1"]

    def step(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*wrapper, *args], capture_output=True, text=True, env={**os.environ, **env})

    assert subprocess.run([enroot, "create", "--name", name, image], capture_output=True, env=env).returncode == 0
    left = subprocess.run(
        [enroot, "start", "--rw", name, "touch", "/left-by-a-killed-run"], capture_output=True, env=env
    )
    assert left.returncode == 0 and (data / name / "left-by-a-killed-run").exists()
    made = step("--create", enroot, image, name, "--", "true")
    assert made.returncode == 0, made.stdout + made.stderr
    assert (data / name / "etc" / "llmft-test-image").is_file() and not (data / name / "left-by-a-killed-run").exists()
    for _ in range(2):
        gone = step("--remove", enroot, image, name)
        assert gone.returncode == 0 and os.listdir(data) == [], gone.stdout + gone.stderr


def test_slurm_gpu_job_in_a_container_reaches_enroots_nvidia_hook_through_pyxis(
    slurm, tiny_model, tiny_data, tmp_path
):
    """A GPU job (run_llm.slurm's default --gpus-per-node=1; the local nodes' GPUs are Slurm's) with CONTAINER_IMAGE:
    llmft sets NVIDIA_VISIBLE_DEVICES=all and NVIDIA_DRIVER_CAPABILITIES=compute,utility in its steps' environment,
    pyxis hands them to enroot, and enroot's 98-nvidia.sh hook runs: on this machine, without nvidia-container-cli
    (libnvidia-container-tools), the container does not start and the job says so at its first step."""
    knobs = (
        f"--export=ALL,DRY_RUN=1,MODEL={tiny_model},DATASET={tiny_data},CHECKPOINT_DIR={tmp_path / 'ckpt'},"
        f"CONTAINER_IMAGE={slurm.tools['TEST_IMAGE']},VENV={sys.prefix}"
    )
    job = slurm.sbatch(["--nodes=2", str(REPO / "slurm" / "run_llm.slurm"), knobs], cwd=tmp_path)
    info = slurm.wait(job, timeout=TRAINING_JOB_S)
    text = read(tmp_path / f"llmft-{job}.out")
    assert info["JobState"] == "FAILED", f"{info}\n{text}"
    assert "container GPUs: NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility" in text, text
    assert "Command not found: nvidia-container-cli" in text and "98-nvidia.sh exited with return code 1" in text
    assert "run_llm.slurm: error: could not read the allocation on every node" in text, text

"""slurm/ scripts without a cluster: shellcheck, and knob checking that runs before anything else."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from conftest import require_tool

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "slurm" / "run_llm.slurm"
SHELL_SCRIPTS = [
    SCRIPT,
    REPO / "slurm" / "local" / "start.sh",
    REPO / "slurm" / "local" / "stop.sh",
    REPO / "tests" / "system_deps.sh",
    REPO / "pbs" / "run_llm.pbs",
    REPO / "pbs" / "local" / "start.sh",
    REPO / "pbs" / "local" / "stop.sh",
    REPO / "tests" / "container_tools.sh",
]


def test_shell_scripts_are_shellcheck_clean():
    proc = subprocess.run(
        [require_tool("shellcheck"), "-s", "bash", *map(str, SHELL_SCRIPTS)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for script in SHELL_SCRIPTS:
        text = script.read_text()
        assert "set -euo pipefail" in text, script
        assert "eval " not in text, script


def run_script(*args: str, **env: str) -> subprocess.CompletedProcess:
    """The batch script run by bash outside Slurm: it checks knobs, then says it must be submitted."""
    return run_job_script(SCRIPT, *args, **env)


def run_job_script(script: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """A job script (Slurm's or PBS's) run by bash outside a job, with no knob from this environment."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    for knob in (
        "EPOCHS",
        "CHECKPOINT_DIR",
        "DRY_RUN",
        "ZERO_STAGE",
        "DS_CONFIG",
        "MODEL",
        "DATASET",
        "MIXTURE",
        "VENV",
    ):
        clean.pop(knob, None)
    clean.update(env)
    return subprocess.run(
        ["bash", str(script), *args], capture_output=True, text=True, env=clean, timeout=60, cwd=REPO
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--export=ALL,EPOCHS=abc"], "EPOCHS=abc is not a positive number (default 3)"),
        (["EPOCHS=0"], "EPOCHS=0 is not a positive number"),
        (["--export=ALL,EPOCHS=3,EPOCH=3"], "unknown knob 'EPOCH'"),
        (["--export=ALL,ZERO_STAGE=7"], "ZERO_STAGE=7 is not a ZeRO stage; use 0, 1, 2 or 3"),
        (["--export=ALL,DATA_PERCENTAGE=150"], "0 < DATA_PERCENTAGE <= 100"),
        (["--export=ALL,DATA_PERCENTAGE=0"], "0 < DATA_PERCENTAGE <= 100"),
        (["--export=ALL,GLOBAL_BATCH=-4"], "GLOBAL_BATCH=-4 is not a positive integer"),
        (["--export=ALL,MICRO_BATCH=1.5"], "MICRO_BATCH=1.5 is not a positive integer"),
        (["--export=ALL,MAX_STEPS=ten"], "MAX_STEPS=ten is not a positive integer"),
        (
            ["SAVE_TOTAL_LIMIT=-1"],
            "SAVE_TOTAL_LIMIT=-1 is not a number of checkpoints; use 0 (keep all) or more (default 2)",
        ),
        (
            ["MAX_RESTARTS=three"],
            "MAX_RESTARTS=three is not a number of restarts; use 0 (never requeue a failed attempt) or more (default 3)",
        ),
        (["--export=ALL,OFFLOAD=maybe"], "OFFLOAD=maybe is not a boolean"),
        (["--export=ALL,OFFLOAD=1,ZERO_STAGE=1"], "OFFLOAD=1 needs ZERO_STAGE=2 or 3"),
        (["--export=ALL,OFFLOAD=1,ZERO_STAGE=auto"], "ZERO_STAGE=auto chooses the offload itself; drop OFFLOAD=1"),
        (
            ["--export=ALL,ZERO_STAGE=3,DS_CONFIG=ds_configs/zero3.json"],
            "give either ZERO_STAGE or DS_CONFIG, not both",
        ),
        (["--export=ALL,DS_CONFIG=/nonexistent/ds.json"], "DS_CONFIG=/nonexistent/ds.json: no such file"),
        (["--export=ALL,NCCL_PROFILE=azure"], "NCCL_PROFILE=azure is unknown; use gcp-g2, aws-efa, gcp-tcpx or ib"),
        (["--export=ALL,WANDB_MODE=loud"], "WANDB_MODE=loud: use online, offline or disabled"),
        (["--export=ALL,VENV=/nonexistent/venv"], "VENV=/nonexistent/venv is not a virtual environment"),
        (["--epochs", "3"], "cannot read argument '--epochs'"),
        # A comma inside an --export=... value splits it: the rest is named, not silently dropped.
        (
            ["--export=ALL,CONTAINER_IMAGE=img,CONTAINER_MOUNTS=/data:/data,/models:/models"],
            "'/models:/models' in '--export=ALL,CONTAINER_IMAGE=img,CONTAINER_MOUNTS=/data:/data,/models:/models' is not KEY=VALUE: "
            "a value was cut at a comma, which separates items in --export=...; separate CONTAINER_MOUNTS with ';'",
        ),
        (
            ["CONTAINER_IMAGE=img", "CONTAINER_MOUNTS=/data /models"],
            "'/data /models' is not a mount SRC[:DST[:FLAGS]]; separate mounts with ';'",
        ),
        (["CONTAINER_IMAGE=img", "CONTAINER_MOUNTS=/data:/data;;/x"], "'' is not a mount"),
        (["CONTAINER_MOUNTS=/data:/data"], "CONTAINER_MOUNTS=/data:/data needs CONTAINER_IMAGE"),
        # A mixture is the whole data: the default dataset and percentage never ride along with it.
        (
            ["MIXTURE=pyproject.toml", "DATASET=data.jsonl"],
            "give either MIXTURE or DATASET, not both (MIXTURE=pyproject.toml, DATASET=data.jsonl): the mixture "
            "file names its datasets, and a percentage: per dataset; drop DATASET",
        ),
        (
            ["--export=ALL,MIXTURE=pyproject.toml,DATA_PERCENTAGE=50"],
            "give either MIXTURE or DATA_PERCENTAGE, not both",
        ),
        (
            ["EXTRA_ARGS=--seed 1 --dataset_mixture mix.yaml"],
            "give the mixture as MIXTURE=FILE, not --dataset_mixture in EXTRA_ARGS (the job would also pass "
            "--dataset_name and --data_percentage, and train on a percentage of it)",
        ),
        (["EXTRA_ARGS=--dataset_mixture=mix.yaml"], "give the mixture as MIXTURE=FILE"),
        (["MIXTURE=/nonexistent/mix.yaml"], "MIXTURE=/nonexistent/mix.yaml: no such file"),
        # Local paths exist before anything runs (in a job: on the batch host, before any srun); a hub id is not a path.
        (
            ["DATASET=/nonexistent/data.jsonl"],
            "DATASET=/nonexistent/data.jsonl: no such file or directory (looked in ",
        ),
        (["DATASET=data/missing.parquet"], "DATASET=data/missing.parquet: no such file or directory"),
        (["MODEL=./models/mine"], "MODEL=./models/mine: no such directory (looked in "),
        (["MODEL=/models/org/name"], "MODEL=/models/org/name: no such directory"),
    ],
)
def test_a_bad_knob_is_one_clear_message_and_exit_2(args, message):
    proc = run_script(*args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("run_llm.slurm: error: "), proc.stderr
    assert message in proc.stderr
    if "unknown knob" in message or "cannot read" in message:
        assert "known knobs: EPOCHS CHECKPOINT_DIR DATA_PERCENTAGE" in proc.stderr


def test_knobs_from_the_environment_are_checked_like_arguments_and_arguments_win():
    assert "EPOCHS=x is not a positive number" in run_script(EPOCHS="x").stderr  # sbatch --export=ALL,EPOCHS=x
    assert run_script("EPOCHS=2", EPOCHS="x", DRY_RUN="1").returncode == 0


def test_valid_knobs_outside_slurm_say_to_submit_with_sbatch():
    proc = run_script("--export=ALL,EPOCHS=3,LORA=yes,OFFLOAD=true,ZERO_STAGE=3,DATA_PERCENTAGE=2.5", DRY_RUN="1")
    assert proc.returncode == 0, proc.stderr
    assert run_script("--export=ALL,ZERO_STAGE=auto,LORA=1", DRY_RUN="1").returncode == 0
    assert "knobs are valid" in proc.stdout
    # Several container mounts in every form a user can pass them: ';' inside --export=..., ',' in a plain
    # argument or the environment, and a quoted value (sbatch keeps the quotes and does not split inside them).
    for args, env in (
        (["--export=ALL,CONTAINER_MOUNTS=/data:/data;/models:/models:ro"], {}),
        (["CONTAINER_MOUNTS=/data:/data,/models:/models:ro"], {}),
        (["--export=ALL,CONTAINER_MOUNTS='/data:/data,/models:/models:ro'"], {}),
        ([], {"CONTAINER_MOUNTS": "'/data:/data,/models:/models:ro'"}),
    ):
        proc = run_script(*args, DRY_RUN="1", CONTAINER_IMAGE="img", **env)
        assert proc.returncode == 0 and "knobs are valid" in proc.stdout, (args, env, proc.stderr)
    proc = run_script(f"MIXTURE={REPO / 'pyproject.toml'}", DRY_RUN="1")
    assert proc.returncode == 0 and "knobs are valid" in proc.stdout and "WARNING" not in proc.stdout, proc.stderr
    proc = run_script("--export=ALL,EPOCHS=3")
    assert proc.returncode == 2 and "not inside a Slurm job" in proc.stderr and "sbatch" in proc.stderr


def test_values_are_data_never_code(tmp_path):
    marker = tmp_path / "pwned"
    for args in (
        [f"--export=ALL,MODEL=$(touch {marker})", "DRY_RUN=1"],
        [f"EXTRA_ARGS=`touch {marker}`; touch {marker}", "DRY_RUN=1"],
        [f"EPOCHS=1;touch {marker}"],
        [f"$(touch {marker})=1"],
    ):
        run_script(*args)
    run_script(DRY_RUN="1", MODEL=f"$(touch {marker})", EXTRA_ARGS=f"--seed 1 $(touch {marker})")
    assert not marker.exists()


def test_help_documents_every_knob_with_its_default():
    proc = run_script("--help")
    assert proc.returncode == 0
    for line in (
        "EPOCHS=3",
        "CHECKPOINT_DIR=runs/<job name>-<run key>",
        "sbatch -J NAME",
        "DATA_PERCENTAGE=100",
        "ZERO_STAGE=2",
        "GLOBAL_BATCH=32",
        "MICRO_BATCH=4",
        "SAVE_TOTAL_LIMIT=2",
        "MAX_RESTARTS=3",
        "NCCL_PROFILE=",
        "CONTAINER_IMAGE=",
        "VENV=",
        "EXTRA_ARGS=",
        "WANDB_PROJECT=",
    ):
        assert line in proc.stdout, line
    from llmft.launch.knobs import NAMES

    for knob in NAMES:
        assert f"  {knob}=" in proc.stdout, f"{knob} is not documented in --help"


def test_sbatch_directives_for_multinode_preemption_safe_runs():
    directives = [line for line in SCRIPT.read_text().splitlines() if line.startswith("#SBATCH")]
    for expected in (
        "--output=%x-%j.out",
        "--requeue",
        "--signal=B:USR1@120",
        "--ntasks-per-node=1",
        "--gpus-per-node=1",
        "--open-mode=append",
    ):
        assert any(expected in d for d in directives), expected


def fake_job_env(tmp_path: Path, **env: str) -> dict[str, str]:
    """Variables of a job whose Slurm cannot be reached (no slurm.conf): the script gets past the knobs."""
    conf = tmp_path / "empty-slurm.conf"
    conf.touch()
    return dict(
        SLURM_JOB_ID="123",
        SLURM_JOB_NAME="t",
        SLURM_JOB_NODELIST="n[1-2]",
        SLURM_CONF=str(conf),
        CHECKPOINT_DIR=str(tmp_path / "ckpt"),
        **env,
    )


def test_a_failing_scontrol_show_hostnames_is_one_clear_message(tmp_path):
    proc = run_script(**fake_job_env(tmp_path))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and "unbound variable" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(
        "run_llm.slurm: error: cannot list the job's nodes: 'scontrol show hostnames n[1-2]' failed: "
    )


def test_pyxis_is_found_in_a_long_srun_help_under_pipefail(tmp_path):
    """`srun --help | grep -q --container-image` under pipefail fails when grep exits at the match while srun still
    writes (SIGPIPE, status 141) and reported "no pyxis". pyxis cannot be installed here, so this srun stands in for
    one whose help (with pyxis's options first) is longer than a pipe buffer."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "help.txt").write_text(
        "      --container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH\n" + "      --padding\n" * 100_000
    )
    srun = bin_dir / "srun"
    srun.write_text(f"#!/bin/bash\n[[ $1 == --help ]] && exec cat {tmp_path / 'help.txt'}\nexit 99\n")
    srun.chmod(0o755)
    env = fake_job_env(
        tmp_path, CONTAINER_IMAGE="nvcr.io#nvidia/pytorch:24.05-py3", PATH=f"{bin_dir}:{os.environ['PATH']}"
    )
    for _ in range(3):
        proc = run_script(**env)
        assert "pyxis" not in proc.stderr, proc.stderr
        assert "cannot list the job's nodes" in proc.stderr, proc.stderr  # the next step: the pyxis check passed


def test_the_defaults_are_llmft_trains_and_the_job_names_each_one_it_applied():
    """EPOCHS and DATA_PERCENTAGE default to llmft train's own, the learning rate is llmft train's, and the first lines
    name every default applied (GLOBAL_BATCH and MICRO_BATCH are the script's own batch: said as the others)."""
    from trl import SFTConfig

    from llmft.training.arguments import LlmftArguments
    from llmft.training.flags import default_of

    names = ("num_train_epochs", "per_device_train_batch_size", "learning_rate")
    epochs, _, lr = (default_of(SFTConfig, name) for name in names)
    assert lr == 2e-5  # the script says it as 2e-5
    proc = run_script(DRY_RUN="1")
    assert proc.returncode == 0, proc.stderr
    assert (
        f"run_llm.slurm: defaults applied: MODEL=Qwen/Qwen2.5-0.5B DATASET=trl-lib/Capybara "
        f"DATA_PERCENTAGE={default_of(LlmftArguments, 'data_percentage'):g} EPOCHS={epochs:g} GLOBAL_BATCH=32 "
        f"MICRO_BATCH=4 ZERO_STAGE=2 SAVE_TOTAL_LIMIT=2; learning rate 2e-5 (llmft train's; --learning_rate in "
        "EXTRA_ARGS changes it)\n"
    ) in proc.stdout
    proc = run_script("EPOCHS=1", "MICRO_BATCH=4", "DATA_PERCENTAGE=5", "EXTRA_ARGS=--learning_rate 1e-4", DRY_RUN="1")
    assert (
        "defaults applied: MODEL=Qwen/Qwen2.5-0.5B DATASET=trl-lib/Capybara GLOBAL_BATCH=32 ZERO_STAGE=2 "
        "SAVE_TOTAL_LIMIT=2; learning rate from EXTRA_ARGS\n"
    ) in proc.stdout


def test_a_dry_run_checks_the_sbatch_world_and_reads_a_local_models_config(tiny_model, tiny_data, tmp_path):
    """DRY_RUN=1 outside Slurm: the batch against the processes the #SBATCH lines ask for, and a local model's config
    read by llmft (VENV's Python); a hub id is said, not fetched."""
    import sys

    proc = run_script(f"MODEL={tiny_model}", f"DATASET={tiny_data}", f"VENV={sys.prefix}", DRY_RUN="1")
    assert proc.returncode == 0, proc.stderr
    assert (
        "run_llm.slurm: batch: GLOBAL_BATCH=32 = MICRO_BATCH 4 x 2 processes (the #SBATCH lines: --nodes=2, "
        "--gpus-per-node=1) x accumulation 4\n"
    ) in proc.stdout
    assert f"run_llm.slurm: model: the config of {tiny_model} reads (gpt2, " in proc.stdout
    assert "knobs are valid" in proc.stdout
    not_a_model = tmp_path / "not_a_model"
    not_a_model.mkdir()
    proc = run_script(f"MODEL={not_a_model}", f"VENV={sys.prefix}", DRY_RUN="1")
    assert proc.returncode == 2 and proc.stderr == (
        f"run_llm.slurm: error: --model {not_a_model}: no config.json in that directory; point it at a model directory\n"
    ), proc.stderr
    proc = run_script(DRY_RUN="1")
    assert "run_llm.slurm: model: Qwen/Qwen2.5-0.5B is a hub id, read on the nodes (not checked here)" in proc.stdout
    proc = run_script("ZERO_STAGE=auto", "GLOBAL_BATCH=20", DRY_RUN="1")
    assert proc.returncode == 0 and "batch: not checked here (ZERO_STAGE=auto picks the micro-batch" in proc.stdout
    # The world is the #SBATCH lines': one node of 4 GPUs here
    script = tmp_path / "run_llm.slurm"
    script.write_text(
        SCRIPT.read_text()
        .replace("#SBATCH --nodes=2\n", "#SBATCH --nodes=1\n")
        .replace("#SBATCH --gpus-per-node=1\n", "#SBATCH --gpus-per-node=4\n")
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in ("MODEL", "DATASET")}
    proc = subprocess.run(
        ["bash", str(script), "GLOBAL_BATCH=24", "DRY_RUN=1"], capture_output=True, text=True, env=clean, timeout=60
    )
    assert proc.returncode == 2 and proc.stderr == (
        "run_llm.slurm: error: GLOBAL_BATCH=24 is not a multiple of MICRO_BATCH=4 x 4 processes (the #SBATCH lines: "
        "--nodes=1, --gpus-per-node=4) = 16; use GLOBAL_BATCH=32 or 16, or another MICRO_BATCH\n"
    ), proc.stderr
    # sbatch's own --nodes/--gpus-per-node given to the dry run (as the sbatch line gives them before the script)
    proc = run_script("--nodes=1", "--gpus-per-node=4", "GLOBAL_BATCH=64", DRY_RUN="1")
    assert (
        proc.returncode == 0
        and (
            "batch: GLOBAL_BATCH=64 = MICRO_BATCH 4 x 4 processes (given: --nodes=1, --gpus-per-node=4) x accumulation 4"
        )
        in proc.stdout
    ), proc.stdout + proc.stderr
    assert "give sbatch its options before the script" in run_script("--nodes=1", **fake_job_env(tmp_path)).stderr
    assert "submit with: sbatch --nodes=1 slurm/run_llm.slurm" in run_script("--nodes=1").stderr
    # SEQUENCE_PARALLEL: the batch over data-parallel groups of N ranks, and N must divide the ranks
    proc = run_script("--nodes=2", "--gpus-per-node=4", "GLOBAL_BATCH=8", "SEQUENCE_PARALLEL=4", DRY_RUN="1")
    assert (
        "batch: GLOBAL_BATCH=8 = MICRO_BATCH 4 x 2 data-parallel groups of SEQUENCE_PARALLEL=4 (given: --nodes=2, "
        "--gpus-per-node=4) x accumulation 1"
    ) in proc.stdout, proc.stdout + proc.stderr
    proc = run_script("--nodes=1", "--gpus-per-node=4", "SEQUENCE_PARALLEL=3", DRY_RUN="1")
    assert proc.returncode == 2 and proc.stderr == (
        "run_llm.slurm: error: SEQUENCE_PARALLEL=3 does not divide the 4 processes (given: --nodes=1, "
        "--gpus-per-node=4); use a SEQUENCE_PARALLEL that divides 4\n"
    ), proc.stderr
    # inside a container the paths may live in the image: not checked on the host
    proc = run_script("DATASET=/data/in-image.jsonl", "MODEL=/models/org/in-image", CONTAINER_IMAGE="img", DRY_RUN="1")
    assert proc.returncode == 0, proc.stderr
    assert "model: /models/org/in-image not checked here (llmft runs inside CONTAINER_IMAGE=img)" in proc.stdout


def test_a_python_too_old_for_the_launcher_is_refused_in_one_line(tmp_path):
    """The job scripts run their launcher (llmft.launch.slurm, llmft.launch.pbs) with VENV's Python, else the
    environment's or python3; one older than 3.9 (a cluster's system Python 3.6 or 3.8) is named, not a traceback.
    The stand-in answers the version check as such a Python does (exit 1)."""
    venv = tmp_path / "old-venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text("#!/bin/sh\nexit 1\n")
    python.chmod(0o755)
    for script in (SCRIPT, REPO / "pbs" / "run_llm.pbs"):
        proc = run_job_script(script, f"VENV={venv}", DRY_RUN="1")
        assert proc.returncode == 2 and proc.stderr == (
            f"{script.name}: error: {python} is not Python 3.9 or newer, which the launcher needs; set "
            "VENV=/path/to/venv (llmft's environment)\n"
        ), proc.stderr

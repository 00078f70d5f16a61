"""Shared fixtures: a tiny offline model + datasets, and a way to run llmft in real subprocesses."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# The machine is shared and its load varies: how fast Hypothesis draws inputs is no behaviour of llmft's, so its
# speed checks (too_slow, the per-example deadline) would fail a test for the load beside it, not for a wrong answer.
settings.register_profile("llmft", suppress_health_check=[HealthCheck.too_slow], deadline=None)
settings.load_profile("llmft")

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
pytest_plugins = ["pbs_cluster"]  # the session fixture pbs_cluster: the machine's one local OpenPBS cluster

# Well-formed values for blueprints/aws/config.yaml's placeholders (no real account behind them).
AWS_PLACEHOLDER_ENV = {
    "AWS_REGION": "us-east-1",
    "HEAD_SUBNET_ID": "subnet-0123456789abcdef0",
    "COMPUTE_SUBNET_ID": "subnet-0fedcba9876543210",
    "KEY_NAME": "llmft-key",
    "S3_BUCKET": "llmft-scripts-bucket",
}


# The longest test files, longest first (docs/development.md, "Slow tests"). make test's workers take whole files in
# collection order, so these start first and the last file to finish is a short one: test_slurm.py alone runs longer
# than a third of the suite, and collected in alphabetical order it started last and ran on alone.
# test_train.py too: left in collection order it was the last file of a CI run (2026-11-27), alone for 3 min.
LONGEST_FILES = (
    "test_slurm.py",
    "test_eval.py",
    "test_pbs.py",
    "test_pbs_stop.py",
    "test_container_jobs.py",
    "test_train.py",
    "test_gpu_suite.py",
    "test_infer.py",
    "test_export.py",
    "test_elastic.py",
    "test_sequence_parallel.py",
    "test_long_context.py",
    "test_your_data_docs.py",
    "test_build_locks.py",
    "test_host_memory.py",
    "test_async_save.py",
)


def pytest_collection_modifyitems(config, items):
    """LONGEST_FILES first, each file's tests in their own order (a stable sort)."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FILES)))


@pytest.fixture(scope="session", autouse=True)
def llmft_cache(tmp_path_factory) -> Path:
    """Prepared data goes to a cache of this test session (inherited by every subprocess), never ~/.cache."""
    path = tmp_path_factory.mktemp("llmft-cache")
    os.environ["LLMFT_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny GPT-2-style model directory with a locally trained tokenizer (no hub access)."""
    from llmft.data.synthetic import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def plain_model(tmp_path_factory) -> Path:
    """The tiny model with a tokenizer without a chat template: trained on prompt/completion text it keeps none, so
    `llmft export`'s checks compare greedy tokens without asking an undertrained model to end a chat turn."""
    from transformers import AutoTokenizer

    from llmft.data.synthetic import make_model, make_tokenizer

    out = tmp_path_factory.mktemp("plain") / "model"
    tokenizer = make_tokenizer()
    tokenizer.chat_template = None
    make_model(tokenizer).save_pretrained(out)
    tokenizer.save_pretrained(out)
    assert AutoTokenizer.from_pretrained(out).chat_template is None
    return out


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """A small prompt/completion JSONL dataset generated in code."""
    from llmft.data.synthetic import as_format, make_examples, write_jsonl

    return write_jsonl(
        as_format(make_examples(256), "prompt_completion"), tmp_path_factory.mktemp("data") / "train.jsonl"
    )


@pytest.fixture(scope="session")
def run_with_eval(tmp_path_factory, tiny_model, tiny_data) -> tuple[Path, str, str]:
    """(output dir, train stdout, prepare stdout): one real 2-process ZeRO-2 `llmft train` run with a held-out eval
    split evaluated every 3 steps (rank 0 prepares the data, rank 1 waits for it), from weights staged to a
    node-local directory, then `llmft prepare` with the same flags (which finds it prepared); shared by the eval,
    report, training and staging tests."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path_factory.mktemp("eval_run") / "run"
    flags = [
        "--model_name_or_path",
        str(tiny_model),
        "--dataset_name",
        str(tiny_data),
        "--output_dir",
        str(out),
        "--eval_strategy",
        "steps",
        "--eval_steps",
        "3",
        "--max_steps",
        "6",
        "--save_steps",
        "3",
        "--global_batch_size",
        "8",
        "--per_device_train_batch_size",
        "2",
        "--learning_rate",
        "5e-3",
        "--report_to",
        "none",
        "--logging_steps",
        "1",
        "--disable_tqdm",
        "true",
        "--zero_stage",
        "2",
    ]
    flags += ["--eval_split_ratio", "0.1", "--data_percentage", "50"]  # a fingerprint of its own: prepared here
    # The model directory as if on NFS (what /proc/mounts would say for a shared HF_HOME): its weights are staged to
    # a node-local directory once, and both ranks load that copy (llmft.training.stage_weights).
    mounts = out.parent / "mounts"
    mounts.write_text(f"/dev/sda1 / ext4 rw 0 0\nfiler:/models {tiny_model.parent} nfs rw 0 0\n")
    trained = run(
        [
            PYTHON,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(port),
            "-m",
            "llmft.train",
            *flags,
        ],
        check=True,
        timeout=600,
        LLMFT_PROC_MOUNTS=str(mounts),
        LLMFT_STAGE_DIR=str(out.parent / "node-local"),
    )
    prepared = run([str(Path(PYTHON).parent / "llmft"), "prepare", *flags], check=True, timeout=300)
    return out, trained.stdout, prepared.stdout


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for subprocesses: offline hub, offline W&B, quiet tokenizers, no stray CUDA."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        WANDB_MODE="offline",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def run(cmd: list[str], timeout: float = 600, check: bool = False, **env: str) -> subprocess.CompletedProcess:
    """Run a command, capture its output, and echo it on failure so pytest shows why."""
    proc = subprocess.run(cmd, cwd=REPO, env=subprocess_env(**env), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{cmd} exited {proc.returncode}\nstdout:\n{proc.stdout[-5000:]}\nstderr:\n{proc.stderr[-8000:]}"
        )
    return proc


def require_tool(name: str) -> str:
    """A system tool the tests need; `make test` installs it first (tests/system_deps.sh). Missing: a failure, not a skip."""
    found = shutil.which(name) or shutil.which(
        name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    )
    if not found:
        pytest.fail(
            f"{name} is not installed: run `make test` (its set-up step, tests/system_deps.sh, installs it) "
            f"or `bash tests/system_deps.sh`",
            pytrace=False,
        )
    return found


@pytest.fixture(autouse=True)
def hf_logging_levels_restored():
    """In-process runs (HF's Trainer applies --log_level) must not leave transformers/datasets more verbose for
    the next test: a later bad-input case would then see datasets' own logged traceback, which a user's fresh
    process never prints."""
    import datasets
    import transformers

    levels = (transformers.logging.get_verbosity(), datasets.logging.get_verbosity())
    yield
    transformers.logging.set_verbosity(levels[0])
    datasets.logging.set_verbosity(levels[1])

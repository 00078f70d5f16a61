"""Model downloads once per job (llmft.training.hub): real processes race for one shared cache; no network is used."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import time
from pathlib import Path

import pytest
from conftest import PYTHON, run

from llmft.training.hub import HubError, fetch_once, job_token, resolve_model, skip_patterns

RANKS = 4


def racer(lock_dir: str, log: str, token: str | None, fail: bool, start, results) -> None:
    """One rank of a job: wait for the others, then ask for the model at the same moment."""

    def fake_download() -> str:  # stands in for snapshot_download: slow, and it records each call
        begin = time.time()
        time.sleep(0.4)
        with open(log, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "begin": begin, "end": time.time()}) + "\n")
        if fail:
            raise HubError("model org/missing: no such model on the Hugging Face Hub")
        snapshot = Path(lock_dir).parent / "snapshots" / "abc123"
        snapshot.mkdir(parents=True, exist_ok=True)
        return str(snapshot)

    start.wait()
    try:
        results.put(("ok", fetch_once(lock_dir, "model:org/tiny@main", token, fake_download)))
    except HubError as e:
        results.put(("error", str(e)))


def race(tmp_path: Path, token: str | None, fail: bool = False, n: int = RANKS) -> tuple[list, list[dict]]:
    ctx = mp.get_context("spawn")
    start, results = ctx.Barrier(n), ctx.Queue()
    log = tmp_path / "downloads.jsonl"
    procs = [
        ctx.Process(
            target=racer, args=(str(tmp_path / "cache" / ".llmft-locks"), str(log), token, fail, start, results)
        )
        for _ in range(n)
    ]
    for p in procs:
        p.start()
    got = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return got, calls


def test_the_ranks_of_a_job_download_once_and_all_get_the_snapshot(tmp_path):
    got, calls = race(tmp_path, token="run:1234")
    assert len(calls) == 1, calls  # one download for the whole job
    paths = {path for status, path in got}
    assert [status for status, _ in got] == ["ok"] * RANKS and len(paths) == 1 and Path(paths.pop()).is_dir()

    # The same job again (a requeue keeps torchrun's run id): nothing downloaded, the recorded snapshot is used.
    got, calls = race(tmp_path, token="run:1234")
    assert len(calls) == 1 and [s for s, _ in got] == ["ok"] * RANKS
    # Another job checks the Hub again, once.
    got, calls = race(tmp_path, token="run:1235")
    assert len(calls) == 2 and [s for s, _ in got] == ["ok"] * RANKS


def test_a_failed_download_fails_every_rank_with_its_message_without_retrying(tmp_path):
    got, calls = race(tmp_path, token="run:77", fail=True)
    assert len(calls) == 1, calls
    assert got == [("error", "model org/missing: no such model on the Hugging Face Hub")] * RANKS


def test_processes_of_different_jobs_take_turns_on_one_cache(tmp_path):
    got, calls = race(tmp_path, token=None, n=3)  # three single-process jobs: each downloads, one at a time
    assert len(calls) == 3 and [s for s, _ in got] == ["ok"] * 3
    spans = sorted((c["begin"], c["end"]) for c in calls)
    assert all(spans[i][1] <= spans[i + 1][0] for i in range(len(spans) - 1)), spans


def test_job_token_is_shared_by_a_jobs_processes_and_absent_when_alone():
    assert job_token({}) is None and job_token({"WORLD_SIZE": "1"}) is None
    assert job_token({"WORLD_SIZE": "8", "TORCHELASTIC_RUN_ID": "4242", "MASTER_PORT": "1"}) == "run:4242"
    plain = {"WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}
    assert job_token(plain) == "master::n1:29500"


def test_local_directories_and_bad_names_never_touch_the_hub(tmp_path):
    def never(*_):
        raise AssertionError("no download expected")

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    assert resolve_model(str(model_dir), download=never) == str(model_dir)
    with pytest.raises(HubError, match=r"model directory /nonexistent/llama does not exist"):
        resolve_model("/nonexistent/llama", download=never)
    with pytest.raises(HubError, match=r"model directory runs/x/model does not exist"):
        resolve_model("runs/x/model", download=never)
    with pytest.raises(HubError, match=r"neither a local directory nor a Hugging Face Hub id"):
        resolve_model("bad name!", download=never)
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(HubError, match=r"model\.gguf is a file; pass a model directory"):
        resolve_model(str(tmp_path / "model.gguf"), download=never)


def test_weights_transformers_does_not_load_are_not_downloaded():
    llama = [
        "config.json",
        "generation_config.json",
        "model-00001-of-00004.safetensors",
        "model.safetensors.index.json",
        "original/consolidated.00.pth",
        "original/params.json",
        "original/tokenizer.model",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "pytorch_model-00001-of-00002.bin",
    ]
    from huggingface_hub.utils import filter_repo_objects

    kept = sorted(filter_repo_objects(llama, ignore_patterns=skip_patterns(llama)))
    assert kept == [
        "config.json",
        "generation_config.json",
        "model-00001-of-00004.safetensors",
        "model.safetensors.index.json",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    bin_only = ["config.json", "pytorch_model.bin", "vocab.json", "merges.txt", "flax_model.msgpack", "tf_model.h5"]
    assert sorted(filter_repo_objects(bin_only, ignore_patterns=skip_patterns(bin_only))) == [
        "config.json",
        "merges.txt",
        "pytorch_model.bin",
        "vocab.json",
    ]


CACHED = r"""
import sys
from llmft.training.hub import resolve_model, HubError
try:
    print(resolve_model(sys.argv[1]))
except HubError as e:
    print("HubError:", e)
"""


def test_compute_nodes_without_internet_use_the_cached_snapshot_or_say_how_to_get_one(tmp_path):
    """The real huggingface_hub path against an unreachable Hub: a cached model loads, an uncached one is one line."""
    cache = tmp_path / "hub"
    snapshot = cache / "models--org--tiny" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (cache / "models--org--tiny" / "refs").mkdir()
    (cache / "models--org--tiny" / "refs" / "main").write_text("a" * 40)
    env = dict(
        HF_HUB_OFFLINE="0",
        HF_HUB_CACHE=str(cache),
        HF_ENDPOINT="http://127.0.0.1:9",
        HF_HUB_ETAG_TIMEOUT="2",
        WORLD_SIZE="2",
        TORCHELASTIC_RUN_ID="55",
    )
    proc = run([PYTHON, "-c", CACHED, "org/tiny"], timeout=120, **env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(snapshot), proc.stdout
    proc = run([PYTHON, "-c", CACHED, "org/uncached"], timeout=120, **env)
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("HubError: cannot download model org/uncached (") and "hf download org/uncached" in last, (
        proc.stdout
    )


def test_a_two_process_run_from_a_hub_id_downloads_once_and_trains(tiny_model, tiny_data, tmp_path):
    """`llmft train --model_name_or_path org/tiny` under torchrun, on a node that cannot reach the Hub but has the
    model in its cache: one process resolves it (and says so), the other waits, both train from the snapshot."""
    cache = tmp_path / "hub"
    snapshot = cache / "models--org--tiny" / "snapshots" / ("b" * 40)
    snapshot.parent.mkdir(parents=True)
    shutil.copytree(tiny_model, snapshot)
    (cache / "models--org--tiny" / "refs").mkdir()
    (cache / "models--org--tiny" / "refs" / "main").write_text("b" * 40)
    out = tmp_path / "run"
    proc = run(
        [
            PYTHON,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "-m",
            "llmft.train",
            "--model_name_or_path",
            "org/tiny",
            "--dataset_name",
            str(tiny_data),
            "--output_dir",
            str(out),
            "--max_steps",
            "1",
            "--global_batch_size",
            "4",
            "--per_device_train_batch_size",
            "2",
            "--report_to",
            "none",
            "--disable_tqdm",
            "true",
        ],
        HF_HUB_OFFLINE="0",
        HF_HUB_CACHE=str(cache),
        HF_ENDPOINT="http://127.0.0.1:9",
        HF_HUB_ETAG_TIMEOUT="2",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("llmft: downloading org/tiny (revision main)") == 1, proc.stdout
    assert proc.stdout.count("using the cached copy of org/tiny") == 1, proc.stdout
    assert "training complete at step 1" in proc.stdout
    [stamp] = (cache / ".llmft-locks").glob("*-*.json")
    assert json.loads(stamp.read_text())["path"] == str(snapshot)

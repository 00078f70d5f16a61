"""A build killed mid-way must not hang every later job: stale op build locks are found and cleared."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from conftest import PYTHON, run

from llmft.training import build_locks

LOCAL_MOUNTS = "/dev/vda / ext4 rw,relatime 0 0\nproc /proc proc rw 0 0\n"


def make_lock(root: Path, op: str = "cpu_adam", build: str = "py311_cpu") -> Path:
    lock = root / build / op / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    return lock


def test_a_lock_no_process_holds_on_a_local_filesystem_is_removed_and_named(tmp_path):
    lock = make_lock(tmp_path)
    findings = build_locks.clear_stale_build_locks(tmp_path, mounts_text=LOCAL_MOUNTS, held=set())
    assert not lock.exists()
    assert [(f.path, f.removed) for f in findings] == [(lock, True)]
    assert str(lock) in findings[0].message and "stale" in findings[0].message


def test_a_lock_held_open_by_a_running_build_is_left_to_it(tmp_path):
    """The real check: a live process (a builder) holds the lock open, read from /proc."""
    lock = make_lock(tmp_path, "fused_adam")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); print('held', flush=True); time.sleep(120)",
            str(lock),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert build_locks.clear_stale_build_locks(tmp_path, mounts_text=LOCAL_MOUNTS) == []
        assert lock.exists()
    finally:
        holder.kill()
        holder.wait()
    # Its builder gone (killed mid-build), the same lock is stale.
    assert [f.removed for f in build_locks.clear_stale_build_locks(tmp_path, mounts_text=LOCAL_MOUNTS)] == [True]
    assert not lock.exists()


def test_on_a_network_filesystem_an_old_lock_is_named_with_the_fix_not_removed(tmp_path):
    """Another node may be building there, out of sight of /proc: llmft names an old lock, it does not delete it."""
    mounts = LOCAL_MOUNTS + f"fs-1.efs:/ {tmp_path} nfs4 rw 0 0\n"
    lock = make_lock(tmp_path)
    fresh = build_locks.clear_stale_build_locks(tmp_path, mounts_text=mounts, held=set(), now=time.time() + 60)
    assert fresh == [] and lock.exists()  # a minute old: a build in progress elsewhere, say nothing
    old = build_locks.clear_stale_build_locks(tmp_path, mounts_text=mounts, held=set(), now=time.time() + 3600)
    assert [(f.path, f.removed) for f in old] == [(lock, False)] and lock.exists()
    assert "nfs4" in old[0].message and f"rm {lock}" in old[0].message


def test_filesystem_type_is_the_longest_mount_point_holding_the_path():
    mounts = "/dev/vda / ext4 rw 0 0\nserver:/home /home nfs4 rw 0 0\ntmpfs /home/u/tmp tmpfs rw 0 0\n"
    assert build_locks.filesystem_type(Path("/home/u/.cache/x"), mounts) == "nfs4"
    assert build_locks.filesystem_type(Path("/home/u/tmp/x"), mounts) == "tmpfs"
    assert build_locks.filesystem_type(Path("/homework/x"), mounts) == "ext4"


def test_extensions_root_follows_torch():
    assert build_locks.extensions_root({"TORCH_EXTENSIONS_DIR": "/scratch/ext"}) == Path("/scratch/ext")
    assert build_locks.extensions_root({"XDG_CACHE_HOME": "/c"}) == Path("/c/torch_extensions")


def test_training_after_a_build_killed_mid_way_runs_instead_of_waiting_forever(
    tiny_model, tiny_data, tmp_path, monkeypatch
):
    """ZeRO-2 with optimizer offload loads DeepSpeed's cpu_adam op; with a stale lock and without llmft's check,
    torch waits on it forever (measured: still waiting after 100 s; the timeout below fails the test).

    The run gets its own extensions directory, a copy of this environment's op cache (a fresh one would cost a cold
    build of about 90 s): a lock planted in the shared cache could be cleared first by a training in another test
    worker, llmft's check doing its job there, and this run would then have nothing to say.
    """
    import shutil
    import sys
    from importlib.metadata import version

    import torch
    from torch.utils.cpp_extension import _get_build_directory

    from llmft.training import upstream_noise
    from llmft.training.build_locks import extensions_root

    keyed = upstream_noise.keyed_extensions_dir(
        os.environ, sys.prefix, torch.__version__, version("deepspeed"), extensions_root()
    )
    private = tmp_path / "torch_extensions"
    built = keyed / "cpu_adam" if keyed is not None else None  # where llmft train builds: this environment's op cache
    if built is not None and (built / "cpu_adam.so").is_file():
        shutil.copytree(built, private / "cpu_adam", ignore=shutil.ignore_patterns("lock"))  # mtimes kept: no rebuild
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(private))
    lock = Path(_get_build_directory("cpu_adam", verbose=False)) / "lock"
    assert lock.parent == private / "cpu_adam"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    out = tmp_path / "run"
    proc = run(
        [
            PYTHON,
            "-m",
            "llmft.train",
            "--model_name_or_path",
            str(tiny_model),
            "--dataset_name",
            str(tiny_data),
            "--output_dir",
            str(out),
            "--report_to",
            "none",
            "--max_steps",
            "1",
            "--global_batch_size",
            "2",
            "--per_device_train_batch_size",
            "2",
            "--save_strategy",
            "no",
            "--disable_tqdm",
            "true",
            "--zero_stage",
            "2",
            "--offload",
        ],
        timeout=420,
        check=True,
    )
    assert f"removed a stale build lock {lock}" in proc.stdout
    assert not lock.exists()
    assert (out / "run_summary.json").is_file()

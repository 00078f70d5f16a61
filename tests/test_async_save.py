"""--async_save: periodic checkpoints written by a thread while training goes on (llmft.training.checkpoint_async_save), published
complete only once every rank's files are written; the same training and the same resumed losses as synchronous saves."""

from __future__ import annotations

import json
import re
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import PYTHON, REPO, run
from test_train import steps

from llmft.checkpoint.run_dir import RUN_RECORD
from llmft.training.checkpoint_async_save import BackgroundWriter, partial_path

PROBE = str(REPO / "tests" / "async_save_probe.py")
FLAGS = (
    "--zero_stage",
    2,
    "--max_steps",
    6,
    "--save_steps",
    2,
    "--global_batch_size",
    8,
    "--per_device_train_batch_size",
    2,
    "--learning_rate",
    "5e-3",
)
SAVE_DELAY_S = 2.0
TIMED = r"llmft: checkpoint-(\d+) written and published in ([\d.]+) s( \(written in the background\))?"
LOSS_TOL = 5e-4  # tests/test_elastic.py: the same state gives the same losses to the 4 printed decimals


def test_a_background_save_returns_before_its_file_is_written_and_keeps_the_state_as_saved(tmp_path):
    import torch

    gate, written = threading.Event(), []

    def slow_write(path, data):
        gate.wait(timeout=60)
        from llmft.training.checkpoint_async_save import write_file

        write_file(path, data)
        written.append(path)

    sync = {"now": False}
    writer = BackgroundWriter(lambda: sync["now"], write=slow_write)
    state = {"w": torch.arange(6.0), "step": 3, "param_groups": [{"lr": 0.5}]}
    state["tied"] = state["w"][:3]  # a view of the same storage: saved once, as torch.save does
    target = tmp_path / "optim_states.pt"
    writer.save(state, str(target))
    state["w"].add_(100)  # the next optimizer step changes the tensor in place: the snapshot keeps the saved values
    state["param_groups"][0]["lr"] = 0.25  # and the scheduler its groups' values
    assert writer.busy() and not target.exists() and not partial_path(target).exists()
    gate.set()
    writer.wait()
    assert not writer.busy() and written == [target] and not partial_path(target).exists()
    loaded = torch.load(target)
    assert torch.equal(loaded["w"], torch.arange(6.0)) and loaded["step"] == 3
    assert loaded["param_groups"] == [{"lr": 0.5}]
    assert loaded["tied"].untyped_storage().data_ptr() == loaded["w"].untyped_storage().data_ptr()
    # the next save reuses the host buffers: a run holds one checkpoint's bytes, as the planner counts
    gate.set()
    writer.save(state, str(tmp_path / "again.pt"))
    writer.wait()
    assert writer._snapshots.allocated_bytes == state["w"].nbytes
    assert torch.equal(torch.load(tmp_path / "again.pt")["w"], torch.arange(6.0) + 100)

    sync["now"] = True  # the stop save and the last save: on disk when save() returns
    writer.save(state, str(tmp_path / "sync.pt"))
    assert not writer.busy() and torch.equal(torch.load(tmp_path / "sync.pt")["w"], torch.arange(6.0) + 100)


def test_a_failed_background_write_is_reported_not_hidden(tmp_path):
    import torch

    writer = BackgroundWriter(lambda: False)
    writer.save({"x": torch.ones(2)}, str(tmp_path / "missing-dir" / "x.pt"))
    writer.wait()
    assert writer.failure() is not None and "missing-dir/x.pt" in writer.failure()


@pytest.fixture(scope="module")
def nodrop_model(tiny_model, tmp_path_factory) -> Path:
    from transformers import AutoConfig

    out = tmp_path_factory.mktemp("nodrop") / "model"
    shutil.copytree(tiny_model, out)
    config = AutoConfig.from_pretrained(out)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    config.save_pretrained(out)
    return out


def train(script: list[str], model, data, out: Path, *extra, **env):
    cmd = [
        PYTHON,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        *script,
        "--model_name_or_path",
        str(model),
        "--dataset_name",
        str(data),
        "--output_dir",
        str(out),
        "--report_to",
        "none",
        "--logging_steps",
        "1",
        "--disable_tqdm",
        "true",
        *map(str, FLAGS),
        *map(str, extra),
    ]
    return run(cmd, check=True, **env).stdout


def test_async_checkpoints_are_published_after_their_files_and_resume_like_synchronous_ones(
    nodrop_model, tiny_data, tmp_path
):
    import torch

    from llmft.checkpoint.zero import load_fp32_state_dict

    sync_out, async_out = tmp_path / "sync", tmp_path / "async"
    # every checkpoint takes SAVE_DELAY_S longer to write on rank 0 (a slow filesystem): synchronously, and in the
    # background with --async_save
    sync = train(["-m", "llmft.train"], nodrop_model, tiny_data, sync_out, LLMFT_TEST_SAVE_DELAY_S=str(SAVE_DELAY_S))
    # checkpoint-2's writes are held (every rank) until step 3 has ended: training goes on meanwhile
    held = train(
        [PROBE],
        nodrop_model,
        tiny_data,
        async_out,
        "--async_save",
        LLMFT_PROBE_HOLD_CKPT="2",
        LLMFT_PROBE_RELEASE_STEP="3",
        LLMFT_PROBE_DIR=str(tmp_path / "probe"),
        LLMFT_TEST_SAVE_DELAY_S=str(SAVE_DELAY_S),
    )
    # a save is timed until it is published, a background one from its start: what the job deadline and the collective
    # timeout are given covers the write (the run's last save is synchronous), at least what the synchronous run records
    timed = {
        run: {int(s): (float(t), bool(bg)) for s, t, bg in re.findall(TIMED, out)}
        for run, out in (("sync", sync), ("held", held))
    }
    assert {s: bg for s, (_, bg) in timed["sync"].items()} == {2: False, 4: False, 6: False}, sync
    assert {s: bg for s, (_, bg) in timed["held"].items()} == {2: True, 4: True, 6: False}, held
    assert all(t >= SAVE_DELAY_S for run in timed.values() for t, _ in run.values()), timed
    # the collective timeout (as torch reports it back) follows what the run measured: 1800 s until 5 steps are
    # measured, then the 300 s floor (these steps and saves are short), 1800 s again for the final save
    sized = [line for line in sync.splitlines() if line.startswith("llmft: collective timeout")]
    assert sized == [
        "llmft: collective timeout 1800 s (start-up, nothing measured yet)",
        "llmft: collective timeout 300 s (at least 300 s)",
        "llmft: collective timeout 1800 s (after training)",
    ], sync
    seen = json.loads((tmp_path / "probe" / "held.json").read_text())
    assert seen == {"marker": False, "shards": []}, seen  # at step 3: no marker while the shards are unwritten
    lines = held.splitlines()
    published = lines.index(f"llmft: saved complete checkpoint {async_out / 'checkpoint-2'}")
    assert published > next(i for i, line in enumerate(lines) if line.startswith("llmft: step 3/6 "))
    for step in (2, 4, 6):
        ckpt = async_out / f"checkpoint-{step}"
        marker = json.loads((ckpt / "llmft_complete.json").read_text())
        assert {f"global_step{step}/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)} <= set(
            marker["files"]
        )
        assert not list(ckpt.rglob(".*.partial"))
    assert [(s, loss) for s, _, loss, _ in steps(held)] == [(s, loss) for s, _, loss, _ in steps(sync)]
    ours, theirs = (
        load_fp32_state_dict(async_out / "checkpoint-4" / "global_step4"),
        load_fp32_state_dict(sync_out / "checkpoint-4" / "global_step4"),
    )
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)

    # what the planner counts for the snapshot (llmft.memory.async_save_bytes, the first node = both ranks here) is
    # what the ranks serialise: the checkpoint's shard files
    from llmft.planning.memory import async_save_bytes
    from llmft.planning.model_shape import load_model_config, model_shape

    files = sum(f.stat().st_size for f in (async_out / "checkpoint-4" / "global_step4").iterdir())
    counted = async_save_bytes(model_shape(load_model_config(str(nodrop_model))), 2, "fp32", 2, 2)
    assert 0.97 * files <= counted <= 1.03 * files, (counted, files)

    resumed = tmp_path / "resumed"  # the async run's checkpoint-2 (written while steps 3 went on) resumed
    resumed.mkdir()
    shutil.copytree(async_out / "checkpoint-2", resumed / "checkpoint-2")
    shutil.copy2(async_out / RUN_RECORD, resumed / RUN_RECORD)
    again = train(["-m", "llmft.train"], nodrop_model, tiny_data, resumed, "--async_save")
    assert f"resuming from {resumed / 'checkpoint-2'}" in again
    whole = {s: loss for s, _, loss, _ in steps(sync)}
    after = {s: loss for s, _, loss, _ in steps(again)}
    assert sorted(after) == [3, 4, 5, 6]
    for s in after:
        assert after[s] == pytest.approx(whole[s], abs=LOSS_TOL), (s, after, whole)


def test_the_planner_counts_the_async_snapshot_in_host_ram():
    """8B full fine-tune, bf16, 8 x H100 per node: on one node the snapshot is the whole checkpoint; on two nodes the
    first node holds its ranks' optimizer shards and rank 0's module states; the host column grows by it."""
    from published_shapes import llama_3_1_8b

    from llmft.planning import memory
    from llmft.planning.hardware import GPUS
    from llmft.planning.model_shape import model_shape

    shape = model_shape(llama_3_1_8b())
    for stage in (2, 3):
        assert memory.async_save_bytes(shape, stage, "bf16", 8, 8) == memory.checkpoint_bytes(shape, stage, "bf16")
        two_nodes = memory.async_save_bytes(shape, stage, "bf16", 8, 16)
        assert two_nodes == 6 * shape.trainable + (0 if stage == 3 else 2 * shape.trainable)

    def host(async_save: bool) -> dict:
        job = memory.Job(
            shape,
            gpu=GPUS["H100-80GB"],
            host_ram_gib=1800,
            nnodes=1,
            nproc_per_node=8,
            max_length=2048,
            precision="bf16",
            global_batch=64,
            zero_stages=(3,),
            offloads=("none",),
            async_save=async_save,
        )
        return memory.plan_memory(job).recommended.host

    off, on = host(False), host(True)
    assert off["async_save"] == 0 and on["async_save"] == memory.checkpoint_bytes(shape, 3, "bf16")
    assert on["peak"] - off["peak"] >= on["async_save"] - max(off["saving"], off["final_model"])


def test_a_write_that_raises_anything_fails_its_checkpoint_stops_the_run_and_no_save_waits_forever(tmp_path):
    """A ValueError stands in for a MemoryError or a pickling error: the thread must not die with it unseen."""
    import torch

    from llmft.training.callbacks import checkpoint_callbacks

    def broken_write(path, data):
        raise ValueError("cannot pickle 'generator' object")

    writer = BackgroundWriter(lambda: False, write=broken_write)
    ckpt = tmp_path / "checkpoint-2"
    (ckpt / "global_step2").mkdir(parents=True)
    writer.save({"x": torch.ones(2)}, str(ckpt / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    writer.wait()
    assert not writer.busy() and writer.failure() == (
        f"writing {ckpt}/global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt failed: ValueError: "
        "cannot pickle 'generator' object"
    )
    # the next save's wait returns (the thread is alive and drains its queue, writing nothing more)
    second = threading.Thread(
        target=lambda: (writer.save({"x": torch.ones(2)}, str(tmp_path / "b.pt")), writer.wait())
    )
    second.start()
    second.join(timeout=60)
    assert not second.is_alive() and not (tmp_path / "b.pt").exists()

    # the checkpoint whose write failed is not published, and the run stops with the reason
    Publish, _ = checkpoint_callbacks()
    publish = Publish(zero_stage=2, batch=None)
    publish.writer, publish.pending = writer, ckpt
    args = SimpleNamespace(device="cpu", output_dir=str(tmp_path), process_index=0, world_size=1)
    state, control = (
        SimpleNamespace(global_step=3, is_world_process_zero=True),
        SimpleNamespace(should_training_stop=False),
    )
    publish.on_step_end(args, state, control)
    assert control.should_training_stop and not (ckpt / "llmft_complete.json").exists()
    assert publish.refused == f"{ckpt} not published as complete: {writer.failure()}"


class StandInCudart:
    """torch.cuda.cudart() as far as page-locking goes: cudaHostRegister answers `status`, calls are counted."""

    def __init__(self, status: int):
        self.status, self.registered, self.cleared = status, 0, 0

    def cudaHostRegister(self, address, nbytes, flags):
        self.registered += 1
        return self.status

    def cudaGetLastError(self):
        self.cleared += 1
        return self.status


def test_after_one_failed_page_lock_the_error_is_cleared_and_no_buffer_is_page_locked_again():
    from llmft.training.checkpoint_async_save import PIN_MIN_BYTES, HostSnapshot, page_lock

    assert page_lock(StandInCudart(0), 4096, PIN_MIN_BYTES) is None
    refused = StandInCudart(2)  # cudaErrorMemoryAllocation
    snapshots = HostSnapshot(cudart=lambda: refused)
    _, pinned = snapshots._buffer(PIN_MIN_BYTES, pin=True)
    assert not pinned and refused.registered == 1 and refused.cleared == 1  # CUDA's last error read back, cleared
    assert snapshots.pin_refused == f"page-locking a {PIN_MIN_BYTES}-byte snapshot buffer failed (CUDA error 2)"
    for _ in range(3):  # the rest of the run: pageable buffers, and no more cudaHostRegister calls
        _, pinned = snapshots._buffer(2 * PIN_MIN_BYTES, pin=True)
        assert not pinned
    assert refused.registered == 1 and refused.cleared == 1
    works = HostSnapshot(cudart=lambda: StandInCudart(0))
    assert works._buffer(PIN_MIN_BYTES, pin=True)[1] and works.pin_refused is None

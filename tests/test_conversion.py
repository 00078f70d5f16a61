"""The elastic conversion (ds_to_universal) sized for the node it runs on: workers, memory and time."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmft.checkpoint.run_dir import CheckpointError
from llmft.planning.batch import BatchPlan
from llmft.planning.conversion import GIB, plan_conversion
from llmft.training import elastic

B8 = dict(trainable=8_030_000_000, largest_tensor=525_336_576)  # Llama-3.1-8B: its embedding is the largest tensor


def test_workers_grow_with_the_nodes_memory_and_cpus_and_stop_at_the_storage():
    big = plan_conversion(**B8, saved_world=8, budget_bytes=600 * GIB, cpus=96, io_mb_s=100)
    assert (big.extract_workers, big.merge_workers, big.fits) == (8, 8, True)  # one per saved rank; merge capped
    assert big.peak_bytes <= 600 * GIB and round(big.seconds) == 3854  # 48 bytes per parameter through 100 MB/s
    mid = plan_conversion(**B8, saved_world=8, budget_bytes=60 * GIB, cpus=96, io_mb_s=100)
    assert 1 <= mid.extract_workers < 8 and mid.peak_bytes <= 60 * GIB and mid.fits
    few_cpus = plan_conversion(**B8, saved_world=8, budget_bytes=600 * GIB, cpus=4, io_mb_s=100)
    assert (few_cpus.extract_workers, few_cpus.merge_workers) == (4, 2)
    # 8B written by 2 ranks on a 16 GiB node: one rank's optimizer file (48 GB) does not fit even with one worker.
    small = plan_conversion(**B8, saved_world=2, budget_bytes=16 * GIB, cpus=4, io_mb_s=100)
    assert not small.fits and (small.extract_workers, small.merge_workers) == (1, 1) and small.peak_bytes > 16 * GIB
    lora = plan_conversion(
        trainable=6_800_000, largest_tensor=525_336_576, saved_world=2, budget_bytes=16 * GIB, cpus=4, io_mb_s=100
    )
    assert lora.fits and lora.peak_bytes < 2 * GIB  # only the adapters' optimizer states are converted


def test_a_conversion_that_does_not_fit_this_node_is_refused_before_it_starts(tmp_path, monkeypatch):
    """The first rank sizes the conversion for its node (the job's memory here, MemAvailable, the ranks waiting) and
    refuses, naming the numbers and the ways out, when one worker of each phase does not fit."""
    ckpt = tmp_path / "checkpoint-4"
    (ckpt / "global_step4").mkdir(parents=True)
    resume = elastic.Resume(
        ckpt, saved_world=2, saved_stage=2, saved_batch=None, world=1, stage=2, batch=BatchPlan(1, 2, 4)
    )
    assert resume.universal
    for name in ("SLURM_MEM_PER_CPU", "SLURM_MEM_PER_GPU", "LLMFT_HOST_RAM_GB"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_MEM_PER_NODE", "16384")
    with pytest.raises(CheckpointError) as e:
        elastic.prepare(
            resume, is_first_rank=True, log=lambda m: None, sizing=(B8["trainable"], B8["largest_tensor"], 1)
        )
    message = str(e.value)
    assert message.startswith(f"converting {ckpt} to a universal checkpoint needs about ")
    assert (
        "GiB of host RAM with one worker" in message
        and "(the job may use 16 GiB here: SLURM_MEM_PER_NODE=16384 MB)" in message
    )
    assert message.endswith("resume on 2 ranks, or on a node with more memory (sbatch --mem=0)")
    assert [p.name for p in Path(ckpt).iterdir()] == ["global_step4"]  # nothing was started
    conv = elastic.conversion_workers(resume, 6_800_000, 525_336_576, 1)  # LoRA's states fit
    assert conv.fits and conv.extract_workers >= 1 and conv.budget_bytes <= 16 * GIB

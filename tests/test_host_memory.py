"""Host memory of real ZeRO-3 runs (2 CPU ranks under torchrun, a GPT-2-124M-sized model built from a config):
a checkpoint gathers nothing onto one rank, loading is partitioned, and the node stays within the plan.

The slowest tests in the suite after the Slurm ones: two 2-process runs of a 124M-parameter model (~1-2 min each
on 2 cores). Peak RSS comes from the lines `llmft train` prints (llmft.training.host_memory: ru_maxrss of every rank);
the node's peak from sampling the ranks' proportional set size while they run (node_memory_sampled)."""

from __future__ import annotations

import re
import subprocess
import threading
from pathlib import Path

import pytest
from conftest import REPO, subprocess_env
from test_train import train_cmd

PARAMS = 124_439_808  # GPT-2 124M with its 50257-token vocabulary
MODEL_GIB = PARAMS * 4 / 2**30  # fp32 on CPU: 0.46 GiB


@pytest.fixture(scope="module")
def gpt2_124m(tmp_path_factory):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from llmft.data.synthetic import as_format, make_examples, make_tokenizer, write_jsonl

    out = tmp_path_factory.mktemp("gpt2-124m")
    tok = make_tokenizer()
    torch.manual_seed(0)
    config = GPT2Config(bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = GPT2LMHeadModel(config)
    assert sum(p.numel() for p in model.parameters()) == PARAMS
    model.save_pretrained(out / "model")
    tok.save_pretrained(out / "model")
    return out / "model", write_jsonl(as_format(make_examples(64), "prompt_completion"), out / "data.jsonl")


def host_lines(stdout: str):
    """(before loading, peak after loading) per rank, and the peak per rank at the end, in GiB."""
    loading = [
        (float(b), float(p))
        for b, p in re.findall(r"rank \d+ ([\d.]+) GiB before loading, ([\d.]+) GiB peak after loading", stdout)
    ]
    end = re.search(r"llmft: host memory peak: (.*?);", stdout).group(1)
    return loading, [float(x) for x in re.findall(r"rank \d+ ([\d.]+) GiB", end)]


SAMPLE_INTERVAL_S = 0.05


def _descendants(root: int) -> list[int]:
    """Every process below `root` (torchrun's ranks and their workers), not `root` itself."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def _pss_bytes(pid: int) -> int:
    """A process's proportional set size: its private pages plus its share of pages it shares with others (the
    libraries every rank maps, counted once across the node, where the sum of RSS counts them once per rank)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass  # the process ended between the listing and the read
    return 0


def node_memory_sampled(cmd: list[str], **env: str) -> tuple[subprocess.CompletedProcess, float]:
    """Run `cmd` (torchrun) as conftest.run does, and the node's peak memory in GiB: the ranks' summed proportional
    set size, sampled every SAMPLE_INTERVAL_S. The node's true peak lies between this and the sum of the ranks'
    ru_maxrss peaks (those peaks need not coincide, and RSS counts shared pages once per rank); a rise shorter than
    one interval can fall between two samples, so the plan must cover at least this figure."""
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=subprocess_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    peak, done = [0], threading.Event()

    def sample():
        while not done.wait(SAMPLE_INTERVAL_S):
            peak[0] = max(peak[0], sum(_pss_bytes(pid) for pid in _descendants(proc.pid)))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        done.set()
        sampler.join()
    if proc.returncode != 0:
        raise AssertionError(f"{cmd} exited {proc.returncode}\nstdout:\n{stdout[-5000:]}\nstderr:\n{stderr[-8000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr), peak[0] / 2**30


def test_zero3_checkpoints_gather_nothing_loading_is_partitioned_and_the_node_stays_within_the_plan(
    gpt2_124m, tmp_path
):
    model, data = gpt2_124m
    flags = (
        "--zero_stage",
        3,
        "--max_steps",
        2,
        "--global_batch_size",
        2,
        "--per_device_train_batch_size",
        1,
        "--max_length",
        64,
    )
    saving, saving_node = node_memory_sampled(
        train_cmd(model, data, tmp_path / "saving", *flags, "--save_steps", 1, "--save_consolidated")
    )
    # TRANSFORMERS_VERBOSITY: the model loads inside SFTTrainer's constructor, before HF applies --log_level.
    plain, plain_node = node_memory_sampled(
        train_cmd(model, data, tmp_path / "plain", *flags, "--save_strategy", "no"), TRANSFORMERS_VERBOSITY="info"
    )
    _, with_ckpt = host_lines(saving.stdout)
    loading, without = host_lines(plain.stdout)

    # Checkpoints every step add well under the model's size to the largest rank's peak (gathering the 16-bit
    # model onto rank 0, as before, added ~0.9x the model's size here). Two separate runs' peaks differ by allocator
    # noise too: fresh-clone CI runs measured up to 0.26x (3.00 against 2.88 GiB, 2026-11-28), so the bound sits
    # halfway between that and the gather.
    assert max(with_ckpt) - max(without) < 0.55 * MODEL_GIB, (with_ckpt, without)
    tag = tmp_path / "saving" / "checkpoint-1" / "global_step1"
    assert sorted(p.name for p in tag.glob("zero_pp_rank_*_model_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_model_states.pt",
        "zero_pp_rank_1_mp_rank_00_model_states.pt",
    ]
    assert not (tmp_path / "saving" / "checkpoint-1" / "model.safetensors").exists()
    assert (
        "Saving the full checkpoint instead" not in saving.stdout + saving.stderr
    )  # HF's fallback: shards written twice

    # --save_consolidated: the gathered model at the end, equal to the last checkpoint's weights.
    import torch
    from safetensors.torch import load_file

    from llmft.checkpoint.zero import load_fp32_state_dict

    final = load_file(tmp_path / "saving" / "model.safetensors")
    shards = load_fp32_state_dict(tmp_path / "saving" / "checkpoint-2" / "global_step2")
    assert sum(v.numel() for v in final.values()) == PARAMS
    assert all(torch.equal(v, shards[k]) for k, v in final.items())

    # Loading takes transformers' partitioned path (zero.Init), so no rank builds the whole model: a rank's growth
    # is its half, plus the one layer DeepSpeed gathers at a time while copying it in (twice: the all-gather
    # buffer and the parameter; GPT-2's embedding is a third of the model, so 0.6x here) and allocator slack.
    # Measured 1.3-1.45x (rank 0's peak RSS also holds the memory-mapped file's pages); a converted full copy on
    # top would be 2.1x or more.
    assert "activating zero.init() for this model" in plain.stdout + plain.stderr
    assert len(loading) == 2
    # Rank 0 reads every tensor from the memory-mapped file (transformers' rank-0 reader under zero.Init), so its
    # RSS also counts the file's pages (one model size, page cache, not an allocation): measured 2.2x on rank 0 in
    # a fresh-clone CI run, 1.4x on rank 1.
    for rank, (before, after) in enumerate(loading):
        file_pages = MODEL_GIB if rank == 0 else 0.0
        assert after - before < 1.75 * MODEL_GIB + file_pages, loading

    # The plan for this very run (CPU processes: their tensors are host memory) covers the node's peak.
    from llmft.planning import memory
    from llmft.planning.ds_config import load_config, template_path
    from llmft.planning.model_shape import load_model_config, model_shape

    shape = model_shape(load_model_config(str(model)))
    job = memory.Job(
        shape,
        None,
        1000.0,
        1,
        2,
        64,
        "fp32",
        global_batch=2,
        micro_batch=1,
        zero_config={3: load_config(template_path(3))["zero_optimization"]},
    )
    planned = memory.estimate(job, memory.Setting(3, "none", 1, 1, True)).host["peak"] / 2**30  # TRL: checkpointing on
    # The node's sampled peak, not the sum of the ranks' peaks: that sum is only an upper bound of the node (the
    # ranks' peaks need not coincide, and RSS counts each library the ranks share once per rank). A fresh-clone CI run
    # measured 6.10 GiB of summed peaks against a 6.06 GiB plan, a failure of the bound, not of the plan.
    for node, ranks in ((plain_node, without), (saving_node, with_ckpt)):
        assert node > 0.5 * sum(ranks), (node, ranks)  # the sampler saw the ranks
        assert node <= planned, (plain_node, saving_node, planned)

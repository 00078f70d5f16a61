"""--sequence_parallel N (DeepSpeed's Ulysses through accelerate): the layout and batch math, each refusal, and real
2-rank gloo runs against a 1-rank run on the same samples.

On CPU the sequence-parallel group must be the whole world (N = world size): with several data-parallel groups, the
backward of the loss's all-gather (torch.distributed.nn.functional.all_gather) falls back on gloo to a scatter that
names a group rank as a global one ("Global rank 0 is not part of group"), so those layouts are planned and refused
in tests here but trained only on GPUs (NCCL has the all-to-all).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import PYTHON, run

from llmft.checkpoint.run_dir import RUN_RECORD
from llmft.planning import sequence_parallel as sp
from llmft.planning.run_plan import PlanError, make_plan
from llmft.planning.world import World
from llmft.training.ulysses import scale_gradient

LOGGED = re.compile(r"\{'loss': '([\d.]+)', 'grad_norm': '([\d.]+)'")
TOTAL, EVERY = 4, 2


def test_the_start_lines_say_the_layout_and_the_global_batch_counts_data_parallel_ranks():
    plan = make_plan(micro_batch=2, global_batch=8, zero_stage=2, world=World(2, 4, "arguments"), sequence_parallel=4)
    lines = plan.lines()
    assert "llmft plan: 8 ranks = 2 data-parallel x 4 sequence-parallel" in lines
    assert "llmft plan: global batch 8 = micro-batch 2 x accumulation 2 x data-parallel size 2" in lines
    assert plan.batch.grad_accum == 2 and plan.batch.world_size == 2
    # without it, the same numbers over all 8 ranks
    assert (
        make_plan(micro_batch=2, global_batch=16, zero_stage=2, world=World(2, 4, "arguments")).batch.grad_accum == 1
    )
    with pytest.raises(PlanError, match=r"^--sequence_parallel 3 does not divide the world size 8: .* use "):
        make_plan(micro_batch=2, global_batch=8, zero_stage=2, world=World(2, 4, "arguments"), sequence_parallel=3)
    with pytest.raises(PlanError, match="global batch 6 is not divisible by micro-batch 2 x world size 2"):
        make_plan(micro_batch=2, global_batch=6, zero_stage=2, world=World(2, 4, "arguments"), sequence_parallel=4)


@pytest.mark.parametrize(
    "check, message",
    [
        (lambda: sp.check_model(2, "gpt2", None, None), "needs a model whose config names its attention and KV heads"),
        (
            lambda: sp.check_model(4, "llama", 6, 2),
            "does not divide the model's 6 attention heads: use --sequence_parallel 2",
        ),
        (lambda: sp.check_model(4, "llama", 12, 6), "and the model's 6 KV heads divide neither way"),
        (lambda: sp.check_attention(2, "eager", False, False), "use --attn_implementation sdpa"),
        (
            lambda: sp.check_attention(2, "sdpa", True, False),
            "--packing with --sequence_parallel and sdpa attention would",
        ),
        (lambda: sp.check_attention(2, "sdpa", False, True), "--padding_free with --sequence_parallel and sdpa"),
        (lambda: sp.pad_to_multiple_of(4, 6, True, 1024), "use --pad_to_multiple_of 12, or leave it out"),
        (lambda: sp.pad_to_multiple_of(2, None, False, None), "give --max_length"),
        (lambda: sp.plan_layout(4, 0), "must be a positive integer"),
    ],
)
def test_each_constraint_is_refused_in_one_line_with_the_fix(check, message):
    with pytest.raises(sp.SequenceParallelError) as e:
        check()
    assert message in str(e.value) and "\n" not in str(e.value)


def test_what_is_allowed():
    sp.check_model(4, "llama", 32, 8)  # Llama-3.1-8B's heads over 4
    sp.check_model(16, "llama", 32, 8)  # 8 KV heads replicated over 16
    sp.check_attention(4, "flash_attention_2", True, False)  # the kernel keeps packed samples apart
    sp.check_attention(1, "eager", True, True)  # no sequence parallelism: nothing to check
    assert sp.pad_to_multiple_of(4, None, True, 4096) == 4  # NCCL gathers rows of other lengths
    assert sp.pad_to_multiple_of(4, 64, True, 4096) == 64
    assert sp.pad_to_multiple_of(2, None, False, 255) == 256  # gloo: one shape on every rank
    assert sp.pad_to_multiple_of(1, None, False, None) is None


def test_the_gradient_correction_follows_the_zero_stage():
    assert [sp.gradient_scale(stage, 4) for stage in (0, 1, 2, 3)] == [0.25, 0.25, 0.25, 1.0]
    assert sp.gradient_scale(2, 1) == 1.0
    assert sp.gradient_scale(2, 4, reduce_scatter=False) == 0.25  # ZeRO-1/2 sum over the group either way
    with pytest.raises(sp.SequenceParallelError, match="^--sequence_parallel under ZeRO-3 with reduce_scatter: false"):
        sp.gradient_scale(3, 4, reduce_scatter=False)
    assert sp.gradient_scale(3, 1, reduce_scatter=False) == 1.0
    x = torch.tensor(3.0, requires_grad=True)
    loss = scale_gradient(x * x, 0.5)
    loss.backward()
    assert loss.item() == 9.0 and x.grad.item() == 3.0  # the value logged is the loss; its gradient is halved


def test_zero_3_without_reduce_scatter_is_refused_in_one_line_before_the_model_loads(llama, tiny_data, tmp_path):
    """ZeRO-3 with reduce_scatter: false sums some buckets over the sequence group and averages others (DeepSpeed's
    stage3.py; its grad norm was 1.49x the 1-rank run's on this model): `llmft train --nproc_per_node 2` refuses it in
    one line, exit code 2, before any DeepSpeed engine starts."""
    config = json.loads((Path(__file__).resolve().parents[1] / "ds_configs" / "zero3.json").read_text())
    config["zero_optimization"]["reduce_scatter"] = False
    (tmp_path / "z3.json").write_text(json.dumps(config))
    proc = run(
        [PYTHON, "-m", "llmft.cli", "train", "--nproc_per_node", "2", "--model_name_or_path", str(llama)]
        + ["--dataset_name", str(tiny_data), "--output_dir", str(tmp_path / "out"), "--report_to", "none"]
        + ["--deepspeed", str(tmp_path / "z3.json"), "--sequence_parallel", "2", "--max_length", "64"]
        + ["--global_batch_size", "4", "--per_device_train_batch_size", "2", "--max_steps", "1"],
        timeout=300,
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert lines[-1] == (
        "llmft train: error: --sequence_parallel under ZeRO-3 with reduce_scatter: false in the DeepSpeed config "
        "would scale some gradients N times too large (DeepSpeed sums small buckets over the sequence group and "
        "averages large parameters): remove reduce_scatter: false from the config, or use --zero_stage 2"
    ), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "DeepSpeed config written" not in proc.stdout


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A tiny Llama-style model (4 heads, 2 KV heads; GPT-2's config has no KV heads for Ulysses)."""
    from llmft.data.synthetic import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("llama") / "model", arch="llama", n_head=4, n_kv_head=2)


def train(model, data, out: Path, nproc: int, *extra, check=True):
    launcher = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)] if nproc > 1 else [PYTHON]
    return run(
        launcher
        + ["-m", "llmft.train", "--model_name_or_path", str(model), "--dataset_name", str(data)]
        + ["--output_dir", str(out), "--report_to", "none", "--logging_steps", "1", "--disable_tqdm", "true"]
        + ["--zero_stage", "2", "--max_steps", str(TOTAL), "--save_steps", str(EVERY), "--save_total_limit", "0"]
        + ["--global_batch_size", "4", "--per_device_train_batch_size", "2", "--max_length", "64"]
        + list(extra),
        check=check,
        timeout=600,
    )


def logged(stdout: str) -> list[tuple[float, float]]:
    """(loss, grad norm) of each logged step, in order."""
    return [(float(loss), float(norm)) for loss, norm in LOGGED.findall(stdout)]


@pytest.fixture(scope="module")
def runs(llama, tiny_data, tmp_path_factory):
    """The 1-rank reference and the 2-rank --sequence_parallel 2 run (ZeRO-2), same samples, global batch, seed; and
    the same 2-rank run under ZeRO-3 with --tiled_mlp, its rows 256 tokens (CPU runs pad to --max_length), 128 a
    rank: 2 shards of the tiny model's hidden 64 (the samples are shorter than 64 tokens: no more is trained)."""
    root = tmp_path_factory.mktemp("sp")
    one = train(llama, tiny_data, root / "one", 1, "--save_strategy", "no").stdout
    two = train(llama, tiny_data, root / "two", 2, "--sequence_parallel", "2").stdout
    tiled = train(
        llama,
        tiny_data,
        root / "tiled",
        2,
        "--sequence_parallel",
        "2",
        "--save_strategy",
        "no",
        "--zero_stage",
        "3",
        "--tiled_mlp",
        "--max_length",
        "256",
    ).stdout
    return root, one, two, tiled


def test_two_sequence_parallel_ranks_train_as_one_rank_does(runs):
    """The first losses and gradient norms of a 2-rank run with --sequence_parallel 2 match a 1-rank run on the same
    data within 2%. The norms are the ZeRO-2 gradient correction's evidence: without it they come out 2x."""
    _, one, two, _ = runs
    assert "llmft plan: 2 ranks = 1 data-parallel x 2 sequence-parallel" in two
    assert "global batch 4 = micro-batch 2 x accumulation 2 x data-parallel size 1" in two
    assert "global batch 4 = micro-batch 2 x accumulation 2 x world size 1" in one
    one, two = logged(one), logged(two)
    assert len(one) == len(two) == TOTAL
    for s, ((loss1, norm1), (loss2, norm2)) in enumerate(zip(one, two), start=1):
        assert loss2 == pytest.approx(loss1, rel=0.02), (s, one, two)
        assert norm2 == pytest.approx(norm1, rel=0.02), (s, one, two)


def test_zero_3_with_the_tiled_mlp_trains_as_one_rank_does(runs):
    """Any ZeRO stage, with DeepSpeed's TiledMLP in 2 shards: under ZeRO-3 each shard gathers the MLP's weights, so
    the ranks agree on the shard count; the losses and gradient norms match the 1-rank run within 2%."""
    _, one, _, tiled = runs
    assert "llmft: tiled MLP: DeepSpeed's TiledMLP on 2 MLPs (one shard per 64 tokens a rank)" in tiled
    assert "llmft plan: ZeRO stage 3" in tiled
    one, tiled = logged(one), logged(tiled)
    assert len(tiled) == TOTAL
    for s, ((loss1, norm1), (loss2, norm2)) in enumerate(zip(one, tiled), start=1):
        assert (loss2, norm2) == pytest.approx((loss1, norm1), rel=0.02), (s, one, tiled)


def test_a_sequence_parallel_run_resumes_from_its_checkpoint_and_infer_and_eval_read_it(runs, llama, tiny_data):
    """checkpoint-2 of the 2-rank run, resumed by the same layout, trains steps 3-4 as the uninterrupted run did; the
    same checkpoint resumed without --sequence_parallel is refused in one line; llmft infer and llmft eval read the
    final one."""
    root, _, two, _ = runs
    src = root / "two"
    assert json.loads((src / RUN_RECORD).read_text())["sequence_parallel"] == 2
    dest = root / "resumed"
    dest.mkdir()
    shutil.copytree(src / f"checkpoint-{EVERY}", dest / f"checkpoint-{EVERY}")
    shutil.copy2(src / RUN_RECORD, dest / RUN_RECORD)
    refused = train(llama, tiny_data, dest, 1, check=False)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    errors = [line for line in refused.stdout.splitlines() + refused.stderr.splitlines() if "error:" in line]
    assert errors == [
        f"llmft train: error: {dest / f'checkpoint-{EVERY}'} was trained with --sequence_parallel 2; resume with "
        "--sequence_parallel 2 (changing N on a resume is not supported), or start a new --output_dir"
    ], refused.stdout + refused.stderr
    assert "Traceback" not in refused.stderr
    resumed = train(llama, tiny_data, dest, 2, "--sequence_parallel", "2").stdout
    assert f"llmft: resuming from {dest.resolve()}/checkpoint-{EVERY}\n" in resumed, resumed
    after, before = logged(resumed), logged(two)[EVERY:]
    assert len(after) == TOTAL - EVERY
    for (loss1, norm1), (loss2, norm2) in zip(before, after):
        assert (loss2, norm2) == pytest.approx((loss1, norm1), rel=0.02), (before, after)
    tag = dest / f"checkpoint-{TOTAL}" / f"global_step{TOTAL}"
    proc = run(
        [PYTHON, "-m", "llmft.infer", str(tag), "--prompt", "Add 2 and 3.", "--max_new_tokens", "4"], check=True
    )
    assert f"llmft infer: loaded {tag} (ZeRO-2, 2 ranks" in proc.stdout + proc.stderr
    # llmft eval reads the run like any other: the harness's results for its last checkpoint, in the run
    from test_eval import eval_args

    task_data = eval_args([], root).task_data
    proc = run(
        [PYTHON, "-m", "llmft.eval", str(dest), "--tasks", "gsm8k", "--num_fewshot", "2", "--limit", "2"]
        + ["--gen_kwargs", "max_gen_toks=4", *[f for t in task_data for f in ("--task_data", t)]],
        check=True,
        timeout=600,
    )
    [result] = (dest / "eval").glob(f"results-step{TOTAL}-*.json")
    assert json.loads(result.read_text())["llmft"]["checkpoint"].endswith(f"checkpoint-{TOTAL}/global_step{TOTAL}")
    assert f"llmft eval: gsm8k (2-shot, n=2) step {TOTAL}: exact_match,strict-match " in proc.stderr


TESTS = Path(__file__).resolve().parent
PROBE = str(TESTS / "train_probe.py")
SAMPLES, PER_EPOCH, STOPPED_AT = 8, 4, 5  # global batch 2: 4 steps an epoch; step 5 is one step into epoch 2


def trained(probe_dir: Path) -> list[tuple[int, tuple]]:
    """(step, sample) for each sample rank 0 trained, in order; a sample is named by its first 8 token ids."""
    lines = [json.loads(line) for line in (probe_dir / "trained.jsonl").read_text().splitlines()]
    return [(line["step"], tuple(row)) for line in lines for row in line["rows"]]


def test_a_two_epoch_sequence_parallel_run_stopped_in_epoch_2_resumes_each_sample_once_an_epoch_in_order(
    llama, tmp_path
):
    """2 epochs of 8 samples (global batch 2, one micro-batch a step). An uninterrupted 2-rank --sequence_parallel 2
    run trains every sample once an epoch, epoch 2 in another order than epoch 1 (the Trainer's per-epoch reshuffle),
    in the order a 1-rank run without sequence parallelism trains them, all 8 steps (DeepSpeed's adapter alone trained
    7: epoch 2 lost a step). The same run stopped at step 5, one step into epoch 2 (every rank held there until the
    stop file appears: LLMFT_TEST_HOLD_AT_STEP), saves checkpoint-5 and, run again, resumes from it (the skip ends
    inside a gathered batch): together the two train the uninterrupted run's samples in its order, with its losses
    (within 2%; DeepSpeed's adapter alone resumed in epoch 1's order)."""
    import subprocess
    import time

    from conftest import subprocess_env

    from llmft.data.synthetic import as_format, make_examples, write_jsonl

    examples = [{**e, "prompt": f"Item {i:02d}: {e['prompt']}"} for i, e in enumerate(make_examples(SAMPLES))]
    data = write_jsonl(as_format(examples, "prompt_completion"), tmp_path / "train.jsonl")

    def command(out: Path, nproc: int, *extra: str) -> list[str]:
        launcher = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)] if nproc > 1 else [PYTHON]
        return (
            launcher
            + [PROBE, "--model_name_or_path", str(llama), "--dataset_name", str(data), "--output_dir", str(out)]
            + ["--report_to", "none", "--logging_steps", "1", "--disable_tqdm", "true", "--zero_stage", "2"]
            + ["--num_train_epochs", "2", "--global_batch_size", "2", "--per_device_train_batch_size", "2"]
            + ["--max_length", "64", *extra]
        )

    probe = {"LLMFT_PROBE_MOMENTS": "0", "LLMFT_PROBE_TRAINED": "1"}
    run(command(tmp_path / "one", 1, "--save_strategy", "no"), check=True, timeout=600, **probe,
        LLMFT_PROBE_DIR=str(tmp_path / "one" / "probe"))  # fmt: skip
    reference = trained(tmp_path / "one" / "probe")
    whole = tmp_path / "whole"
    uninterrupted = run(command(whole, 2, "--sequence_parallel", "2", "--save_strategy", "no"), check=True,
                        timeout=600, **probe, LLMFT_PROBE_DIR=str(whole / "probe")).stdout  # fmt: skip
    sp_order = trained(whole / "probe")
    assert len(reference) == len(sp_order) == 2 * SAMPLES, (reference, sp_order)
    first, second = [s for _, s in sp_order[:SAMPLES]], [s for _, s in sp_order[SAMPLES:]]
    assert len(set(first)) == len(set(second)) == SAMPLES and set(first) == set(second)  # each sample once an epoch
    assert first != second  # reshuffled
    assert sp_order == reference  # the order a run without sequence parallelism trains them in, step by step
    out, stop = tmp_path / "sp", tmp_path / "stop"
    sp = command(out, 2, "--sequence_parallel", "2", "--save_strategy", "no", "--stop_file", str(stop))
    env = subprocess_env(**probe, LLMFT_PROBE_DIR=str(out / "probe"), LLMFT_TEST_HOLD_AT_STEP=str(STOPPED_AT))
    trained_file = out / "probe" / "trained.jsonl"
    with open(tmp_path / "stopped.log", "w") as log:
        proc = subprocess.Popen(sp, cwd=TESTS.parent, env=env, stdout=log, stderr=subprocess.STDOUT)
        until = time.monotonic() + 600  # a hang guard: the ranks wait at step 5 for the stop however slow the machine
        while proc.poll() is None and time.monotonic() < until:
            if trained_file.exists() and f'"step": {STOPPED_AT - 1},' in trained_file.read_text():
                stop.touch()  # rank 0 is training step 5: every vote before it is past, and the ranks hold at its end
                break
            time.sleep(0.5)
        rc = proc.wait(timeout=600)
    assert rc == 0 and stop.exists(), (tmp_path / "stopped.log").read_text()[-5000:]
    stopped = (tmp_path / "stopped.log").read_text()
    assert f"stop requested; saved checkpoint-{STOPPED_AT}" in stopped, stopped[-5000:]
    stop.unlink()
    resumed = run(sp, check=True, timeout=600, **probe, LLMFT_PROBE_DIR=str(out / "probe")).stdout
    assert f"llmft: resuming from {out.resolve()}/checkpoint-{STOPPED_AT}\n" in resumed, resumed
    both = trained(out / "probe")  # the stopped run's samples, then the resumed run's
    assert both == sp_order, (both, sp_order)
    losses, expected = logged(stopped) + logged(resumed), logged(uninterrupted)
    assert len(losses) == len(expected) == 2 * PER_EPOCH, (losses, expected)
    for (loss1, norm1), (loss2, norm2) in zip(expected, losses):
        assert (loss2, norm2) == pytest.approx((loss1, norm1), rel=0.02), (expected, losses)

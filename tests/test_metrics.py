"""The throughput accounting behind the step line and run_summary.json: FLOPs per token (full fine-tuning, LoRA,
ZeRO-3-partitioned weights), token counts of padded and packed batches, MFU against the GPU table, start-up phases."""

from __future__ import annotations

import re
import time

import pytest
import torch
from datasets import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from trl.data_utils import pack_dataset
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from llmft.planning.hardware import GPU, GPUS
from llmft.training.metrics import (
    FlopShape,
    StartupClock,
    batch_counts,
    flop_shape,
    format_step_line,
    mfu,
    training_flops,
)

STEP_LINE = re.compile(
    r"llmft: step (\d+)/(\d+) loss ([\d.]+) lr ([\d.e+-]+) tokens/s (\d+) padded/s (\d+) tflops/gpu ([\d.e+-]+) "
    r"mfu (n/a|[\d.]+%) gpu_mem (n/a|[\d.]+GiB) data ([\d.]+)%( save [\d.]+s)?( eval [\d.]+s)?$"
)


def gpt2():
    return GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=32, n_layer=3, n_head=4, n_positions=64))


def llama():
    config = LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def test_flops_per_token_full_finetuning_is_6n_plus_attention():
    shape = FlopShape(matmul_params=1_000, trainable_params=1_000, n_layers=2, attn_width=8)
    # two samples of 3 and 5 tokens: 6N per token, 12*L*A*s per token of a sample of length s
    assert training_flops(shape, tokens=8, sum_sq_lengths=3**2 + 5**2) == 6 * 1_000 * 8 + 12 * 2 * 8 * 34
    lora = FlopShape(matmul_params=1_000, trainable_params=10, n_layers=2, attn_width=8)
    # frozen weights: forward and activation gradients (4N); adapters: weight gradients (2N_trainable)
    assert training_flops(lora, tokens=8, sum_sq_lengths=34) == (4 * 1_000 + 2 * 10) * 8 + 12 * 2 * 8 * 34


def test_model_shape_counts_matmul_parameters_once():
    model = gpt2()  # tied: the token embedding is also the LM head (a matmul); position embeddings are a look-up
    total = sum(p.numel() for p in model.parameters())
    shape = flop_shape(model)
    assert shape.matmul_params == total - model.transformer.wpe.weight.numel()
    assert shape.trainable_params == shape.matmul_params
    assert (shape.n_layers, shape.attn_width) == (3, 32)

    model = llama()  # untied: the input embedding is a look-up, lm_head a matmul; head_dim 16 x 4 heads != hidden 32
    total = sum(p.numel() for p in model.parameters())
    shape = flop_shape(model)
    assert shape.matmul_params == total - model.model.embed_tokens.weight.numel()
    assert (shape.n_layers, shape.attn_width) == (2, 64)


def test_model_shape_under_lora_and_zero3_partitioning():
    from peft import LoraConfig, get_peft_model

    base = llama()
    n = flop_shape(base).matmul_params
    model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    adapters = sum(p.numel() for name, p in model.named_parameters() if "lora_" in name)
    shape = flop_shape(model)
    assert adapters > 0 and shape.trainable_params == adapters
    assert shape.matmul_params == n + adapters

    # ZeRO-3 leaves each rank an empty tensor and records the real size in ds_numel
    for p in base.parameters():
        p.ds_numel = p.numel()
        p.data = torch.empty(0)
    assert flop_shape(model) == shape


def test_batch_counts_padded_and_packed():
    seqs = [[5] * 3, [6] * 7, [7] * 2]
    padded = DataCollatorForLanguageModeling(pad_token_id=0)([{"input_ids": s} for s in seqs])
    assert batch_counts(padded).tolist() == [12, 21, 9 + 49 + 4]

    rows = pack_dataset(Dataset.from_dict({"input_ids": seqs}), seq_length=12, strategy="bfd")
    packed = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)([rows[0]])
    assert batch_counts(packed).tolist() == [12, 12, 9 + 49 + 4]
    tail = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True, pad_to_multiple_of=16)([rows[0]])
    assert tail["input_ids"].numel() == 16
    assert batch_counts(tail).tolist() == [12, 16, 9 + 49 + 4]
    no_cu = {k: v for k, v in packed.items() if not k.startswith("cu_seq_lens")}
    assert batch_counts(no_cu).tolist() == [12, 12, 9 + 49 + 4]
    no_cu_tail = {k: v for k, v in tail.items() if not k.startswith("cu_seq_lens")}  # lengths from position_ids alone
    assert batch_counts(no_cu_tail).tolist() == [12, 16, 9 + 49 + 4]


def test_mfu_only_against_a_known_peak():
    assert mfu(156.0, GPUS["A100-80GB"]) == pytest.approx(0.5)
    assert mfu(60.5, GPUS["L4"]) == pytest.approx(0.5)
    assert mfu(494.5, GPUS["H100-80GB"]) == pytest.approx(0.5)
    assert mfu(10.0, GPU("NVIDIA RTX 9999", 48.0, (12, 0), None)) is None  # unknown GPU: no guess
    assert mfu(10.0, None) is None  # CPU


def test_step_line_keeps_the_parsed_prefix():
    rates = {
        "tokens_per_second": 3623.4,
        "padded_tokens_per_second": 5120.0,
        "tflops_per_gpu": 121.37,
        "mfu": 0.3889,
        "peak_gpu_memory_gib": 61.23,
        "data_wait_share": 0.004,
    }
    line = format_step_line(40, 128, 1.37861, 2.44e-3, rates)
    assert line == (
        "llmft: step 40/128 loss 1.3786 lr 2.44e-03 tokens/s 3623 padded/s 5120 tflops/gpu 121.4 mfu 38.9% "
        "gpu_mem 61.2GiB data 0.4%"
    )
    assert STEP_LINE.match(line)
    cpu = format_step_line(1, 2, 2.0, 1e-3, {**rates, "mfu": None, "peak_gpu_memory_gib": None})
    assert "mfu n/a gpu_mem n/a" in cpu and STEP_LINE.match(cpu)
    assert re.match(r"llmft: step (\d+)/\d+ loss", line)  # tests/slurm_cluster.py step_lines
    saved = format_step_line(3, 4, 2.0, 1e-3, {**rates, "save_seconds": 12.34, "eval_seconds": 0.0})
    assert saved.endswith("data 0.4% save 12.3s") and STEP_LINE.match(saved)  # only what happened in the interval
    both = format_step_line(3, 4, 2.0, 1e-3, {**rates, "save_seconds": 1.0, "eval_seconds": 4.56})
    assert both.endswith("save 1.0s eval 4.6s") and STEP_LINE.match(both)


def test_startup_clock_nested_phases_do_not_double_count():
    clock = StartupClock(start=time.time())
    with clock.phase("data"):
        time.sleep(0.05)
        with clock.phase("model_load"):
            time.sleep(0.1)
        time.sleep(0.05)
    assert clock.seconds["model_load"] == pytest.approx(0.1, abs=0.04)
    assert clock.seconds["data"] == pytest.approx(0.1, abs=0.04)
    assert clock.elapsed() == pytest.approx(sum(clock.seconds.values()), abs=0.04)


def test_summary_rates_start_after_torch_compile_stops_compiling(capsys):
    """A compiled run compiles at its first step and again when batch shapes change; run_summary.json's rates must be
    the steady state after the last compilation (seen at a logging step, agreed over ranks), not an average over it."""
    from types import SimpleNamespace

    from llmft.training.metrics import Meter, _callback_class

    compiled = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)

    def run(compile_at: set[int]):
        meter = Meter(FlopShape(1000, 1000, 1, 8), None, StartupClock(start=time.time()), 1)
        callback = _callback_class()(meter)
        state = SimpleNamespace(global_step=0, max_steps=12, is_world_process_zero=True, log_history=[])
        callback.on_train_begin(None, state, None)
        for step in range(1, 13):
            next(meter.timed(iter([{"input_ids": torch.ones(2, 5, dtype=torch.long)}])))  # 10 tokens a step
            if step in compile_at:
                compiled(torch.ones(100 + step))  # a shape not seen before: torch.compile compiles a new graph
            state.global_step = step
            callback.on_step_end(None, state, None)
            if step % 2 == 0:
                callback.on_log(None, state, None, logs={"loss": 1.0})
        callback.on_train_end(None, state, None)
        return meter

    meter = run(compile_at={1, 3})
    t = meter.totals
    assert meter.steady_from == 4 and t["first"]["tokens"] == 40  # the logging step after the compile at step 3
    expected = (t["end"]["tokens"] - t["first"]["tokens"]) / (t["end"]["time"] - t["first"]["time"])
    assert meter.summary(None)["tokens_per_second"] == pytest.approx(expected, rel=1e-6)
    assert (
        "run_summary.json rates are over steps 5-12 (torch.compile compiled until step 4)" in capsys.readouterr().out
    )

    meter = run(
        compile_at={1}
    )  # compiled at the first step only: the steady state starts after it, as without compile
    assert meter.steady_from == 1 and meter.totals["first"]["tokens"] == 10
    assert "rates are over steps" not in capsys.readouterr().out


def test_rates_leave_out_saving_and_evaluating_and_report_them_on_their_own(monkeypatch, capsys):
    """A run that saves and evaluates at every step reports the tokens/s of a run that does neither; the time spent
    saving and evaluating is in the step line of the interval it happened in, W&B's logs and run_summary.json.
    The clock is the meter's own (time.time), advanced by the simulated work: no sleeping, no timing noise."""
    from types import SimpleNamespace

    from llmft.training import metrics
    from llmft.training.metrics import Meter, _callback_class

    now = [1000.0]
    monkeypatch.setattr(metrics.time, "time", lambda: now[0])

    def run(save_every_step: bool):
        meter = Meter(FlopShape(1000, 1000, 1, 8), None, StartupClock(start=now[0]), 1)
        callback = _callback_class()(meter)
        state = SimpleNamespace(global_step=0, max_steps=6, is_world_process_zero=True, log_history=[])
        callback.on_train_begin(None, state, None)
        logs = []
        for step in range(1, 7):
            next(meter.timed(iter([{"input_ids": torch.ones(2, 5, dtype=torch.long)}])))  # 10 tokens
            now[0] += 0.5  # the step's forward, backward and optimizer step
            state.global_step = step
            callback.on_step_end(None, state, None)
            logs.append({"loss": 1.0})
            callback.on_log(None, state, None, logs=logs[-1])
            if save_every_step:
                with meter.outside_training("eval"):
                    now[0] += 2.0
                with meter.outside_training("save"), meter.outside_training("save"):  # nested: counted once
                    now[0] += 30.0
        callback.on_train_end(None, state, None)
        with meter.outside_training("save"):  # the final model, saved after training ended
            now[0] += 7.0
        return meter.summary(None), logs

    plain, plain_logs = run(save_every_step=False)
    saving, saving_logs = run(save_every_step=True)
    assert plain["tokens_per_second"] == saving["tokens_per_second"] == 20.0  # 10 tokens per 0.5 s
    assert plain["train_seconds"] == saving["train_seconds"] == 3.0
    assert (plain["save_seconds"], plain["eval_seconds"]) == (7.0, 0.0)
    assert (saving["save_seconds"], saving["eval_seconds"]) == (6 * 30.0 + 7.0, 6 * 2.0)
    assert all(log["tokens_per_second"] == 20.0 for log in saving_logs)
    assert [log["save_seconds"] for log in saving_logs] == [0.0] + [30.0] * 5  # a step's save is in the next interval
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("llmft: step")]
    assert [line.endswith("save 30.0s eval 2.0s") for line in lines[6:]] == [False] + [True] * 5
    assert not any("save" in line for line in lines[:6])

"""The speed levers llmft turns on by itself (llmft.planning.speed_defaults): recomputation off where the planner says
the run fits without it, torch.compile where it was measured and the run is long enough to repay its compile; each
said in one line, each decided for an L4, A100, H100 and T4 from this CPU machine, and a flag given always wins."""

from __future__ import annotations

import dataclasses
import re

import pytest

from llmft.planning.hardware import GPUS
from llmft.planning.speed_defaults import (
    COMPILE_SECONDS,
    choose_recomputation,
    choose_torch_compile,
    compile_break_even_seconds,
)


def parsed_run(model_dir, *extra, gpu: bool = True):
    from llmft import train
    from llmft.training.flags import parse_train_flags

    argv = ["--model_name_or_path", str(model_dir), "--dataset_name", "d.jsonl", "--output_dir", "out", *extra]
    if gpu:  # decided for that GPU from this CPU machine (llmft train would refuse --use_cpu where one is)
        argv += ["--use_cpu", "false"]
    parsed = parse_train_flags(train.make_parser(), argv)
    assert not isinstance(parsed, str), parsed
    return train.RunSettings.from_flags(*parsed)


@pytest.fixture(scope="module")
def llama_8b(tmp_path_factory):
    """Llama-3.1-8B's config.json alone: what the planner reads (no weights)."""
    from published_shapes import llama_3_1_8b

    path = tmp_path_factory.mktemp("llama-3.1-8b")
    llama_3_1_8b().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama_1b(tmp_path_factory):
    from published_shapes import llama_3_2_1b

    path = tmp_path_factory.mktemp("llama-3.2-1b")
    llama_3_2_1b().save_pretrained(path)
    return path


def test_the_parser_records_which_speed_flags_were_given():
    """Not given, the flags parse to TRL's defaults (recomputation on, compile off) and llmft decides them; given on
    the command line, either way, they are the user's."""
    run = parsed_run("m")
    assert run.llmft_decides == {"gradient_checkpointing", "torch_compile"}
    assert run.training.gradient_checkpointing is True and run.training.torch_compile is False
    run = parsed_run("m", "--gradient_checkpointing", "false", "--torch_compile", "false")
    assert run.llmft_decides == frozenset() and run.training.gradient_checkpointing is False
    assert parsed_run("m", "--torch_compile", "true").llmft_decides == {"gradient_checkpointing"}


# 8B LoRA at sequence 4096, micro-batch 1: 47.3 GiB planned without recomputation (49.3 measured on an H200)
@pytest.mark.parametrize(
    "gpu, recompute", [("T4", True), ("L4", True), ("A100-40GB", True), ("A100-80GB", False), ("H100-80GB", False)]
)
def test_recomputation_is_off_by_default_wherever_the_plan_fits_without_it(
    gpu, recompute, llama_8b, monkeypatch, capsys
):
    from llmft import train

    monkeypatch.setenv("LLMFT_HOST_RAM_GB", "128")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    flags = ["--use_peft", "--lora_target_modules", "all-linear", "--max_length", "4096"]
    flags += ["--per_device_train_batch_size", "1", "--global_batch_size", "8", "--zero_stage", "2"]
    run, _ = train.check_run(parsed_run(llama_8b, *flags), cuda=True, gpu=GPUS[gpu])
    assert run.training.gradient_checkpointing is recompute
    assert run.training.activation_checkpointing is recompute  # the name transformers 5 reads
    out = capsys.readouterr().out
    if recompute:
        needs = re.search(r"gradient checkpointing on \(auto: without recomputation this run needs ([\d.]+) GiB", out)
        assert needs and float(needs.group(1)) > GPUS[gpu].memory_gib, out
        assert f"GiB per GPU of {GPUS[gpu].memory_gib:.1f}); --gradient_checkpointing false turns it off" in out
    else:
        needs = re.search(r"gradient checkpointing off \(auto: this run fits without recomputation, ([\d.]+) of", out)
        assert needs and 45 < float(needs.group(1)) < GPUS[gpu].memory_gib, out
        assert "1.23x tokens/s measured on an H200); --gradient_checkpointing true keeps it on" in out
    # asked for either way, it is what was asked, and nothing is said
    for value in ("true", "false"):
        run, _ = train.check_run(
            parsed_run(llama_8b, *flags, "--gradient_checkpointing", value), cuda=True, gpu=GPUS[gpu]
        )
        assert run.training.gradient_checkpointing is (value == "true")
        assert "gradient checkpointing o" not in capsys.readouterr().out


def test_cpu_processes_keep_trls_recomputation_and_the_plan_checks_what_train_runs():
    assert choose_recomputation(None, None, True, 1.0, None) == (True, "")
    assert choose_recomputation(False, GPUS["L4"], False, 30.0, 22.0) == (False, "")  # the user's; the job checks it
    on, why = choose_recomputation(None, GPUS["H100-80GB"], None, None, None)
    assert on and "no memory plan could be made" in why


LONG, SHORT = 2000, 100  # optimizer steps of 32 packed rows of 2048 tokens


def compile_choice(gpu="H100-80GB", train_s=3600.0, **facts):
    asked = []

    def planned():
        asked.append(1)
        return train_s

    kw = dict(packing=True, zero_stage=2, use_peft=False, sequence_parallel=1, layers=16) | facts
    on, why = choose_torch_compile(None, GPUS.get(gpu), planned_train_s=planned, **kw)
    return on, why, bool(asked)


def test_torch_compile_is_on_by_default_only_where_it_was_measured_and_pays():
    """1.30x after a 131 s compile (H200, packed 1.24B, ZeRO-2): on for a packed full fine-tune of a bf16 GPU planned
    to train at least twice the break-even (568 s); off, without asking the planner, wherever it was not measured."""
    assert round(compile_break_even_seconds(16)) == 568 and COMPILE_SECONDS == 131.0
    on, why, asked = compile_choice(train_s=1200.0)
    assert on and asked and why.startswith("torch.compile on (auto: packed rows, planned 20 min of training; 1.3x")
    on, why, _ = compile_choice(train_s=1100.0)
    assert not on and "planned to train 18 min; compiling 16 layers takes about 131 s and pays from 19 min" in why
    on, why, _ = compile_choice(layers=32, train_s=1200.0)  # twice the layers, twice the compile
    assert not on and "compiling 32 layers takes about 262 s" in why
    for facts in (
        dict(packing=False),
        dict(use_peft=True),
        dict(zero_stage=3),
        dict(sequence_parallel=2),
        dict(gpu="T4"),  # no bf16
        dict(gpu="CPU"),  # no GPU
    ):
        assert compile_choice(**facts) == (False, "", False), facts
    for gpu in ("L4", "A100-40GB", "H100-80GB"):
        assert compile_choice(gpu=gpu)[0]
    assert choose_torch_compile(
        True,
        None,
        packing=False,
        zero_stage=3,
        use_peft=True,
        sequence_parallel=2,
        layers=1,
        planned_train_s=lambda: 0.0,
    ) == (True, "")  # asked for: the user's


@pytest.mark.parametrize("steps, resumed_at, on", [(LONG, None, True), (SHORT, None, False), (LONG, 1900, False)])
def test_llmft_train_plans_the_runs_training_time_for_its_compile_decision(
    steps, resumed_at, on, llama_1b, tmp_path, monkeypatch, capsys
):
    """The run's training time comes from the planner's tokens/s for its own setting on its GPU, over the steps it has
    left: a resumed run that is nearly done does not compile for its last steps."""
    from llmft import train

    monkeypatch.setenv("LLMFT_HOST_RAM_GB", "128")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    flags = ["--packing", "true", "--max_length", "2048", "--per_device_train_batch_size", "8"]
    flags += ["--global_batch_size", "32", "--zero_stage", "2", "--max_steps", str(steps)]
    run, decided = train.check_run(parsed_run(llama_1b, *flags), cuda=True, gpu=GPUS["H100-80GB"])
    checkpoint = tmp_path / f"checkpoint-{resumed_at}" if resumed_at else None
    resume = train.ResumeDecision(checkpoint, {}, None, None)
    run = train.choose_compile_default(run, decided, resume, llama_1b_config(llama_1b), rows=10**6)
    assert run.training.torch_compile is on
    out = capsys.readouterr().out
    assert ("torch.compile on (auto: packed rows" in out) is on
    assert ("torch.compile off (auto: this run is planned to train" in out) is (not on)
    # given, the flag is the user's, on a fresh run or a resumed one
    run, decided = train.check_run(
        parsed_run(llama_1b, *flags, "--torch_compile", str(not on).lower()), cuda=True, gpu=GPUS["H100-80GB"]
    )
    run = train.choose_compile_default(run, decided, resume, llama_1b_config(llama_1b), rows=10**6)
    assert run.training.torch_compile is (not on) and "torch.compile o" not in capsys.readouterr().out


def llama_1b_config(path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def test_an_epoch_run_counts_its_steps_from_the_packed_rows(llama_1b, monkeypatch, capsys):
    from llmft import train

    monkeypatch.setenv("LLMFT_HOST_RAM_GB", "128")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    flags = ["--packing", "true", "--max_length", "2048", "--per_device_train_batch_size", "8"]
    flags += ["--global_batch_size", "32", "--zero_stage", "2", "--num_train_epochs", "2"]
    run, decided = train.check_run(parsed_run(llama_1b, *flags), cuda=True, gpu=GPUS["H100-80GB"])
    resume = train.ResumeDecision(None, {}, None, None)
    config = llama_1b_config(llama_1b)
    assert train.choose_compile_default(run, decided, resume, config, rows=32 * LONG // 2).training.torch_compile
    assert not train.choose_compile_default(run, decided, resume, config, rows=32 * SHORT // 2).training.torch_compile
    assert dataclasses.replace(run.training).torch_compile is False  # deciding changed no copy it was given


def test_profile_step_names_where_the_step_went_and_stays_out_of_the_rates(tmp_path, tiny_model, tiny_data):
    """--profile_step 2 of a 4-step CPU run: the 10 operators with the most self time in step 2 are written beside the
    checkpoints and the first three printed; run_summary.json's rates are over steps 3-4 (the profiler's overhead
    is in step 2); a step the run does not reach is refused in one line before anything loads."""
    import json

    from conftest import PYTHON, run

    out = tmp_path / "run"
    flags = ["--model_name_or_path", str(tiny_model), "--dataset_name", str(tiny_data), "--output_dir", str(out)]
    flags += [
        "--max_steps",
        "4",
        "--global_batch_size",
        "4",
        "--per_device_train_batch_size",
        "2",
        "--zero_stage",
        "2",
    ]
    flags += ["--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true"]
    proc = run([PYTHON, "-m", "llmft.train", *flags, "--profile_step", "2"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = (out / "profile_step_2.txt").read_text().splitlines()
    assert table[0].startswith("llmft --profile_step 2: ") and "top 10 by self CPU time" in table[0]
    rows = table[3:]
    assert len(rows) == 10 and any("aten::" in r for r in rows)
    shares = [float(r.split("%")[0]) for r in rows]
    assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 100.0
    printed = re.search(r"llmft: profiled step 2 \([\d.]+ s\): (.*); all 10 in (\S+)", proc.stdout)
    assert printed and printed.group(2) == str(out / "profile_step_2.txt") and printed.group(1).count("%") == 3
    assert "run_summary.json rates are over steps 3-4 (step 2 was profiled)" in proc.stdout
    assert json.loads((out / "run_summary.json").read_text())["tokens_per_second"] > 0

    refused = run([PYTHON, "-m", "llmft.train", *flags, "--output_dir", str(tmp_path / "b"), "--profile_step", "4"])
    assert refused.returncode == 2 and refused.stderr.strip().count("\n") == 0, refused.stderr
    assert "--profile_step 4: give a step from 1 to 3, before the run's last" in refused.stderr
    assert not (tmp_path / "b" / "profile_step_4.txt").exists()

"""`llmft train` end to end: real torchrun, real DeepSpeed engine (gloo on CPU), a tiny GPT-2-style model."""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from pathlib import Path

import pytest
from conftest import PYTHON, REPO, run

from llmft.data.synthetic import as_format, make_examples, write_jsonl
from llmft.training.metrics import STARTUP_PHASES, SUMMARY_FIELDS

STEP_RE = re.compile(
    r"llmft: step (\d+)/(\d+) loss ([\d.]+) lr ([\d.e+-]+) tokens/s (\d+) padded/s (\d+) tflops/gpu ([\d.e+-]+) "
    r"mfu (n/a|[\d.]+%) gpu_mem (n/a|[\d.]+GiB) data ([\d.]+)%"
)
PROBE = str(Path(__file__).resolve().parent / "train_probe.py")


PROBE = REPO / "tests" / "train_probe.py"


def train_cmd(model, data, out, *extra, nproc=2):
    launcher = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)] if nproc > 1 else [PYTHON]
    return launcher + [
        "-m",
        "llmft.train",
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
        *map(str, extra),
    ]


def steps(stdout: str) -> list[tuple[int, int, float, float]]:
    return [(int(s), int(m), float(loss), float(lr)) for s, m, loss, lr, *_ in STEP_RE.findall(stdout)]


def summary(out: Path) -> dict:
    return json.loads((out / "run_summary.json").read_text())


def test_zero2_two_processes_trains_saves_shards_and_writes_the_resolved_config(tiny_model, tiny_data, tmp_path):
    out = tmp_path / "run"
    proc = run(
        train_cmd(
            tiny_model,
            tiny_data,
            out,
            "--zero_stage",
            2,
            "--max_steps",
            10,
            "--save_steps",
            5,
            "--global_batch_size",
            8,
            "--per_device_train_batch_size",
            2,
            "--learning_rate",
            "5e-3",
        ),
        check=True,
    )
    assert "llmft plan: world size 2 (1 nodes x 2 processes, from torchrun)" in proc.stdout
    logged = steps(proc.stdout)
    assert [s for s, *_ in logged] == list(range(1, 11))
    first, last = logged[0][2], sum(loss for *_, loss, _ in logged[-3:]) / 3
    assert last < 0.85 * first, f"loss did not go down: {logged}"

    tag = out / "checkpoint-10" / "global_step10"
    assert sorted(p.name for p in tag.iterdir()) == [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    for step in (5, 10):
        ckpt = f"checkpoint-{step}"
        marker = json.loads((out / ckpt / "llmft_complete.json").read_text())
        assert marker["world_size"] == 2
        # Rank 1 itself reported the files it wrote; rank 0 merged the reports into the marker.
        own = [f"global_step{step}/zero_pp_rank_1_mp_rank_00_optim_states.pt", "rng_state_1.pth"]
        assert marker["reported_by_rank"]["1"] == own and all(f in marker["files"] for f in own)
        assert f"global_step{step}/mp_rank_00_model_states.pt" in marker["reported_by_rank"]["0"]
        assert (out / ckpt / "config.json").is_file() and (out / ckpt / "tokenizer.json").is_file()
    cfg = json.loads((out / "ds_config.json").read_text())
    assert (
        cfg["train_batch_size"] == 8 == cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * 2
    )
    assert cfg["gradient_accumulation_steps"] == 2 and cfg["zero_optimization"]["stage"] == 2
    assert json.loads((out / "llmft_done.json").read_text())["global_step"] == 10
    assert proc.stdout.count("llmft plan: world size") == 1  # rank 0 only
    assert (
        len(re.findall(r"llmft: (prepared|reused prepared) data ", proc.stdout)) == 1
    )  # one preparation, logged once

    # Speed, from the run itself: the step line's throughput fields and run_summary.json (CPU: no MFU, no GPU memory).
    for _, _, _, _, tps, padded, tflops, mfu, gpu_mem, data_share in STEP_RE.findall(proc.stdout):
        assert (
            0 < int(tps) <= int(padded)
            and float(tflops) > 0
            and mfu == gpu_mem == "n/a"
            and 0 <= float(data_share) <= 100
        )
    s = summary(out)
    assert list(s) == list(SUMMARY_FIELDS)
    assert s["steps"] == 10 == s["global_step"] and s["world_size"] == 2 and s["gpu"] is None and s["mfu"] is None
    assert s["peak_gpu_memory_gib"] is None and 0 < s["peak_host_rss_gib"] < 8
    assert 0 < s["tokens"] <= s["padded_tokens"] and 0 < s["tokens_per_second"] <= s["padded_tokens_per_second"]
    assert s["tflops_per_gpu"] > 0 and s["train_loss"] > 0
    assert list(s["startup_seconds"]) == list(STARTUP_PHASES) and all(v > 0 for v in s["startup_seconds"].values())
    assert sum(s["startup_seconds"].values()) < s["wall_seconds"]
    assert proc.stdout.count("llmft: start-up ") == 1


def test_a_run_that_saves_and_evaluates_every_step_reports_the_rate_of_one_that_does_not(
    tiny_model, tiny_data, tmp_path
):
    """Saves and evaluations made 3 s and 2 s slower (tests/train_probe.py) at every step of a tiny model whose steps
    take a fraction of that: were they counted, the rate would drop ~50x. It matches the run without them (within
    5x: timing of tiny steps on a shared machine), and the time is reported on its own, in the summary and step lines."""
    flags = (
        "--max_steps",
        4,
        "--global_batch_size",
        4,
        "--per_device_train_batch_size",
        2,
        "--zero_stage",
        2,
        "--eval_split_ratio",
        "0.05",
    )
    plain_out, saving_out = tmp_path / "plain", tmp_path / "saving"
    run(train_cmd(tiny_model, tiny_data, plain_out, *flags, "--save_strategy", "no", nproc=1), check=True)
    saving = run(
        [
            PYTHON,
            PROBE,
            *train_cmd(
                tiny_model,
                tiny_data,
                saving_out,
                *flags,
                "--save_steps",
                1,
                "--eval_strategy",
                "steps",
                "--eval_steps",
                1,
                nproc=1,
            )[3:],
        ],
        check=True,
        timeout=1200,
        LLMFT_PROBE_DIR=str(tmp_path / "probe"),
        LLMFT_PROBE_MOMENTS="0",
        LLMFT_PROBE_SLOW_SAVE="3",
        LLMFT_PROBE_SLOW_EVAL="2",
    )
    plain, saved = summary(plain_out), summary(saving_out)
    assert saved["steps"] == plain["steps"] == 4 and saved["tokens"] == plain["tokens"]
    # steps of ~0.1 s on a shared machine vary 3x between runs; counted, 5 s of saving and evaluating per step would
    # make the rate ~50x lower
    assert 0.1 < saved["tokens_per_second"] / plain["tokens_per_second"] < 10, (saved, plain)
    # the rates' time holds none of the saves: counted, it would be longer than they are (bounds that leave a loaded
    # machine 30x slower steps than a quiet one's)
    assert saved["train_seconds"] < saved["save_seconds"], saved
    assert saved["save_seconds"] >= 4 * 3 and saved["eval_seconds"] >= 4 * 2 and plain["eval_seconds"] < 2
    assert saved["train_seconds"] + saved["save_seconds"] + saved["eval_seconds"] < saved["wall_seconds"]
    lines = [line for line in saving.stdout.splitlines() if STEP_RE.match(line)]
    assert len(lines) == 4 and not re.search(r" (save|eval) ", lines[0])  # step 1's save and eval come after its line
    assert all(re.search(r"data [\d.]+% save [3-9]\.\ds eval [2-9]\.\ds$", line) for line in lines[1:]), lines


def test_a_finished_run_resubmitted_on_fewer_processes_trains_nothing(tiny_model, tiny_data, tmp_path):
    """A finished 2-process run, run again on 1 process (a resubmitted Slurm job): transformers would resume its last
    checkpoint with the accumulation doubled and train a step past --max_steps over the finished model; llmft says
    the run is complete and leaves it as it was."""
    out = tmp_path / "run"
    flags = ("--max_steps", 2, "--save_steps", 1, "--global_batch_size", 8, "--per_device_train_batch_size", 2)
    run(train_cmd(tiny_model, tiny_data, out, *flags), check=True)
    model = out / "model.safetensors"
    written = model.stat().st_mtime_ns
    again = run(train_cmd(tiny_model, tiny_data, out, *flags, nproc=1), check=True)
    assert f"llmft: {out} is already complete at step 2 (--max_steps 2): nothing to train" in again.stdout
    assert steps(again.stdout) == [] and not (out / "checkpoint-3").exists()
    assert model.stat().st_mtime_ns == written


def test_a_finished_epochs_run_run_again_trains_nothing_and_keeps_its_summary(tiny_model, tmp_path):
    """Epochs only (no --max_steps): transformers resumes the last checkpoint, trains no step, and would write the
    final model and a 0-step run_summary.json over the finished run's; llmft says the run is complete instead."""
    data = write_jsonl(as_format(make_examples(32), "prompt_completion"), tmp_path / "d.jsonl")
    out = tmp_path / "run"
    flags = ("--num_train_epochs", 1, "--save_steps", 1, "--global_batch_size", 8, "--per_device_train_batch_size", 4)
    first = run(train_cmd(tiny_model, data, out, *flags, nproc=1), check=True)
    assert [s for s, *_ in steps(first.stdout)] == [1, 2, 3, 4]
    kept = {name: (out / name).read_bytes() for name in ("model.safetensors", "run_summary.json")}
    again = run(train_cmd(tiny_model, data, out, *flags, nproc=1), check=True)
    assert (
        f"llmft: {out} is already complete at step 4 (--num_train_epochs 1, 4 steps): nothing to train; "
        "raise --num_train_epochs to train further"
    ) in again.stdout
    assert {name: (out / name).read_bytes() for name in kept} == kept
    assert summary(out)["steps"] == 4


def test_zero3_stops_on_request_then_resumes_where_it_stopped(tiny_model, tiny_data, tmp_path):
    """The preemption path: a stop request mid-run saves a complete checkpoint; a rerun continues from it."""
    out, stop = tmp_path / "run", tmp_path / "STOP"
    flags = (
        "--zero_stage",
        3,
        "--max_steps",
        10,
        "--save_steps",
        2,
        "--global_batch_size",
        4,
        "--per_device_train_batch_size",
        1,
        "--learning_rate",
        "1e-3",
    )
    cmd = train_cmd(tiny_model, tiny_data, out, *flags)

    def request_stop_after_first_checkpoint():
        deadline = time.time() + 300
        while time.time() < deadline and not (out / "checkpoint-2" / "llmft_complete.json").exists():
            time.sleep(0.02)
        stop.touch()

    watcher = threading.Thread(target=request_stop_after_first_checkpoint, daemon=True)
    watcher.start()
    first = run(cmd, check=True, LLMFT_STOP_FILE=str(stop))
    watcher.join()
    stopped = int(re.search(r"stop requested; saved checkpoint-(\d+)", first.stdout).group(1))
    assert 2 <= stopped < 10
    assert not (out / "llmft_done.json").exists()
    assert summary(out)["steps"] == stopped  # written when a stop request ends the run early, too
    tag = out / f"checkpoint-{stopped}" / f"global_step{stopped}"
    assert sorted(p.name for p in tag.glob("zero_pp_rank_*_model_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_model_states.pt",
        "zero_pp_rank_1_mp_rank_00_model_states.pt",
    ]

    stop.unlink()
    second = run(cmd, check=True, LLMFT_STOP_FILE=str(stop))
    assert f"resuming from {out / f'checkpoint-{stopped}'}" in second.stdout
    before, after = steps(first.stdout), steps(second.stdout)
    assert [s for s, *_ in before] == list(range(1, stopped + 1))
    assert [s for s, *_ in after] == list(range(stopped + 1, 11))  # nothing trained twice, nothing skipped
    for s, total, _, lr in before + after:  # one linear schedule across both runs
        assert lr == pytest.approx(1e-3 * (1 - s / total), rel=1e-3, abs=1e-9)
    assert json.loads((out / "llmft_done.json").read_text())["global_step"] == 10
    assert summary(out)["steps"] == 10 - stopped  # this run's steps
    # ZeRO-3 saves shards only, once per checkpoint (HF's fallback would write them twice, and warn so);
    # the final model is config and tokenizer beside the last checkpoint unless --save_consolidated.
    assert not list(out.glob("**/model.safetensors")) and (out / "config.json").is_file()
    assert "Saving the full checkpoint instead" not in first.stdout + first.stderr + second.stdout + second.stderr
    assert f"weights are the ZeRO-3 shards in {out / 'checkpoint-10'}" in second.stdout
    # The same world size resumes DeepSpeed's own shards: nothing converted (another world: tests/test_elastic.py).
    assert "universal" not in second.stdout and not list(out.glob("checkpoint-*/universal_step*"))


def test_auto_takes_the_planners_setting_for_this_machine_and_says_why(tiny_model, tiny_data, tmp_path):
    """On this CPU machine: the largest micro-batch up to the one given, no recomputation, ZeRO-1 (with accumulation it
    reduces gradients once per step, ZeRO-2 at every micro-batch: llmft.planning.comm); the run uses it."""
    out = tmp_path / "auto"
    proc = run(
        train_cmd(
            tiny_model,
            tiny_data,
            out,
            "--auto",
            "--max_steps",
            1,
            "--global_batch_size",
            8,
            "--per_device_train_batch_size",
            4,
            nproc=1,
        ),
        check=True,
    )
    line = next(line for line in proc.stdout.splitlines() if line.startswith("llmft plan: auto: "))
    assert line.startswith(
        "llmft plan: auto: ZeRO-1, micro-batch 4 x accumulation 2, gradient checkpointing off (per process"
    )
    assert "1 x 1 CPU process per node (no GPU)" in line and "no CPU offload needed; no recomputation needed" in line
    cfg = json.loads((out / "ds_config.json").read_text())
    assert cfg["zero_optimization"]["stage"] == 1 and cfg["train_micro_batch_size_per_gpu"] == 4
    assert cfg["gradient_accumulation_steps"] == 2
    assert "llmft: host memory: rank 0 " in proc.stdout and "llmft: host memory peak: rank 0 " in proc.stdout


def test_auto_on_a_rerun_keeps_the_zero_stage_the_runs_checkpoints_were_written_with(
    tiny_model, tmp_path, monkeypatch
):
    """In-process, no training: --auto picks ZeRO-1 on this CPU machine for a new run, but a rerun into a directory
    whose run was ZeRO-3 keeps ZeRO-3 (DeepSpeed loads those shards only under it) and says so."""
    from llmft.train import RunSettings, choose_automatically, make_parser

    monkeypatch.setenv("LLMFT_HOST_RAM_GB", "16")
    out = tmp_path / "run"
    argv = [
        "--model_name_or_path",
        str(tiny_model),
        "--dataset_name",
        "d.jsonl",
        "--output_dir",
        str(out),
        "--auto",
        "--global_batch_size",
        "4",
        "--per_device_train_batch_size",
        "2",
    ]
    script_args, training_args, model_args, llmft_args = make_parser().parse_args_and_config(args=argv)
    run = RunSettings(script_args, training_args, model_args, llmft_args)
    choose = lambda: choose_automatically(run, "fp32", None)  # noqa: E731
    setting, line = choose()
    assert setting.zero_stage == 1 and "kept" not in line  # accumulation 2: ZeRO-1 moves the least
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "llmft_run.json").write_text(json.dumps({"zero_stage": 3}))
    setting, line = choose()
    assert setting.zero_stage == 3 and line.endswith("; ZeRO-3 kept: the run being resumed was trained with it")


def test_the_checkpointing_auto_chooses_takes_effect_in_the_trainer_arguments(tmp_path):
    """TRL turns gradient checkpointing on by default; --auto's choice must win either way (transformers 5 keeps a
    copy's resolved `activation_checkpointing`, which once silently undid a changed `gradient_checkpointing`)."""
    from llmft.train import make_parser
    from llmft.training.model_files import with_checkpointing

    argv = ["--model_name_or_path", "m", "--dataset_name", "d.jsonl", "--output_dir", str(tmp_path / "o")]
    training_args = make_parser().parse_args_and_config(args=argv)[1]
    assert training_args.gradient_checkpointing is True  # TRL's default
    for on in (False, True, False):
        training_args = with_checkpointing(training_args, on)
        assert training_args.gradient_checkpointing is on and training_args.activation_checkpointing is on


def test_torch_compile_compiles_the_deepspeed_engine_and_trains_the_same(tiny_model, tiny_data, tmp_path):
    """--torch_compile is applied (accelerate compiles the DeepSpeed engine's module; llmft refuses to go on if the
    engine is not compiled) and trains the same losses. The eager backend keeps this fast: dynamo captures the
    model's graphs, nothing is code-generated."""
    import shutil

    model = Path(shutil.copytree(tiny_model, tmp_path / "model"))
    config = json.loads((model / "config.json").read_text())
    config.update(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # compiled dropout draws its randomness differently
    (model / "config.json").write_text(json.dumps(config))
    flags = (
        "--zero_stage",
        2,
        "--max_steps",
        3,
        "--global_batch_size",
        4,
        "--per_device_train_batch_size",
        2,
        "--learning_rate",
        "1e-3",
        "--save_strategy",
        "no",
    )
    plain = run(train_cmd(model, tiny_data, tmp_path / "plain", *flags, nproc=1), check=True)
    compiled = run(
        train_cmd(
            model,
            tiny_data,
            tmp_path / "compiled",
            *flags,
            "--torch_compile",
            "true",
            "--torch_compile_backend",
            "eager",
            nproc=1,
        ),
        check=True,
    )
    assert "llmft: torch.compile on (backend eager, mode default)" in compiled.stdout
    assert "torch.compile on" not in plain.stdout
    assert len(steps(compiled.stdout)) == 3
    for (s1, _, loss1, _), (s2, _, loss2, _) in zip(steps(plain.stdout), steps(compiled.stdout)):
        assert s1 == s2 and loss2 == pytest.approx(loss1, rel=1e-4)


def test_torch_compile_that_did_not_take_effect_stops_the_run():
    from types import SimpleNamespace

    from llmft.errors import TrainError
    from llmft.training.callbacks import compile_report

    args = SimpleNamespace(torch_compile=True, torch_compile_backend="inductor", torch_compile_mode=None)
    report = compile_report(SimpleNamespace(model_wrapped=SimpleNamespace(is_compiled=False)))
    with pytest.raises(TrainError, match="--torch_compile was not applied to the model"):
        report.on_train_begin(args, None, None)
    compile_report(SimpleNamespace(model_wrapped=SimpleNamespace(is_compiled=True))).on_train_begin(args, None, None)
    args.torch_compile = False
    report.on_train_begin(args, None, None)  # not asked: nothing to check


def test_yaml_config_column_mapping_chat_format_packing(tiny_model, tmp_path):
    """A YAML file holds the flags (TRL's parser); question/answer fields are mapped; an eval split without
    --eval_strategy is scored once at the end; chat data uses the template, with packing and gradient checkpointing on."""
    qa = write_jsonl(as_format(make_examples(32), "question_answer"), tmp_path / "qa.jsonl")
    config = tmp_path / "run.yaml"
    config.write_text(
        f"model_name_or_path: {tiny_model}\ndataset_name: {qa}\nprompt_column: question\ncompletion_column: answer\n"
        f"zero_stage: 0\nmax_steps: 2\nsave_steps: 2\nper_device_train_batch_size: 2\nreport_to: none\neval_split_ratio: 0.25\n"
    )
    proc = run(
        [
            PYTHON,
            "-m",
            "llmft.train",
            "--config",
            str(config),
            "--output_dir",
            str(tmp_path / "qa_run"),
            "--logging_steps",
            "1",
            "--disable_tqdm",
            "true",
        ],
        check=True,
    )
    assert (
        "24 records (prompt_completion, 100% of the split), 8 for evaluation" in proc.stdout
        and "ZeRO stage 0" in proc.stdout
    )
    assert [s for s, *_ in steps(proc.stdout)] == [1, 2]
    assert re.search(r"llmft: step 2/2 eval loss [\d.]+ perplexity [\d.]+\n", proc.stdout), proc.stdout

    chat = write_jsonl(as_format(make_examples(16), "messages"), tmp_path / "chat.jsonl")
    proc = run(
        train_cmd(
            tiny_model,
            chat,
            tmp_path / "chat_run",
            "--zero_stage",
            1,
            "--max_steps",
            1,
            "--per_device_train_batch_size",
            2,
            "--packing",
            "--gradient_checkpointing",
            nproc=1,
        ),
        check=True,
    )
    assert "16 records (messages" in proc.stdout and (tmp_path / "chat_run" / "llmft_done.json").is_file()


def test_real_tokens_counted_the_same_padded_or_packed(tiny_model, tmp_path):
    """One epoch over the same samples: the padded run (attention masks) and the packed run (padding-free rows,
    position ids) count the same real tokens; only the padded one feeds padding. The padding-free run (the GPU
    default where a varlen kernel runs it; asked for here) trains the same batches as the padded one: the same
    losses step by step, without a pad token."""
    data = write_jsonl(as_format(make_examples(24), "prompt_completion"), tmp_path / "d.jsonl")
    flags = ("--zero_stage", 0, "--num_train_epochs", 1, "--save_strategy", "no", "--logging_steps", 1)
    model = tmp_path / "no-dropout"  # dropout draws differ with the batch's shape: off, so the losses can be compared
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(
        json.dumps({**config, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0})
    )
    padded_run = run(
        train_cmd(model, data, tmp_path / "padded", *flags, "--per_device_train_batch_size", 8, nproc=1), check=True
    )
    free_run = run(
        train_cmd(
            model,
            data,
            tmp_path / "free",
            *flags,
            "--per_device_train_batch_size",
            8,
            "--padding_free",
            "true",
            nproc=1,
        ),
        check=True,
    )
    free = summary(tmp_path / "free")
    assert free["steps"] == 3 and free["tokens"] == free["padded_tokens"] == summary(tmp_path / "padded")["tokens"]
    assert [loss for _, _, loss, _ in steps(free_run.stdout)] == pytest.approx(
        [loss for _, _, loss, _ in steps(padded_run.stdout)], abs=2e-4
    )
    proc = run(
        train_cmd(
            model,
            data,
            tmp_path / "packed",
            *flags,
            "--per_device_train_batch_size",
            4,
            "--packing",
            "--max_length",
            128,
            nproc=1,
        ),
        check=True,
    )
    assert "llmft: attention llmft_sdpa_packed (auto): SDPA on each packed sample" in proc.stdout
    # the start lines say what padding costs this data, and what the run's batches do about it (llmft.padding)
    assert re.search(
        r"llmft: data: 24 sequences, .* micro-batch of 8, \d+% of the tokens fed are padding: padding-free "
        r"batches would feed none",
        padded_run.stdout,
    )
    assert "would be padding (padding-free: none is fed" in free_run.stdout
    assert re.search(r"would be padding; --packing: no padding, about \d+ samples per row of 128 tokens", proc.stdout)
    padded, packed = summary(tmp_path / "padded"), summary(tmp_path / "packed")
    assert padded["steps"] == 3 and packed["steps"] >= 1
    assert packed["tokens"] == padded["tokens"] == packed["padded_tokens"] < padded["padded_tokens"]


def test_held_out_evaluation_logs_loss_and_perplexity_and_the_data_is_prepared_once(run_with_eval):
    import math

    out, train_out, prepare_out = run_with_eval
    evals = [
        (int(s), float(loss), float(ppl))
        for s, loss, ppl in re.findall(r"llmft: step (\d+)/6 eval loss ([\d.]+) perplexity ([\d.]+)", train_out)
    ]
    assert [s for s, *_ in evals] == [3, 6]
    for _, loss, ppl in evals:
        assert ppl == pytest.approx(math.exp(loss), rel=1e-3)
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    logged = [(h["step"], h["eval_perplexity"]) for h in history if "eval_loss" in h]
    assert [s for s, _ in logged] == [3, 6] and all(math.isfinite(p) for _, p in logged)
    assert "115 records (prompt_completion, 50% of the split), 26 for evaluation" in train_out
    # Rank 0 prepared (rank 1 waited for its files); `llmft prepare` with the same flags then finds it ready.
    prepared = re.findall(r"llmft: prepared data (\S+) \(fingerprint (\w+)\)", train_out)
    assert len(prepared) == 1, train_out
    directory, fingerprint = prepared[0]
    assert f"llmft: reused prepared data {directory} (fingerprint {fingerprint})" in prepare_out
    record = json.loads((out / "llmft_data.json").read_text())
    assert record["fingerprint"] == fingerprint and record["records"] == {"train": 115, "eval": 26}


def test_wandb_offline_logs_without_network_and_never_prints_the_key(tiny_model, tiny_data, tmp_path):
    secret = "wandb-secret-0123456789abcdef0123456789abcdef"
    cmd = train_cmd(tiny_model, tiny_data, tmp_path / "run", "--zero_stage", 0, "--max_steps", 2, nproc=1)
    cmd[cmd.index("--report_to") + 1] = "wandb"
    proc = run(
        cmd,
        check=True,
        WANDB_MODE="offline",
        WANDB_API_KEY=secret,
        WANDB_DIR=str(tmp_path),
        WANDB_PROJECT="llmft-test",
    )
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    record = next(runs[0].glob("*.wandb")).read_bytes()
    assert all(key.encode() in record for key in ("tokens_per_second", "padded_tokens_per_second", "tflops_per_gpu"))
    assert secret not in proc.stdout + proc.stderr


def _bad(tmp_path: Path, tiny_data: Path):
    bad_line = tmp_path / "bad.jsonl"
    bad_line.write_text('{"text": "a"}\n{"text": "b"}\n{"text": \n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    qa = write_jsonl(as_format(make_examples(4), "question_answer"), tmp_path / "qa.jsonl")
    return [
        (["--dataset_name", str(tmp_path / "missing.jsonl")], "missing.jsonl not found"),
        (["--dataset_name", str(bad_line)], "bad.jsonl: line 3 is not valid JSON"),
        (["--dataset_name", str(empty)], "empty.jsonl is empty"),
        (["--dataset_name", str(qa)], "dataset has columns answer, question but llmft needs"),
        (["--zero_stage", "7"], "unknown ZeRO stage 7"),
        (["--deepspeed", str(tmp_path / "nope.json")], f"DeepSpeed config {tmp_path / 'nope.json'} not found"),
        (
            ["--global_batch_size", "7", "--per_device_train_batch_size", "2"],
            "global batch 7 is not divisible by micro-batch 2 x world size 1 = 2; use global batch 6 or 8",
        ),
        (["--data_percentage", "150"], "--data_percentage must be in (0, 100], got 150"),
        (["--data_percentage", "0"], "--data_percentage must be in (0, 100], got 0"),
        (["--packing", "--packing_strategy", "wrapped"], "--packing_strategy wrapped concatenates samples"),
        (
            ["--attn_implementation", "flash_attention_2"],
            "flash_attention_2 needs a CUDA GPU and none is visible here",
        ),
        (["--use_liger_kernel", "true"], "--use_liger_kernel needs a CUDA GPU"),
        (["--auto", "--zero_stage", "3"], "--auto chooses the ZeRO stage and offload itself"),
        (["--save_consolidated", "--zero_stage", "2"], "under ZeRO-2 the final model is written whole already"),
        (
            ["--eval_strategy", "steps", "--eval_steps", "5"],
            "--eval_strategy steps needs evaluation data: add --eval_dataset_name FILE or --eval_split_ratio 0.05",
        ),
        (["--eval_split_ratio", "1"], "--eval_split_ratio must be in (0, 1)"),
        (["--eval_dataset_name", str(tmp_path / "missing_eval.jsonl")], "missing_eval.jsonl not found"),
    ]


def test_bad_input_fails_fast_with_one_clear_line(tiny_model, tiny_data, tmp_path, capsys):
    """Each case goes through the same entry point as the command line, in-process to spare 9 interpreter starts."""
    import os

    from llmft.train import cli, make_parser

    env_before = dict(os.environ)
    parser = make_parser()
    for extra, message in _bad(tmp_path, tiny_data):
        out = tmp_path / "never"
        argv = [
            "--model_name_or_path",
            str(tiny_model),
            "--dataset_name",
            str(tiny_data),
            "--output_dir",
            str(out),
            "--report_to",
            "none",
            *extra,
        ]
        assert cli(parser, argv) == 2, extra
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("llmft train: error:")]
        assert len(errors) == 1 and message in errors[0], (extra, err[-2000:])
        assert not out.exists() or not any(out.iterdir())  # nothing written, nothing loaded
    # failed before any distributed set-up. threadpoolctl (imported by scipy, which datasets imports while loading a
    # file when scipy is installed, as lm-eval installs it) sets KMP_DUPLICATE_LIB_OK on import: not llmft's doing.
    after = {k: v for k, v in os.environ.items() if k != "KMP_DUPLICATE_LIB_OK" or k in env_before}
    assert after == env_before


def test_bad_input_from_the_llmft_command_exits_2_without_traceback(tiny_model, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a" "completion": "b"}\n')
    proc = run(
        [
            str(Path(PYTHON).parent / "llmft"),
            "train",
            "--model_name_or_path",
            str(tiny_model),
            "--dataset_name",
            str(bad),
            "--output_dir",
            str(tmp_path / "out"),
            "--report_to",
            "none",
        ]
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(f"llmft train: error: {bad}: line 2 is not valid JSON")
    assert "Traceback" not in proc.stderr


STUCK_WORKER_RANK = """
import sys, time
from accelerate.data_loader import DataLoaderShard
from llmft.training.callbacks import checkpoint_callbacks

class OneItemHangs:  # a worker that never finishes its item, the case torch answers with SIGTERM
    def __len__(self):
        return 40
    def __getitem__(self, i):
        if i == 3:
            time.sleep(10**6)
        return i

_, GracefulStop = checkpoint_callbacks()
loader = DataLoaderShard(OneItemHangs(), batch_size=1, num_workers=2)
GracefulStop(None).on_train_begin(None, None, None, train_dataloader=loader)
batches = iter(loader)
print([int(next(batches)) for _ in range(2)], flush=True)  # accelerate reads one ahead: not item 3
if sys.argv[1] == "shutdown":
    del batches  # torch: sentinel, join 5 s, SIGTERM (ignored by our workers), join 5 s
# "alive": a run stopped mid-epoch exits with its iterator alive; at exit torch no longer shuts workers down
print("exiting", flush=True)
"""


@pytest.mark.parametrize("iterator", ["shutdown", "alive"])
def test_dataloader_workers_do_not_keep_the_rank_from_exiting(tmp_path, iterator):
    """Workers ignore SIGTERM (below), which torch and multiprocessing use to end workers at shutdown and at exit;
    without llmft's exit hook the rank then waits for them forever (a 2-node Slurm job sat at torchrun's exit barrier
    after its stop checkpoint: the stopped run's iterator was still alive at exit). Both ways out: the iterator shut
    down with one worker stuck, and the iterator alive at exit; the exit is quiet (no "worker killed" error)."""
    script = tmp_path / "rank.py"
    script.write_text(STUCK_WORKER_RANK)
    proc = run([PYTHON, str(script), iterator], timeout=300, check=True)  # without the hook: forever
    assert proc.stdout.split("\n")[:2] == ["[0, 1]", "exiting"]
    assert "Traceback" not in proc.stderr and "killed by signal" not in proc.stderr, proc.stderr


STOP_VOTE_SCRIPT = """
import json, sys, time
from types import SimpleNamespace
import torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
from llmft.training.callbacks import checkpoint_callbacks
_, GracefulStop = checkpoint_callbacks()
votes, all_reduce = [0], dist.all_reduce
def counted(*a, **k):
    votes[0] += 1
    return all_reduce(*a, **k)
dist.all_reduce = counted
step_seconds, request_step, out = float(sys.argv[1 + rank]), int(sys.argv[3]), sys.argv[4]
stop = GracefulStop(None)
state = SimpleNamespace(global_step=0, max_steps=10**6, is_world_process_zero=rank == 0)
asked_at = None
while True:
    time.sleep(step_seconds)
    dist.barrier()  # the gradient all-reduce: the ranks step together
    state.global_step += 1
    if rank == 1 and state.global_step == request_step:  # a signal that reached one rank only
        stop._request(None, None)
        asked_at = time.monotonic()
    control = SimpleNamespace(should_save=False, should_training_stop=False)
    stop.on_step_end(SimpleNamespace(device="cpu"), state, control)
    if control.should_training_stop:
        assert control.should_save and stop.stopped_at == state.global_step
        break
with open(f"{out}.{rank}", "w") as f:
    json.dump({"stopped": state.global_step, "votes": votes[0], "delay": time.monotonic() - asked_at if asked_at else None}, f)
dist.barrier()
dist.destroy_process_group()
"""


def test_stop_votes_are_spaced_by_step_time_and_every_rank_stops_at_the_same_step(tmp_path):
    """The ranks vote on a stop request (so all stop at one step) every k steps, k steps taking at most 0.5 s:
    fast steps do not pay a collective each, slow steps still vote every step, and a request seen by one rank
    stops every rank at the same step within that bound."""
    from llmft.training.callbacks import STOP_VOTE_MAX_DELAY_S, steps_between_stop_votes

    assert steps_between_stop_votes(0.6, 10) == 8  # 60 ms steps: vote every 8th
    assert steps_between_stop_votes(30.0, 1) == steps_between_stop_votes(0.6, 1) == 1  # slow steps: every step
    assert steps_between_stop_votes(0.0, 0) == 1 and steps_between_stop_votes(1e-6, 100) == 1000  # bounded
    script = tmp_path / "vote.py"
    script.write_text(STOP_VOTE_SCRIPT)
    launch = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]

    def ranks(rank0_step_s, rank1_step_s, request_step, name):
        run(
            launch + [str(rank0_step_s), str(rank1_step_s), str(request_step), str(tmp_path / name)],
            check=True,
            timeout=120,
        )
        return [json.loads((tmp_path / f"{name}.{r}").read_text()) for r in (0, 1)]

    fast = ranks(0.005, 0.02, 60, "fast")  # ~20 ms steps
    assert fast[0]["stopped"] == fast[1]["stopped"] >= 60
    assert fast[1]["delay"] < 2 * STOP_VOTE_MAX_DELAY_S  # the bound, with room for a loaded machine
    assert fast[0]["votes"] == fast[1]["votes"] <= fast[0]["stopped"] / 4  # far fewer votes than steps

    slow = ranks(0.3, 0.3, 3, "slow")
    assert slow[0]["stopped"] == slow[1]["stopped"] == 3  # a step longer than the bound: a vote every step
    assert slow[0]["votes"] == slow[1]["votes"] == 3


def test_dataloader_workers_leave_stop_signals_to_their_rank():
    """Slurm sends SIGTERM to every process of a step (requeue, preemption). A DataLoader worker killed by it used to
    end the rank ("DataLoader worker ... is killed by signal: Terminated") before the stop's checkpoint; found by the
    requeued Slurm job once llmft's CPU split gave each rank dataloader workers. The workers now ignore it, the rank
    records the stop request, and the epoch's data keeps coming."""
    import multiprocessing
    import signal
    import time

    from accelerate.data_loader import DataLoaderShard

    from llmft.training.callbacks import checkpoint_callbacks

    _, GracefulStop = checkpoint_callbacks()
    stop = GracefulStop(None)
    loader = DataLoaderShard(list(range(40)), batch_size=1, num_workers=2)  # what the Trainer trains from
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        stop.on_train_begin(None, None, None, train_dataloader=loader)
        batches = iter(loader)
        seen = [int(next(batches))]
        workers = multiprocessing.active_children()
        assert len(workers) == 2
        for worker in workers:
            os.kill(worker.pid, signal.SIGTERM)
            os.kill(worker.pid, signal.SIGUSR1)
        time.sleep(0.5)
        assert all(worker.is_alive() for worker in workers)
        seen += [int(b) for b in batches]
        assert seen == list(range(40))
        os.kill(os.getpid(), signal.SIGTERM)  # the rank itself: a stop request, not an exit
        assert stop.requested
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_save_total_limit_never_deletes_the_last_complete_checkpoint_for_an_incomplete_one(
    tiny_model, tiny_data, tmp_path
):
    """Issue 21, as a user met it: run 1 (--save_steps 2 --save_total_limit 2) leaves checkpoint-2 and -4; a stop save
    cut off leaves checkpoint-5 without its marker. The rerun resumes from 4 and moves 5 aside, saying so; while 6 is
    written (before it is complete) 4 is still there and complete; only once 8 is complete is 4 deleted.
    transformers' own rotation (inside the save, by step, counting 5) deleted 4 while 6 was being written."""
    out, probe = tmp_path / "run", tmp_path / "probe"
    flags = ("--save_steps", 2, "--save_total_limit", 2, "--global_batch_size", 4, "--per_device_train_batch_size", 4)
    run(train_cmd(tiny_model, tiny_data, out, "--max_steps", 4, *flags, nproc=1), check=True)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    cut = out / "checkpoint-5"  # what a stop save killed mid-write leaves: some files, no marker
    shutil.copytree(out / "checkpoint-4", cut)
    (cut / "llmft_complete.json").unlink()
    for shard in cut.glob("global_step4/*optim_states.pt"):
        shard.unlink()

    cmd = train_cmd(tiny_model, tiny_data, out, "--max_steps", 8, *flags, nproc=1)
    second = run(
        [cmd[0], str(PROBE), *cmd[3:]],
        check=True,
        LLMFT_PROBE_DIR=str(probe),
        LLMFT_PROBE_LISTING="1",
        LLMFT_PROBE_MOMENTS="0",
    )
    assert f"llmft: resuming from {out / 'checkpoint-4'}" in second.stdout
    listing = {step: json.loads((probe / f"listing-at-save-{step}.json").read_text()) for step in (6, 8)}
    assert listing[6] == {"checkpoint-2": True, "checkpoint-4": True, "checkpoint-6": False}, listing
    assert listing[8] == {"checkpoint-4": True, "checkpoint-6": True, "checkpoint-8": False}, listing
    assert (
        f"llmft: moved checkpoint-5 aside to {out / 'incomplete' / 'checkpoint-5'}: checkpoint-5 has no "
        "llmft_complete.json: it was interrupted while saving; never resumed from, delete it to free its space"
    ) in second.stdout
    assert (out / "incomplete" / "checkpoint-5").is_dir()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-6", "checkpoint-8"]
    assert "llmft: deleted checkpoint-4 (--save_total_limit 2 counts complete checkpoints only)" in second.stdout
    assert [s for s, *_ in steps(second.stdout)] == [5, 6, 7, 8]


STOP_FILE_SCRIPT = """
import json, sys
from types import SimpleNamespace
import torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
from llmft.training.callbacks import checkpoint_callbacks
_, GracefulStop = checkpoint_callbacks()
stop = GracefulStop(sys.argv[1 + rank])  # each rank's view of the stop file: rank 1's node sees it, rank 0's not yet
state = SimpleNamespace(global_step=0, max_steps=10**6, is_world_process_zero=rank == 0)
stopped = None
while state.global_step < 20 and stopped is None:
    dist.barrier()  # the gradient all-reduce: the ranks step together
    state.global_step += 1
    control = SimpleNamespace(should_save=False, should_training_stop=False)
    stop.on_step_end(SimpleNamespace(device="cpu"), state, control)
    if control.should_training_stop:
        stopped = state.global_step
with open(f"{sys.argv[3]}.{rank}", "w") as f:
    json.dump(stopped, f)
dist.barrier()
dist.destroy_process_group()
"""


def test_every_rank_reads_the_stop_file_and_the_vote_stops_them_all(tmp_path):
    """Rank 0 is often on another node than the batch shell that wrote the stop file, and NFS can hide a new file
    there for up to a minute: a 2-process run in which only rank 1 sees the file stops both, at the first vote."""
    seen, unseen = tmp_path / "rank1-node" / "STOP", tmp_path / "rank0-node" / "STOP"
    seen.parent.mkdir()
    unseen.parent.mkdir()
    seen.touch()
    script = tmp_path / "stopfile.py"
    script.write_text(STOP_FILE_SCRIPT)
    run(
        [
            PYTHON,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(script),
            str(unseen),
            str(seen),
            str(tmp_path / "stopped"),
        ],
        check=True,
        timeout=120,
    )
    assert [json.loads((tmp_path / f"stopped.{r}").read_text()) for r in (0, 1)] == [1, 1]

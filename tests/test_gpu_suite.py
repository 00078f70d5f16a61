"""bench/gpu_suite.py, the one prepared GPU run, proven on CPU first (--dry_run): a GPU minute is never lost to a bug."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from conftest import PYTHON, REPO, run

sys.path.insert(0, str(REPO / "bench"))


def rows_of(out) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


# One setting of each kind the GPU run has, in the suite's order: a long-context row (LoRA on the 8B model's key, with
# the tiled MLP), the doubling search, full fine-tuning under ZeRO-3, the packed run and its compiled, profiled lever,
# the install step, llmft's defaults beside the plain script, a lever that needs a GPU extra. The other rows differ from
# these only in flags and numbers, which test_the_gpu_run_is_the_issues_settings_in_its_order_of_priority checks; each
# run costs the 2-core CI about 40 s (the compiled one about 2 minutes).
DRY_RUN_ROWS = [
    "long-1k",
    "long-doubling",
    "long-full-z3-offload",
    "packed",
    "packed-fast",
    "prebuild",
    "default",
    "default-plain",
    "packed-no-liger",
]
DRY_SEARCH = ["long-planned-longest", "long-4k", "long-8k"]  # what long-doubling records: the planner, then 2 runs


def test_the_dry_run_measures_one_setting_of_each_kind_llmft_beside_plain_trl(tmp_path):
    """Each kind of setting of the GPU run runs on CPU with a tiny Llama through the same code: llmft and the plain TRL
    script each write their rates, the plain rows carry the llmft / plain ratio, and every row is kept as it comes."""
    from gpu_suite import settings

    work, kept = tmp_path / "work", tmp_path / "kept"  # kept: the device call's $OUT, without the gigabytes
    cmd = [PYTHON, "bench/gpu_suite.py", "--dry_run", "--steps", "2", "--out", str(work), "--results", str(kept)]
    cmd += ["--only", *reversed(DRY_RUN_ROWS)]  # --only keeps the suite's order, whatever order it is given in
    proc = run(cmd, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not (kept / "models").exists()
    assert (work / "models").is_dir() and not any((work / "models").iterdir())  # each removed after its last run
    rows = rows_of(kept)
    assert [s.name for s in settings(dry=True) if s.name in DRY_RUN_ROWS] == DRY_RUN_ROWS
    i = DRY_RUN_ROWS.index("long-doubling")
    assert [r["name"] for r in rows] == DRY_RUN_ROWS[:i] + DRY_SEARCH + DRY_RUN_ROWS[i + 1 :]
    search, rows = rows[i : i + 3], rows[:i] + rows[i + 3 :]
    assert search[0]["planned_longest"] == 2**21  # a tiny Llama on this machine: no limit below its positions
    for r in search[1:] + [rows[0]]:  # the long rows: one sequence a step, host RAM beside the planner's
        assert "error" not in r and r["long"] and r["tokens_per_second"] > 0, r
        assert r["plan_fits"] is True and r["host_gib"] > 0 and r["plan_host_gib"] > 0, r
    assert [r["length"] for r in search[1:]] == [4096, 8192]  # doubling from the last fixed length, 2048
    for r in rows:
        if r["name"] == "packed-no-liger" and "error" in r:  # Liger is a GPU extra
            assert r["error"] == "not run: liger_kernel is not installed here"
            continue
        assert "error" not in r, r
        if r["who"] == "prebuild":  # the install step on a CPU machine: its one line, nothing built
            assert r["said"] == ["llmft prebuild: this torch is a CPU build: no DeepSpeed GPU op to prebuild"], r
            continue
        assert r["tokens_per_second"] > 0 and r["wall"] > 0, r
        assert r["mfu"] is None and r["peak_gpu_memory_gib"] is None  # no GPU: said as n/a, never made up
    assert all(r["startup_seconds"] for r in rows if r["who"] == "llmft" and "error" not in r)
    measured = {r["name"] for r in rows + search[1:] if "error" not in r and r["who"] != "prebuild"}
    kept_files = {p.name for p in (kept / "summaries").iterdir()}  # each run's whole summary, as it came
    assert kept_files == {f"{name}.json" for name in measured} | {"packed-fast.profile.txt"}
    text = (kept / "table.md").read_text()
    assert "DRY RUN (CPU, tiny Llama)" in text and "GSM8K train (200 problems, 512-token BPE" in text
    assert text.count("(llmft / plain)") == 1  # the default pair
    assert "Long context (one sequence a step)" in text and "the planner's longest: 2,097,152" in text
    fast = next(r for r in rows if r["name"] == "packed-fast")  # profiled after its compile: where the step went
    assert fast["profile"].startswith("llmft --profile_step 1:") and "Where packed-fast's step went" in text
    assert (kept / "summaries" / "packed-fast.profile.txt").read_text() == fast["profile"]
    # the plain script trained with the DeepSpeed config llmft resolved for the same setting
    plain_log = (kept / "log.txt").read_text()
    assert str(work / "runs" / "default" / "ds_config.json") in plain_log


def test_the_runs_train_on_all_of_gsm8ks_training_split_as_prompt_completion(tmp_path):
    """The issue's data: GSM8K's 7,473 training problems (carried in the repository, since the GPU machine reaches no
    hub), each a prompt ending in "Answer:" and the worked answer ending in its "#### N" line; and a tokenizer that
    splits numbers as Llama 3 does, so a run trains on realistic token counts."""
    from gpu_suite import gsm8k, gsm8k_tokenizer

    rows = [json.loads(line) for line in gsm8k(tmp_path / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 7473 and set(rows[0]) == {"prompt", "completion"}
    assert rows[0]["prompt"].startswith("Question: Natalia sold clips to 48 of her friends in April")
    assert all(r["prompt"].endswith("\nAnswer:") and "\n#### " in r["completion"] for r in rows)
    tokenizer = gsm8k_tokenizer(gsm8k(tmp_path / "few.jsonl", 300), 2000)
    split = [piece for piece, _ in tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(" 12345 clips")]
    assert split == ["Ġ", "123", "45", "Ġclips"]  # numbers in groups of up to 3 digits, as Llama 3 splits them


def test_a_run_past_the_budget_is_recorded_not_started(tmp_path):
    """A lent GPU's minutes run out: the rows not reached are written as such, and the suite still ends 0."""
    proc = run([PYTHON, "bench/gpu_suite.py", "--dry_run", "--budget_s", "0", "--out", str(tmp_path)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = rows_of(tmp_path)
    assert rows and all(r["error"] == "not run: past --budget_s 0" for r in rows)
    assert not (tmp_path / "runs").exists()


def test_without_cuda_the_real_run_refuses_and_says_how_to_check_on_cpu(tmp_path):
    proc = run([PYTHON, "bench/gpu_suite.py", "--out", str(tmp_path)], timeout=300, CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 2 and "--dry_run" in proc.stdout


def test_the_gpu_run_is_the_issues_settings_in_its_order_of_priority():
    """What the lent minutes go to first: the default path against plain TRL, then packed, the MFU levers, 8B LoRA
    at sequence 4096, llmft's install step (prebuild) and the start-up after it on an empty op cache; the 1B runs at sequence 2048, micro-batch 8 x 4."""
    from gpu_suite import SHAPES, checkpointing, llmft_command, plain_arch_list, settings

    real = settings(dry=False)
    assert [s.name for s in real] == [
        "long-32k",  # issue 45 (1): long context first
        "long-64k",
        "long-128k",
        "long-doubling",
        "long-full-z3-offload",
        "packed",  # (2): the MFU combination against the packed run
        "packed-fast",
        "8b-lora",  # (3): 8B LoRA at 4096
        "8b-lora-no-ckpt",
        "8b-lora-fast",
        "8b-lora-no-ckpt-micro2",
        "prebuild",  # (4): a fresh node
        "startup",
        "default",  # issue 31's comparisons with plain TRL, and each lever alone
        "default-plain",
        "packed-plain",
        "packed-no-ckpt",
        "packed-no-liger",
        "packed-micro16",
        "dpo-sft-lora",  # issue 43's DPO rows (tests/test_gpu_suite_preference.py), run with --only
        "dpo-precomputed",
        "dpo-live",
    ]
    long = [s for s in real if s.name.startswith("long-")]
    assert {s.model for s in long} == {"llama-3.1-8b"} and {s.micro_batch * s.grad_accum for s in long} == {1}
    assert [s.max_length for s in long] == [32768, 65536, 131072, 262144, 32768]
    for s in long[:4]:  # LoRA with ALST's savers (its tiled loss: Liger's fused linear cross-entropy)
        assert s.data == "long" and "--use_peft" in s.flags
        assert [s.flags[s.flags.index(f) + 1] for f in ("--tiled_mlp", "--activation_offloading")] == ["true"] * 2
    assert (long[4].zero_stage, long[4].offload, "--use_peft" in long[4].flags) == (3, True, False)
    one_b = [s for s in real if s.model == "llama-3.2-1b"]
    assert {(s.max_length, s.micro_batch * s.grad_accum) for s in one_b} == {(2048, 32)}
    assert {s.micro_batch for s in one_b} == {8, 16}
    [lora] = [s for s in real if s.name == "8b-lora"]
    assert lora.model == "llama-3.1-8b" and lora.max_length == 4096 and lora.packing and "all-linear" in lora.flags
    [no_ckpt] = [s for s in real if s.name == "8b-lora-no-ckpt"]  # the same tokens a step, without recomputation
    assert (no_ckpt.micro_batch * no_ckpt.grad_accum, no_ckpt.max_length) == (8, 4096)
    assert checkpointing(no_ckpt.flags) == "false" and no_ckpt.flags[: len(lora.flags) - 1] == lora.flags[:-1]
    [fast] = [s for s in real if s.name == "8b-lora-fast"]  # that run again, compiled
    assert fast.flags == [*no_ckpt.flags, "--torch_compile", "true"] and fast.micro_batch == no_ckpt.micro_batch
    assert SHAPES["llama-3.2-1b"]["vocab_size"] == SHAPES["llama-3.1-8b"]["vocab_size"] == 128256
    assert [s.pair for s in real if s.who == "plain"] == ["default", "packed"]
    # the planner is asked about the run as it trains: TRL's default gradient checkpointing unless a flag says not
    assert [checkpointing(s.flags) for s in real if s.name in ("default", "packed-no-ckpt", "8b-lora")] == [
        "true",
        "true",
        "false",
    ]
    # the levers measure against TRL's defaults, given: llmft's own (recomputation off where it fits, compile on a long
    # run) would change what a row measures; the default row runs llmft's defaults as a user gets them
    by_name = {s.name: s for s in real}
    cmd = llmft_command(by_name["packed"], Path("m"), Path("d"), Path("o"), 12)
    assert cmd[-4:] == ["--gradient_checkpointing", "true", "--torch_compile", "false"]
    cmd = llmft_command(by_name["packed-fast"], Path("m"), Path("d"), Path("o"), 12)
    assert cmd[-6:] == ["--gradient_checkpointing", "false", "--torch_compile", "true", "--profile_step", "3"]
    cmd = llmft_command(by_name["default"], Path("m"), Path("d"), Path("o"), 12)
    assert "--gradient_checkpointing" not in cmd and "--torch_compile" not in cmd
    # the GPU image's TORCH_CUDA_ARCH_LIST=9.0a, which DeepSpeed's builder cannot read, is fixed for the plain script
    assert plain_arch_list({"TORCH_CUDA_ARCH_LIST": "9.0a"}) == {"TORCH_CUDA_ARCH_LIST": "9.0"}
    assert plain_arch_list({"TORCH_CUDA_ARCH_LIST": "9.0"}) == {} and plain_arch_list({}) == {}


def test_a_failed_run_is_recorded_by_its_error_not_torchruns_banner(tmp_path):
    """What the plain packed run printed when the lent H100's disk filled (2026-11-27): the row names the error."""
    from benchlib import Run
    from gpu_suite import exit_failure, plain_failure

    stderr = (
        "[rank0]: RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 9886529600 vs 9886529432\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
        "============================================================\n"
        "/work/main/bench/plain_trl_sft.py FAILED\n"
        "------------------------------------------------------------\n"
        "============================================================\n"
    )
    failed = Run("packed-plain", 150.8, "{'loss': '3.511'}\n", tmp_path, returncode=1, stderr=stderr)
    assert plain_failure(failed, tmp_path) == (
        "exit 1: [rank0]: RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 9886529600 vs "
        "9886529432"
    )
    full = Run(
        "prebuild", 15.0, "llmft prebuild: compiling\n", tmp_path, returncode=2, stderr="llmft prebuild: error: x\n"
    )
    assert exit_failure(full) == "exit 2: llmft prebuild: error: x"
    assert plain_failure(Run("p", 1.0, "", tmp_path), tmp_path) == "exit 0 without its --summary"


def test_the_reserved_peak_is_read_from_the_line_llmft_prints_at_the_end_of_a_gpu_run():
    """The planner's 10% fragmentation allowance is checked against what the allocator reserved: the suite reads it
    from the line llmft.training.host_memory prints (its own formatting, so a change there fails here)."""
    from gpu_suite import reserved_peak

    from llmft.training.host_memory import _gib

    line = f"llmft: GPU memory peak: rank 0 {_gib(25.4 * 2**30)} allocated, {_gib(27.93 * 2**30)} reserved"
    assert reserved_peak(f"step 12\n{line}\nllmft: host memory peak: ...") == 27.93
    assert reserved_peak("a CPU run prints no GPU line") is None


def test_the_long_context_predictions_in_bench_readme_are_the_planners(tmp_path):
    """bench/README.md's predictions for the GPU run to check (an H100 80GB and an H200, 128 GiB of host RAM) are what
    `python bench/gpu_suite.py --predict` prints today: a planner change that moves them fails here until the README
    says the new numbers."""
    from gpu_suite import predictions

    table = predictions(tmp_path)
    assert table in (REPO / "bench" / "README.md").read_text()
    rows = [line.split(" | ") for line in table.splitlines()[2:]]
    assert {r[0].strip("| ") for r in rows} == {"H100-80GB", "H200"}
    longest = [r for r in rows if "longest" in r[1]]  # both stop on host RAM at 128 GiB, as the README says
    assert [r[2] for r in longest] == ["262,144"] * 2 and all("host RAM" in r[-1] for r in longest)

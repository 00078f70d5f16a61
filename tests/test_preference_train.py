"""`llmft train --method dpo|kto|reward` (llmft.planning.methods): TRL's preference trainers on llmft's machinery.

Each run is real: `llmft train` in its own process on DeepSpeed (ZeRO-0 on one CPU rank, ZeRO-3 on two under
torchrun), against TRL's trainer run directly in this process on the same tiny model, data, seed and configuration.
"""

from __future__ import annotations

import ast
import json
import math
import re
import threading
import time
from pathlib import Path

import pytest
from conftest import PYTHON, REPO, run

from llmft.data.synthetic import make_examples, write_jsonl
from llmft.planning.methods import METHODS
from llmft.planning.world import free_port

STEPS = 20
LR = "5e-4"
COMMON = ("--max_length", 64, "--learning_rate", LR, "--save_strategy", "no", "--zero_stage", 0)
TRL_CONFIGS = {"dpo": "DPOConfig", "kto": "KTOConfig", "reward": "RewardConfig"}
TRL_TRAINERS = {"dpo": "DPOTrainer", "kto": "KTOTrainer", "reward": "RewardTrainer"}


def pairs(n: int = 64) -> list[dict]:
    """Explicit-prompt preference pairs: the right answer chosen, another prompt's answer rejected."""
    ex = make_examples(n)
    return [
        {"prompt": e["prompt"], "chosen": e["completion"], "rejected": ex[(i + 1) % n]["completion"]}
        for i, e in enumerate(ex)
    ]


def unpaired(n: int = 64) -> list[dict]:
    """KTO's unpaired records: every other one the right answer (desirable), the rest another prompt's."""
    ex = make_examples(n)
    return [
        {
            "prompt": e["prompt"],
            "completion": e["completion"] if i % 2 == 0 else ex[(i + 1) % n]["completion"],
            "label": i % 2 == 0,
        }
        for i, e in enumerate(ex)
    ]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("pref-data")
    return {
        "pairs": write_jsonl(pairs(), d / "pairs.jsonl"),
        "unpaired": write_jsonl(unpaired(), d / "unpaired.jsonl"),
        "held_out": write_jsonl(pairs(96)[64:], d / "held_out.jsonl"),
    }


def data_for(method: str, data: dict[str, Path]) -> Path:
    return data["unpaired"] if "unpaired_preference" in METHODS[method].formats else data["pairs"]


def llmft_cmd(method, model, dataset, out, *extra, nproc=1):
    # a port of its own: torchrun's default 29500 may be another test's at the same moment
    torchrun = [
        PYTHON,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(free_port()),
    ]
    launcher = torchrun if nproc > 1 else [PYTHON]
    return launcher + [
        "-m",
        "llmft.train",
        "--method",
        method,
        "--model_name_or_path",
        str(model),
        "--dataset_name",
        str(dataset),
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


def logged_losses(out: Path) -> list[float]:
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [e["loss"] for e in history if "loss" in e]


def step_losses(stdout: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"llmft: step (\d+)/\d+ loss ([\d.]+)", stdout)}


def trl_direct_losses(method: str, model: Path, dataset: Path, out: Path) -> list[float]:
    """TRL's trainer run directly, as its docs show: no DeepSpeed, the same seed, batch and configuration."""
    import trl
    from datasets import load_dataset
    from transformers import AutoTokenizer

    args = getattr(trl, TRL_CONFIGS[method])(
        output_dir=str(out),
        per_device_train_batch_size=4,
        max_steps=STEPS,
        learning_rate=float(LR),
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        seed=42,
        max_length=64,
        save_strategy="no",
        disable_tqdm=True,
        bf16=False,
    )
    trainer = getattr(trl, TRL_TRAINERS[method])(
        model=str(model),
        args=args,
        train_dataset=load_dataset("json", data_files=str(dataset), split="train"),
        processing_class=AutoTokenizer.from_pretrained(model),
    )
    trainer.train()
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


@pytest.fixture(scope="module")
def dpo_one_rank(tiny_model, data, tmp_path_factory) -> tuple[Path, str]:
    """`llmft train --method dpo` on one CPU rank, ZeRO-0, 20 steps of 4 pairs; shared by the tests below."""
    out = tmp_path_factory.mktemp("dpo") / "run"
    flags = ("--max_steps", STEPS, "--global_batch_size", 4, "--per_device_train_batch_size", 4, *COMMON)
    proc = run(llmft_cmd("dpo", tiny_model, data["pairs"], out, *flags), check=True)
    return out, proc.stdout


def test_the_first_dpo_loss_is_ln2_since_the_policy_is_its_reference(dpo_one_rank):
    out, stdout = dpo_one_rank
    assert logged_losses(out)[0] == pytest.approx(math.log(2), abs=1e-4)
    assert "llmft plan: method dpo" in stdout and "the global batch counts pairs" in stdout
    assert "perplexity" not in stdout  # exp(a preference loss) is not a perplexity
    record = json.loads((out / "llmft_run.json").read_text())
    assert record["method"] == "dpo"


@pytest.mark.parametrize("method", ["dpo", "kto", "reward"])
def test_llmft_losses_match_trls_trainer_run_directly(method, tiny_model, data, dpo_one_rank, tmp_path):
    """20 steps: llmft (its own process, DeepSpeed ZeRO-0, llmft's batch math and callbacks) and TRL's trainer run
    directly agree within 1e-3 at every step; the loss moves, so agreement is not two untrained runs."""
    dataset, entry, stdout = data_for(method, data), METHODS[method], ""
    if method == "dpo":
        out = dpo_one_rank[0]
    else:  # a held-out metric (a reward model's accuracy) on a file of its own: the training data stays TRL's
        out = tmp_path / method
        flags = ("--max_steps", STEPS, "--global_batch_size", 4, "--per_device_train_batch_size", 4, *COMMON)
        held_out = ("--eval_dataset_name", data["held_out"]) if entry.held_out_metric else ()
        stdout = run(llmft_cmd(method, tiny_model, dataset, out, *flags, *held_out), check=True).stdout
    ours = logged_losses(out)
    theirs = trl_direct_losses(method, tiny_model, dataset, tmp_path / "direct")
    assert len(ours) == len(theirs) == STEPS
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-3, (ours, theirs)
    assert max(ours) - min(ours) > 0.01  # it trained
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["tokens"] > 0 and summary["tokens_per_second"] > 0 and summary["tflops_per_gpu"] > 0
    if entry.held_out_metric:  # a reward model's accuracy on the held-out pairs, said and in run_summary.json
        value = summary[f"eval_{entry.held_out_metric}"]
        assert 0.0 <= value <= 1.0
        assert f"held-out {entry.held_out_metric}: {value:.4f}" in stdout


def test_the_reference_forward_is_counted_in_the_flops():
    """DPO's live reference adds a forward (2N a token) to the policy's 6N; precomputed log-probs add nothing."""
    from llmft.training.metrics import FlopShape, training_flops

    n = 1_000_000
    policy = FlopShape(n, n, 2, 64)
    with_reference = FlopShape(n, n, 2, 64, reference_params=n)
    assert training_flops(policy, 1000, 0) == 6 * n * 1000
    assert training_flops(with_reference, 1000, 0) == 8 * n * 1000


def test_two_ranks_under_zero3_match_one_rank(tiny_model, data, dpo_one_rank, tmp_path):
    """The same global batch of 4 pairs on 2 ranks (2 each) under ZeRO-3, TRL's reference model sharded by
    DeepSpeed beside the policy, against 1 rank under ZeRO-0: every step's loss within 2%."""
    out = tmp_path / "zero3"
    flags = ("--max_steps", STEPS, "--global_batch_size", 4, "--per_device_train_batch_size", 2)
    flags += ("--max_length", 64, "--learning_rate", LR, "--save_strategy", "no", "--zero_stage", 3)
    run(llmft_cmd("dpo", tiny_model, data["pairs"], out, *flags, nproc=2), check=True)
    one, two = logged_losses(dpo_one_rank[0]), logged_losses(out)
    assert len(two) == STEPS
    assert max(abs(a - b) / a for a, b in zip(one, two)) < 0.02, (one, two)


def stop_after_checkpoint(out: Path, step: int, stop: Path) -> threading.Thread:
    """A stop request (the stop file, as a preempted job gets) once checkpoint-`step` is complete, from a thread; the
    runs wait at a later step for it (LLMFT_TEST_HOLD_AT_STEP), so they stop at a known step."""

    def request() -> None:
        deadline = time.time() + 600
        while time.time() < deadline and not (out / f"checkpoint-{step}" / "llmft_complete.json").exists():
            time.sleep(0.02)
        stop.touch()

    watcher = threading.Thread(target=request, daemon=True)
    watcher.start()
    return watcher


def test_a_dpo_run_stopped_and_resumed_gives_the_uninterrupted_runs_losses(tiny_model, data, dpo_one_rank, tmp_path):
    """A stop request (the stop file, as a preempted job gets) after the first complete checkpoint: the run saves
    and stops; the rerun resumes, and the 20 steps' losses are the uninterrupted run's (dpo_one_rank: the same flags
    without checkpoints, which do not change the losses)."""
    flags = ("--max_steps", STEPS, "--global_batch_size", 4, "--per_device_train_batch_size", 4, *COMMON)
    flags += ("--save_strategy", "steps", "--save_steps", 2)  # the last --save_strategy wins
    out, stop = tmp_path / "stopped", tmp_path / "STOP"

    watcher = stop_after_checkpoint(out, 4, stop)
    # the run waits at step 6 for the stop request (LLMFT_TEST_HOLD_AT_STEP), so it stops at a known step
    first = run(
        llmft_cmd("dpo", tiny_model, data["pairs"], out, *flags),
        check=True,
        LLMFT_STOP_FILE=str(stop),
        LLMFT_TEST_HOLD_AT_STEP="6",
    )
    watcher.join()
    stopped = 6
    assert f"stop requested; saved checkpoint-{stopped}" in first.stdout
    stop.unlink()
    second = run(llmft_cmd("dpo", tiny_model, data["pairs"], out, *flags), check=True, LLMFT_STOP_FILE=str(stop))
    assert f"resuming from {out / f'checkpoint-{stopped}'}" in second.stdout
    before, after = step_losses(first.stdout), step_losses(second.stdout)
    assert sorted(before) == list(range(1, stopped + 1)) and sorted(after) == list(range(stopped + 1, STEPS + 1))
    assert logged_losses(out) == pytest.approx(logged_losses(dpo_one_rank[0]), abs=1e-4)
    assert json.loads((out / "llmft_done.json").read_text())["global_step"] == STEPS


# ---- refusals: one line, exit 2, before anything trains


def test_another_methods_flag_is_refused_in_one_line(tiny_model, data, tmp_path):
    proc = run(llmft_cmd("sft", tiny_model, data["pairs"], tmp_path / "o", "--beta", "0.1"))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[-1] == (
        "llmft train: error: --beta is a flag of --method dpo, kto, not of --method sft: add --method dpo, or drop --beta"
    )
    assert "Traceback" not in proc.stderr


def refusal(argv: list[str], capsys) -> str:
    """`llmft train ARGV` in this process: exit code 2 and one line on stderr, which is returned."""
    from llmft.train import cli, make_parser

    assert cli(make_parser(), argv) == 2
    err = capsys.readouterr().err.strip().splitlines()  # (datasets' progress bars may come before it)
    errors = [line for line in err if line.startswith("llmft train: error: ")]
    assert len(errors) == 1 and err[-1] == errors[0] and "Traceback" not in err, err
    return errors[0].removeprefix("llmft train: error: ")


@pytest.mark.parametrize(
    "method, extra, message",
    [
        ("dpo", ["--packing"], "--packing is a flag of --method sft, not of --method dpo: add --method sft"),
        ("kto", ["--padding_free", "true"], "--padding_free is a flag of --method sft, dpo, not of --method kto"),
        (
            "reward",
            ["--padding_free", "true"],
            "--padding_free is a flag of --method sft, dpo, not of --method reward",
        ),
        ("dpo", ["--padding_free", "true"], "--padding_free True is not supported: TRL 1.16's DPOTrainer turns"),
        ("kto", ["--sync_ref_model", "true"], "--sync_ref_model True is not supported: it mixes the policy"),
        ("reward", ["--sequence_parallel", "2"], "--sequence_parallel 2 is not supported with --method reward"),
        ("orpo", [], "--method 'orpo' is not a training method; choose one of sft, dpo, kto, reward"),
        (
            "dpo",
            ["--prompt_template", "gsm8k"],
            "--prompt_template shape(s) SFT data; --method dpo trains on its records",
        ),
        ("kto", ["--dataset_format", "messages"], "--dataset_format messages is not a format --method kto trains on"),
    ],
)
def test_flags_a_method_cannot_take_are_refused(method, extra, message, tmp_path, capsys):
    argv = ["--method", method, "--model_name_or_path", "m", "--dataset_name", "d.jsonl"]
    assert refusal([*argv, "--output_dir", str(tmp_path / "o"), *extra], capsys).startswith(message)


def test_the_method_may_come_from_the_config_yaml(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("method: dpo\nmodel_name_or_path: m\ndataset_name: d.jsonl\npacking: true\n")
    line = refusal(["--config", str(config), "--output_dir", str(tmp_path / "o")], capsys)
    assert line.startswith("--packing is a flag of --method sft, not of --method dpo")


@pytest.mark.parametrize(
    "method, records, message",
    [
        (
            "sft",
            pairs(8),
            "the dataset holds preference records (prompt, chosen, rejected), which --method sft does "
            "not train on: train them with --method dpo or reward",
        ),
        (
            "sft",
            unpaired(8),
            "the dataset holds unpaired_preference records (prompt, completion, label), which "
            "--method sft does not train on: train them with --method kto",
        ),
        (
            "dpo",
            make_examples(8),
            '--method dpo trains on {"prompt", "chosen", "rejected"} or {"chosen", "rejected"} pairs; this dataset has '
            "prompt_completion data; for SFT data use --method sft",
        ),
        ("kto", pairs(8), '--method kto trains on {"prompt", "completion", "label"} records (label true or false)'),
        ("kto", [{**r, "label": "yes"} for r in unpaired(8)], "record 1: label 'yes' is not a boolean; KTO's label"),
    ],
)
def test_data_of_another_method_is_refused_in_one_line(method, records, message, tiny_model, tmp_path, capsys):
    dataset = write_jsonl(records, tmp_path / "d.jsonl")
    argv = ["--method", method, "--model_name_or_path", str(tiny_model), "--dataset_name", str(dataset)]
    assert refusal([*argv, "--output_dir", str(tmp_path / "o"), "--max_steps", "1"], capsys).startswith(message)


def test_a_reward_model_needs_a_base_with_a_classification_class(tiny_model, tmp_path, capsys):
    """CodeGen has no AutoModelForSequenceClassification class: refused before any weight loads."""
    import shutil

    from transformers import CodeGenConfig

    base = tmp_path / "codegen"
    shutil.copytree(tiny_model, base)
    (base / "config.json").unlink()
    CodeGenConfig(n_layer=1, n_embd=32, n_head=2, vocab_size=512).save_pretrained(base)
    dataset = write_jsonl(pairs(8), tmp_path / "d.jsonl")
    argv = ["--method", "reward", "--model_name_or_path", str(base), "--dataset_name", str(dataset)]
    line = refusal([*argv, "--output_dir", str(tmp_path / "o")], capsys)
    assert line.startswith("--method reward puts a one-output score head on the base, but its architecture (codegen)")


def test_no_code_outside_the_method_table_asks_which_method_it_runs():
    """A method is one entry in llmft/planning/methods.py: no `method == ...`, `.name == "dpo"` or `"dpo" == ...`
    comparison anywhere else in llmft/ (a fourth method would have to find and extend each)."""
    names = set(METHODS)
    found = []
    for path in sorted((REPO / "llmft").rglob("*.py")):
        if path == REPO / "llmft" / "planning" / "methods.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            named = any(
                (isinstance(s, ast.Name) and "method" in s.id)
                or (isinstance(s, ast.Attribute) and ("method" in s.attr or s.attr == "name"))
                for s in sides
            )
            literal = any(isinstance(s, ast.Constant) and s.value in names for s in sides)
            if literal and (named or any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops)):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert found == []


def test_a_jobs_run_directory_names_its_method_and_an_sft_run_keeps_its_own():
    """runs/<name>-<key>: METHOD=dpo joins the key and names the method ("dpo-1a2b3c4d"); METHOD=sft, or none, is
    the key an SFT job had before --method existed."""
    import dataclasses

    from llmft.launch import job, knobs

    k = knobs.resolve({}, ["MODEL=org/m", "DATASET=org/d"])
    sft = dataclasses.replace(k, values={**k.values, "METHOD": "sft"})
    dpo = dataclasses.replace(k, values={**k.values, "METHOD": "dpo"})
    assert job.run_key(sft) == job.run_key(k) and re.fullmatch(r"[0-9a-f]{8}", job.run_key(k))
    assert re.fullmatch(r"dpo-[0-9a-f]{8}", job.run_key(dpo)) and job.run_key(dpo)[4:] != job.run_key(k)


def test_llmft_eval_scores_a_dpo_checkpoint_and_refuses_a_reward_model_in_one_line(tiny_model, data, tmp_path):
    """`llmft eval` works unchanged on a DPO run's checkpoint (a causal LM, like SFT's); a reward model's checkpoint
    (a one-output score head) is one line naming what it is, exit 2, before any shard is read."""
    gsm8k = write_jsonl(
        [
            {"question": e["prompt"], "answer": f"{e['completion']}\n#### {e['completion'].rstrip('.').split()[-1]}"}
            for e in make_examples(4, seed=5)
        ],
        tmp_path / "gsm8k" / "test.jsonl",
    )
    steps = ("--max_steps", 2, "--save_steps", 2, "--global_batch_size", 4, "--per_device_train_batch_size", 4)
    common = ("--max_length", 64, "--learning_rate", LR, "--zero_stage", 0)
    evaluate = ["eval", "--tasks", "gsm8k", "--task_data", f"gsm8k={gsm8k}", "--num_fewshot", "0", "--limit", "2"]
    evaluate += ["--gen_kwargs", "max_gen_toks=4", "--batch_size", "2"]
    llmft = str(Path(PYTHON).parent / "llmft")
    for method, dataset in (("dpo", data["pairs"]), ("reward", data["pairs"])):
        out = tmp_path / method
        run(llmft_cmd(method, tiny_model, dataset, out, *steps, *common), check=True)
        proc = run([llmft, *evaluate[:1], str(out), *evaluate[1:]], timeout=600)
        if method == "dpo":
            assert proc.returncode == 0, proc.stderr[-3000:]
            [line] = [json.loads(x) for x in (out / "eval" / "summary.jsonl").read_text().splitlines()]
            assert line["step"] == 2 and line["task"] == "gsm8k"
        else:
            assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
            [said] = [x for x in proc.stderr.splitlines() if x.startswith("llmft eval: error")] or [proc.stderr]
            assert "is a reward model" in said and "eval_accuracy" in said, proc.stderr[-3000:]


def test_a_dpo_run_on_two_ranks_resumes_on_one_keeping_the_global_batch_and_logs_its_rewards_to_wandb(
    tiny_model, data, dpo_one_rank, tmp_path
):
    """Elastic resume and W&B, as SFT has them: 2 ranks under ZeRO-2 stop after a complete checkpoint (a stop
    request at a known step); the rerun on 1 rank resumes through a universal checkpoint with the global batch of 4
    pairs kept, trains the remaining steps once each, and its losses follow the uninterrupted run's; W&B (offline)
    holds DPO's rewards beside the loss."""
    from wandb_file import run_info

    out, stop, wandb_dir = tmp_path / "elastic", tmp_path / "STOP", tmp_path / "wandb"
    wandb_dir.mkdir()
    flags = ("--max_steps", STEPS, "--global_batch_size", 4, "--max_length", 64, "--learning_rate", LR)
    flags += ("--zero_stage", 2, "--save_steps", 2, "--report_to", "wandb")
    env = {"LLMFT_STOP_FILE": str(stop), "WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir)}

    watcher = stop_after_checkpoint(out, 4, stop)
    first = run(
        llmft_cmd("dpo", tiny_model, data["pairs"], out, *flags, "--per_device_train_batch_size", 2, nproc=2),
        check=True,
        LLMFT_TEST_HOLD_AT_STEP="6",
        **env,
    )
    watcher.join()
    assert "stop requested; saved checkpoint-6" in first.stdout
    stop.unlink()
    second = run(
        llmft_cmd("dpo", tiny_model, data["pairs"], out, *flags, "--per_device_train_batch_size", 2), check=True, **env
    )
    assert re.search(
        r"resuming checkpoint-6 written by 2 ranks on 1 ranks: universal checkpoint \S+ \(converted in \d+ s\), "
        r"accumulation 1 -> 2, global batch 4 kept",
        second.stdout,
    ), second.stdout
    assert sorted(step_losses(second.stdout)) == list(range(7, STEPS + 1))
    ours, uninterrupted = logged_losses(out), logged_losses(dpo_one_rank[0])
    assert len(ours) == STEPS
    assert all(abs(a - b) <= 0.02 * b for a, b in zip(ours, uninterrupted)), (ours, uninterrupted)
    [wandb_file] = sorted(wandb_dir.rglob("run-*.wandb"))[-1:]
    logged = {key for row in run_info(wandb_file)["history"] for key in row}
    assert {"train/rewards/chosen", "train/rewards/rejected", "train/rewards/accuracies", "train/loss"} <= logged

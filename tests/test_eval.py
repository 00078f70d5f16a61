"""`llmft eval`: lm-evaluation-harness tasks on ZeRO checkpoints, run directories and exported models, read from
local files (--task_data) with nothing fetched; GSM8K scored as llmft's own scorer scored it before the harness
replaced it; perplexity logged during training."""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import PYTHON, run

from llmft import eval as ev
from llmft.data.synthetic import make_examples, write_jsonl
from llmft.training.metrics import add_perplexity

GSM8K_REFERENCE = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"

# llmft's own GSM8K scorer (removed: the harness scores now) was tested on these predictions of GSM8K_REFERENCE:
# (prediction, strict match, flexible match). The harness must give the same figures.
OLD_LLMFT_CASES = [
    ("She sold 24 in May, so 48+24=72.\n#### 72", True, True),
    ("The answer is 72.", False, True),  # no '####': only the last number counts
    ("#### 72\nThen she bought 5 more.", True, False),  # strict takes the first '####', flexible the last number
    ("#### $72", False, True),  # strict's pattern needs a digit right after '#### '
    ("So the total is $72.", False, True),  # '$' and the trailing '.' are ignored
    ("#### 1,072", False, False),
    ("I don't know.", False, False),  # nothing extracted: wrong, not an error
    ("#### 72.00", False, False),  # the harness compares strings, not values
]


def test_training_logs_perplexity_beside_eval_loss():
    assert add_perplexity({"eval_loss": math.log(4.0)})["eval_perplexity"] == pytest.approx(4.0)
    assert "eval_perplexity" not in add_perplexity({"loss": 1.0})


@pytest.fixture
def no_network(monkeypatch):
    """Any connection to a non-local address fails the test: the harness must read only the local files."""
    real_connect = socket.socket.connect

    def connect(sock, address, *args):
        host = address[0] if isinstance(address, tuple) else address
        if isinstance(host, str) and host not in ("127.0.0.1", "localhost", "::1") and not host.startswith("/"):
            raise AssertionError(f"llmft eval tried to reach {address}")
        return real_connect(sock, address, *args)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def gsm8k_records(n: int, seed: int) -> list[dict]:
    """Records in GSM8K's format (question; answer ending in '#### N'), generated in code."""
    rows = []
    for e in make_examples(n, seed=seed):
        last = e["completion"].rstrip(".").split()[-1]
        rows.append({"question": e["prompt"], "answer": f"{e['completion']}\n#### {last}"})
    return rows


def eval_args(checkpoints, tmp_path: Path, **overrides) -> SimpleNamespace:
    test = write_jsonl(gsm8k_records(6, seed=5), tmp_path / "gsm8k" / "test.jsonl")
    train = write_jsonl(gsm8k_records(4, seed=6), tmp_path / "gsm8k" / "train.jsonl")
    values = dict(
        checkpoint=[str(c) for c in checkpoints],
        tasks="gsm8k",
        task_data=[f"gsm8k={test}", f"gsm8k:train={train}"],
        num_fewshot=2,
        limit=None,
        batch_size="auto",
        gen_kwargs="max_gen_toks=12",
        apply_chat_template=None,
        fewshot_as_multiturn=False,
        max_length=None,
        include_path=None,
        log_samples=True,
        seed=1234,
        output=None,
        model_name=None,
        device="cpu",
        dtype="auto",
        trust_checkpoint=False,
    )
    values.update(overrides)
    return SimpleNamespace(**values)


def test_gsm8k_through_the_harness_gives_the_old_llmft_exact_match_figures(tmp_path, no_network):
    """The harness's gsm8k task (its prompt, filters and metric), fed the predictions llmft's scorer was tested on,
    scores each one as llmft did: strict 2/8, flexible 4/8."""
    import lm_eval
    from lm_eval.api.model import LM

    records = [
        {"question": f"Natalia sold clips to {i} of her friends. How many clips?", "answer": GSM8K_REFERENCE}
        for i in range(len(OLD_LLMFT_CASES))
    ]
    data = write_jsonl(records, tmp_path / "gsm8k_test.jsonl")

    class Replay(LM):
        """A model whose answer to the i-th question is the i-th old prediction."""

        def generate_until(self, requests):
            out = []
            for r in requests:
                context, gen_kwargs = r.args
                assert context.startswith("Question: Natalia sold clips to ") and context.endswith("\nAnswer:")
                assert "Question:" in gen_kwargs["until"]  # the harness's own stop sequences
                out.append(OLD_LLMFT_CASES[int(context.split("to ")[1].split()[0])][0])
            return out

        def loglikelihood(self, requests):
            raise NotImplementedError

        def loglikelihood_rolling(self, requests):
            raise NotImplementedError

    args = eval_args([], tmp_path, task_data=[f"gsm8k={data}"], num_fewshot=0)
    manager, tasks = ev.task_manager(args, tmp_path / "tasks")
    results = lm_eval.simple_evaluate(
        model=Replay(), tasks=tasks, task_manager=manager, num_fewshot=0, log_samples=True
    )
    scores = results["results"]["gsm8k"]
    assert scores["exact_match,strict-match"] == pytest.approx(2 / 8)
    assert scores["exact_match,flexible-extract"] == pytest.approx(4 / 8)
    by_filter = {}
    for sample in results["samples"]["gsm8k"]:
        by_filter.setdefault(sample["filter"], {})[sample["doc_id"]] = bool(sample["exact_match"])
    assert [by_filter["strict-match"][i] for i in range(8)] == [c[1] for c in OLD_LLMFT_CASES]
    assert [by_filter["flexible-extract"][i] for i in range(8)] == [c[2] for c in OLD_LLMFT_CASES]
    assert results["configs"]["gsm8k"]["dataset_path"] == "json" and results["n-samples"]["gsm8k"]["effective"] == 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory, tiny_model, tiny_data) -> Path:
    """A real 2-process ZeRO-3 `llmft train` run (4 steps, a checkpoint at step 4)."""
    out = tmp_path_factory.mktemp("zero3") / "run"
    run(
        [
            PYTHON,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(_free_port()),
            "-m",
            "llmft.train",
            "--model_name_or_path",
            str(tiny_model),
            "--dataset_name",
            str(tiny_data),
            "--output_dir",
            str(out),
            "--max_steps",
            "4",
            "--save_steps",
            "4",
            "--global_batch_size",
            "8",
            "--per_device_train_batch_size",
            "2",
            "--learning_rate",
            "5e-3",
            "--report_to",
            "none",
            "--logging_steps",
            "1",
            "--zero_stage",
            "3",
        ],
        timeout=600,
        check=True,
    )
    return out


def samples(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def comparable(result_file: Path) -> dict:
    doc = json.loads(result_file.read_text())
    return {"results": doc["results"], "n-shot": doc["n-shot"], "n-samples": doc["n-samples"]}


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_checkpoint_scores_equal_its_exported_model(stage, run_with_eval, zero3_run, tmp_path, no_network):
    """gsm8k from local files on a ZeRO-2 (run_with_eval) and a ZeRO-3 run, read from the shards in memory, gives
    exactly the prompts, responses and scores of the same weights exported as a Hugging Face model."""
    import torch

    from llmft.checkpoint.export import write_model_dir
    from llmft.checkpoint.loader import load, resolve_checkpoint

    out = run_with_eval[0] if stage == 2 else zero3_run
    tag, _ = resolve_checkpoint([str(out)])
    loaded, exported = load(tag), tmp_path / "exported"  # fp32 on CPU, written as `llmft export --dtype float32` does
    write_model_dir(loaded.model, loaded.tokenizer, exported, torch.float32, 5 * 2**30, None)
    [zero] = ev.run(eval_args([out], tmp_path, output=tmp_path / "zero"))
    [hf] = ev.run(eval_args([exported], tmp_path, output=tmp_path / "hf"))

    assert zero["meta"]["checkpoint"] == str(tag) and zero["meta"]["step"] == (6 if stage == 2 else 4)
    assert (zero["meta"]["device"], zero["meta"]["dtype"], zero["meta"]["batch_size"]) == ("cpu", "float32", 8)
    assert comparable(zero["results_file"]) == comparable(hf["results_file"])
    [zs] = (tmp_path / "zero").glob("samples-step*-gsm8k-*.jsonl")
    [hs] = (tmp_path / "hf").glob("samples-*-gsm8k-*.jsonl")
    zero_samples, hf_samples = samples(zs), samples(hs)
    assert len(zero_samples) == 12  # 6 documents x 2 filters
    assert [(s["arguments"], s["resps"], s["filtered_resps"], s["exact_match"]) for s in zero_samples] == [
        (s["arguments"], s["resps"], s["filtered_resps"], s["exact_match"]) for s in hf_samples
    ]
    prompt = zero_samples[0]["arguments"][0][0]
    assert prompt.count("Question: ") == 3 and prompt.endswith(
        "\nAnswer:"
    )  # 2 shots from the train file, then the question
    assert any(s["resps"][0][0].strip() for s in zero_samples)  # the model generated something to compare
    [line] = zero["lines"]
    assert line["task"] == "gsm8k" and line["num_fewshot"] == 2 and line["n"] == 6
    assert set(line["metrics"]) == {"exact_match,strict-match", "exact_match,flexible-extract"}


def test_the_cli_writes_the_harness_json_and_a_summary_line_into_the_run(run_with_eval, tmp_path):
    """`llmft eval RUN` in a fresh process (offline): <run>/eval/ gets the harness's JSON and summary.jsonl, and
    the one-line summary is printed."""
    import shutil

    out = Path(shutil.copytree(run_with_eval[0], tmp_path / "run"))
    args = eval_args([out], tmp_path)
    proc = run(
        [
            str(Path(PYTHON).parent / "llmft"),
            "eval",
            str(out),
            "--tasks",
            "gsm8k",
            *[f for t in args.task_data for f in ("--task_data", t)],
            "--num_fewshot",
            "2",
            "--limit",
            "4",
            "--gen_kwargs",
            "max_gen_toks=8",
            "--batch_size",
            "3",
        ],
        check=True,
        timeout=600,
    )
    [result] = (out / "eval").glob("results-step6-*.json")
    doc = json.loads(result.read_text())
    assert doc["llmft"]["checkpoint"].endswith("checkpoint-6/global_step6") and doc["llmft"]["batch_size"] == 3
    assert doc["configs"]["gsm8k"]["num_fewshot"] == 2 and doc["n-samples"]["gsm8k"]["effective"] == 4
    assert set(doc["results"]["gsm8k"]) >= {"exact_match,strict-match", "exact_match_stderr,flexible-extract"}
    [line] = samples(out / "eval" / "summary.jsonl")
    assert line["step"] == 6 and line["task"] == "gsm8k" and line["results_file"] == result.name
    assert line["metrics"]["exact_match,strict-match"] == doc["results"]["gsm8k"]["exact_match,strict-match"]
    assert "llmft eval: gsm8k (2-shot, n=4) step 6: exact_match,strict-match " in proc.stderr
    assert not list((out / "eval").glob("samples-*"))  # only with --log_samples


def test_prompts_cut_to_fit_the_model_are_counted(tiny_model, tmp_path, no_network, capsys):
    """A question longer than the tiny model's 256 positions: the harness cuts it from the left; llmft counts it."""
    rows = gsm8k_records(3, seed=5)
    rows.insert(1, {"question": " ".join(["apple river stone"] * 100), "answer": "#### 1"})
    data = write_jsonl(rows, tmp_path / "long.jsonl")
    [got] = ev.run(
        eval_args(
            [tiny_model],
            tmp_path,
            task_data=[f"gsm8k={data}"],
            num_fewshot=0,
            output=tmp_path / "out",
            gen_kwargs="max_gen_toks=8",
            log_samples=False,
        )
    )
    assert got["meta"]["prompts_left_truncated"] == 1
    assert json.loads(got["results_file"].read_text())["llmft"]["prompts_left_truncated"] == 1
    err = capsys.readouterr().err
    assert (
        "max length 256 (llmft's default: no training max_length recorded 4096 capped at the model's 256 positions)"
        in err
    )
    assert "1 generation prompt(s) were longer than the max length (256) less the tokens to generate" in err


def test_task_data_paths_and_overrides(tmp_path):
    """--task_data parsing and the YAML llmft writes: it includes the harness's file and changes only the data."""
    from lm_eval.tasks import TaskManager

    test = write_jsonl(gsm8k_records(2, 1), tmp_path / "d" / "test.jsonl")
    train = write_jsonl(gsm8k_records(2, 2), tmp_path / "d" / "train.jsonl")
    assert ev.parse_task_data([f"gsm8k={test}", f"gsm8k:train={train}"]) == {"gsm8k": {None: test, "train": train}}
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "my_qa.yaml").write_text(
        "task: my_qa\ndataset_path: json\noutput_type: generate_until\ndoc_to_text: '{{question}}'\n"
        "doc_to_target: '{{answer}}'\n"
    )
    manager = TaskManager(include_path=str(mine))  # the harness's own index
    # llmft's (its walk of the harness's tasks kept for the process) is the same index
    ours = ev.new_task_manager(str(mine))
    assert (ours.all_tasks, ours.all_subtasks, ours.all_groups, ours.all_tags) == (
        manager.all_tasks,
        manager.all_subtasks,
        manager.all_groups,
        manager.all_tags,
    )
    assert {k: (e.kind, e.yaml_path, e.tags) for k, e in ours.task_index.items()} == {
        k: (e.kind, e.yaml_path, e.tags) for k, e in manager.task_index.items()
    }
    assert ours.task_index["my_qa"].yaml_path == mine / "my_qa.yaml"
    assert "my_qa" not in ev.new_task_manager(None).all_tasks  # an include path is not kept for the next manager
    cfg = {"test_split": "test", "training_split": "train", "fewshot_split": "train", "num_fewshot": 5}
    assert ev.split_files("gsm8k", cfg, {None: tmp_path / "d"}) == {
        "test": test,
        "train": train,
    }  # a directory: every split found
    assert ev.fewshot_split_needed(cfg, None) == "train" and ev.fewshot_split_needed(cfg, 0) is None
    assert (
        ev.fewshot_split_needed({**cfg, "fewshot_config": {"samples": "fn"}}, 4) is None
    )  # minerva_math: fixed examples
    written = ev.write_overrides({"gsm8k": {None: test}}, 0, manager, tmp_path / "tasks")
    import yaml

    override = yaml.safe_load((written / "gsm8k.yaml").read_text())
    assert override == {
        "include": str(manager.task_index["gsm8k"].yaml_path),
        "task": "gsm8k",
        "dataset_path": "json",
        "dataset_name": None,
        "dataset_kwargs": {"data_files": {"test": str(test.resolve())}},
        "training_split": None,
        "fewshot_split": None,
    }
    assert ev.new_task_manager([str(mine), str(written)]).task_index["gsm8k"].yaml_path == written / "gsm8k.yaml"
    assert (
        ev.eval_batch_size("auto", "cuda:0") == "auto"
        and ev.eval_batch_size("auto", "cpu") == 8
        and ev.eval_batch_size("4", "cpu") == 4
    )


def test_minerva_math_and_mmlu_read_local_files_in_their_formats(tmp_path, no_network):
    """The two other tasks a math fine-tune reports, from local files: MATH (hendrycks_math records; the harness's
    own answer extraction and fixed 4-shot examples) and an MMLU subject (a directory: test.jsonl, and dev.jsonl for shots)."""
    import lm_eval
    from lm_eval.api.model import LM

    algebra = write_jsonl(
        [
            {"problem": "What is $1+1$?", "level": "Level 1", "type": "Algebra", "solution": "It is $\\boxed{2}$."},
            {"problem": "What is $2+3$?", "level": "Level 1", "type": "Algebra", "solution": "It is $\\boxed{5}$."},
        ],
        tmp_path / "algebra.jsonl",
    )
    row = {"question": "2+2?", "subject": "abstract_algebra", "choices": ["3", "4", "5", "6"], "answer": 1}
    mmlu_test = write_jsonl([row] * 3, tmp_path / "mmlu" / "test.jsonl")
    write_jsonl([row] * 5, tmp_path / "mmlu" / "dev.jsonl")

    class Fixed(LM):
        def generate_until(self, requests):  # right for the first MATH problem only
            return ["The answer is $2$.\nFinal Answer: The final answer is $2$. I hope it is correct."] * len(requests)

        def loglikelihood(self, requests):  # prefers choice B ("4", right)
            return [(0.0 if r.args[1].strip() == "B" else -1.0, False) for r in requests]

        def loglikelihood_rolling(self, requests):
            raise NotImplementedError

    args = eval_args(
        [],
        tmp_path,
        tasks="minerva_math_algebra,mmlu_abstract_algebra",
        num_fewshot=None,
        task_data=[f"minerva_math_algebra={algebra}", f"mmlu_abstract_algebra={mmlu_test.parent}"],
    )
    manager, tasks = ev.task_manager(args, tmp_path / "tasks")
    results = lm_eval.simple_evaluate(model=Fixed(), tasks=tasks, task_manager=manager)
    assert results["results"]["minerva_math_algebra"]["exact_match,none"] == pytest.approx(0.5)
    assert results["results"]["mmlu_abstract_algebra"]["acc,none"] == pytest.approx(1.0)
    assert results["n-shot"] == {"minerva_math_algebra": 4, "mmlu_abstract_algebra": 0}  # the tasks' own defaults


def test_the_docs_walkthrough_runs(tmp_path):
    """docs/evaluation.md's CPU walkthrough, run as written: a mixture fine-tune, the harness's GSM8K on two
    checkpoints from a local file, and the report's bar chart across them."""
    import os
    import re
    import subprocess

    from conftest import REPO, subprocess_env

    text = (REPO / "docs" / "evaluation.md").read_text()
    block = re.search(r"<!-- walkthrough -->\n```bash\n(.*?)```\n<!-- /walkthrough -->", text, re.S).group(1)
    env = subprocess_env(PATH=f"{Path(PYTHON).parent}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    walk = tmp_path / "walk"
    assert json.loads((walk / "run" / "llmft_data.json").read_text())["mixture"]["sources"][0]["weight"] == 3.0
    lines = samples(walk / "run" / "eval" / "summary.jsonl")
    assert [(line["step"], line["task"], line["n"]) for line in lines] == [(2, "gsm8k", 8), (4, "gsm8k", 8)]
    assert (walk / "report" / "benchmarks.png").is_file() and "| run | 4 | gsm8k |" in (
        walk / "report" / "report.md"
    ).read_text()


# --------------------------------------------------------------------------------------------------
# Real context lengths, the chat template a run trained with, one process, one GPU


def test_the_harness_gets_the_runs_max_length_else_4096_never_the_models_131072_positions():
    """Llama-3.1 has 131,072 positions: with no max length the harness probed batches that long and ran out of memory."""
    assert ev.eval_max_length(None, None, 131072) == (4096, "llmft's default: no training max_length recorded")
    assert ev.eval_max_length(None, 2048, 131072) == (2048, "the run's training max_length, llmft_run.json")
    assert ev.eval_max_length(8192, 2048, 131072) == (8192, "--max_length")
    assert ev.eval_max_length(None, 1024, 256) == (
        256,
        "the run's training max_length, llmft_run.json 1024 capped at the model's 256 positions",
    )
    assert ev.eval_max_length(None, None, None)[0] == 4096  # a config that names no positions


def test_a_chat_trained_run_is_scored_through_its_chat_template_unless_the_flag_says_otherwise():
    assert ev.chat_template_choice(None, "messages", True) == (
        True,
        False,
        "the run trained on chat data, llmft_data.json",
    )
    apply, give_default, why = ev.chat_template_choice(None, "messages", False)  # training gave it llmft's default
    assert (apply, give_default) == (True, True) and "llmft's default template" in why
    assert ev.chat_template_choice(None, "prompt_completion", True)[:2] == (False, False)
    assert ev.chat_template_choice(None, None, True) == (False, False, "no run record of chat data")
    assert ev.chat_template_choice(False, "messages", True) == (False, False, "--no-apply_chat_template")
    assert ev.chat_template_choice(True, "text", True) == (True, False, "--apply_chat_template")
    with pytest.raises(ev.EvalError, match="tokenizer has no chat template: pass --model_name"):
        ev.chat_template_choice(True, "messages", False)
    parser = ev.make_parser()
    base = ["ckpt", "--tasks", "gsm8k"]
    assert parser.parse_args(base).apply_chat_template is None
    assert parser.parse_args([*base, "--apply_chat_template"]).apply_chat_template is True
    assert parser.parse_args([*base, "--no-apply_chat_template"]).apply_chat_template is False


@pytest.mark.parametrize(
    "env, processes",
    [
        ({}, 1),
        ({"SLURM_NTASKS": "8", "SLURM_JOB_ID": "7"}, 1),  # sbatch --ntasks=8 running python -m llmft.eval directly
        ({"SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "1"}, 1),  # srun --ntasks 1 inside it
        ({"SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8"}, 8),  # srun -n 8 python -m llmft.eval
        ({"WORLD_SIZE": "2"}, 2),  # torchrun --nproc_per_node 2
    ],
)
def test_several_processes_are_the_slurm_steps_tasks_not_the_allocations(env, processes, tmp_path):
    assert ev.launched_processes(env) == processes
    args = eval_args([], tmp_path)
    if processes == 1:
        ev.check_args(args, env)
    else:
        with pytest.raises(ev.EvalError, match=f"this launch started {processes}: run it without torchrun or srun"):
            ev.check_args(args, env)


def test_a_model_larger_than_one_gpu_is_refused_with_the_fix():
    """Llama-3.1-8B's shape from its config (llmft.planning.model_shape, meta device) and 70B's published size,
    against the catalogue's GPU facts."""
    import dataclasses

    from published_shapes import llama_3_1_8b

    from llmft.planning.hardware import GPUS
    from llmft.planning.model_shape import model_shape

    l8b = model_shape(llama_3_1_8b())
    assert l8b.params == 8_030_261_248
    l70b = dataclasses.replace(l8b, params=70_553_706_496)
    for gpu in ("L4", "A100-40GB", "A100-80GB", "H100-80GB"):
        ev.gpu_fit(l8b, "bfloat16", 4096, GPUS[gpu], 1)  # 15.0 GiB of weights fit each
    with pytest.raises(ev.EvalError) as e:  # fp16 on a T4 (no bf16): 15.0 GiB of weights on 15 GiB
        ev.gpu_fit(l8b, "float16", 4096, GPUS["T4"], 1)
    assert str(e.value).endswith("one T4 has 15 GiB: use a GPU with 19 GiB or more")
    with pytest.raises(
        ev.EvalError, match=r"a shorter --max_length \(the logits grow with it\), or a GPU with 33 GiB or more$"
    ):
        ev.gpu_fit(l8b, "bfloat16", 32768, GPUS["L4"], 1)  # the weights fit; a 32k sequence's logits do not
    ev.gpu_fit(l70b, "bfloat16", 4096, GPUS["H200"], 1)  # 131.4 GiB of weights, 2.0 of logits, 2 free: 139.8
    for gpu, visible in (("A100-80GB", 8), ("H100-80GB", 2)):
        with pytest.raises(ev.EvalError) as e:
            ev.gpu_fit(l70b, "bfloat16", 4096, GPUS[gpu], visible)
        assert "the model's weights (131.4 GiB in bfloat16)" in str(e.value)
        assert (
            f"run lm_eval --model hf --model_args pretrained=DIR,parallelize=True,dtype=bfloat16 on these {visible} GPUs"
            in str(e.value)
        )
    with pytest.raises(ev.EvalError, match="one A100-40GB has 39.4 GiB: use a GPU with 136 GiB or more$"):
        ev.gpu_fit(l70b, "bfloat16", 4096, GPUS["A100-40GB"], 1)


def test_a_chat_trained_run_reaches_the_harness_with_its_template_and_max_length(
    run_with_eval, tmp_path, no_network, capsys
):
    """A real ZeRO-2 run (run_with_eval) whose records say it trained on chat data at max_length 64 (rewritten here: a
    real chat run costs minutes on the 2-core machine): the harness scores chat-templated prompts at 64 tokens, and
    --no-apply_chat_template --max_length 128 turn both back."""
    import shutil

    out = Path(shutil.copytree(run_with_eval[0], tmp_path / "run"))
    for name, key, value in (("llmft_data.json", "shape", "messages"), ("llmft_run.json", "max_length", 64)):
        record = json.loads((out / name).read_text())
        (out / name).write_text(json.dumps({**record, key: value}))

    [chat] = ev.run(eval_args([out], tmp_path, output=tmp_path / "chat", limit=3, num_fewshot=0))
    meta = chat["meta"]
    assert (meta["max_length"], meta["max_length_from"]) == (64, "the run's training max_length, llmft_run.json")
    assert (meta["chat_template"], meta["chat_template_from"]) == (
        True,
        "the run trained on chat data, llmft_data.json",
    )
    [sample_file] = (tmp_path / "chat").glob("samples-*-gsm8k-*.jsonl")
    prompt = samples(sample_file)[0]["arguments"][0][0]
    assert prompt.startswith("<|user|>\nQuestion: ") and prompt.endswith("<|assistant|>\n")  # the tokenizer's template
    assert (
        "max length 64 (the run's training max_length, llmft_run.json), chat template on (the run trained on chat data"
        in capsys.readouterr().err
    )

    args = eval_args([out], tmp_path, output=tmp_path / "plain", limit=3, num_fewshot=0)
    args.apply_chat_template, args.max_length = False, 128
    [plain] = ev.run(args)
    assert (plain["meta"]["max_length"], plain["meta"]["chat_template"]) == (128, False)
    [sample_file] = (tmp_path / "plain").glob("samples-*-gsm8k-*.jsonl")
    assert samples(sample_file)[0]["arguments"][0][0].startswith("Question: ")


def test_a_model_too_large_for_the_gpu_is_refused_before_its_shards_are_read(tiny_model, tmp_path, monkeypatch):
    """On a GPU (its facts stubbed: this machine has none) the check runs on the config alone; no weight is loaded."""
    import torch

    from llmft.planning.hardware import GPU

    monkeypatch.setattr(ev, "local_gpu", lambda index: GPU("tiny-GPU", 0.001, (8, 0), None))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(ev, "load_model", no_load)
    with pytest.raises(ev.EvalError, match="one tiny-GPU has 0.001 GiB: use a GPU with 3 GiB or more"):
        ev.load_for_eval(str(tiny_model), eval_args([tiny_model], tmp_path), "cuda:0", torch.bfloat16)

"""`llmft eval`: GSM8K-style exact match as lm-evaluation-harness scores it, perplexity on the references, batched
greedy generation equal to one-at-a-time generation, several checkpoints, several processes, exported models."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import PYTHON, run
from llmft import eval as ev
from llmft.training.metrics import add_perplexity
from llmft.data.synthetic import as_format, make_examples, write_jsonl

GSM8K_REFERENCE = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


@pytest.mark.parametrize("prediction, strict, flexible", [
    ("She sold 24 in May, so 48+24=72.\n#### 72", True, True),
    ("The answer is 72.", False, True),                    # no '####': only the last number counts
    ("#### 72\nThen she bought 5 more.", True, False),     # strict takes the first '####', flexible the last number
    ("#### $72", False, True),                             # strict's pattern needs a digit right after '#### '
    ("So the total is $72.", False, True),                 # '$' and the trailing '.' are ignored
    ("#### 1,072", False, False),
    ("I don't know.", False, False),                       # nothing extracted: wrong, not an error
    ("#### 72.00", False, False),                          # the harness compares strings, not values
])
def test_exact_match_follows_lm_evaluation_harness_gsm8k(prediction, strict, flexible):
    assert ev.score(prediction, GSM8K_REFERENCE) == (strict, flexible)


def test_reference_answers_and_custom_extractors():
    assert ev.reference_answer(GSM8K_REFERENCE) == "72"
    assert ev.reference_answer("Total: #### 1,234.") == "1234"
    assert ev.reference_answer("-3") == "-3"
    assert ev.reference_answer("4 plus 8 is 12.") == "12"  # no '####': the reference's last number
    assert ev.score("The answer is 12", "4 plus 8 is 12.", r"answer is (\d+)") == (True, True)
    assert ev.score("4 plus 8 is 13.", "4 plus 8 is 12.", r"is (\-?[0-9]+)") == (False, False)
    assert ev.extract(ev.FLEXIBLE_PATTERN, "a 1 b 22 c 3", -1) == "3"  # single digits match the second group
    assert ev.extract(ev.FLEXIBLE_PATTERN, "costs $1,000.", -1) == "$1,000."


def test_training_logs_perplexity_beside_eval_loss():
    assert add_perplexity({"eval_loss": math.log(4.0)})["eval_perplexity"] == pytest.approx(4.0)
    assert "eval_perplexity" not in add_perplexity({"loss": 1.0})


def eval_data(tmp_path: Path, fmt: str = "prompt_completion", n: int = 6) -> Path:
    return write_jsonl(as_format(make_examples(n, seed=5), fmt), tmp_path / f"eval_{fmt}.jsonl")


def one_at_a_time(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """Reference generation: a single unpadded prompt, greedy."""
    import torch

    enc = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def reference_nll(model, tokenizer, prompt: str, completion: str) -> tuple[float, int]:
    """Reference perplexity terms, computed by the model's own loss: prompt tokens masked, EOS appended as in training."""
    import torch

    p_ids = tokenizer(prompt)["input_ids"]
    ids = tokenizer(prompt + completion + tokenizer.eos_token)["input_ids"]
    k = next((i for i, (a, b) in enumerate(zip(p_ids, ids)) if a != b), min(len(p_ids), len(ids)))
    labels = [-100] * k + ids[k:]
    with torch.no_grad():
        loss = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels])).loss
    return float(loss) * (len(ids) - k), len(ids) - k


@pytest.fixture(scope="module")
def compared(run_with_eval, tmp_path_factory):
    """One `llmft eval` of two checkpoints of the shared run (prompt/completion data, batches of 4)."""
    out, _, _ = run_with_eval
    tmp = tmp_path_factory.mktemp("eval")
    data = eval_data(tmp)
    proc = run([str(Path(PYTHON).parent / "llmft"), "eval", str(out / "checkpoint-3"), str(out), "--dataset_name", str(data),
                "--max_new_tokens", "8", "--batch_size", "4", "--answer_pattern", r"is (\-?[0-9]+)", "--output", str(tmp / "results")],
               check=True, timeout=300)
    return out, data, tmp / "results", proc


def test_several_checkpoints_give_a_table_and_one_json_each_with_the_documented_fields(compared):
    out, data, results, proc = compared
    files = sorted(results.glob("*.json"))
    assert [f.name for f in files] == ["00-run-eval-eval_prompt_completion-step3.json", "01-run-eval-eval_prompt_completion-step6.json"]
    docs = [json.loads(f.read_text()) for f in files]
    for doc, step in zip(docs, (3, 6)):
        assert list(doc) == ["checkpoint", "step", "metrics", "examples"]
        assert doc["step"] == step and doc["checkpoint"].endswith(f"checkpoint-{step}/global_step{step}")
        assert list(doc["metrics"]) == ["perplexity", "exact_match_strict", "exact_match_flexible", "n"]
        assert doc["metrics"]["n"] == 6 == len(doc["examples"])
        assert list(doc["examples"][0]) == ["prompt", "reference", "prediction", "correct_strict", "correct_flexible"]
    table = [line for line in proc.stdout.splitlines() if "global_step" in line]
    assert len(table) == 2 and table[0].split()[1] == "3" and table[1].split()[1] == "6"
    assert docs[0]["metrics"]["perplexity"] != docs[1]["metrics"]["perplexity"]


def test_batched_left_padded_generation_and_perplexity_match_one_example_at_a_time(compared):
    from llmft.checkpoint.loader import load

    out, data, results, _ = compared
    doc = json.loads(sorted(results.glob("*.json"))[-1].read_text())
    loaded = load(Path(doc["checkpoint"]))
    records = [json.loads(line) for line in data.read_text().splitlines()]
    nll = tokens = 0
    for ex, rec in zip(doc["examples"], records):
        assert ex["prompt"] == rec["prompt"] and ex["reference"] == rec["completion"]
        assert ex["prediction"] == one_at_a_time(loaded.model, loaded.tokenizer, rec["prompt"], 8)
        assert (ex["correct_strict"], ex["correct_flexible"]) == ev.score(ex["prediction"], rec["completion"], r"is (\-?[0-9]+)")
        a, b = reference_nll(loaded.model, loaded.tokenizer, rec["prompt"], rec["completion"])
        nll, tokens = nll + a, tokens + b
    assert doc["metrics"]["perplexity"] == pytest.approx(math.exp(nll / tokens), rel=1e-4)
    strict = sum(e["correct_strict"] for e in doc["examples"]) / 6
    assert doc["metrics"]["exact_match_strict"] == pytest.approx(strict)


def test_two_processes_split_the_records_and_rank_0_writes_the_same_result(compared, tmp_path):
    out, data, results, _ = compared
    single = json.loads(sorted(results.glob("*.json"))[-1].read_text())
    target = tmp_path / "two.json"
    proc = run([PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "llmft.eval", str(out), "--dataset_name", str(data),
                "--max_new_tokens", "8", "--batch_size", "4", "--answer_pattern", r"is (\-?[0-9]+)", "--output", str(target)],
               check=True, timeout=300)
    two = json.loads(target.read_text())
    assert two["examples"] == single["examples"]
    assert two["metrics"]["perplexity"] == pytest.approx(single["metrics"]["perplexity"], rel=1e-6)
    assert two["metrics"]["n"] == 6
    assert proc.stderr.count("llmft eval: perplexity") == 1  # rank 0 only
    assert sorted(p.name for p in tmp_path.iterdir()) == ["two.json"]  # the ranks' partial files are gone


def args_for(path, data, **overrides):
    values = dict(checkpoint=[str(path)], dataset_name=str(data), dataset_config=None, dataset_split="test", prompt_column=None,
                  completion_column=None, messages_column=None, dataset_text_field="text", limit=None, max_new_tokens=6,
                  batch_size=3, answer_pattern=ev.STRICT_PATTERN, output=None, model_name=None, device="cpu", dtype="auto",
                  timeout=60, trust_checkpoint=False)
    values.update(overrides)
    return SimpleNamespace(**values)


def test_an_exported_model_chat_and_text_data(run_with_eval, tmp_path):
    from llmft.infer import export
    from llmft.checkpoint.loader import load, resolve_checkpoint

    out, _, _ = run_with_eval
    tag, _ = resolve_checkpoint([str(out)])
    exported = export(load(tag), tmp_path / "exported")
    chat = eval_data(tmp_path, "messages", n=4)
    [doc] = ev.run(args_for(exported, chat))
    assert doc["checkpoint"] == str(exported) and doc["metrics"]["n"] == 4
    assert doc["examples"][0]["prompt"].endswith("<|assistant|>\n")  # the chat template's generation prompt
    assert doc["examples"][0]["reference"] == json.loads(chat.read_text().splitlines()[0])["messages"][-1]["content"]
    assert doc["metrics"]["exact_match_strict"] is not None and doc["metrics"]["perplexity"] > 1
    assert (exported / "eval-eval_messages.json").is_file()  # default: beside the model

    [zero] = ev.run(args_for(out, chat, output=tmp_path / "z.json"))  # same weights from the ZeRO shards: same answers
    assert [e["prediction"] for e in zero["examples"]] == [e["prediction"] for e in doc["examples"]]

    [text] = ev.run(args_for(exported, eval_data(tmp_path, "text", n=3), output=tmp_path / "t.json"))
    assert text["metrics"]["exact_match_strict"] is None and text["metrics"]["perplexity"] > 1
    assert all(e["prediction"] is None for e in text["examples"])


def test_bad_input_is_one_clear_line(run_with_eval, tmp_path, capsys):
    out, _, _ = run_with_eval
    data = eval_data(tmp_path)
    not_chat = write_jsonl([{"messages": [{"role": "user", "content": "hi"}]}], tmp_path / "one_turn.jsonl")
    cases = [
        (args_for(tmp_path / "missing", data), "does not exist: check the path"),
        (args_for(out, data, answer_pattern="(unclosed"), "--answer_pattern '(unclosed' is not a valid regular expression"),
        (args_for(out, data, limit=0), "--limit must be at least 1"),
        (args_for(out, data, checkpoint=[str(out), str(out)], output=tmp_path / "x.json"), "names a directory (one JSON each)"),
        (args_for(out, tmp_path / "nope.jsonl"), "nope.jsonl not found"),
        (args_for(out, not_chat), "does not end with an assistant message"),
        (args_for(out, data, max_new_tokens=400), "exceeds the model's 256 positions: lower --max_new_tokens"),
    ]
    for args, message in cases:
        with pytest.raises(SystemExit) as e:
            ev.main(args)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("llmft eval: error: ") and message in err[-1], (message, err[-3:])


def test_an_over_long_record_is_skipped_and_counted_not_the_whole_evaluation(run_with_eval, tmp_path, capsys):
    out, _, _ = run_with_eval
    rows = as_format(make_examples(4, seed=5), "prompt_completion")
    rows.insert(1, {"prompt": " ".join(["apple river stone"] * 100) + "\n", "completion": "#### 1"})
    data = write_jsonl(rows, tmp_path / "one_long.jsonl")
    got = ev.run(args_for(out, data, max_new_tokens=20))[0]
    assert "1 of 5 records skipped for generation" in capsys.readouterr().err
    assert got["metrics"]["skipped_too_long"] == 1 and got["metrics"]["n"] == 5
    assert got["examples"][1]["skipped"] == "prompt too long" and got["examples"][1]["prediction"] is None
    assert all(e["prediction"] is not None for i, e in enumerate(got["examples"]) if i != 1)

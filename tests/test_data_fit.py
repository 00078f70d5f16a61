"""The data fit: what max_length cuts and drops, counted, said in one line per split, and warned about with the fix."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from llmft.data import cache
from llmft.data import fit as data_fit
from llmft.data.synthetic import write_jsonl

WORDS = "apple river stone cloud garden window silver forest candle bridge ocean paper".split()


def gsm8k_like(n: int, seed: int = 0) -> list[dict]:
    """question/answer records of very different lengths, the answer ending in '#### N' as GSM8K's do."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        question = " ".join(rng.choice(WORDS) for _ in range(rng.choice([2, 5, 12, 30, 60])))
        answer = " ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 4, 10, 25]))) + f" #### {i}"
        rows.append({"question": question + "?\n", "answer": answer})
    return rows


def sft_args(tmp_path, **overrides):
    from trl import SFTConfig

    values = dict(output_dir=str(tmp_path / "out"), report_to="none", bf16=False, use_cpu=True, max_length=48)
    values.update(overrides)
    return SFTConfig(**values)


def independent_count(rows, tokenizer, max_length):
    """Tokenise each record here, as a prompt/completion pair is trained (prompt + completion + EOS, loss on the part
    after the prompt), and count what keeping the first max_length tokens does to it."""
    lengths, truncated, dropped, partly, fully, cut = [], 0, 0, 0, 0, 0
    for row in rows:
        prompt = tokenizer(row["question"])["input_ids"]
        whole = tokenizer(row["question"] + row["answer"] + tokenizer.eos_token)["input_ids"]
        start = next((i for i, (a, b) in enumerate(zip(prompt, whole)) if a != b), min(len(prompt), len(whole)))
        n = len(whole)
        lengths.append(n)
        if n > max_length:
            cut += n - max_length
            if start >= max_length:
                fully += 1
                dropped += 1
            else:
                truncated += 1
                partly += 1
    lengths = np.array(lengths)
    return {
        "records": len(rows),
        "kept": len(rows) - dropped,
        "truncated": truncated,
        "dropped": dropped,
        "completion_partly_cut": partly,
        "completion_fully_cut": fully,
        "tokens_cut": cut,
        "tokens": int(lengths.sum()),
        "length_p50": int(np.percentile(lengths, 50, method="inverted_cdf")),
        "length_p95": int(np.percentile(lengths, 95, method="inverted_cdf")),
        "length_max": int(lengths.max()),
    }


def test_the_counts_match_an_independent_tokenisation_and_the_trained_sequences(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    rows = gsm8k_like(120)
    path = write_jsonl(rows, tmp_path / "gsm.jsonl")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    opts = cache.DataOptions(
        dataset_name=str(path), prompt_column="question", completion_column="answer", eval_split_ratio=0.25
    )
    lines = []
    prepared = cache.prepare(
        opts, tokenizer, sft_args(tmp_path), log=lines.append, root=tmp_path / "cache", positions=256
    )

    train_rows, eval_rows = cache.load_records(opts)[:2]
    for split, records in (("train", train_rows), ("eval", eval_rows)):
        expected = independent_count(
            [{"question": r["prompt"], "answer": r["completion"]} for r in records], tokenizer, 48
        )
        fit = prepared.info["fit"][split]
        assert {k: fit[k] for k in expected} == expected, split
        assert expected["dropped"] > 0 and expected["truncated"] > 0  # the data exercises both
    assert len(prepared.train) == prepared.info["fit"]["train"]["kept"]  # what TRL kept is what was counted
    assert len(prepared.eval) == prepared.info["fit"]["eval"]["kept"]

    fit = prepared.info["fit"]["train"]
    line = next(x for x in lines if x.startswith("train data: "))
    assert line == (
        f"train data: {fit['kept']} of {fit['records']} records kept, {fit['truncated']} truncated, {fit['dropped']} dropped; "
        f"completion cut in {fit['completion_partly_cut'] + fit['completion_fully_cut']} ({fit['completion_fully_cut']} entirely); "
        f"{fit['tokens_cut']} of {fit['tokens']} tokens cut ({fit['tokens_cut'] / fit['tokens']:.1%}); "
        f"length p50 {fit['length_p50']}, p95 {fit['length_p95']}, max {fit['length_max']} vs max_length 48"
    )
    warning = next(x for x in lines if x.startswith("warning: ") and "train records" in x)
    want = math.ceil(fit["length_p95"] / 64) * 64
    assert (
        f"raise --max_length to {want}" in warning
        and f"{fit['completion_fully_cut']} lost their whole completion" in warning
    )

    cache.write_run_record(tmp_path / "run", opts, prepared)
    assert json.loads((tmp_path / "run" / "llmft_data.json").read_text())["fit"] == prepared.info["fit"]

    again = []  # a reused preparation says the same
    cache.prepare(opts, tokenizer, sft_args(tmp_path), log=again.append, root=tmp_path / "cache", positions=256)
    assert line in again


def test_text_data_that_fits_gets_its_line_and_no_warning(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    path = write_jsonl([{"text": "apple river stone"}] * 10, tmp_path / "t.jsonl")
    lines = []
    p = cache.prepare(
        cache.DataOptions(dataset_name=str(path)),
        AutoTokenizer.from_pretrained(tiny_model),
        sft_args(tmp_path, max_length=64),
        log=lines.append,
        root=tmp_path / "cache",
    )
    fit = p.info["fit"]["train"]
    assert (fit["kept"], fit["truncated"], fit["dropped"], fit["tokens_cut"]) == (10, 0, 0, 0)
    assert "completion_fully_cut" not in fit  # text data trains on every token: no completion to lose
    assert not [x for x in lines if x.startswith("warning")]


def summary(lengths, trained_ranges, max_length):
    """The per-record summary of records whose trained tokens are the [a, b) positions."""
    ids = [list(range(n)) for n in lengths]
    labels = [[t if a <= i < b else -100 for i, t in enumerate(row)] for row, (a, b) in zip(ids, trained_ranges)]
    from datasets import Dataset

    return data_fit.summarise(Dataset.from_dict({"input_ids": ids, "labels": labels}), max_length)


def test_each_truncation_rule_counts_what_trl_does():
    s = summary([10, 30, 30, 50], [(2, 10), (5, 30), (25, 30), (0, 50)], 20)
    start = data_fit.fit_of(
        s,
        max_length=20,
        **dict(zip(("keep", "drops"), data_fit.truncation_of(20, False, "bfd", "keep_start"))),
        masked=True,
    )
    # record 2 loses its whole completion (trained from 25) and is dropped; records 1 and 3 lose part of it
    assert {
        k: start[k]
        for k in ("kept", "truncated", "dropped", "completion_partly_cut", "completion_fully_cut", "tokens_cut")
    } == {
        "kept": 3,
        "truncated": 2,
        "dropped": 1,
        "completion_partly_cut": 2,
        "completion_fully_cut": 1,
        "tokens_cut": 10 + 10 + 30,
    }
    end = data_fit.fit_of(s, max_length=20, keep="keep_end", drops=True, masked=True)
    assert (end["dropped"], end["completion_fully_cut"], end["completion_partly_cut"]) == (
        0,
        0,
        2,
    )  # the end keeps completions
    packed_bfd = data_fit.fit_of(
        s,
        max_length=20,
        **dict(zip(("keep", "drops"), data_fit.truncation_of(20, True, "bfd", "keep_start"))),
        masked=True,
    )
    assert (packed_bfd["dropped"], packed_bfd["truncated"], packed_bfd["completion_fully_cut"]) == (
        0,
        3,
        1,
    )  # bfd cuts, keeps all
    split = data_fit.fit_of(
        s,
        max_length=20,
        **dict(zip(("keep", "drops"), data_fit.truncation_of(20, True, "bfd_split", "keep_start"))),
        masked=True,
    )
    assert (split["truncated"], split["tokens_cut"]) == (0, 0)  # bfd_split carries the rest into other rows
    assert data_fit.truncation_of(None, False, "bfd", "keep_start") == (None, False)


@pytest.mark.parametrize(
    "fit, positions, fix",
    [
        (dict(records=100, truncated=6, dropped=0, length_p95=300, max_length=256), 1024, "raise --max_length to 320"),
        (
            dict(records=100, truncated=1, dropped=1, completion_fully_cut=1, length_p95=200, max_length=128),
            256,
            "raise --max_length to 256",
        ),
        (
            dict(records=100, truncated=90, dropped=0, length_p95=900, max_length=256),
            256,
            "use a model with at least 960 positions (this one has 256",
        ),
    ],
)
def test_the_warning_names_the_fix(fit, positions, fix):
    assert fix in data_fit.fit_warning("train", fit, positions)


def test_no_warning_below_the_threshold():
    assert (
        data_fit.fit_warning("train", dict(records=100, truncated=5, dropped=0, length_p95=100, max_length=256), 1024)
        is None
    )


def test_llmft_prepare_prints_the_fit_and_the_warning(tiny_model, tmp_path, capsys, monkeypatch):
    from llmft.cli import main

    monkeypatch.setenv("LLMFT_CACHE", str(tmp_path / "cache"))
    path = write_jsonl(gsm8k_like(40), tmp_path / "gsm.jsonl")
    assert (
        main(
            [
                "prepare",
                "--model_name_or_path",
                str(tiny_model),
                "--dataset_name",
                str(path),
                "--output_dir",
                str(tmp_path / "o"),
                "--prompt_column",
                "question",
                "--completion_column",
                "answer",
                "--max_length",
                "32",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "llmft: train data: " in out and "vs max_length 32" in out
    assert "llmft: warning: " in out and "raise --max_length to" in out

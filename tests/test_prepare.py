"""Data prepared once: the same tokens as TRL on the fly, a key that follows what matters, never half a preparation."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from llmft.data import cache
from llmft.data.loading import DataError
from llmft.data.synthetic import as_format, make_examples, write_jsonl


def sft_args(tmp_path, **overrides):
    from trl import SFTConfig

    values = dict(output_dir=str(tmp_path / "out"), report_to="none", bf16=False, use_cpu=True, max_length=48)
    values.update(overrides)
    return SFTConfig(**values)


def tokenizer_of(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def quiet_log(lines):
    return lambda msg: lines.append(msg)


@pytest.fixture(scope="module")
def model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model)


@pytest.mark.parametrize(
    "fmt, packing", [("text", False), ("prompt_completion", False), ("messages", False), ("prompt_completion", True)]
)
def test_the_trainer_gets_the_same_tokens_and_loss_masks_as_trl_preparing_on_the_fly(
    tiny_model, model, tmp_path, fmt, packing
):
    """The hand-off llmft train makes (prepared data + skip_prepare_dataset) against SFTTrainer tokenising itself."""
    import dataclasses

    from trl import SFTTrainer

    from llmft.data import loading as data

    path = write_jsonl(as_format(make_examples(40), fmt), tmp_path / f"{fmt}.jsonl")
    # chat with --assistant_only_loss false: TRL on the fly trains chat on every token (llmft's default, the assistant
    # turns, is checked against an independent computation in tests/test_formats.py)
    opts = cache.DataOptions(
        dataset_name=str(path),
        eval_split_ratio=0.2,
        data_percentage=75,
        assistant_only_loss=False if fmt == "messages" else None,
    )
    args = sft_args(tmp_path, packing=packing, max_length=40 if packing else 24)  # short: truncation happens too
    lines = []
    prepared = cache.prepare(opts, tokenizer_of(tiny_model), args, log=quiet_log(lines), root=tmp_path / "cache")

    raw_train, raw_eval, _ = cache.load_records(opts)
    fly_tokenizer = tokenizer_of(tiny_model)
    data.ensure_chat_template(fly_tokenizer)
    on_the_fly = SFTTrainer(
        model=model, args=args, train_dataset=raw_train, eval_dataset=raw_eval, processing_class=fly_tokenizer
    )
    handed = SFTTrainer(
        model=model,
        args=dataclasses.replace(args, dataset_kwargs={"skip_prepare_dataset": True}),
        train_dataset=prepared.train,
        eval_dataset=prepared.eval,
        processing_class=tokenizer_of(tiny_model),
    )
    for split in ("train_dataset", "eval_dataset"):
        fly, mine = getattr(on_the_fly, split), getattr(handed, split)
        columns = ["input_ids", "labels"] + (["seq_lengths"] if packing else [])
        assert len(fly) == len(mine) > 0
        for column in columns:
            assert mine[column] == fly[column], (split, column)
    labels = [t for row in handed.train_dataset["labels"] for t in row]
    if fmt == "prompt_completion":
        assert -100 in labels and any(t != -100 for t in labels)  # the prompt is masked, the completion is not
    else:
        assert -100 not in labels  # text, and chat with --assistant_only_loss false: every token trains
    assert max(len(ids) for ids in handed.train_dataset["input_ids"]) <= args.max_length


def test_fingerprint_follows_data_tokenizer_and_options_not_paths_or_training_flags(tiny_model, tmp_path):
    import shutil

    rows = as_format(make_examples(20), "prompt_completion")
    a = write_jsonl(rows, tmp_path / "a" / "d.jsonl")
    b = write_jsonl(rows, tmp_path / "b" / "d.jsonl")
    shutil.copytree(tiny_model, tmp_path / "model-copy")
    tok = tokenizer_of(tiny_model)
    base_args = sft_args(tmp_path)

    def fp(path=a, tokenizer=None, args=base_args, **opts):
        return cache.fingerprint(cache.DataOptions(dataset_name=str(path), **opts), tokenizer or tok, args)[0]

    base = fp()
    assert base == fp(
        path=b, tokenizer=tokenizer_of(tmp_path / "model-copy")
    )  # same bytes, same tokenizer, other paths
    assert base == fp(
        args=sft_args(tmp_path / "elsewhere", learning_rate=1e-3, num_train_epochs=7)
    )  # training-only flags
    assert base == fp(seed=7)  # the full data does not depend on the seed

    b.write_text(b.read_text().replace("plus", "Plus", 1))
    more_tokens = tokenizer_of(tiny_model)
    more_tokens.add_tokens(["<extra>"])
    other_template = tokenizer_of(tiny_model)
    other_template.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    changed = {
        "one byte of data": fp(path=b),
        "tokenizer": fp(tokenizer=more_tokens),
        "chat template": fp(tokenizer=other_template),
        "column mapping": fp(prompt_column="question"),
        "text field": fp(args=sft_args(tmp_path, dataset_text_field="body")),
        "max_length": fp(args=sft_args(tmp_path, max_length=64)),
        "packing": fp(args=sft_args(tmp_path, packing=True)),
        "data_percentage": fp(data_percentage=50),
        "seed with a subset": fp(data_percentage=50, seed=7),
        "eval split": fp(eval_split_ratio=0.1),
        "eval file": fp(eval_dataset_name=str(a)),
        "dataset format": fp(dataset_format="text"),
        "prompt template": fp(prompt_template="gsm8k"),
        "role map": fp(role_map="bot=assistant"),
        "assistant-only loss": fp(assistant_only_loss=False),
        "drop long records": fp(drop_long_records=True),
    }
    assert base not in changed.values()
    assert len(set(changed.values())) == len(changed), changed


def test_reuse_across_output_dirs_and_a_new_preparation_after_a_change(tiny_model, tmp_path):
    path = write_jsonl(as_format(make_examples(30), "text"), tmp_path / "d.jsonl")
    opts = cache.DataOptions(dataset_name=str(path))
    root = tmp_path / "cache"
    lines = []
    first = cache.prepare(opts, tokenizer_of(tiny_model), sft_args(tmp_path / "run1"), log=quiet_log(lines), root=root)
    again = cache.prepare(
        opts, tokenizer_of(tiny_model), sft_args(tmp_path / "run2", learning_rate=0.1), log=quiet_log(lines), root=root
    )
    assert not first.reused and again.reused and again.directory == first.directory
    assert f"reused prepared data {first.directory} (fingerprint {first.fingerprint})" in lines
    assert again.train["input_ids"] == first.train["input_ids"]
    changed = cache.prepare(
        opts, tokenizer_of(tiny_model), sft_args(tmp_path, max_length=8), log=quiet_log(lines), root=root
    )
    assert not changed.reused and changed.fingerprint != first.fingerprint
    assert max(len(x) for x in changed.train["input_ids"]) == 8


KILLER = r"""
import os, signal, sys
from pathlib import Path
from datasets import Dataset
from transformers import AutoTokenizer
from trl import SFTConfig
from llmft.data import cache

saves = []
original = Dataset.save_to_disk
def save_then_die(self, path, *a, **k):
    original(self, path, *a, **k)
    saves.append(path)
    if len(saves) == 2:  # train and eval written, marker not yet: killed half-way
        os.kill(os.getpid(), signal.SIGKILL)
Dataset.save_to_disk = save_then_die
args = SFTConfig(output_dir=sys.argv[3], report_to="none", bf16=False, use_cpu=True, max_length=48)
opts = cache.DataOptions(dataset_name=sys.argv[2], eval_split_ratio=0.25)
cache.prepare(opts, AutoTokenizer.from_pretrained(sys.argv[1]), args, root=Path(sys.argv[4]))
"""


def test_a_preparation_killed_half_way_is_never_taken_as_complete(tiny_model, tmp_path):
    path = write_jsonl(as_format(make_examples(24), "prompt_completion"), tmp_path / "d.jsonl")
    root = tmp_path / "cache"
    proc = subprocess.run(
        [sys.executable, "-c", KILLER, str(tiny_model), str(path), str(tmp_path / "o"), str(root)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -9, proc.stderr[-3000:]
    leftovers = list((root / "prepared").glob(".tmp-*"))
    assert len(leftovers) == 1 and (leftovers[0] / "eval").is_dir()  # it had written both splits
    assert not [p for p in (root / "prepared").iterdir() if not p.name.startswith(".")]  # but nothing was published

    opts = cache.DataOptions(dataset_name=str(path), eval_split_ratio=0.25)
    lines = []
    done = cache.prepare(opts, tokenizer_of(tiny_model), sft_args(tmp_path), log=quiet_log(lines), root=root)
    assert not done.reused and [x for x in lines if x.startswith(f"prepared data {done.directory}")]
    assert not list((root / "prepared").glob(".tmp-*"))  # the dead process's directory is cleaned up
    assert json.loads((done.directory / cache.MARKER).read_text())["fingerprint"] == done.fingerprint

    # A published directory whose files were damaged afterwards is not complete either: it is prepared again.
    arrow = next((done.directory / "train").glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[:-10])
    again = cache.prepare(opts, tokenizer_of(tiny_model), sft_args(tmp_path), log=quiet_log(lines), root=root)
    assert not again.reused and again.train["input_ids"] == done.train["input_ids"]


def rank_env(rank: int, port: str = "29999") -> dict:
    return {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}


def test_other_ranks_wait_for_rank_0_then_read_its_files_or_its_error(tiny_model, tmp_path):
    path = write_jsonl(as_format(make_examples(24), "messages"), tmp_path / "d.jsonl")
    opts = cache.DataOptions(dataset_name=str(path))
    root, args = tmp_path / "cache", sft_args(tmp_path)
    got = {}

    def rank1(env, key):
        try:
            got[key] = cache.prepare(
                opts, tokenizer_of(tiny_model), args, env=env, root=root, log=quiet_log([]), timeout=120
            )
        except DataError as e:
            got[key] = e

    waiter = threading.Thread(target=rank1, args=(rank_env(1), "ok"))
    waiter.start()
    time.sleep(2)
    assert waiter.is_alive()  # nothing to read yet: rank 1 waits
    lines = []
    mine = cache.prepare(opts, tokenizer_of(tiny_model), args, env=rank_env(0), root=root, log=quiet_log(lines))
    waiter.join(60)
    assert got["ok"].directory == mine.directory and got["ok"].train["input_ids"] == mine.train["input_ids"]
    assert got["ok"].shape == "messages"
    assert len([m for m in lines if m.startswith("prepared data")]) == 1

    # Rank 0 fails on bad data: the waiting rank stops with rank 0's reason instead of waiting out its timeout.
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"text": \n')
    bad_opts = cache.DataOptions(dataset_name=str(bad))
    waiter = threading.Thread(
        target=lambda: got.update(
            bad=_try(
                lambda: cache.prepare(
                    bad_opts,
                    tokenizer_of(tiny_model),
                    args,
                    env=rank_env(1, "30001"),
                    root=root,
                    log=quiet_log([]),
                    timeout=120,
                )
            )
        )
    )
    waiter.start()
    with pytest.raises(DataError, match="line 2 is not valid JSON"):
        cache.prepare(bad_opts, tokenizer_of(tiny_model), args, env=rank_env(0, "30001"), root=root, log=quiet_log([]))
    waiter.join(60)
    assert isinstance(got["bad"], DataError) and str(got["bad"]).startswith("rank 0 could not prepare the data: ")
    assert "line 2 is not valid JSON" in str(got["bad"])

    # No rank 0 at all (say, a cache directory the nodes do not share): a clear error after the timeout.
    t0 = time.time()
    with pytest.raises(
        DataError,
        match="rank 0 has not started preparing the data in .* LLMFT_CACHE must be on storage every node shares",
    ):
        cache.prepare(
            cache.DataOptions(dataset_name=str(path), data_percentage=50),
            tokenizer_of(tiny_model),
            args,
            env=rank_env(1, "30002"),
            root=root,
            log=quiet_log([]),
            timeout=2,
        )
    assert time.time() - t0 < 30


def _try(fn):
    try:
        return fn()
    except DataError as e:
        return e


def test_bad_options_fail_before_anything_loads(tmp_path):
    for opts, strategy, message in [
        (
            cache.DataOptions(dataset_name="d.jsonl"),
            "steps",
            "--eval_strategy steps needs evaluation data: add --eval_dataset_name FILE or --eval_split_ratio 0.05",
        ),
        (
            cache.DataOptions(dataset_name="d.jsonl", eval_split_ratio=1.5),
            "no",
            "--eval_split_ratio must be in (0, 1)",
        ),
        (
            cache.DataOptions(dataset_name="d.jsonl", eval_split_ratio=0.1, eval_dataset_name="e.jsonl"),
            "no",
            "give either --eval_dataset_name or --eval_split_ratio, not both",
        ),
        (cache.DataOptions(dataset_name="d.jsonl", data_percentage=0), "no", "--data_percentage must be in (0, 100]"),
    ]:
        with pytest.raises(DataError) as e:
            cache.check_options(opts, strategy)
        assert message in str(e.value)
    cache.check_options(cache.DataOptions(dataset_name="d.jsonl", eval_split_ratio=0.1), "steps")


def test_held_out_split_is_deterministic_and_independent_of_percentage_and_seed(tmp_path):
    from llmft.data.loading import held_out_split, load_train_split, take_percentage

    ds = load_train_split(str(write_jsonl(as_format(make_examples(100), "text"), tmp_path / "d.jsonl")))
    train, held = held_out_split(ds, 0.1)
    assert len(held) == 10 and len(train) == 90
    assert held["text"] == held_out_split(ds, 0.1)[1]["text"]
    assert set(take_percentage(train, 50, seed=3)["text"]) <= set(train["text"])
    with pytest.raises(DataError, match="leaves nothing to train on"):
        held_out_split(ds.select(range(1)), 0.5)


def test_the_cache_defaults_under_the_hugging_face_home():
    assert cache.cache_root({"LLMFT_CACHE": "/shared/cache"}) == Path("/shared/cache")
    assert cache.cache_root({"HF_HOME": "/hf"}) == Path("/hf/llmft")
    assert cache.cache_root({"XDG_CACHE_HOME": "/xdg"}) == Path("/xdg/huggingface/llmft")


def test_an_unwritable_cache_is_one_clear_error(tiny_model, tmp_path):
    path = write_jsonl(as_format(make_examples(8), "text"), tmp_path / "d.jsonl")
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache should be")
    with pytest.raises(
        DataError,
        match=r"cannot write prepared data under .*not-a-dir/prepared .* point LLMFT_CACHE at a writable directory",
    ):
        cache.prepare(
            cache.DataOptions(dataset_name=str(path)),
            tokenizer_of(tiny_model),
            sft_args(tmp_path),
            root=blocker,
            log=quiet_log([]),
        )


def test_llmft_prepare_refuses_bad_input_with_one_line(tiny_model, tmp_path, capsys):
    from llmft.cli import main

    base = ["prepare", "--model_name_or_path", str(tiny_model), "--output_dir", str(tmp_path / "o")]
    for extra, message in [
        (["--dataset_name", str(tmp_path / "nope.jsonl")], "nope.jsonl not found"),
        (["--dataset_name", "d.jsonl", "--eval_strategy", "steps"], "--eval_strategy steps needs evaluation data"),
        (
            ["--dataset_name", "d.jsonl", "--chat_template_path", "Qwen/Qwen2.5-0.5B-Instruct"],
            "takes a .jinja/.j2 template file",
        ),
    ]:
        assert main(base + extra) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("llmft prepare: error: ")]
        assert len(errors) == 1 and message in errors[0], (extra, errors)

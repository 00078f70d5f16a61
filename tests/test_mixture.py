"""--dataset_mixture: several datasets, each with its columns, split, percentage and weight (or all of it), sampled
by datasets.interleave_datasets; realised shares match the weights, the cache key follows every weight, a rerun
sees the same records in the same order, and a bad mixture is one line before any model loads."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import PYTHON, run

from llmft.data import cache as prepare
from llmft.data import mixture
from llmft.data.loading import DataError
from llmft.data.synthetic import write_jsonl


def source_file(path: Path, n: int, tag: str, fmt: str = "qa") -> Path:
    """n records, each saying which source it came from, in one of three column layouts."""
    if fmt == "qa":
        rows = [{"question": f"{tag} question {i}?", "answer": f"{tag} answer {i}."} for i in range(n)]
    elif fmt == "pc":
        rows = [{"prompt": f"{tag} prompt {i}\n", "completion": f"{tag} completion {i}"} for i in range(n)]
    else:
        rows = [{"body": f"{tag} text {i}"} for i in range(n)]
    return write_jsonl(rows, path)


def write_mixture(path: Path, sources: list[dict], **extra) -> Path:
    path.write_text(yaml.safe_dump({**extra, "datasets": sources}, sort_keys=False))
    return path


def three_sources(tmp_path: Path, n: int = 3000) -> list[dict]:
    return [
        {
            "path": str(source_file(tmp_path / "a.jsonl", n, "A")),
            "columns": {"prompt": "question", "completion": "answer"},
            "weight": 1,
        },
        {"path": str(source_file(tmp_path / "b.jsonl", n, "B", "pc")), "weight": 2},
        {
            "path": str(source_file(tmp_path / "c.jsonl", n, "C")),
            "columns": {"prompt": "question", "completion": "answer"},
            "format": "prompt_completion",
            "weight": 5,
        },
    ]


def origin(row: dict) -> str:
    return row["prompt"][0]


def test_realised_shares_match_the_weights_within_sampling_error(tmp_path):
    """Weights 1:2:5 over three 3000-record sources: each source's count in the mixture is within 4 binomial standard
    deviations of its expected share, the mixture stops when the heaviest source is used up (first_exhausted), and a
    source marked `all` is in it exactly once per record."""
    mix_file = write_mixture(tmp_path / "mix.yaml", three_sources(tmp_path), seed=7)
    train, _, shape = prepare.load_records(prepare.DataOptions(dataset_name=None, dataset_mixture=str(mix_file)))
    assert shape == "prompt_completion"
    counts = {s: sum(1 for r in train if origin(r) == s) for s in "ABC"}
    n = len(train)
    assert counts["C"] == 3000  # the source drawn most often runs out first: nothing repeats
    for source, p in zip("ABC", (1 / 8, 2 / 8, 5 / 8)):
        assert abs(counts[source] - n * p) <= 4 * math.sqrt(n * p * (1 - p)), (source, counts, n)
    assert len({(r["prompt"], r["completion"]) for r in train}) == n

    sources = three_sources(tmp_path)
    sources.append({"path": str(source_file(tmp_path / "d.jsonl", 50, "D", "pc")), "weight": "all"})
    mixed: dict = {}
    with_all, _, _ = prepare.load_records(
        prepare.DataOptions(
            dataset_name=None, dataset_mixture=str(write_mixture(tmp_path / "mix_all.yaml", sources, seed=7))
        ),
        mixed,
    )
    assert sum(1 for r in with_all if origin(r) == "D") == 50
    assert len(with_all) == n + 50
    assert [s["records"] for s in mixed["sources"]] == [counts["A"], counts["B"], counts["C"], 50]
    assert [s["weight"] for s in mixed["sources"]] == [1.0, 2.0, 5.0, "all"]
    assert origin(with_all[0]) != "D" or origin(with_all[-1]) != "D"  # shuffled in, not appended


def test_the_fingerprint_changes_with_any_weight_source_percentage_or_seed_and_not_with_paths(tmp_path):
    base = three_sources(tmp_path)

    def fp(sources, name="m.yaml", **extra):
        return mixture.mixture_fingerprint(
            mixture.read_mixture(str(write_mixture(tmp_path / name, sources, **extra)), 42)
        )

    reference = fp(base)
    for i in range(3):  # each source's weight on its own
        changed = [dict(s) for s in base]
        changed[i]["weight"] = changed[i]["weight"] + 1
        assert fp(changed) != reference, i
    all_of_it = [dict(s) for s in base]
    all_of_it[0]["weight"] = "all"
    assert fp(all_of_it) != reference
    assert fp(base, seed=43) != reference
    assert fp(base, stopping_strategy="all_exhausted") != reference
    assert fp([{**base[0], "percentage": 50}, *base[1:]]) != reference
    assert fp(base[:2]) != reference
    source_file(tmp_path / "a.jsonl", 3000, "A2")  # one source's bytes change
    assert fp(base) != reference
    source_file(tmp_path / "a.jsonl", 3000, "A")
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    copies = [{**s, "path": str(shutil.copy(s["path"], moved))} for s in base]
    assert fp(copies, name="other.yaml") == reference  # the same data from other paths and another file name

    # the preparation's cache key follows the mixture too
    from trl import SFTConfig

    from llmft.data.synthetic import make_tokenizer

    args = SFTConfig(output_dir=str(tmp_path / "out"), report_to="none", bf16=False, use_cpu=True, max_length=32)
    tokenizer = make_tokenizer()
    keys = []
    for weight in (1, 3):
        f = write_mixture(tmp_path / f"k{weight}.yaml", [{**base[0], "weight": weight}, *base[1:]])
        keys.append(
            prepare.fingerprint(prepare.DataOptions(dataset_name=None, dataset_mixture=str(f)), tokenizer, args)[0]
        )
    assert keys[0] != keys[1]


def test_bad_mixtures_are_one_line(tmp_path):
    good = three_sources(tmp_path, n=10)
    cases = [
        ([{**good[0], "weight": 0}, *good[1:]], "weight 0 must be a positive number, or all"),
        ([{**good[0], "weight": -2}, *good[1:]], "weight -2 must be a positive number, or all"),
        ([{**good[0], "weight": "most"}, *good[1:]], "weight 'most' must be a positive number, or all"),
        (
            [{k: v for k, v in good[0].items() if k != "weight"}, *good[1:]],
            "no weight: give a positive number, or all",
        ),
        ([{**good[0], "path": str(tmp_path / "gone.jsonl")}, *good[1:]], "gone.jsonl not found"),
        (
            [{**good[0], "columns": {"prompt": "query", "completion": "answer"}}, *good[1:]],
            "source "
            + str(tmp_path / "a.jsonl")
            + ": column(s) query not in the dataset; its columns are question, answer",
        ),
        (
            [{**good[0], "format": "messages"}, *good[1:]],
            "format messages needs a messages or conversations column; its columns are prompt, completion",
        ),
        (
            [
                good[0],
                {
                    "path": str(source_file(tmp_path / "t.jsonl", 5, "T", "text")),
                    "columns": {"text": "body"},
                    "weight": 1,
                },
            ],
            "the sources must give one format after their column mappings",
        ),
        ([{**good[0], "percentage": 0}], "percentage 0 must be in (0, 100]"),
        (
            [{**good[0], "columns": {"question": "q"}}],
            "must map prompt, completion, messages, text to the source's field names",
        ),
        ([], "expected a mapping with a non-empty 'datasets' list"),
    ]
    for sources, message in cases:
        opts = prepare.DataOptions(
            dataset_name=None, dataset_mixture=str(write_mixture(tmp_path / "bad.yaml", sources))
        )
        with pytest.raises(DataError) as e:
            prepare.check_options(opts)
        assert message in str(e.value) and "\n" not in str(e.value), (message, str(e.value))
    with pytest.raises(DataError, match="drop --dataset_name, --prompt_column"):
        prepare.check_options(
            prepare.DataOptions(dataset_name="x.jsonl", prompt_column="q", dataset_mixture=str(tmp_path / "bad.yaml"))
        )
    (tmp_path / "broken.yaml").write_text("datasets: [\n")
    with pytest.raises(DataError, match="broken.yaml is not valid YAML"):
        prepare.check_options(prepare.DataOptions(dataset_name=None, dataset_mixture=str(tmp_path / "broken.yaml")))


def test_a_mixture_run_records_it_and_a_rerun_trains_on_the_same_order(tiny_model, tmp_path, llmft_cache):
    """A 2-process `llmft train --dataset_mixture` run: llmft_data.json names the sources, weights and records each
    gave; the prepared records' order is the same when the cache is gone and the run is requeued; a bad weight
    stops `llmft train` with one line before the model loads."""
    sources = three_sources(tmp_path, n=40)
    sources[2]["weight"] = "all"
    mix_file = write_mixture(tmp_path / "mix.yaml", sources)
    out = tmp_path / "run"
    flags = [
        "--model_name_or_path",
        str(tiny_model),
        "--dataset_mixture",
        str(mix_file),
        "--output_dir",
        str(out),
        "--global_batch_size",
        "4",
        "--per_device_train_batch_size",
        "2",
        "--report_to",
        "none",
        "--max_length",
        "32",
        "--disable_tqdm",
        "true",
    ]
    cache = tmp_path / "cache"
    trained = run(
        [
            PYTHON,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "-m",
            "llmft.train",
            *flags,
            "--max_steps",
            "2",
            "--save_steps",
            "2",
        ],
        check=True,
        timeout=600,
        LLMFT_CACHE=str(cache),
    )
    record = json.loads((out / "llmft_data.json").read_text())
    assert record["dataset_name"] == f"mixture {mix_file}"
    shares = record["mixture"]["sources"]
    assert [s["weight"] for s in shares] == [1.0, 2.0, "all"] and shares[2]["records"] == 40
    assert sum(s["records"] for s in shares) == record["records"]["train"]
    assert f"records (prompt_completion, {shares[0]['records']} from " in trained.stdout

    first = sorted(cache.glob("prepared/*/train"))
    assert len(first) == 1
    from datasets import load_from_disk

    order = load_from_disk(str(first[0]))["input_ids"]
    shutil.rmtree(cache)  # a requeued job on a node without the cache prepares again: the same records, same order
    again = run(
        [
            PYTHON,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "-m",
            "llmft.train",
            *flags,
            "--max_steps",
            "3",
            "--save_steps",
            "3",
        ],
        check=True,
        timeout=600,
        LLMFT_CACHE=str(cache),
    )
    assert "resum" in again.stdout.lower()
    [second] = sorted(cache.glob("prepared/*/train"))
    assert second.parent.name == first[0].parent.name and load_from_disk(str(second))["input_ids"] == order

    bad = write_mixture(tmp_path / "bad.yaml", [{**sources[0], "weight": 0}, *sources[1:]])
    proc = run(
        [
            PYTHON,
            "-m",
            "llmft.train",
            *flags[:2],
            "--dataset_mixture",
            str(bad),
            "--output_dir",
            str(tmp_path / "bad_run"),
            "--report_to",
            "none",
        ],
        timeout=300,
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("llmft train: error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "weight 0 must be a positive number, or all" in errors[0], (
        proc.stderr[-2000:]
    )
    assert "Traceback" not in proc.stderr and not (tmp_path / "bad_run").exists()
    assert "Loading weights" not in proc.stderr  # stopped before the model loaded

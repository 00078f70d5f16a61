"""What padding costs and what padding-free batches and --packing would change, from the prepared data's lengths
(llmft.padding): the expected longest sample of a micro-batch, checked against shuffled batches of real lengths."""

from __future__ import annotations

import random

import pytest
from conftest import PYTHON, run
from datasets import Dataset

from llmft.data.padding import expected_longest, padding_report, prepared_lengths


def test_expected_longest_of_a_micro_batch():
    assert expected_longest([5] * 10, 8) == 5  # equal lengths: no padding
    assert expected_longest([1, 3], 1) == pytest.approx(2.0)  # one sample: the mean
    assert expected_longest([1, 3], 2) == pytest.approx(1 * 0.25 + 3 * 0.75)  # max of two draws
    rng = random.Random(0)
    lengths = [int(rng.lognormvariate(5, 0.8)) + 1 for _ in range(20_000)]
    shuffled = lengths[:]
    rng.shuffle(shuffled)
    measured = sum(max(shuffled[i : i + 8]) for i in range(0, len(shuffled), 8)) / (len(shuffled) / 8)
    assert expected_longest(lengths, 8) == pytest.approx(measured, rel=0.03)  # a shuffled epoch's batches


def test_report_says_what_padding_costs_and_what_packing_changes():
    lengths = [100] * 90 + [1000] * 10  # mean 190; a batch of 8 nearly always holds a 1000-token sample
    report = padding_report(lengths, micro_batch=8, max_length=2048)
    longest = 1000 - 900 * 0.9**8  # E[max of 8]
    assert report.expected_padded_length == pytest.approx(longest)
    assert report.padding_share == pytest.approx(1 - 190 / longest)
    assert report.padding_free_gain == pytest.approx(longest / 190)
    assert report.samples_per_packed_row == pytest.approx(2048 / 190)
    (line,) = report.lines(packing=False, padding_free=False)
    assert line.startswith(
        "data: 100 sequences, mean 190 tokens, longest 1000; padded to the longest of a micro-batch "
        f"of 8, {report.padding_share:.0%} of the tokens fed are padding: padding-free batches would "
        f"feed none (up to {longest / 190:.2f}x the real tokens/s"
    )
    assert "--packing also fills rows of 2048 with about 11 samples each (about 11x the samples per step" in line
    (packed,) = report.lines(packing=True, padding_free=False)
    assert "would be padding; --packing: no padding, about 11 samples per row of 2048 tokens" in packed
    (free,) = report.lines(packing=False, padding_free=True)
    assert "would be padding (padding-free: none is fed, up to" in free
    even = padding_report([64] * 50, micro_batch=8, max_length=64)
    assert (
        even.padding_share == 0
        and "(padding-free would gain little)" in even.lines(packing=False, padding_free=False)[0]
    )


def test_lengths_of_prepared_data_unpacked_and_packed():
    from trl.data_utils import pack_dataset

    seqs = [[1] * 3, [2] * 7, [3] * 2]
    assert prepared_lengths(Dataset.from_dict({"input_ids": seqs})) == [3, 7, 2]
    packed = pack_dataset(Dataset.from_dict({"input_ids": seqs}), seq_length=12, strategy="bfd")
    assert sorted(prepared_lengths(packed)) == [2, 3, 7]  # the samples', not the rows'


def test_plan_prints_the_padding_of_prepared_data(tiny_model, tiny_data, tmp_path):
    from pathlib import Path

    llmft = str(Path(PYTHON).parent / "llmft")
    prepared = run(
        [llmft, "prepare", "--model_name_or_path", str(tiny_model), "--dataset_name", str(tiny_data)], check=True
    )
    directory = next(
        line.split("prepared data ")[1].split(" ")[0]
        for line in prepared.stdout.splitlines()
        if "prepared data " in line
    )
    out = run(
        [
            llmft,
            "plan",
            "--global_batch_size",
            "16",
            "--per_device_train_batch_size",
            "4",
            "--nnodes",
            "1",
            "--nproc_per_node",
            "1",
            "--prepared",
            directory,
        ],
        check=True,
    ).stdout
    line = next(line for line in out.splitlines() if line.startswith("llmft plan: data: 256 sequences"))
    assert "padded to the longest of a micro-batch of 4" in line and "of the tokens fed are padding" in line
    bad = run([llmft, "plan", "--global_batch_size", "16", "--prepared", str(tmp_path)])
    assert bad.returncode == 2 and "is not complete prepared data" in bad.stderr and "Traceback" not in bad.stderr

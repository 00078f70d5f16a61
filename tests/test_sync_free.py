"""No device-to-host sync per micro-batch in the code llmft controls (llmft.sync_free), with the same logged values.

Counted on a CPU (tests/sync_counter.py): every host read of a tensor inside each optimizer step's micro-batches.
TRL's own trainer makes several per micro-batch (its metrics' .item() calls, HF's NaN/Inf filter); llmft's
trainer logs the same loss, entropy, token accuracy and token count with none."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
import transformers
from conftest import PYTHON, REPO, run
from datasets import Dataset
from sync_counter import MODEL_CODE, SyncCounter
from transformers import AutoTokenizer

from llmft.tiny import as_format, make_examples
from llmft.training import checkpoint_save
from llmft.training.sync_free import reduce_metrics

PROBE = str(REPO / "tests" / "train_probe.py")
LOGGED = ("loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens")


@contextlib.contextmanager
def nan_loss_at(call: int):
    """The Trainer's training_step reports a NaN loss at its `call`-th call (after a real forward and backward)."""
    original, calls = transformers.Trainer.training_step, [0]

    def step(trainer, *args, **kwargs):
        loss = original(trainer, *args, **kwargs)
        calls[0] += 1
        return loss * float("nan") if calls[0] == call else loss

    transformers.Trainer.training_step = step
    try:
        yield
    finally:
        transformers.Trainer.training_step = original


def train_in_process(trainer_cls, model_dir, out, nan_at: int | None = None):
    """4 optimizer steps x 2 micro-batches of 3 on CPU (no DeepSpeed): (log history, syncs per micro-batch by site)."""
    from trl import SFTConfig

    torch.manual_seed(0)
    args = SFTConfig(
        output_dir=str(out),
        per_device_train_batch_size=3,
        gradient_accumulation_steps=2,
        max_steps=4,
        logging_steps=2,
        learning_rate=5e-3,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=0,
        disable_tqdm=True,
        max_length=64,
    )
    data = Dataset.from_list(as_format(make_examples(48), "prompt_completion"))
    counter = SyncCounter()
    trainer = trainer_cls(
        model=str(model_dir),
        args=args,
        train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        callbacks=[counter.callback()],
    )
    with counter.installed(), nan_loss_at(nan_at) if nan_at else contextlib.nullcontext():
        trainer.train()
    logs = [{k: entry[k] for k in LOGGED} for entry in trainer.state.log_history if "loss" in entry]
    return logs, counter


@pytest.mark.parametrize("nan_at", [None, 3])
def test_llmft_logs_what_trl_logs_without_reading_back_per_micro_batch(tiny_model, tmp_path, nan_at):
    """The same training (seeded) through TRL's SFTTrainer and through llmft's: identical logged loss (with a NaN
    micro-batch loss filtered the same way), grad norm, entropy, token accuracy and token count; TRL reads tensors
    back several times per micro-batch, llmft not once outside the model's own code."""
    from trl import SFTTrainer

    trl_logs, trl_syncs = train_in_process(SFTTrainer, tiny_model, tmp_path / "trl", nan_at)
    llmft_logs, llmft_syncs = train_in_process(checkpoint_save.trainer_class(), tiny_model, tmp_path / "llmft", nan_at)
    assert len(trl_logs) == len(llmft_logs) == 2 and trl_syncs.micro_batches == llmft_syncs.micro_batches == 8
    for ours, theirs in zip(llmft_logs, trl_logs):
        assert ours == pytest.approx(theirs, rel=1e-6), (ours, theirs)
    assert llmft_logs[-1]["num_tokens"] > llmft_logs[0]["num_tokens"] > 0 and llmft_logs[0]["entropy"] > 0
    trl_reads = sum(trl_syncs.outside_model_code().values())
    assert trl_reads >= 3 * trl_syncs.micro_batches, trl_syncs.sites  # the counter sees TRL's .item() calls
    assert llmft_syncs.outside_model_code() == {}, llmft_syncs.sites


def test_reduce_metrics_gives_trls_per_micro_batch_ratios():
    rows = torch.tensor(
        [[4.0, 8.0, 2.0, 10.0], [0.0, 0.0, 0.0, 6.0], [2.0, 1.0, 2.0, 4.0]]
    )  # label tokens, entropy, hits, fed
    doubled = []
    values, total = reduce_metrics(rows.clone(), 100, tp_size=1, all_reduce=lambda t: (doubled.append(1), t.mul_(2)))
    assert doubled  # summed over ranks first (two ranks with the same rows here): ratios unchanged, tokens doubled
    assert values == {"entropy": [2.0, 0.0, 0.5], "mean_token_accuracy": [0.5, 0.0, 1.0]}  # no label token: 0, as TRL
    assert total == 100 + 2 * (10 + 6 + 4)
    assert reduce_metrics(rows.clone(), 0, tp_size=2)[1] == 5 + 3 + 2  # tensor-parallel ranks repeat each token


def test_a_real_deepspeed_run_reads_nothing_back_per_micro_batch(tiny_model, tiny_data, tmp_path):
    """`llmft train` (ZeRO-2, 4 micro-batches per step): host reads inside the steps' micro-batches, outside the model's
    own code, stay below one per micro-batch (what is left is per optimizer step: DeepSpeed's gradient checks)."""
    out, probe = tmp_path / "run", tmp_path / "probe"
    flags = [
        "--model_name_or_path",
        tiny_model,
        "--dataset_name",
        tiny_data,
        "--output_dir",
        out,
        "--report_to",
        "none",
        "--logging_steps",
        1,
        "--disable_tqdm",
        "true",
        "--max_steps",
        3,
        "--save_strategy",
        "no",
        "--zero_stage",
        2,
        "--global_batch_size",
        8,
        "--per_device_train_batch_size",
        2,
    ]
    run([PYTHON, PROBE, *map(str, flags)], check=True, LLMFT_PROBE_DIR=str(probe), LLMFT_PROBE_SYNCS="1")
    counted = json.loads((probe / "syncs.json").read_text())
    assert counted["micro_batches"] == 12
    ours = {site: n for site, n in counted["sites"].items() if not any(part in site for part in MODEL_CODE)}
    assert sum(ours.values()) / counted["micro_batches"] < 1, ours
    assert not any(n >= counted["micro_batches"] for n in ours.values()), ours  # no single site once per micro-batch

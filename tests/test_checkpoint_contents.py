"""What a checkpoint holds: the weights once (no model.safetensors beside the ZeRO-0/1/2 shards), and still everything
resume, `llmft infer` and `llmft export` need. Real 2-process torchrun + DeepSpeed (gloo) runs of a tiny model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import PYTHON, run
from test_train import steps, train_cmd

from llmft.checkpoint.run_dir import RUN_RECORD

FLAGS = (
    "--zero_stage",
    2,
    "--max_steps",
    4,
    "--save_steps",
    2,
    "--global_batch_size",
    8,
    "--per_device_train_batch_size",
    2,
    "--learning_rate",
    "5e-3",
)
LOSS_TOL = 5e-4  # tests/test_elastic.py: the same state gives the same losses to the 4 printed decimals


@pytest.fixture(scope="module")
def nodrop_model(tiny_model, tmp_path_factory) -> Path:
    from transformers import AutoConfig

    out = tmp_path_factory.mktemp("nodrop") / "model"
    shutil.copytree(tiny_model, out)
    config = AutoConfig.from_pretrained(out)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    config.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def zero2_run(nodrop_model, tiny_data, tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("zero2") / "run"
    return out, run(train_cmd(nodrop_model, tiny_data, out, *FLAGS), check=True).stdout


def test_a_zero2_checkpoint_holds_the_weights_once(zero2_run):
    out, _ = zero2_run
    for step in (2, 4):
        ckpt = out / f"checkpoint-{step}"
        assert not list(ckpt.glob("model*.safetensors")), sorted(p.name for p in ckpt.iterdir())
        assert (ckpt / f"global_step{step}" / "mp_rank_00_model_states.pt").is_file()
        assert (ckpt / "config.json").is_file() and (ckpt / "tokenizer.json").is_file()
        marker = json.loads((ckpt / "llmft_complete.json").read_text())
        assert not [f for f in marker["files"] if f.endswith(".safetensors")]
    assert (out / "model.safetensors").is_file()  # the final model stays a Hugging Face model


def test_a_zero2_checkpoint_without_model_safetensors_resumes_with_the_same_losses(
    zero2_run, nodrop_model, tiny_data, tmp_path
):
    out, stdout = zero2_run
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(out / "checkpoint-2", resumed / "checkpoint-2")
    shutil.copy2(out / RUN_RECORD, resumed / RUN_RECORD)
    second = run(train_cmd(nodrop_model, tiny_data, resumed, *FLAGS), check=True).stdout
    assert f"resuming from {resumed / 'checkpoint-2'}" in second
    whole = {s: loss for s, _, loss, _ in steps(stdout)}
    after = {s: loss for s, _, loss, _ in steps(second)}
    assert sorted(after) == [3, 4]
    for s in (3, 4):
        assert after[s] == pytest.approx(whole[s], abs=LOSS_TOL), (s, after, whole)


def test_infer_and_export_read_a_zero2_checkpoint_without_model_safetensors(zero2_run, tmp_path):
    import torch
    from safetensors.torch import load_file

    out, _ = zero2_run
    gen = run(
        [
            PYTHON,
            "-m",
            "llmft.infer",
            str(out / "checkpoint-4"),
            "--prompt",
            "What is 2 plus 3?",
            "--max_new_tokens",
            "4",
            "--json",
        ],
        check=True,
        timeout=180,
    )
    result = json.loads(gen.stdout)
    assert result["step"] == 4 and result["zero_stage"] == 2 and result["generations"][0]["completion"]
    # what `llmft export` and `llmft infer` load the checkpoint with (llmft.checkpoint.loader); test_export.py runs
    # the export itself on a model trained long enough to pass its chat-stop check
    from llmft.checkpoint.loader import load

    loaded = load(out / "checkpoint-4" / "global_step4").model.state_dict()
    final = load_file(out / "model.safetensors")
    assert final and set(final) <= set(loaded)  # every weight of the final model (which leaves out a tied lm_head)
    for name, tensor in final.items():  # the fp32 masters of step 4 are the weights of the final model (fp32 on CPU)
        assert torch.equal(loaded[name], tensor), name

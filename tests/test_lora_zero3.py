"""LoRA under ZeRO-3 on 2 ranks: every saved adapter is whole and trained, loads with PEFT and llmft infer, and gives
the logits the model had in training; a save that is not (zeros, empty, missing or partitioned tensors) is never
published as a complete checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import PYTHON, REPO, run

from llmft.checkpoint.run_dir import COMPLETE_MARKER, DONE_MARKER
from llmft.training import checkpoint_checks

PROBE = str(REPO / "tests" / "train_probe.py")
R, LAYERS, EMBD = 4, 2, 64  # llmft.tiny's model: 2 layers, width 64; c_attn maps 64 -> 192
EXPECTED = {
    f"base_model.model.transformer.h.{i}.attn.c_attn.lora_{ab}.weight": shape
    for i in range(LAYERS)
    for ab, shape in (("A", (R, EMBD)), ("B", (3 * EMBD, R)))
}


def lora_cmd(model, data, out):
    return [
        PYTHON,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        PROBE,
        "--model_name_or_path",
        str(model),
        "--dataset_name",
        str(data),
        "--output_dir",
        str(out),
        "--report_to",
        "none",
        "--logging_steps",
        "1",
        "--disable_tqdm",
        "true",
        "--zero_stage",
        "3",
        "--max_steps",
        "4",
        "--save_steps",
        "2",
        "--global_batch_size",
        "4",
        "--per_device_train_batch_size",
        "2",
        "--learning_rate",
        "5e-3",
        "--use_peft",
        "--lora_r",
        str(R),
        "--lora_alpha",
        "8",
        "--lora_target_modules",
        "c_attn",
    ]


@pytest.fixture(scope="module")
def lora_run(tiny_model, tiny_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lora") / "run"
    run(lora_cmd(tiny_model, tiny_data, out), check=True, LLMFT_PROBE_DIR=str(out / "probe"))
    return out


def adapter(where: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(where / checkpoint_checks.ADAPTER_FILE)


def test_every_saved_adapter_is_whole_trained_and_published(lora_run):
    import torch

    saved = {}
    for where in (lora_run / "checkpoint-2", lora_run / "checkpoint-4", lora_run):
        tensors = adapter(where)
        assert {k: tuple(v.shape) for k, v in tensors.items()} == EXPECTED, where
        for k, v in tensors.items():
            if "lora_B" in k:
                assert v.abs().max() > 0, f"{where}: {k} is all zeros (untrained or never gathered)"
        config = json.loads((where / "adapter_config.json").read_text())
        assert config["r"] == R and config["target_modules"] == ["c_attn"]
        saved[where.name] = tensors
    assert (lora_run / "checkpoint-2" / COMPLETE_MARKER).is_file() and (
        lora_run / "checkpoint-4" / COMPLETE_MARKER
    ).is_file()
    assert json.loads((lora_run / DONE_MARKER).read_text())["global_step"] == 4
    # Steps 3-4 trained it further; the final adapter is the step-4 one.
    b = next(k for k in EXPECTED if "lora_B" in k)
    assert not torch.equal(saved["checkpoint-2"][b], saved["checkpoint-4"][b])
    for k in EXPECTED:
        assert torch.equal(saved["checkpoint-4"][k], saved[lora_run.name][k])


def test_saved_adapters_give_the_logits_the_model_had_in_training(lora_run, tiny_model):
    """PEFT loading the adapter file, and llmft infer reading the ZeRO-3 shards with and without --merge."""
    import torch
    from peft import PeftModel
    from train_probe import PROBE_IDS
    from transformers import AutoModelForCausalLM

    from llmft import infer

    trained = torch.load(lora_run / "probe" / "logits-4.pt")
    for where in (lora_run, lora_run / "checkpoint-4"):
        base = AutoModelForCausalLM.from_pretrained(tiny_model)
        peft_model = PeftModel.from_pretrained(base, where).eval()
        with torch.no_grad():
            logits = peft_model(input_ids=PROBE_IDS).logits
        torch.testing.assert_close(logits, trained, rtol=0, atol=1e-5, msg=f"PEFT from {where}")
    for merge in (False, True):
        loaded = infer.load(lora_run / "checkpoint-4" / "global_step4", merge=merge)
        with torch.no_grad():
            logits = loaded.model(input_ids=PROBE_IDS).logits
        torch.testing.assert_close(logits, trained, rtol=0, atol=1e-5, msg=f"llmft infer, merge={merge}")

    # The command itself, both ways: the same greedy answer.
    answers = []
    for extra in ([], ["--merge"]):
        proc = run(
            [
                PYTHON,
                "-m",
                "llmft.infer",
                str(lora_run / "checkpoint-4"),
                "--prompt",
                "What is 2 plus 3?",
                "--max_new_tokens",
                "6",
                "--json",
                *extra,
            ],
            check=True,
        )
        answers.append(json.loads(proc.stdout[proc.stdout.index("{") :])["generations"][0]["completion"])
    assert answers[0] == answers[1]


def test_a_save_with_zeroed_adapter_is_refused_and_training_stops(tiny_model, tiny_data, tmp_path):
    """The on_save check on a real run: rank 0's adapter file is zeroed after the save (as an ungathered ZeRO-3
    save would leave it); checkpoint-2 gets no completeness marker, nothing resumes from it, and the run fails
    with one line naming the file."""
    out = tmp_path / "run"
    proc = run(
        lora_cmd(tiny_model, tiny_data, out),
        LLMFT_PROBE_DIR=str(tmp_path / "probe"),
        LLMFT_PROBE_SABOTAGE="zero_lora_b",
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("llmft train: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert errors[0] == (
        f"llmft train: error: {out / 'checkpoint-2'} not published as complete: {out / 'checkpoint-2' / 'adapter_model.safetensors'}: "
        "base_model.model.transformer.h.0.attn.c_attn.lora_B.weight is all zeros but the model's is not (2 such tensors)"
    )
    assert not (out / "checkpoint-2" / COMPLETE_MARKER).exists()
    assert not (out / "checkpoint-4").exists() and not (out / DONE_MARKER).exists()
    assert f'File "{REPO / "llmft"}' not in proc.stderr  # llmft's error is one line; torchrun adds its own report


# ---- the check itself, on files written here ----------------------------------------------------------


@pytest.fixture(scope="module")
def peft_model(tiny_model):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model), LoraConfig(r=R, target_modules=["c_attn"])
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()  # "trained"
    return model


def test_the_check_names_each_kind_of_bad_file(peft_model, tiny_model, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    expected = checkpoint_checks.live_tensors(peft_model)
    assert {t.names[0]: t.shape for t in expected} == EXPECTED and all(t.nonzero for t in expected)
    peft_model.save_pretrained(tmp_path)
    path = tmp_path / checkpoint_checks.ADAPTER_FILE
    assert checkpoint_checks.problems(tmp_path, expected, adapter=True) == []
    good = load_file(path)

    def with_tensors(tensors):
        save_file(tensors, path, metadata={"format": "pt"})
        return checkpoint_checks.problems(tmp_path, expected, adapter=True)

    a0, b1 = (
        "base_model.model.transformer.h.0.attn.c_attn.lora_A.weight",
        "base_model.model.transformer.h.1.attn.c_attn.lora_B.weight",
    )
    assert with_tensors({k: v for k, v in good.items() if k != b1}) == [f"{path} is missing {b1} (shape [192, 4])"]
    assert with_tensors({**good, a0: torch.empty(0)}) == [
        f"{path}: {a0} has shape [0], the model's is [4, 64] (a partition saved instead of the whole tensor)"
    ]
    assert with_tensors({**good, b1: torch.zeros(192, 4)}) == [
        f"{path}: {b1} is all zeros but the model's is not (1 such tensors)"
    ]
    assert with_tensors({}) == [f"{path} holds no tensors"]
    path.write_bytes(b"")
    assert checkpoint_checks.problems(tmp_path, expected, adapter=True) == [f"{path} is empty (0 bytes)"]
    path.write_bytes(b'\x10\x00\x00\x00\x00\x00\x00\x00{"a": trunc')
    assert checkpoint_checks.problems(tmp_path, expected, adapter=True)[0].startswith(
        f"{path} is not a readable safetensors file ("
    )
    path.unlink()
    assert checkpoint_checks.problems(tmp_path, expected, adapter=True) == [f"{path} is missing"]


def test_full_model_files_tied_weights_and_shards(tiny_model, tmp_path):
    """A full model: tied embeddings saved once are fine; a save split into shards is read through its index."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    expected = checkpoint_checks.live_tensors(model)
    model.save_pretrained(tmp_path / "one")
    assert checkpoint_checks.problems(tmp_path / "one", expected, adapter=False) == []
    model.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    assert (tmp_path / "sharded" / checkpoint_checks.MODEL_INDEX).is_file()
    assert checkpoint_checks.problems(tmp_path / "sharded", expected, adapter=False) == []
    shard = sorted((tmp_path / "sharded").glob("model-*.safetensors"))[-1]
    shard.unlink()
    assert checkpoint_checks.problems(tmp_path / "sharded", expected, adapter=False) == [f"{shard} is missing"]
    # ZeRO shards only (no model file at all): nothing to check here, the shards are the weights.
    assert checkpoint_checks.problems(tmp_path / "none", expected, adapter=False) == []


def test_a_lora_checkpoint_written_by_two_ranks_resumes_on_one(lora_run, tiny_model, tiny_data, tmp_path):
    """Elastic resume with LoRA: only the adapter is in the optimizer; its moments come back whole on one rank."""
    import shutil

    import torch

    out = tmp_path / "run"
    out.mkdir()
    shutil.copytree(lora_run / "checkpoint-2", out / "checkpoint-2")
    cmd = lora_cmd(tiny_model, tiny_data, out)
    cmd = [PYTHON] + cmd[cmd.index(PROBE) :]  # one process
    proc = run(cmd, check=True, LLMFT_PROBE_DIR=str(out / "probe"))
    assert "resuming checkpoint-2 written by 2 ranks on 1 ranks: universal checkpoint" in proc.stdout
    assert "accumulation 1 -> 2, global batch 4 kept" in proc.stdout
    saved = torch.load(lora_run / "probe" / "moments-saved-2.pt")
    resumed = torch.load(out / "probe" / "moments-resumed-2.pt")
    assert sorted(saved) == sorted(resumed) and len(saved) == len(EXPECTED)
    for name in saved:
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(saved[name][key], resumed[name][key]), (name, key)
    tensors = adapter(out)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == EXPECTED
    assert json.loads((out / DONE_MARKER).read_text())["global_step"] == 4

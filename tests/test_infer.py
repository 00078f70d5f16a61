"""`python -m llmft.infer` on checkpoints written by real `llmft train` runs (torchrun, 2 processes, DeepSpeed on
CPU): ZeRO 0, 1, 2, 3 with CPU offload, and LoRA; exactness against DeepSpeed, generation, the
`inference/` entry point and the `llmft infer` subcommand."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
from conftest import PYTHON, REPO, run

PROMPT = "What is 2 plus 3?"

# name -> llmft train flags; each run: 4 steps, checkpoints at steps 2 and 4.
# Four runs cover the matrix (stages 0-3, offload, LoRA); the plain-DeepSpeed fixture in
# test_zero_checkpoint.py covers full-weight stage 1 and bf16 exactness.
RUNS = {
    "z0": ["--zero_stage", "0"],
    "z2": ["--zero_stage", "2"],
    "z3_offload": ["--zero_stage", "3", "--offload"],
    "lora_z1": ["--zero_stage", "1", "--use_peft", "--lora_r", "8", "--lora_target_modules", "c_attn", "c_proj"],
}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def trained(tmp_path_factory, tiny_model, tiny_data):
    """trained(name) -> the output dir of a real 2-process `llmft train` run, trained once per session."""
    root = tmp_path_factory.mktemp("llmft_runs")
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            out = root / name
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
                    "2",
                    "--global_batch_size",
                    "8",
                    "--per_device_train_batch_size",
                    "2",
                    "--report_to",
                    "none",
                    "--logging_steps",
                    "1",
                    *RUNS[name],
                ],
                timeout=480,
                check=True,
            )
            done[name] = out
        return done[name]

    return get


def tag(out: Path, step: int = 4) -> Path:
    return out / f"checkpoint-{step}" / f"global_step{step}"


def infer(*args, check=True):
    proc = run([PYTHON, "-m", "llmft.infer", *map(str, args)], timeout=180)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def deepspeed_reference(ckpt_dir: Path) -> dict:
    """DeepSpeed's own reconstruction; for stage 0 (which it does not handle) the Trainer's final model, saved at the
    same (last) step: checkpoints hold no model.safetensors (llmft.training.checkpoint_save)."""
    from safetensors.torch import load_file

    from llmft.checkpoint.zero import open_checkpoint

    tags = sorted(ckpt_dir.glob("global_step*"))
    if open_checkpoint(tags[-1]).stage == 0:
        assert not (ckpt_dir / "model.safetensors").exists()
        sd = load_file(ckpt_dir.parent / "model.safetensors")
        sd.setdefault("lm_head.weight", sd["transformer.wte.weight"])
        return sd
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()):
        return get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir))


@pytest.mark.parametrize("name,stage", [("z0", 0), ("z2", 2), ("z3_offload", 3)])
def test_real_run_weights_and_logits_equal_deepspeed(trained, tiny_model, name, stage):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmft.checkpoint.loader import load
    from llmft.checkpoint.zero import load_fp32_state_dict

    out = trained(name)
    ref = deepspeed_reference(out / "checkpoint-4")
    ours = load_fp32_state_dict(tag(out))
    assert set(ours) == set(ref)
    for k, v in ref.items():
        assert ours[k].dtype == torch.float32 and torch.equal(ours[k], v), f"{name}: {k}"

    loaded = load(tag(out))  # llmft layout: config + tokenizer come from beside global_step4
    assert (loaded.ckpt.stage, loaded.ckpt.world_size, loaded.ckpt.step) == (stage, 2, 4)
    reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model)).eval()
    reference.load_state_dict(ref)
    ids = loaded.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, reference(ids).logits)


def test_demo_command_streams_and_greedy_is_deterministic(trained, capsys):
    tag_dir = tag(trained("z2"))
    streamed = infer(tag_dir, "--prompt", PROMPT, "--max_new_tokens", "20")  # the demo's command
    first = _main(capsys, tag_dir, "--prompt", PROMPT, "--max_new_tokens", "20")
    second = _main(capsys, tag_dir, "--prompt", PROMPT, "--max_new_tokens", "20")
    assert first == second  # greedy: the same tokens every time
    # streamed to the terminal: the prompt, then the completion, then a newline
    assert streamed.stdout == PROMPT + first["generations"][0]["completion"] + "\n"
    assert first["generations"][0]["new_tokens"] == 20
    assert first["checkpoint"] == str(tag_dir) and first["zero_stage"] == 2 and first["step"] == 4
    assert "ZeRO-2, 2 ranks" in streamed.stderr


def _main(capsys, *argv) -> dict:
    from llmft.infer import main, make_parser

    rc = main(make_parser().parse_args([*map(str, argv), "--json"]))
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-2000:]
    return json.loads(captured.out)


def test_batch_from_prompt_file_matches_single_prompts(trained, tmp_path, capsys):
    out = trained("z2")
    lines = tmp_path / "prompts.txt"
    lines.write_text("What is 2 plus 3?\n\nSpell apple backwards.\nRepeat: apple river stone\n")
    batch = _main(capsys, out, "--prompt_file", lines, "--max_new_tokens", "8")["generations"]
    assert [g["prompt"] for g in batch] == ["What is 2 plus 3?", "Spell apple backwards.", "Repeat: apple river stone"]
    for g in batch:
        single = _main(capsys, out, "--prompt", g["prompt"], "--max_new_tokens", "8")["generations"][0]
        assert single == g  # left-padded batching changes nothing in greedy output

    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text(
        json.dumps({"prompt": "Spell apple backwards."})
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "Hi"}]})
        + "\n"
    )
    rows = _main(capsys, out, "--prompt_file", jsonl, "--max_new_tokens", "4")["generations"]
    assert rows[0]["prompt"] == "Spell apple backwards."
    assert rows[1]["prompt"] == "<|user|>\nHi<|endoftext|>\n<|assistant|>\n"  # messages go through the chat template


def test_chat_sampling_and_seed(trained, capsys):
    out = trained("z2")
    chat = _main(capsys, out, "--prompt", "Hi", "--chat", "--max_new_tokens", "4")
    assert chat["generations"][0]["prompt"] == "<|user|>\nHi<|endoftext|>\n<|assistant|>\n"
    args = [out, "--prompt", PROMPT, "--max_new_tokens", "12", "--temperature", "1.5", "--top_p", "0.95"]
    a = _main(capsys, *args, "--seed", "1")["generations"][0]["completion"]
    b = _main(capsys, *args, "--seed", "1")["generations"][0]["completion"]
    assert a == b  # a seed makes sampling reproducible
    draws = {_main(capsys, *args, "--seed", str(s))["generations"][0]["completion"] for s in range(2, 6)}
    assert len(draws) > 1  # and it does sample


def test_resolves_run_dir_checkpoint_dir_and_skips_incomplete(trained, tmp_path, capsys):
    from llmft.checkpoint.loader import resolve_checkpoint

    out = trained("z0")
    assert resolve_checkpoint([str(out)]) == (tag(out), None)
    assert resolve_checkpoint([str(out / "checkpoint-2")]) == (tag(out, 2), None)
    chosen, note = resolve_checkpoint([str(tag(out, 2)), str(tag(out, 4))])
    assert chosen == tag(out) and "highest step" in note
    # a newer checkpoint without llmft's completeness marker (a save that was interrupted) is skipped
    run_copy = tmp_path / "run"
    shutil.copytree(out, run_copy)
    shutil.copytree(run_copy / "checkpoint-4", run_copy / "checkpoint-6")
    (run_copy / "checkpoint-6" / "llmft_complete.json").unlink()
    assert resolve_checkpoint([str(run_copy)])[0] == tag(run_copy)
    assert "skipping" in capsys.readouterr().err


def test_lora_adapter_and_merge(trained, capsys):
    import torch
    from peft import PeftModel

    from llmft.checkpoint.loader import load

    out = trained("lora_z1")
    ref = deepspeed_reference(out / "checkpoint-4")  # the LoRA weights (frozen base weights are not saved)
    assert ref and all("lora_" in k for k in ref)
    unmerged = load(tag(out))
    assert unmerged.ckpt.stage == 1
    assert isinstance(unmerged.model, PeftModel)
    sd = unmerged.model.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in ref.items())
    merged = load(tag(out), merge=True).model
    assert not any("lora_" in k for k in merged.state_dict())
    ids = torch.arange(3, 30).reshape(1, -1)
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, unmerged.model(ids).logits, rtol=1e-5, atol=1e-5)
    g1 = _main(capsys, out, "--prompt", PROMPT, "--max_new_tokens", "8")
    g2 = _main(capsys, out, "--prompt", PROMPT, "--max_new_tokens", "8", "--merge")
    assert g1["generations"] == g2["generations"]


def test_inference_entry_point_and_llmft_subcommand(trained, tiny_model, capsys):
    """The original workflow: python3 inference/inference.py <tag dir> --model_name ... (and `llmft infer`)."""
    tag_dir = tag(trained("z2"))
    expected = _main(capsys, tag_dir, "--prompt", PROMPT, "--max_new_tokens", "6")["generations"]
    legacy = run(
        [
            PYTHON,
            str(REPO / "inference" / "inference.py"),
            str(tag_dir),
            "--prompt",
            PROMPT,
            "--model_name",
            str(tiny_model),
            "--device",
            "cpu",
            "--max_new_tokens",
            "6",
            "--json",
        ],
        timeout=180,
    )
    assert legacy.returncode == 0, legacy.stderr[-3000:]
    assert json.loads(legacy.stdout)["generations"] == expected
    sub = run(
        [PYTHON, "-m", "llmft.cli", "infer", str(tag_dir), "--prompt", PROMPT, "--max_new_tokens", "6", "--json"],
        timeout=180,
    )
    assert sub.returncode == 0, sub.stderr[-3000:]
    assert json.loads(sub.stdout)["generations"] == expected


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["--prompt", "hi", "--device", "cuda:99"], "--device cuda:99"),
        ([], "nothing to do"),
        (["--prompt_file", "/nonexistent/prompts.txt"], "does not exist"),
        (["--prompt", "hi", "--model_name", "/nonexistent/model"], "cannot load the config of /nonexistent/model"),
    ],
)
def test_bad_options_are_one_line_errors(trained, argv, expected, capsys):
    from llmft.infer import main, make_parser

    assert main(make_parser().parse_args([str(tag(trained("z2"))), *argv])) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("llmft infer: error: ") and "\n" not in err and expected in err


def test_the_new_token_budget_stops_at_the_models_positions():
    from llmft.checkpoint.loader import new_token_budget
    from llmft.checkpoint.run_dir import CheckpointError

    assert new_token_budget(100, 50, 256) == (50, None)
    assert new_token_budget(218, 60, 256) == (
        38,
        "the prompt has 218 tokens: generating at most 38 new tokens, up to the "
        "model's 256 positions (not --max_new_tokens 60)",
    )
    assert new_token_budget(5000, 60, None) == (60, None)  # no known limit: the model decides
    with pytest.raises(
        CheckpointError, match="the prompt has 256 tokens and the model reads at most 256 positions: shorten"
    ):
        new_token_budget(256, 1, 256)


def test_a_long_prompt_generates_up_to_the_models_limit_and_a_too_long_one_is_one_line(trained, capsys):
    from transformers import AutoTokenizer

    from llmft.infer import main, make_parser

    tag_dir = tag(trained("z2"))
    tokenizer = AutoTokenizer.from_pretrained(trained("z2"))
    long_prompt = " ".join(["apple river stone"] * 200)
    n = len(tokenizer(long_prompt)["input_ids"])
    words = long_prompt.split()
    while n > 218:  # a 218-token prompt, as the GSM8K question that crashed
        words = words[:-1]
        n = len(tokenizer(" ".join(words))["input_ids"])
    got = _main(capsys, tag_dir, "--prompt", " ".join(words), "--max_new_tokens", "60")
    assert got["generations"][0]["new_tokens"] <= 256 - n
    assert main(make_parser().parse_args([str(tag_dir), "--prompt", " ".join(words), "--max_new_tokens", "60"])) == 0
    assert (
        f"llmft infer: the prompt has {n} tokens: generating at most {256 - n} new tokens" in capsys.readouterr().err
    )
    assert main(make_parser().parse_args([str(tag_dir), "--prompt", long_prompt, "--max_new_tokens", "60"])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        err[-1].startswith("llmft infer: error: the prompt has ")
        and "the model reads at most 256 positions" in err[-1]
    )
    assert "Traceback" not in "\n".join(err)

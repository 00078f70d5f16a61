"""A rerun into an output directory resumes only the same experiment; a different one is refused, naming each
difference and the way out, and the directory is left exactly as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmft.checkpoint.run_dir import mark_complete
from llmft.training.run_identity import RUN_RECORD, RunMismatch, check_same_run, differences, record_run, run_identity


def _args(tmp_path, model, data, *extra):
    from llmft.train import make_parser

    return make_parser().parse_args_and_config(
        args=[
            "--model_name_or_path",
            str(model),
            "--dataset_name",
            str(data),
            "--output_dir",
            str(tmp_path / "run"),
            "--report_to",
            "none",
            *map(str, extra),
        ]
    )


def _identity(parsed, global_batch=8, zero_stage=2):
    from llmft.data.loading import content_fingerprint

    script_args = parsed[0]
    return run_identity(
        *parsed,
        dataset_fingerprint=content_fingerprint(script_args.dataset_name),
        global_batch=global_batch,
        zero_stage=zero_stage,
    )


def _finished_run(out: Path, identity: dict) -> Path:
    """What a run leaves: its record, a complete checkpoint, the done marker."""
    ckpt = out / "checkpoint-4" / "global_step4"
    ckpt.mkdir(parents=True)
    (ckpt / "mp_rank_00_model_states.pt").write_bytes(b"weights")
    (out / "checkpoint-4" / "latest").write_text("global_step4")
    mark_complete(out / "checkpoint-4", 1, 2)
    (out / "llmft_done.json").write_text('{"global_step": 4}\n')
    record_run(out, identity)
    return out / "checkpoint-4"


def _snapshot(root: Path) -> dict:
    return {
        str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_the_record_holds_what_defines_the_run_and_not_the_world_size(tiny_model, tiny_data, tmp_path):
    parsed = _args(
        tmp_path, tiny_model, tiny_data, "--use_peft", "--lora_r", 8, "--lora_target_modules", "c_attn", "--packing"
    )
    identity = _identity(parsed)
    assert identity["model"] == str(tiny_model) and identity["dataset"] == str(tiny_data)
    assert identity["lora"]["r"] == 8 and identity["lora"]["target_modules"] == ["c_attn"]
    assert (identity["packing"], identity["max_length"], identity["global_batch"], identity["zero_stage"]) == (
        True,
        1024,
        8,
        2,
    )
    assert not any("world" in key for key in identity)
    json.dumps(identity)  # written as JSON


def test_a_rerun_with_other_settings_is_refused_naming_each_difference(tiny_model, tiny_data, tmp_path, capsys):
    """Through the real entry point: one line, exit 2, and the finished run's files are untouched."""
    from llmft.train import cli, make_parser

    data = tmp_path / "data.jsonl"
    data.write_bytes(tiny_data.read_bytes())
    out = tmp_path / "run"
    ckpt = _finished_run(out, _identity(_args(tmp_path, tiny_model, data)))
    with data.open("a") as f:
        f.write('{"prompt": "one more", "completion": "record"}\n')
    before = _snapshot(out)

    argv = [
        "--model_name_or_path",
        str(tiny_model),
        "--dataset_name",
        str(data),
        "--output_dir",
        str(out),
        "--report_to",
        "none",
        "--use_peft",
        "--lora_r",
        "8",
        "--max_length",
        "128",
        "--global_batch_size",
        "16",
        "--per_device_train_batch_size",
        "8",
    ]
    assert cli(make_parser(), argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("llmft train: error:")]
    assert len(errors) == 1, err
    line = errors[0]
    assert line.startswith(f"llmft train: error: {out} holds another run (")
    for difference in (
        f"dataset content {data} (",
        "LoRA settings none -> {r 8, alpha 32",
        "max_length 1024 -> 128",
        "global batch 8 -> 16",
    ):
        assert difference in line, difference
    assert line.endswith(
        f"use a new --output_dir, or continue this run with the new settings on purpose: --resume_from_checkpoint {ckpt}"
    )
    assert _snapshot(out) == before


def test_same_settings_resume_and_an_explicit_checkpoint_continues_on_purpose(tiny_model, tiny_data, tmp_path):
    out = tmp_path / "run"
    identity = _identity(_args(tmp_path, tiny_model, tiny_data))
    ckpt = _finished_run(out, identity)
    assert check_same_run(out, identity, None) == []
    assert check_same_run(out, identity, "latest") == []
    other = {**identity, "packing": True, "zero_stage": 3}
    with pytest.raises(RunMismatch, match="packing False -> True; ZeRO stage 2 -> 3"):
        check_same_run(out, other, "latest")  # "latest" is the implicit resume, said out loud
    assert check_same_run(out, other, str(ckpt)) == ["packing False -> True", "ZeRO stage 2 -> 3"]


def test_nothing_to_protect_means_nothing_refused(tiny_model, tiny_data, tmp_path):
    out = tmp_path / "run"
    identity = _identity(_args(tmp_path, tiny_model, tiny_data))
    record_run(out, identity)  # a run that failed before its first checkpoint
    assert check_same_run(out, {**identity, "global_batch": 64}, None) == []
    legacy = tmp_path / "legacy"
    _finished_run(legacy, identity)
    (legacy / RUN_RECORD).unlink()  # written before llmft recorded runs: nothing to compare with
    assert check_same_run(legacy, {**identity, "global_batch": 64}, None) == []


def test_differences_are_named_one_by_one():
    saved = {
        "model": "gpt2",
        "lora": None,
        "global_batch": 32,
        "dataset": "a.jsonl",
        "dataset_fingerprint": "aaaa",
        "quantization": None,
        "zero_stage": 2,
    }
    now = {
        **saved,
        "model": "/models/llama",
        "dataset": "b.jsonl",
        "dataset_fingerprint": "bbbb",
        "quantization": "4bit",
    }
    assert differences(saved, now) == [
        "model gpt2 -> /models/llama",
        "dataset content a.jsonl (aaaa) -> b.jsonl (bbbb)",
        "QLoRA quantization none -> 4bit",
    ]
    assert differences(saved, {**saved, "dataset": "moved/a.jsonl"}) == []  # same content under another path

"""bench/gpu_suite.py's DPO rows (issue 43 item 9): DPO of a Llama-3.1-8B shape with LoRA at sequence 2048, the
reference precomputed and the adapter disabled (live), against llmft's LoRA SFT in the same call; the planner's
answer for each on the lent GPUs, and the rows run on CPU with a tiny Llama (--dry_run)."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import PYTHON, REPO, run

sys.path.insert(0, str(REPO / "bench"))

ROWS = ["dpo-sft-lora", "dpo-precomputed", "dpo-live"]


def test_the_dpo_rows_are_the_issues_settings():
    from gpu_suite import llmft_command, preference_settings, settings

    real = preference_settings(dry=False)
    assert [s.name for s in real] == ROWS == [s.name for s in settings(dry=False)][-3:]
    sft, pre, live = real
    for s in real:
        assert (s.model, s.max_length, s.zero_stage) == ("llama-3.1-8b", 2048, 2)
        assert s.flags[:7] == [
            "--use_peft",
            "--lora_r",
            "16",
            "--lora_alpha",
            "32",
            "--lora_target_modules",
            "all-linear",
        ]
    # the same tokens a step: 8 sequences of SFT, 4 pairs of 2 sequences of DPO
    assert (
        sft.micro_batch * sft.grad_accum
        == 2 * pre.micro_batch * pre.grad_accum
        == 2 * live.micro_batch * live.grad_accum
    )
    assert (pre.method, pre.pair, pre.goal) == ("dpo", "dpo-sft-lora", 0.9)
    assert (live.method, live.pair, live.goal) == ("dpo", "dpo-sft-lora", 0.65)
    cmd = llmft_command(pre, REPO / "m", REPO / "d", REPO / "o", 12)
    assert cmd[cmd.index("--method") + 1] == "dpo" and cmd[cmd.index("--precompute_ref_log_probs") + 1] == "true"
    assert "--precompute_ref_log_probs" not in llmft_command(live, REPO / "m", REPO / "d", REPO / "o", 12)
    assert "--method" not in llmft_command(sft, REPO / "m", REPO / "d", REPO / "o", 12)


@pytest.mark.parametrize("gpu", ["H100-80GB", "H200"])
def test_the_planner_predicts_the_rows_fit_and_their_ratios_to_sft(tmp_path, gpu):
    """What the GPU run checks the planner against: each row fits with room on one GPU; the precomputed reference
    plans SFT's memory and step, the live one a reference forward more (2 P FLOPs a token: 0.75x with recomputation,
    above the 0.65x goal)."""
    from gpu_suite import SHAPES, planned, preference_settings
    from transformers import LlamaConfig

    from llmft.planning.hardware import gpu_by_name
    from llmft.planning.run_plan import Hardware

    LlamaConfig(**SHAPES["llama-3.1-8b"]).save_pretrained(tmp_path)
    hardware = Hardware(gpu_by_name(gpu), gpu_by_name(gpu).memory_gib, 128, 1, None, None)
    sft, pre, live = (planned(s, tmp_path, hardware=hardware) for s in preference_settings(dry=False))
    assert all(p["plan_fits"] for p in (sft, pre, live))
    assert pre["plan_gib"] == pytest.approx(sft["plan_gib"], rel=0.01) and live["plan_gib"] > pre["plan_gib"]
    assert sft["plan_step_s"] / pre["plan_step_s"] == pytest.approx(1.0, abs=0.01)
    assert sft["plan_step_s"] / live["plan_step_s"] == pytest.approx(0.75, abs=0.01)


def test_the_dpo_rows_dry_run_beside_lora_sft(tmp_path):
    work, kept = tmp_path / "work", tmp_path / "kept"
    cmd = [PYTHON, "bench/gpu_suite.py", "--dry_run", "--steps", "2", "--out", str(work), "--results", str(kept)]
    proc = run([*cmd, "--only", *ROWS], timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (kept / "results.jsonl").read_text().splitlines()]
    assert [r["name"] for r in rows] == ROWS
    for r in rows:
        assert "error" not in r and r["tokens_per_second"] > 0 and r["plan_fits"] is True, r
    text = (kept / "table.md").read_text()
    assert "(goal 0.90x)" in text and "(goal 0.65x)" in text


def test_the_rows_data_is_pairs_of_about_the_rows_length_and_the_sft_rows_is_their_chosen_side(tmp_path):
    from gpu_suite import gsm8k, gsm8k_tokenizer, preference_records

    tokenizer = gsm8k_tokenizer(gsm8k(tmp_path / "few.jsonl", 300), 2000)
    pairs = [json.loads(x) for x in preference_records(tmp_path / "p.jsonl", tokenizer, 2048, 4, False).open()]
    sft = [json.loads(x) for x in preference_records(tmp_path / "s.jsonl", tokenizer, 2048, 4, True).open()]
    assert len(pairs) == len(sft) == 4 and set(pairs[0]) == {"prompt", "chosen", "rejected"}
    assert [(r["prompt"], r["chosen"]) for r in pairs] == [(r["prompt"], r["completion"]) for r in sft]
    for r in pairs:
        n = {k: len(tokenizer(r[k], add_special_tokens=False)["input_ids"]) for k in r}
        assert r["chosen"] != r["rejected"] and r["prompt"].startswith("Question: ")
        for side in ("chosen", "rejected"):
            assert 1500 < n["prompt"] + n[side] <= 2048, n  # about the row's length, never truncated

"""The reference model of preference tuning (issue 43, item 3), on CPU with the tiny model: an SFT LoRA adapter's
model is the reference of the DPO run started from it, not the bare base; precomputed reference log-probs give the
live reference's losses, are kept in llmft's cache across a killed job, and are computed again when max_length
changes; full fine-tuning under ZeRO-3 on 2 ranks shards the reference and starts at ln 2.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import PYTHON, REPO, run, subprocess_env

from llmft.checkpoint.run_dir import COMPLETE_MARKER
from llmft.training import reference

LN2 = math.log(2)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    """Preference pairs {"prompt", "chosen", "rejected"} as text, written in code: the right answer against a wrong one."""
    from llmft.data.synthetic import make_examples, write_jsonl

    rows = []  # 32 pairs
    for e in make_examples(32, seed=3):
        words = e["completion"].split()
        rows.append({"prompt": e["prompt"] + "\n", "chosen": e["completion"], "rejected": " ".join(reversed(words))})
    return write_jsonl(rows, tmp_path_factory.mktemp("pairs") / "pairs.jsonl")


def train_cmd(model, data, out, *extra: str, nproc: int = 1) -> list[str]:
    launcher = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)] if nproc > 1 else [PYTHON]
    return launcher + [
        "-m",
        "llmft.train",
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
        "--seed",
        "7",
        *extra,
    ]


def dpo_cmd(model, data, out, *extra: str, nproc: int = 1) -> list[str]:
    return train_cmd(
        model,
        data,
        out,
        "--method",
        "dpo",
        "--global_batch_size",
        "4",
        "--per_device_train_batch_size",
        str(4 // nproc),
        "--learning_rate",
        "1e-3",
        *extra,
        nproc=nproc,
    )


def losses(out: Path) -> list[float]:
    state = json.loads((out / "trainer_state.json").read_text())
    return [h["loss"] for h in state["log_history"] if "loss" in h]


def summary(out: Path) -> dict:
    return json.loads((out / "run_summary.json").read_text())


@pytest.fixture(scope="module")
def sft_adapter(tiny_model, tiny_data, tmp_path_factory) -> Path:
    """A finished SFT LoRA run (one process): its output directory holds the trained adapter."""
    out = tmp_path_factory.mktemp("sft") / "run"
    extra = ["--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--lora_target_modules", "c_attn"]
    extra += ["--max_steps", "4", "--global_batch_size", "4", "--per_device_train_batch_size", "4"]
    run(train_cmd(tiny_model, tiny_data, out, *extra, "--learning_rate", "5e-2"), check=True)
    assert (out / "adapter_model.safetensors").is_file()
    return out


def completion_logps(model, tokenizer, rows: list[dict], side: str) -> list[float]:
    """The summed log-probs of each row's `side` after its prompt, tokenised as TRL's DPOTrainer tokenises text
    (eos appended, the completion from where prompt and prompt+completion diverge), computed here without TRL."""
    import torch

    out = []
    for r in rows:
        prompt = tokenizer(r["prompt"])["input_ids"]
        full = {s: tokenizer(r["prompt"] + r[s] + tokenizer.eos_token)["input_ids"] for s in ("chosen", "rejected")}
        start = min(next((i for i, (a, b) in enumerate(zip(prompt, f)) if a != b), len(prompt)) for f in full.values())
        ids = torch.tensor([full[side]])
        with torch.no_grad():
            logits = model(ids).logits[0, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
        out.append(float(logp[start - 1 :].sum()))
    return out


def test_sft_lora_then_dpo_the_reference_is_the_sft_model_not_the_base(sft_adapter, tiny_model, pairs, tmp_path):
    """DPO with LoRA started from an SFT LoRA run's output: the reference log-probs it precomputes (stored in llmft's
    cache) equal the SFT model's, computed here with PEFT on the SFT adapter (unmerged), and differ from the bare
    base's; the run says which reference it uses, and its first loss is ln 2 (the policy starts as the SFT model)."""
    import pyarrow as pa
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "dpo"
    proc = run(
        dpo_cmd(sft_adapter, pairs, out, "--use_peft", "--lora_r", "4", "--lora_target_modules", "c_attn",
                "--max_steps", "2", "--precompute_ref_log_probs", "true"),
        check=True,
    )  # fmt: skip
    text = proc.stdout + proc.stderr
    assert f"SFT adapter {sft_adapter}" in text and "merged into" in text, text[-3000:]
    assert f"reference: log-probs of the SFT model {sft_adapter}" in text, text[-3000:]
    assert abs(losses(out)[0] - LN2) < 1e-4
    key = summary(out)["reference_log_probs"]["keys"]["train"]
    stored = pa.ipc.open_stream(str(Path(os.environ["LLMFT_CACHE"]) / "ref_logps" / key / "ref_logps.arrow"))
    stored = stored.read_all().to_pydict()

    rows = [json.loads(line) for line in pairs.read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(sft_adapter)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    base_logps = completion_logps(base, tokenizer, rows, "chosen")
    sft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), sft_adapter)
    sft = sft.eval()
    for side in ("chosen", "rejected"):
        expected = completion_logps(sft, tokenizer, rows, side)
        assert stored[f"ref_{side}_logps"] == pytest.approx(expected, abs=1e-3), side
    gap = [abs(a - b) for a, b in zip(stored["ref_chosen_logps"], base_logps)]
    assert sum(g > 0.1 for g in gap) >= 0.9 * len(gap), gap  # the SFT adapter moved the rows: the base differs


def test_precomputed_and_live_references_give_the_same_losses(tiny_model, pairs, tmp_path):
    """Full fine-tuning (ZeRO-2, one process): the live reference (a stage-0 replica) and --precompute_ref_log_probs
    give the same losses within 1e-4 for 5 steps, from ln 2; each run names its reference, the precomputing one
    reports the pass's time and size in run_summary.json."""
    live, pre = tmp_path / "live", tmp_path / "pre"
    steps = ["--max_steps", "5", "--zero_stage", "2"]
    a = run(dpo_cmd(tiny_model, pairs, live, *steps), check=True)
    b = run(dpo_cmd(tiny_model, pairs, pre, *steps, "--precompute_ref_log_probs", "true"), check=True)
    assert "reference: a second copy of the model on every rank (a stage-0 replica under ZeRO-2" in a.stdout + a.stderr
    assert "reference: log-probs of the initial policy weights precomputed" in b.stdout + b.stderr
    assert abs(losses(live)[0] - LN2) < 1e-4
    assert losses(pre) == pytest.approx(losses(live), abs=1e-4)
    assert len(losses(pre)) == 5
    record = summary(pre)["reference_log_probs"]
    assert record["computed"] == 1 and record["bytes"] > 0 and record["seconds"] > 0, record
    assert "reference_log_probs" not in summary(live)


def test_a_job_killed_after_the_precompute_does_not_compute_it_again(tiny_model, pairs, tmp_path):
    """A precomputing job killed (SIGKILL, as a preemption) at step 3 after checkpoint-2: started again it resumes
    from checkpoint-2 and reuses the stored reference log-probs (run_summary.json counts 0 computed, 1 reused);
    a sweep's other element (another --beta, another run directory) reuses them too; a rerun with another max_length
    (its own key, though these short rows tokenise the same) computes them again."""
    out = tmp_path / "run"
    cmd = dpo_cmd(tiny_model, pairs, out, "--max_steps", "4", "--save_steps", "2", "--precompute_ref_log_probs", "true",
                  "--max_length", "48", "--use_peft", "--lora_target_modules", "c_attn")  # fmt: skip
    env = subprocess_env(LLMFT_TEST_HOLD_AT_STEP="3")
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        marker, until = out / "checkpoint-2" / COMPLETE_MARKER, time.monotonic() + 600
        while proc.poll() is None and not marker.is_file() and time.monotonic() < until:
            time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    killed = (tmp_path / "killed.log").read_text()
    assert marker.is_file() and "): computed in" in killed, killed[-4000:]
    again = run(cmd, check=True)
    text = again.stdout + again.stderr
    assert "resuming from" in text and "checkpoint-2" in text, text[-3000:]
    assert "reference log-probs for train" in text and "reused from" in text and "): computed in" not in text
    record = summary(out)["reference_log_probs"]
    assert (record["computed"], record["reused"]) == (0, 1), record
    sweep = tmp_path / "beta"  # a sweep's other element: another --beta and run directory, the same reference
    cmd[cmd.index("--output_dir") + 1] = str(sweep)
    cmd[cmd.index("--max_steps") + 1] = "1"
    run([*cmd, "--beta", "0.3"], check=True)
    assert summary(sweep)["reference_log_probs"]["reused"] == 1
    other = tmp_path / "shorter"
    cmd[cmd.index("--max_length") + 1] = "40"
    cmd[cmd.index("--output_dir") + 1] = str(other)
    run(cmd, check=True)
    record2 = summary(other)["reference_log_probs"]
    assert (record2["computed"], record2["reused"]) == (1, 0) and record2["keys"] != record["keys"], record2


def test_full_fine_tuning_under_zero3_on_two_ranks_shards_the_reference(tiny_model, pairs, tmp_path):
    """Full-FT DPO under ZeRO-3 on 2 ranks: the reference is a second copy in a ZeRO-3 inference engine (each rank
    holds part of its parameters), and the first loss is ln 2 (policy and reference start equal)."""
    out = tmp_path / "z3"
    proc = run(dpo_cmd(tiny_model, pairs, out, "--max_steps", "2", "--zero_stage", "3", nproc=2), check=True)
    text = proc.stdout + proc.stderr
    assert "reference: a second copy of the model, sharded for inference under ZeRO-3" in text, text[-3000:]
    shares = re.findall(r"reference engine: ZeRO-3, (\d+) of its (\d+) parameters held on this rank", text)
    assert shares and all(int(held) < int(total) for held, total in shares), text[-3000:]  # each rank holds a part
    assert abs(losses(out)[0] - LN2) < 1e-4


def test_choose_reference_names_each_way():
    """The decision alone: precompute first, then LoRA's disabled adapter, then a sharded copy (ZeRO-3) or a replica."""
    pick = reference.choose_reference
    assert pick(False, use_peft=True, zero_stage=3, precompute=True).strategy == ""
    assert pick(True, use_peft=True, zero_stage=3, precompute=True).strategy == "precomputed"
    assert pick(True, use_peft=True, zero_stage=3, precompute=False).strategy == "adapter_disabled"
    assert pick(True, use_peft=False, zero_stage=3, precompute=False).strategy == "sharded_copy"
    for stage in (0, 1, 2):
        assert pick(True, use_peft=False, zero_stage=stage, precompute=False).strategy == "replica"
    assert "the SFT model /a" in pick(True, use_peft=True, zero_stage=2, precompute=False, sft_model="/a").line


def test_the_merged_sft_model_is_the_sft_adapters_model_and_is_kept(sft_adapter, tiny_model, pairs):
    """The SFT adapter merged into its base (llmft's cache, keyed by both) gives the log-probs PEFT gives with the
    adapter unmerged; a second call reuses the directory; the adapter's base is never what comes back."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert reference.sft_adapter_source(str(sft_adapter)) == sft_adapter
    assert reference.sft_adapter_source(str(tiny_model)) is None
    lines: list[str] = []
    merged = reference.merged_sft_model(sft_adapter, trust=False, rank0=True, log=lines.append)
    assert merged == reference.merged_sft_model(sft_adapter, trust=False, rank0=True, log=lines.append)
    assert "reusing" in lines[-1] and reference.merged_from(str(merged)) == str(sft_adapter)
    rows = [json.loads(line) for line in pairs.read_text().splitlines()][:8]
    tokenizer = AutoTokenizer.from_pretrained(merged)
    sft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), sft_adapter)
    got = completion_logps(AutoModelForCausalLM.from_pretrained(merged).eval(), tokenizer, rows, "chosen")
    assert got == pytest.approx(completion_logps(sft.eval(), tokenizer, rows, "chosen"), abs=1e-4)
    base = completion_logps(AutoModelForCausalLM.from_pretrained(tiny_model).eval(), tokenizer, rows, "chosen")
    assert sum(abs(a - b) > 0.1 for a, b in zip(got, base)) >= 0.75 * len(got)  # not the base's


def test_the_keys_change_with_the_data_and_the_weights(tiny_model, tmp_path):
    """The data fingerprint follows the token ids (one changed id changes it, a copy does not); the weights
    fingerprint follows the weight files' bytes, not their path."""
    import shutil

    from datasets import Dataset
    from safetensors.torch import load_file, save_file

    rows = [{"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5], "rejected_ids": [6]} for _ in range(4)]
    same = Dataset.from_list([dict(r) for r in rows])
    rows[2]["chosen_ids"] = [4, 7]
    fp = reference.data_fingerprint
    assert fp(Dataset.from_list(rows[:2] + rows[:2])) == fp(same) != fp(Dataset.from_list(rows))
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model, copy)
    assert reference.weights_fingerprint(copy, tmp_path / "memo") == reference.weights_fingerprint(tiny_model)
    tensors = load_file(copy / "model.safetensors")
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 1
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    assert reference.weights_fingerprint(copy, tmp_path / "memo") != reference.weights_fingerprint(tiny_model)


def test_a_pass_cut_off_leaves_nothing_taken_as_complete_and_is_cleared_later(tmp_path):
    """A .partial directory is never complete; publishing renames it with its marker; a stale .partial of a job
    killed during its pass is removed by the next pass, a recent one (a pass running now) is left alone."""
    store = reference.ReferenceStore(tmp_path, {"version": 1, "weights": "w"}, str(tmp_path), lambda line: None)
    key = store.key("train", "data")
    stale, live = store.partial(key, "killed"), store.partial("other", "running")
    (stale / "ref_logps.arrow").write_bytes(b"half")
    assert not store.complete(key)
    day_ago = time.time() - reference.STALE_PARTIAL_S - 60
    os.utime(stale, (day_ago, day_ago))
    fresh = store.partial(key, "again")
    assert not stale.exists() and live.exists()
    (fresh / "ref_logps.arrow").write_bytes(b"whole")
    assert store.publish(fresh, key, {"rows": 1}) == store.path(key) and store.complete(key)
    assert (store.path(key) / "ref_logps.arrow").read_bytes() == b"whole" and not fresh.exists()

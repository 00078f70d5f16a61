"""The planner knows preference tuning (issue 43 item 4): chosen and rejected in one forward, the reference (a copy,
ZeRO-3 shards, nothing when precomputed or adapter-disabled) and its forward, a reward model's score head, and the
one line `llmft plan --method dpo` recommends the reference in. Llama-3.1-8B's published shape on an H100 80GB and
an L4 (tests/published_shapes.py); nothing is downloaded."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

import pytest
from published_shapes import llama_3_1_8b

from llmft import plan
from llmft.planning import memory, run_plan
from llmft.planning.hardware import gpu_by_name
from llmft.planning.memory import Job, MemoryPlanError, Setting, estimate, flops_per_token, plan_memory
from llmft.planning.model_shape import model_shape
from llmft.planning.preference import plan_with_reference
from llmft.planning.world import World

P = 8_030_261_248  # Llama-3.1-8B's parameters
BF16_COPY = 2 * P


@pytest.fixture(scope="module")
def full():
    return model_shape(llama_3_1_8b())


@pytest.fixture(scope="module")
def lora():
    return model_shape(llama_3_1_8b(), use_peft=True, lora_r=16)


@pytest.fixture(scope="module")
def llama_config(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama-3.1-8b")
    llama_3_1_8b().save_pretrained(out)
    return out


def job(shape, gpu="H100-80GB", n=8, **kw) -> Job:
    return Job(shape, gpu_by_name(gpu), 1000, 1, n, 2048, "bf16", global_batch=8 * n, **kw)


SETTING = Setting(zero_stage=2, offload="none", micro_batch=2, grad_accum=4, gradient_checkpointing=True)


@pytest.mark.parametrize("gpu", ["H100-80GB", "L4"])
def test_dpo_full_fine_tuning_needs_sfts_memory_for_twice_the_sequences_plus_the_reference(full, gpu):
    """A pair is two sequences in one forward: DPO's activations and loss buffers at micro-batch 2 are SFT's at 4;
    the live copy adds exactly its bf16 weights (replicated under ZeRO-2) and its forward's transient; precomputed
    log-probs hold none of it."""
    sft = estimate(job(full, gpu), dataclasses.replace(SETTING, micro_batch=4, grad_accum=2))
    copy = estimate(job(full, gpu, method="dpo"), SETTING)
    pre = estimate(job(full, gpu, method="dpo", reference="precomputed"), SETTING)
    assert (copy.activations, copy.loss_buffers) == (sft.activations, sft.loss_buffers)
    assert copy.model_states == sft.model_states == pre.model_states
    forward = memory.reference_forward_bytes(job(full, gpu, method="dpo"), SETTING)
    assert copy.reference == BF16_COPY + forward
    assert 0 < forward < copy.activations  # one layer's worth, not every layer's
    assert pre.reference == 0 and pre.gpu_total < copy.gpu_total
    assert copy.gpu_total - pre.gpu_total >= BF16_COPY  # at least the weights (the 10% fragmentation on top)
    assert copy.as_dict()["reference_gib"] == memory.gib(copy.reference)


def test_zero3_shards_the_copy_over_the_world(full):
    stage3 = dataclasses.replace(SETTING, zero_stage=3)
    for n in (2, 8):
        j = job(full, n=n, method="dpo")
        est = estimate(j, stage3)
        assert est.reference - memory.reference_forward_bytes(j, stage3) == -(-BF16_COPY // n)


@pytest.mark.parametrize("gpu", ["H100-80GB", "L4"])
def test_lora_adds_no_copy_the_adapter_disabled_policy_is_the_reference(lora, gpu):
    j = job(lora, gpu, method="dpo")
    assert j.reference_strategy == "adapter"
    est = estimate(j, SETTING)
    assert est.reference == memory.reference_forward_bytes(j, SETTING) < 2 * 2**30
    assert memory.reference_weight_bytes(lora, "adapter", 2, 8, "bf16") == 0


def test_a_reward_models_score_head_keeps_less_than_the_lm_heads_tiled_loss(full):
    reward = estimate(job(full, method="reward"), SETTING)
    dpo = estimate(job(full, method="dpo", reference="precomputed"), SETTING)
    assert reward.reference == 0 and reward.activations == dpo.activations
    assert reward.loss_buffers < dpo.loss_buffers
    # no [4096 x 32768] vocabulary tile and no fp32 LM-head gradient: the scores and the hidden states' gradient
    tokens = SETTING.micro_batch * 2 * 2048
    assert reward.loss_buffers == tokens * (2 + 2 * 4096) + 6 * 4096


def test_the_live_references_forward_is_in_the_flops_and_the_step_time(full, lora):
    live = estimate(job(lora, method="dpo"), SETTING)
    pre = estimate(job(lora, method="dpo", reference="precomputed"), SETTING)
    extra = flops_per_token(lora, 2048, True, reference_forward=True) - flops_per_token(lora, 2048, True)
    assert extra == 2 * lora.params + 4 * lora.layers * lora.hidden * 2048
    assert pre.tokens_per_s / live.tokens_per_s == pytest.approx(
        flops_per_token(lora, 2048, True, reference_forward=True) / flops_per_token(lora, 2048, True), rel=0.02
    )
    # tokens/s counts the chosen and the rejected sequence: a DPO step's tokens are twice SFT's at the same micro-batch
    sft = estimate(job(lora), SETTING)
    assert pre.step_s == pytest.approx(2 * sft.step_s, rel=0.02)


def test_sft_plans_as_before(full):
    """The default method and no reference: the same estimate as a Job built without them."""
    base = Job(full, gpu_by_name("H100-80GB"), 1000, 1, 8, 2048, "bf16", global_batch=64)
    assert base.method == "sft" and base.reference_strategy == "none"
    assert estimate(base, SETTING).reference == 0
    assert plan_memory(base).recommended == plan_memory(job(full, method="sft")).recommended


@pytest.mark.parametrize(
    "gpu, n, shape, strategy, words",
    [
        ("H100-80GB", 8, "full", "copy", "the copy (14.96 GiB, a stage-0 replica) fits beside the policy"),
        ("H100-80GB", 3, "full", "precomputed", "the policy fits without the copy"),
        ("L4", 8, "full", "copy", "which shards the copy to 1.87 GiB per GPU (of 14.96 GiB)"),
        ("L4", 8, "lora", "adapter", "LoRA: the base model is the reference"),
        ("H100-80GB", 8, "lora", "adapter", "LoRA: the base model is the reference"),
    ],
)
def test_the_recommended_reference(request, gpu, n, shape, strategy, words):
    j, mplan, advice = plan_with_reference(job(request.getfixturevalue(shape), gpu, n, method="dpo"))
    assert advice.strategy == strategy == j.reference_strategy and words in advice.line
    est = mplan.recommended
    assert est is not None and est.fits
    assert est.setting.precompute_ref_log_probs == (strategy == "precomputed")
    assert f"GPU {memory.gib(est.gpu_total)} GiB of {j.device_gib:g} (reference {memory.gib(est.reference)} GiB" in (
        advice.line
    )
    if strategy == "precomputed":  # the copy is what does not fit beside the policy at ZeRO-2
        copy = plan_memory(dataclasses.replace(j, reference="copy")).recommended
        assert copy is None or copy.setting.zero_stage == 3 or copy.setting.offload != "none"
        assert est.setting.zero_stage < 3 and "--precompute_ref_log_probs" in est.setting.flags()


def test_llmft_plan_method_dpo_prints_the_reference_line(capsys, llama_config):
    argv = ["--model", llama_config, "--gpu", "H100-80GB", "--host_ram_gb", 1000, "--nproc_per_node", 3]
    argv += ["--global_batch_size", 24, "--max_length", 2048, "--method", "dpo"]
    rc = plan.main(plan.make_parser().parse_args([str(a) for a in argv]))
    out, err = capsys.readouterr()
    assert rc == 0, err
    lines = out.splitlines()
    assert "--method dpo (2 sequences per pair)" in lines[0]
    [ref] = [line for line in lines if line.startswith("llmft plan: reference (dpo): ")]
    assert "precomputed (--precompute_ref_log_probs" in ref and "reference log-probs precomputed" in out
    rc = plan.main(plan.make_parser().parse_args([str(a) for a in argv + ["--json"]]))
    doc = json.loads(capsys.readouterr().out)
    assert doc["method"] == "dpo" and doc["reference"] == "precomputed"


def test_write_gives_the_method_knob_and_the_precompute_flag(capsys, llama_config, tmp_path):
    argv = ["--model", llama_config, "--gpu", "H100-80GB", "--host_ram_gb", 1000, "--nproc_per_node", 3]
    argv += ["--global_batch_size", 24, "--max_length", 2048, "--method", "dpo", "--write", tmp_path / "w"]
    rc = plan.main(plan.make_parser().parse_args([str(a) for a in argv]))
    assert rc == 0, capsys.readouterr().err
    export = shlex.split((tmp_path / "w" / "sbatch.txt").read_text())[5]
    assert "METHOD=dpo" in export and "--precompute_ref_log_probs true" in export


def test_check_memory_names_the_reference_the_job_will_hold(capsys, llama_config):
    argv = ["--model", llama_config, "--gpu", "L4", "--host_ram_gb", 200, "--nproc_per_node", 8, "--check_memory"]
    argv += ["--global_batch_size", 64, "--per_device_train_batch_size", 1, "--zero_stage", 2, "--use_peft"]
    argv += ["--max_length", 1024, "--method", "dpo"]
    rc = plan.main(plan.make_parser().parse_args([str(a) for a in argv]))
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "llmft plan: reference (dpo): the policy with its LoRA adapter disabled" in out
    assert "llmft plan: memory: ZeRO-2" in out and " fits " in out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--method", "bogus"], "--method 'bogus' is not a training method; choose one of sft, dpo, kto, reward"),
        (["--method", "sft", "--precompute_ref_log_probs"], "--method sft has none"),
        (["--method", "reward", "--precompute_ref_log_probs"], "--method reward has none"),
    ],
)
def test_bad_method_input_is_one_line_and_exit_2(capsys, llama_config, extra, message):
    argv = ["--model", llama_config, "--gpu", "L4", "--host_ram_gb", 200, *extra]
    rc = plan.main(plan.make_parser().parse_args([str(a) for a in argv]))
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and message in err, err


def test_an_adapter_reference_without_lora_is_refused(full):
    with pytest.raises(MemoryPlanError, match="needs LoRA"):
        plan_memory(job(full, method="dpo", reference="adapter"))
    with pytest.raises(MemoryPlanError, match="trains without a reference"):
        plan_memory(job(full, method="reward", reference="copy"))


def test_auto_choice_gives_the_plans_answer(llama_config, monkeypatch):
    """llmft train --auto (and ZERO_STAGE=auto) ask the same planner as llmft plan: on 3 H100s, where the policy
    fits ZeRO-2 but not a copy beside it, --auto precomputes, and its Setting carries the flag llmft train applies."""
    hardware = run_plan.Hardware(gpu_by_name("H100-80GB"), 79.1, 1000, 3, None, None)
    monkeypatch.setattr(run_plan, "resolve_hardware", lambda *a, **k: hardware)
    common = dict(
        precision="bf16",
        max_micro_batch=4,
        global_batch=24,
        grad_accum=None,
        max_length=2048,
        use_peft=False,
        lora_r=16,
        lora_target_modules=None,
        allow_gradient_checkpointing=True,
        save_total_limit=None,
        output_dir="",
        attention=None,
        load_in_4bit=False,
        save_consolidated=False,
        use_liger_kernel=False,
    )
    world = World(1, 3, "test")
    sft, _ = run_plan.auto_choice(str(llama_config), world, **common)
    dpo, line = run_plan.auto_choice(str(llama_config), world, method="dpo", **common)
    assert not sft.precompute_ref_log_probs
    assert dpo.precompute_ref_log_probs and "--precompute_ref_log_probs" in dpo.flags()
    assert "reference (dpo): its log-probs precomputed" in line
    j = Job(model_shape(llama_3_1_8b()), hardware.gpu, 1000, 1, 3, 2048, "bf16", global_batch=24, method="dpo")
    _, mplan, _ = plan_with_reference(dataclasses.replace(j, max_micro_batch=4), memory.plan_with_savers)
    assert mplan.recommended.setting == dpo


@pytest.mark.parametrize(
    "argv",
    [
        ["--gpu", "L4", "--nproc_per_node", 8, "--global_batch_size", 64, "--use_peft"],
        ["--gpu", "H100-80GB", "--nproc_per_node", 8, "--global_batch_size", 64],
        ["--gpu", "H100-80GB", "--nproc_per_node", 3, "--global_batch_size", 24],
        ["--gpu", "L4", "--nproc_per_node", 8, "--global_batch_size", 64],
    ],
)
def test_the_reference_lines_in_docs_preference_are_the_planners(capsys, llama_config, argv):
    argv = ["--model", llama_config, "--method", "dpo", "--host_ram_gb", 1000, "--max_length", 2048, *argv]
    argv += ["--use_liger_kernel", "false"]  # as the page's lines were made: without liger-kernel installed
    assert plan.main(plan.make_parser().parse_args([str(a) for a in argv])) == 0
    [line] = [x for x in capsys.readouterr().out.splitlines() if x.startswith("llmft plan: reference (dpo)")]
    assert f"\n{line}\n" in (Path(__file__).resolve().parents[1] / "docs" / "preference.md").read_text()


def test_check_memory_counts_the_reference_as_the_run_holds_it_and_says_what_fits(capsys, llama_config):
    """The job's memory check (a fixed ZeRO-2 setting, full fine-tuning on 3 H100s): without
    --precompute_ref_log_probs the run holds a copy, which does not fit, and the reference line recommends
    precomputing; with it, the same setting fits."""
    argv = ["--model", llama_config, "--gpu", "H100-80GB", "--host_ram_gb", 1000, "--nproc_per_node", 3]
    argv += ["--global_batch_size", 24, "--per_device_train_batch_size", 8, "--zero_stage", 2, "--check_memory"]
    argv += [
        "--max_length",
        2048,
        "--gradient_checkpointing",
        "true",
        "--method",
        "dpo",
        "--use_liger_kernel",
        "false",
    ]
    rc = plan.main(plan.make_parser().parse_args([str(a) for a in argv]))
    out, err = capsys.readouterr()
    assert rc == 2 and "does not fit" in err and "GPU memory" in err, err
    assert "llmft plan: reference (dpo): its log-probs precomputed" in out
    rc = plan.main(plan.make_parser().parse_args([str(a) for a in argv + ["--precompute_ref_log_probs", "true"]]))
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "precomputed (--precompute_ref_log_probs" in out and ", as asked" in out
    assert "llmft plan: memory: ZeRO-2, micro-batch 8 x accumulation 1, gradient checkpointing on fits" in out

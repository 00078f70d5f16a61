"""Packed samples must not attend to each other: the same samples trained packed (TRL's bfd packing and
padding-free collator, exactly what `llmft train --packing` feeds the model) and unpacked give the same per-token
losses and the same gradients, for a Llama-shaped and a GPT-2-shaped model, under SDPA and eager attention.
The decision logic (llmft.training.packing, llmft.planning.hardware) is checked with the facts of an L4, an A100 and a T4."""

from __future__ import annotations

import random
import sys

import pytest
import torch
from datasets import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config
from trl.data_utils import pack_dataset
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from llmft.planning.hardware import GPUS, HardwareError, check_liger, choose_attention, choose_liger
from llmft.training.flags import parse_train_flags
from llmft.training.packing import (
    PACKED_SDPA,
    PackingError,
    check_packing,
    masks_from_position_ids,
    model_attentions,
    packed_kernel,
    register_packed_sdpa,
    uses_sliding_window,
)

VOCAB, PAD = 96, 0
register_packed_sdpa()


def tiny_llama(attn: str):
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=PAD,
    )
    return LlamaForCausalLM._from_config(config, attn_implementation=attn)


def tiny_gpt2(attn: str):
    config = GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=256,
        pad_token_id=PAD,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel._from_config(config, attn_implementation=attn)


def samples(n: int = 6, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(5, 40))] for _ in range(n)]


def per_token_losses(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Loss of predicting ids[1:] from logits[:-1] (one sample, no batch dim)."""
    return torch.nn.functional.cross_entropy(logits[:-1].float(), ids[1:], reduction="none")


def unpacked(model, seqs):
    batch = DataCollatorForLanguageModeling(pad_token_id=PAD)([{"input_ids": s} for s in seqs])
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    return {
        tuple(s): per_token_losses(logits[i, : len(s)], batch["input_ids"][i, : len(s)]) for i, s in enumerate(seqs)
    }


def packed(model, seqs, with_positions: bool = True, drop: tuple[str, ...] = ()):
    """TRL's bfd packing into one row, its padding-free collator, and the model called with the whole batch as
    SFTTrainer calls it. with_positions=False drops position_ids: one causal sequence, samples attending to each other."""
    rows = pack_dataset(Dataset.from_dict({"input_ids": seqs}), seq_length=sum(map(len, seqs)), strategy="bfd")
    assert len(rows) == 1
    batch = DataCollatorForLanguageModeling(pad_token_id=PAD, padding_free=True)([rows[0]])
    assert "attention_mask" not in batch
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    if not with_positions:
        inputs = {"input_ids": inputs["input_ids"]}
    inputs = {k: v for k, v in inputs.items() if k not in drop}
    inputs["use_cache"] = False  # as SFTTrainer.compute_loss does; with a cache transformers skips packed detection
    logits = model(**inputs).logits[0]
    ids, pos = batch["input_ids"][0], batch["position_ids"][0]
    starts = torch.nonzero(pos == 0).flatten().tolist() + [len(pos)]
    return {tuple(ids[a:b].tolist()): per_token_losses(logits[a:b], ids[a:b]) for a, b in zip(starts, starts[1:])}


@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager", PACKED_SDPA])
def test_packed_and_unpacked_training_agree_per_token(build, attn):
    torch.manual_seed(0)
    model = build(attn).train()
    seqs = samples()

    reference = unpacked(model, seqs)
    sum(v.sum() for v in reference.values()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    got = packed(model, seqs)
    assert got.keys() == reference.keys()  # every sample present, once, uncut
    for key, losses in reference.items():
        torch.testing.assert_close(got[key], losses, rtol=1e-4, atol=1e-5)
    sum(v.sum() for v in got.values()).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-3, atol=1e-5, msg=name)


def test_the_comparison_catches_samples_attending_to_each_other():
    """Without the restarting position ids the row is one causal sequence: later samples see earlier ones and
    their losses change. The test above would fail on such a model."""
    torch.manual_seed(0)
    model = tiny_llama("sdpa")
    seqs = samples()
    reference, leaky = unpacked(model, seqs), packed(model, seqs, with_positions=False)
    differing = [k for k in reference if not torch.allclose(leaky[k], reference[k], rtol=1e-4, atol=1e-5)]
    assert len(differing) >= len(seqs) - 1  # all but the first sample in the row


def test_packed_sdpa_attends_per_sample_from_the_boundaries():
    """llmft's SDPA splits at the sample boundaries TRL's collator passes (cu_seq_lens_q): even without position ids
    (RoPE only sees relative positions) the Llama-shaped model's losses match the unpacked ones."""
    torch.manual_seed(0)
    model = tiny_llama(PACKED_SDPA)
    seqs = samples()
    reference, got = unpacked(model, seqs), packed(model, seqs, drop=("position_ids",))
    for key, losses in reference.items():
        torch.testing.assert_close(got[key], losses, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "facts, kernel",
    [
        (dict(device_type="cuda", dtype="bfloat16"), "varlen"),  # an A100/H100/L4 training in bf16
        (dict(device_type="cuda", dtype="float16"), "varlen"),  # an A100/L4 training in fp16
        (
            dict(device_type="cuda", dtype="float16", capability=GPUS["T4"].compute_capability),
            "per_sample",
        ),  # no FA2 on a T4
        (dict(device_type="cuda", dtype="bfloat16", capability=GPUS["H100-80GB"].compute_capability), "varlen"),
        (dict(device_type="cuda", dtype="bfloat16", capability=GPUS["L4"].compute_capability), "varlen"),
        (dict(device_type="cpu", dtype="bfloat16"), "per_sample"),  # PyTorch's varlen kernel is CUDA-only
        (dict(device_type="cuda", dtype="float32"), "per_sample"),  # flash kernels are 16-bit only
        (dict(device_type="cuda", dtype="bfloat16", dropout=0.1), "per_sample"),  # varlen_attn has no dropout
        (dict(device_type="cuda", dtype="bfloat16", head_dim=512), "per_sample"),  # flash supports head_dim <= 256
        (dict(device_type="cuda", dtype="bfloat16", varlen_available=False), "per_sample"),  # PyTorch before 2.9
    ],
)
def test_packed_batches_use_pytorchs_varlen_kernel_only_where_it_runs(facts, kernel):
    assert packed_kernel(**{"dropout": 0.0, "head_dim": 64, "varlen_available": True, **facts}) == kernel


def test_the_logged_packed_kernel_follows_the_model_and_machine():
    """What `llmft train` logs: the varlen kernel for a Llama training in bf16 or fp16 on a GPU; SDPA per sample on
    CPU, in fp32, and for GPT-2, whose attention dropout (attn_pdrop 0.1) the varlen kernel does not have."""
    from llmft.training.packing import packed_kernel_for

    assert packed_kernel_for(LlamaConfig(), cuda=True, precision="bf16") == "varlen"
    assert packed_kernel_for(LlamaConfig(), cuda=True, precision="fp16") == "varlen"
    assert packed_kernel_for(LlamaConfig(), cuda=False, precision="fp32") == "per_sample"
    assert packed_kernel_for(LlamaConfig(), cuda=True, precision="fp32") == "per_sample"
    assert packed_kernel_for(GPT2Config(), cuda=True, precision="bf16") == "per_sample"
    assert packed_kernel_for(GPT2Config(attn_pdrop=0.0), cuda=True, precision="bf16") == "varlen"
    assert packed_kernel_for(LlamaConfig(), cuda=True, precision="fp16", capability=(7, 5)) == "per_sample"  # T4


def stand_in_varlen(signature: str):
    """What PyTorch's CUDA-only varlen_attn computes ((tokens, heads, dim) tensors, causal within each sample), in
    plain SDPA, with the keyword arguments of PyTorch 2.9-2.11 ("old": is_causal, no scale or GQA) or 2.13 ("new")."""

    def attend(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, enable_gqa=False, **causal):
        assert causal == ({"window_size": (-1, 0)} if signature == "new" else {"is_causal": True})
        assert cu_q.dtype == torch.int32 and max_q == max(torch.diff(cu_q).tolist())
        assert enable_gqa or k.shape[1] == q.shape[1]  # the old kernel needs the KV heads repeated
        bounds = cu_q.tolist()
        return torch.cat(
            [
                torch.nn.functional.scaled_dot_product_attention(
                    q[a:b].transpose(0, 1),
                    k[a:b].transpose(0, 1),
                    v[a:b].transpose(0, 1),
                    is_causal=True,
                    scale=scale,
                    enable_gqa=enable_gqa,
                ).transpose(0, 1)
                for a, b in zip(bounds, bounds[1:])
            ]
        )

    causal = {"window_size": (-1, 0)} if signature == "new" else {"is_causal": True}
    return attend, causal, signature == "new", signature == "new"


@pytest.mark.parametrize("signature", ["old", "new"])
def test_varlen_path_keeps_samples_apart_with_gqa_and_the_models_scale(monkeypatch, signature):
    """The GPU path's plumbing (layout, GQA, scale, causality, boundaries), run on the CPU through a stand-in for the
    kernel: a Llama with 4 query / 2 KV heads and a non-default attention scale gives the unpacked per-token losses.
    The real kernel's numbers against SDPA are bench/gpu_attention.py's (on a GPU)."""
    from llmft.training import packing

    monkeypatch.setattr(packing, "_varlen", lambda: stand_in_varlen(signature))
    monkeypatch.setattr(packing, "packed_kernel", lambda **facts: "varlen")
    torch.manual_seed(0)
    model = tiny_llama(PACKED_SDPA)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.scaling *= 0.7  # folded into the queries where the kernel takes no scale
            layer.self_attn.q_proj.weight.mul_(
                30
            )  # peaked attention, so that a wrong scale or mask shows in the losses
            layer.self_attn.k_proj.weight.mul_(30)
    calls = []
    real = packing._varlen_forward
    monkeypatch.setattr(packing, "_varlen_forward", lambda *a: calls.append(1) or real(*a))
    seqs = samples()
    reference = unpacked(model, seqs)
    reads, tolist = [], torch.Tensor.tolist

    def read(tensor, *args):  # host reads made by llmft's attention (a device-to-host sync per forward on a GPU)
        reads.extend([1] if sys._getframe(1).f_code.co_filename.endswith("llmft/packing.py") else [])
        return tolist(tensor, *args)

    monkeypatch.setattr(torch.Tensor, "tolist", read)
    got = packed(model, seqs)
    assert len(calls) == len(model.model.layers)  # every layer went through the varlen path
    assert reads == []  # the longest sample comes from the collator's host-side max_length_q
    for key, losses in reference.items():
        torch.testing.assert_close(got[key], losses, rtol=1e-4, atol=1e-5)


def test_packing_decision():
    ok = dict(packing=True, padding_free=False, strategy="bfd", masks_from_positions=True)
    assert check_packing(attention="flash_attention_2", **ok) == "flash_attention_2"
    assert check_packing(attention="eager", **ok) == "eager"
    assert check_packing(attention="sdpa", **ok) == PACKED_SDPA  # SDPA per sample, not one dense row
    assert check_packing(attention="sdpa", sliding_window=True, **ok) == "sdpa"  # windows need transformers' mask
    assert check_packing(attention="flex_attention", **{**ok, "packing": False}) == "flex_attention"  # nothing packed
    with pytest.raises(PackingError, match="--packing_strategy wrapped concatenates samples"):
        check_packing(attention="sdpa", **{**ok, "strategy": "wrapped"})
    with pytest.raises(PackingError, match="--attn_implementation flex_attention is not known"):
        check_packing(attention="flex_attention", **ok)
    with pytest.raises(PackingError, match="--padding_free: this model's code does not build"):
        check_packing(
            attention="sdpa", **{**ok, "packing": False, "padding_free": True, "masks_from_positions": False}
        )


def test_which_models_build_masks_from_position_ids():
    assert masks_from_position_ids(LlamaConfig())
    assert masks_from_position_ids(Qwen2Config())
    assert masks_from_position_ids(GPT2Config())
    assert not uses_sliding_window(LlamaConfig()) and not uses_sliding_window(Qwen2Config())
    assert uses_sliding_window(Qwen2Config(use_sliding_window=True, sliding_window=64))
    remote = LlamaConfig(auto_map={"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"})
    assert not masks_from_position_ids(remote, trust_remote_code=True)
    unknown = LlamaConfig()
    unknown.model_type = "not-a-model"
    assert not masks_from_position_ids(unknown)


def test_attention_choice_from_hardware_facts():
    l4, a100, t4 = GPUS["L4"], GPUS["A100-80GB"], GPUS["T4"]
    assert choose_attention("auto", a100, flash_installed=True) == "flash_attention_2"
    assert choose_attention(None, l4, flash_installed=True) == "flash_attention_2"
    assert choose_attention("auto", l4, flash_installed=False) == "sdpa"
    assert choose_attention("auto", t4, flash_installed=True) == "sdpa"  # flash-attn 2 needs compute capability 8.0
    assert choose_attention("auto", None, flash_installed=True) == "sdpa"
    assert choose_attention("eager", t4, flash_installed=False) == "eager"
    assert choose_attention("flash_attention_2", a100, flash_installed=True) == "flash_attention_2"
    with pytest.raises(HardwareError, match="this T4 has 7.5: use sdpa"):
        choose_attention("flash_attention_2", t4, flash_installed=True)
    with pytest.raises(HardwareError, match=r"needs flash-attn: pip install 'llmft\[gpu\]'"):
        choose_attention("flash_attention_2", l4, flash_installed=False)
    with pytest.raises(HardwareError, match="needs a CUDA GPU and none is visible"):
        choose_attention("flash_attention_2", None, flash_installed=True)
    with pytest.raises(HardwareError, match="unknown --attn_implementation 'flash'"):
        choose_attention("flash", a100, flash_installed=True)


def test_liger_decision_from_hardware_facts():
    supported = frozenset({"llama", "qwen2", "mistral"})
    for gpu in (GPUS["L4"], GPUS["A100-80GB"], GPUS["T4"]):
        check_liger(gpu, "llama", supported)  # any GPU, any ZeRO stage
    with pytest.raises(HardwareError, match="needs a CUDA GPU"):
        check_liger(None, "llama", supported)
    with pytest.raises(HardwareError, match=r"needs liger-kernel: pip install 'llmft\[gpu\]'"):
        check_liger(GPUS["A100-80GB"], "llama", None)
    with pytest.raises(HardwareError, match="Liger has no kernels for model type 'gpt2'"):
        check_liger(GPUS["A100-80GB"], "gpt2", supported)
    with pytest.raises(HardwareError, match="fused_linear_cross_entropy is not supported"):
        check_liger(GPUS["A100-80GB"], "llama", supported, {"fused_linear_cross_entropy": True})


def test_liger_is_on_by_default_where_it_runs_in_bf16_and_a_flag_as_given_wins():
    """Not given: on for an A100, an L4, an H100 or an H200 with liger-kernel and a Llama (1.26x on an H200 at the
    same memory, bench/README.md), off on a T4 (no bf16) and a CPU; without liger-kernel on a bf16 GPU, off with a
    line that names the install. Given, or a --liger_kernel_config: as given, with check_liger's refusals."""
    supported = frozenset({"llama", "qwen2", "mistral"})
    for name in ("L4", "A100-40GB", "A100-80GB", "H100-80GB", "H200"):
        on, why = choose_liger(None, GPUS[name], "llama", supported)
        assert on and "Liger's kernels on (auto" in why and "--use_liger_kernel false" in why, name
        assert choose_liger(False, GPUS[name], "llama", supported) == (False, "")
        on, why = choose_liger(None, GPUS[name], "llama", None)
        assert not on and "pip install 'llmft[gpu]'" in why
        assert choose_liger(None, GPUS[name], "gpt2", supported) == (False, "")  # no kernels for it: quietly off
    assert choose_liger(None, GPUS["T4"], "llama", supported) == (False, "")
    assert choose_liger(None, None, "llama", supported) == (False, "")
    assert choose_liger(True, GPUS["T4"], "llama", supported) == (True, "")  # asked for: a T4 runs them (fp16)
    with pytest.raises(HardwareError, match="needs a CUDA GPU"):
        choose_liger(True, None, "llama", None)
    with pytest.raises(HardwareError, match="needs a CUDA GPU"):  # a kernel config asks for Liger: never ignored
        choose_liger(None, None, "llama", None, {"rms_norm": False})
    with pytest.raises(HardwareError, match="fused_linear_cross_entropy is not supported"):
        choose_liger(None, GPUS["H100-80GB"], "llama", supported, {"fused_linear_cross_entropy": True})
    assert choose_liger(None, GPUS["H100-80GB"], "llama", supported, {"rms_norm": False}) == (True, "")


def test_attention_choice_follows_what_the_model_has():
    assert model_attentions(LlamaConfig()) == {"flash_attention_2", "sdpa", "eager"}
    assert model_attentions(GPT2Config()) == {"flash_attention_2", "sdpa", "eager"}
    assert model_attentions(LlamaConfig(auto_map={"AutoModelForCausalLM": "x.Y"}), trust_remote_code=True) is None
    a100 = GPUS["A100-80GB"]
    eager_only = frozenset({"eager"})
    assert choose_attention("auto", a100, flash_installed=True, model_supports=eager_only) == "eager"
    assert choose_attention("auto", a100, flash_installed=True, model_supports=frozenset({"sdpa", "eager"})) == "sdpa"
    with pytest.raises(HardwareError, match="this model has no sdpa attention; use one of eager"):
        choose_attention("sdpa", None, flash_installed=False, model_supports=eager_only)


def test_padded_batches_go_padding_free_where_a_varlen_kernel_runs_them():
    """The default for padded batches, from each machine's facts: an A100, L4 or H100 (bf16, PyTorch's varlen flash
    kernel or flash-attention) trains padding-free; a T4 (no FA2 kernel), a CPU, fp32, sliding windows keep padding;
    a flag as given, and --packing, always win."""
    from llmft.planning.hardware import choose_precision
    from llmft.training.packing import choose_padding_free

    def decide(gpu, attention="sdpa", **facts):
        precision = choose_precision("auto", gpu)
        kernel = packed_kernel(
            device_type="cuda" if gpu else "cpu",
            dtype={"bf16": "bfloat16", "fp16": "float16"}.get(precision, "float32"),
            dropout=0.0,
            head_dim=64,
            varlen_available=True,
            capability=gpu and gpu.compute_capability,
        )
        args = dict(
            requested=None,
            packing=False,
            cuda=gpu is not None,
            micro_batch=8,
            attention=attention,
            kernel=kernel,
            masks_from_positions=True,
            sliding_window=False,
        )
        return choose_padding_free(**{**args, **facts})

    for name in ("A100-40GB", "L4", "H100-80GB"):
        on, why = decide(GPUS[name])
        assert on and "PyTorch's varlen flash kernel" in why and "--padding_free false keeps padding" in why
        on, why = decide(GPUS[name], attention="flash_attention_2")
        assert on and "flash-attention's varlen kernel" in why
        assert decide(GPUS[name], requested=False) == (False, "")  # --padding_free false: kept padded
        assert decide(GPUS[name], packing=True) == (False, "")  # --packing is padding-free already (TRL)
        assert decide(GPUS[name], micro_batch=1) == (False, "")  # one sample: nothing to remove
        on, why = decide(GPUS[name], sliding_window=True)
        assert not on and "sliding-window" in why
        on, why = decide(GPUS[name], masks_from_positions=False)
        assert not on and "position ids" in why
    on, why = decide(GPUS["T4"])
    assert not on and "compute capability 8.0+" in why
    assert decide(GPUS["T4"], requested=True) == (True, "")  # asked for: check_packing decides if it is safe
    assert decide(None) == (False, "")  # CPU: padded (per-sample SDPA is slower than padding there)
    assert decide(None, requested=True) == (True, "")


@pytest.mark.parametrize(
    "argv, gpu, installed, expected",
    [
        ([], "H100-80GB", True, True),  # not given, on an H100 with liger-kernel: on
        ([], "H100-80GB", False, False),  # not installed: off (a line names the install)
        ([], "T4", True, False),
        ([], None, True, False),  # a CPU
        (["--use_liger_kernel", "false"], "A100-80GB", True, False),
        (["--use_liger_kernel", "true"], "L4", True, True),
    ],
)
def test_llmft_train_hands_the_trainer_its_liger_decision(argv, gpu, installed, expected, monkeypatch, capsys):
    """What `llmft train` gives the Trainer: --use_liger_kernel not given parses as None (SFTConfig's False cannot
    tell it from "false") and becomes choose_liger's answer for the machine's GPU; the log says when it is on."""
    import dataclasses

    from llmft import train

    monkeypatch.setattr(train, "liger_model_types", lambda: frozenset({"llama"}) if installed else None)
    parsed = parse_train_flags(
        train.make_parser(), ["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", "out", *argv]
    )
    assert parsed[1].use_liger_kernel == {"false": False, "true": True}.get(argv[-1] if argv else None)
    run, decided = train.check_run(train.RunSettings(*parsed), cuda=False, gpu=None)
    if gpu is not None:
        decided = dataclasses.replace(decided, cuda=True, gpu=GPUS[gpu], precision="bf16")
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    run, _ = train.choose_model_settings(run, decided, config)
    assert run.training.use_liger_kernel is expected
    assert ("Liger's kernels on (auto" in capsys.readouterr().out) == (expected and not argv)

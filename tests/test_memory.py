"""The memory planner (llmft.planning.memory): DeepSpeed's own estimates, properties over random jobs, the activation
formula against what autograd really saves, and the plans docs/memory-planning.md shows."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmft.planning.final_save import final_save_lead
from llmft.planning.hardware import GPUS, NODE_TYPES
from llmft.planning.memory import (
    GIB,
    Job,
    MemoryPlanError,
    ModelShape,
    Setting,
    activation_bytes,
    ds_zero2_estimate,
    ds_zero3_estimate,
    estimate,
    layer_activation_bytes_per_token,
    model_states_bytes,
    optimizer_step_bytes,
    plan_memory,
)


def shape(params=8_030_261_248, largest=525_336_576, lora=0, **dims) -> ModelShape:
    """Llama-3.1-8B's dimensions unless told otherwise."""
    base = dict(
        name="t",
        params=params,
        largest_layer_params=largest,
        layers=32,
        hidden=4096,
        heads=32,
        kv_heads=8,
        head_dim=128,
        intermediate=14336,
        vocab=128256,
        quantizable_params=int(params * 0.87),
        lora_params=lora,
    )
    base.update(dims)
    return ModelShape(**base)


# ---- agreement with DeepSpeed's estimators ------------------------------------------------------------------------

GRID = list(
    itertools.product(
        [1_000_003, 124_439_808, 1_235_814_400, 8_030_261_248, 70_553_706_496],  # total parameters
        [1, 2, 4, 8],  # GPUs per node
        [1, 2, 3, 16],  # nodes
    )
)


@pytest.mark.parametrize("total, per_node, nodes", GRID)
def test_model_states_equal_deepspeeds_own_estimates(total, per_node, nodes):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    largest = total // 15 + 7
    s, world = shape(params=total, largest=largest), per_node * nodes
    for offload in (False, True):
        ds = estimate_zero2_model_states_mem_needs(total, per_node, nodes, cpu_offload=offload)
        assert ds_zero2_estimate(total, per_node, nodes, cpu_offload=offload) == ds
        assert model_states_bytes(s, 2, "optimizer" if offload else "none", world, "bf16") == ds[1]
    for offload, params, init in itertools.product((False, True), (False, True), (False, True)):
        ds = estimate_zero3_model_states_mem_needs(total, largest, per_node, nodes, offload, params, init)
        assert ds_zero3_estimate(total, largest, per_node, nodes, offload, params, init) == ds
        if offload or not params:
            mode = "optimizer+params" if offload and params else "optimizer" if offload else "none"
            assert model_states_bytes(s, 3, mode, world, "bf16") == ds[1]


@pytest.mark.parametrize("total, per_node, nodes", GRID[::3])
def test_offloaded_host_states_equal_deepspeeds_zero_init_figure(total, per_node, nodes):
    """With zero.Init (llmft's ZeRO-3 path), the host side of offloading is DeepSpeed's own number."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    s = shape(params=total, largest=total // 15)
    job = Job(s, GPUS["A100-80GB"], 10_000, nodes, per_node, 512, "bf16", global_batch=per_node * nodes)
    for mode, params in (("optimizer", False), ("optimizer+params", True)):
        est = estimate(job, Setting(3, mode, 1, 1, True))
        ds_cpu = estimate_zero3_model_states_mem_needs(total, total // 15, per_node, nodes, True, params, True)[0]
        assert est.host["offload"] == pytest.approx(ds_cpu, abs=per_node + 2)


# ---- properties ----------------------------------------------------------------------------------------------------


def random_shape(layers, hidden, kv_div, inter, vocab, gated) -> ModelShape:
    heads = hidden // 64
    mlp = (3 if gated else 2) * hidden * inter
    return shape(
        params=layers * (4 * hidden * hidden + mlp) + 2 * vocab * hidden,
        largest=vocab * hidden,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=max(1, heads // kv_div),
        head_dim=64,
        intermediate=inter,
        vocab=vocab,
        gated_mlp=gated,
        rms_norm=gated,
    )


shapes = st.builds(
    random_shape,
    st.integers(1, 80),
    st.sampled_from([256, 1024, 4096, 8192]),
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([1024, 11008, 14336, 28672]),
    st.sampled_from([512, 32000, 128256]),
    st.booleans(),
)


def lora_of(s: ModelShape, frac: float) -> ModelShape:
    """Adapters on every linear layer: q, k, v, o and the MLP's input projections read the hidden state, its output
    projection the MLP's width."""
    inputs = (6 if s.gated_mlp else 3) * s.hidden + s.intermediate
    return dataclasses.replace(s, lora_params=max(1, int(s.params * frac)), lora_inputs=inputs)


@given(
    s=shapes,
    stage=st.sampled_from([2, 3]),
    world=st.integers(1, 512),
    more=st.integers(1, 64),
    precision=st.sampled_from(["bf16", "fp16", "fp32"]),
    lora=st.sampled_from([0.0, 0.001, 0.05]),
)
def test_more_gpus_never_raise_per_gpu_model_states(s, stage, world, more, precision, lora):
    if lora:
        s = lora_of(s, lora)
    for offload in ("none", "optimizer") if stage == 2 else ("none", "optimizer", "optimizer+params"):
        assert model_states_bytes(s, stage, offload, world + more, precision) <= model_states_bytes(
            s, stage, offload, world, precision
        )


@given(
    s=shapes,
    micro=st.integers(1, 64),
    seq=st.sampled_from([128, 1024, 4096, 32768]),
    precision=st.sampled_from(["bf16", "fp32"]),
    attention=st.sampled_from(["sdpa", "flash_attention_2"]),
)
def test_recomputation_never_raises_activations(s, micro, seq, precision, attention):
    """For two layers or more (a one-layer model checkpointed keeps its input, which the plain run frees)."""
    s = dataclasses.replace(s, layers=max(2, s.layers))
    assert activation_bytes(s, micro, seq, True, precision, attention) <= activation_bytes(
        s, micro, seq, False, precision, attention
    )


@given(
    s=shapes,
    frac=st.sampled_from([0.0005, 0.002, 0.01]),
    stage=st.sampled_from([0, 1, 2, 3]),
    nodes=st.integers(1, 4),
    per_node=st.sampled_from([1, 2, 4, 8]),
    micro=st.integers(1, 8),
    gc=st.booleans(),
    four_bit=st.booleans(),
)
def test_lora_never_needs_more_than_full_fine_tuning_except_activations(
    s, frac, stage, nodes, per_node, micro, gc, four_bit
):
    """Model states on the GPU, host and disk, for adapters up to 1% of the model, without CPU offload (what LoRA runs
    with: with the optimizer offloaded, full fine-tuning's GPU also keeps only the 16-bit weights, and adapters come
    on top). Activations are the exception: each adapted linear keeps its dropped-out input (measured on an H100:
    +30% per layer with r=16 on every linear layer; bench/activations.py), so a small model with long micro-batches
    can need more GPU memory under LoRA; the next test checks that term against autograd."""
    four_bit = four_bit and stage < 3
    full = Job(s, GPUS["L4"], 192, nodes, per_node, 1024, "bf16")
    lora = dataclasses.replace(full, shape=lora_of(s, frac), load_in_4bit=four_bit)
    setting = Setting(stage, "none", micro, 1, gc)
    a, b = estimate(lora, setting), estimate(full, setting)
    assert a.model_states <= b.model_states and a.loss_buffers <= b.loss_buffers
    assert a.host["peak"] <= b.host["peak"]
    assert a.checkpoint <= b.checkpoint


jobs = st.builds(
    lambda s, gpu, host, nodes, per_node, seq, gb_mult, lora, gc: Job(
        lora_of(s, 0.002) if lora else s,
        GPUS[gpu],
        host,
        nodes,
        per_node,
        seq,
        "bf16" if GPUS[gpu].has_bf16 else "fp16",
        global_batch=nodes * per_node * gb_mult,
        gradient_checkpointing=gc,
    ),
    shapes,
    st.sampled_from(sorted(GPUS)),
    st.sampled_from([8.0, 16.0, 85.0, 680.0, 2048.0]),
    st.integers(1, 8),
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([256, 2048, 8192]),
    st.sampled_from([1, 4, 16]),
    st.booleans(),
    st.sampled_from([None, True, False]),
)


@settings(max_examples=150, deadline=None)
@given(job=jobs)
def test_a_fitting_candidate_never_exceeds_the_gpu_or_host_it_was_given(job):
    plan = plan_memory(job)
    for c in plan.candidates:
        d = c.as_dict()
        s = c.setting
        # the peak is the larger of the micro-batches' phase and ZeRO-1/2's optimizer step, never their sum
        absent, added = optimizer_step_bytes(job.shape, s.zero_stage, s.offload, job.world, job.precision)
        training = c.model_states - absent + c.activations + c.loss_buffers
        assert c.gpu_total == max(training, c.model_states + added) + c.overhead
        assert -absent <= c.phase <= max(-absent, added)
        if c.fits:
            assert c.gpu_total <= job.device_gib * GIB and d["gpu_total_gib"] <= job.device_gib + 0.005
            assert c.host["peak"] <= job.host_ram_gib * GIB
            assert s.micro_batch * s.grad_accum * job.world == job.global_batch
        else:
            assert "GPU memory" in c.why or "host RAM" in c.why
    if plan.recommended is not None:
        assert plan.candidates[0] is plan.recommended and plan.recommended.fits
    else:
        assert not any(c.fits for c in plan.candidates) and plan.reason.startswith("nothing fits")


# ---- activations: the formula against what autograd saves ----------------------------------------------------------


def saved_bytes(model, batch, seq, padded: bool) -> int:
    """Bytes of the distinct storages autograd keeps for the backbone's backward pass."""
    import torch

    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, model.config.vocab_size, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.long)
    if padded:
        mask[0, : seq // 4] = 0
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = (
            model.model(input_ids=ids, attention_mask=mask)
            if hasattr(model, "model")
            else model.transformer(input_ids=ids, attention_mask=mask)
        )
        out.last_hidden_state.sum()
    return sum(n for ptr, n in storages.items() if ptr not in params)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_activation_formula_matches_what_autograd_saves(arch, precision):
    """A SwiGLU/GQA/RMSNorm (Llama) and a gelu_new/LayerNorm (GPT-2) decoder under SDPA with a padding mask: the
    estimate is within 15% of the bytes autograd really keeps; with recomputation it is an upper bound.
    (GPT-2's attention dropout is off: on CPU SDPA's math path then keeps the s^2 probabilities, which the GPU
    kernels llmft targets do not.)"""
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    from llmft.planning.model_shape import model_shape

    if arch == "llama":
        config = LlamaConfig(
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            intermediate_size=688,
            vocab_size=512,
            max_position_embeddings=512,
        )
    else:
        config = GPT2Config(
            n_embd=256,
            n_layer=4,
            n_head=8,
            vocab_size=512,
            n_positions=512,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
    config._attn_implementation = "sdpa"
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.train()
    s = model_shape(config)
    batch, seq = 2, 128
    measured = saved_bytes(model, batch, seq, padded=True)
    assert measured == pytest.approx(activation_bytes(s, batch, seq, False, precision), rel=0.15)

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    kept = saved_bytes(model, batch, seq, padded=True)  # each layer's input; one layer is rebuilt at a time later
    rebuilt = batch * seq * layer_activation_bytes_per_token(s, precision)
    assert 0.6 * (activation_bytes(s, batch, seq, True, precision) - rebuilt) <= kept
    assert kept + rebuilt <= activation_bytes(s, batch, seq, True, precision)
    assert kept < 0.1 * measured


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("targets", [["all-linear"], None])
def test_lora_activation_term_matches_what_autograd_saves(precision, targets):
    """LoRA (r=16, TRL's default dropout 0.05, adapters in the training dtype as DeepSpeed casts them) on every
    linear layer, or on PEFT's default q/v: the estimate is within 15% of what autograd keeps. Without the LoRA term
    the all-linear case is under-estimated (the planner said 17.9 GiB for a QLoRA run that peaked at 22.0 on an
    H100; with the term, 22.6)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    from llmft.planning.model_shape import model_shape

    config = LlamaConfig(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=688,
        vocab_size=512,
        max_position_embeddings=512,
    )
    config._attn_implementation = "sdpa"
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_config(config, dtype=dtype),
        LoraConfig(
            r=16, lora_alpha=32, lora_dropout=0.05, target_modules=targets and targets[0], task_type="CAUSAL_LM"
        ),
    )
    for p in model.parameters():
        p.data = p.data.to(dtype)
    model.train()
    s = model_shape(config, use_peft=True, lora_target_modules=targets)
    assert s.lora_inputs == (6 * 256 + 688 if targets else 2 * 256)
    batch, seq = 2, 128
    measured = saved_bytes(model.base_model.model, batch, seq, padded=True)
    assert measured == pytest.approx(activation_bytes(s, batch, seq, False, precision), rel=0.15)
    if targets:
        without_term = dataclasses.replace(s, lora_inputs=0)
        assert activation_bytes(without_term, batch, seq, False, precision) < 0.85 * measured


# ---- the planner against the GPU -----------------------------------------------------------------------------------
# Peaks measured with one process, ZeRO-2, bf16, llmft's packed attention (torch.cuda.max_memory_allocated, from
# bench/README.md's GPU sections), beside the part of the plan they measure: model states + activations + loss
# buffers + phase (the optimizer step's fp32 gradient partition is never live with the activations).
MEASURED_PEAKS = [  # (config, ZeRO, micro-batch, sequence, recomputation, LoRA r=16 on every linear, Liger, GiB, run)
    ("llama_3_2_1b", 2, 8, 2048, True, False, False, 25.4, "H100 2026-11-27 packed"),
    ("llama_3_2_1b", 2, 8, 2048, True, False, True, 25.4, "H200 2026-11-27 packed-liger"),
    ("llama_3_2_1b", 2, 8, 2048, False, False, False, 48.6, "H200 2026-11-27 packed-no-ckpt"),
    ("llama_3_1_8b", 2, 2, 4096, True, True, False, 21.0, "H100 2026-11-27 8b-lora"),
    ("llama_3_1_8b", 2, 1, 4096, False, True, False, 49.3, "H200 2026-11-27 8b-lora-no-ckpt"),
    ("tinyllama_1_1b", 2, 4, 2048, True, False, False, 22.6, "H100 2026-11-24 z2-pack-ckpt"),
    ("tinyllama_1_1b", 2, 4, 2048, False, False, False, 33.4, "H100 2026-11-24 z2-pack, accumulation 8"),
    ("tinyllama_1_1b", 2, 4, 2048, False, False, False, 31.4, "H100 2026-11-24 z2-pack, accumulation 1"),
    ("tinyllama_1_1b", 2, 4, 2048, False, False, True, 29.0, "H100 2026-11-24 z2-pack-liger, accumulation 8"),
    ("tinyllama_1_1b", 2, 4, 2048, False, False, True, 26.9, "H100 2026-11-24 z2-pack-liger, accumulation 1"),
    ("tinyllama_1_1b", 3, 4, 2048, False, False, False, 33.1, "H100 2026-11-24 z3-pack"),
    ("tinyllama_1_1b", 3, 4, 2048, False, False, True, 28.4, "H100 2026-11-24 z3-pack-liger"),
]


@pytest.mark.parametrize("config, stage, micro, seq, checkpointing, lora, liger, measured, run", MEASURED_PEAKS)
def test_the_plan_is_within_10_percent_of_every_peak_measured_on_a_gpu(
    config, stage, micro, seq, checkpointing, lora, liger, measured, run
):
    """Issue 31's goal for the planner. Counting ZeRO's fp32 gradient partition beside the activations put the runs
    without recomputation 9-20% over (54.1 GiB planned for the 48.6 measured), and not counting Liger's kernels 16-27%
    over (33.7 for 29.0)."""
    import published_shapes

    from llmft.planning.ds_config import load_config, template_path
    from llmft.planning.model_shape import model_shape

    s = model_shape(getattr(published_shapes, config)(), use_peft=lora, lora_r=16, lora_target_modules=["all-linear"])
    zero = {stage: load_config(template_path(stage))["zero_optimization"]}
    gpu = GPUS["H100-80GB"]
    job = Job(s, gpu, 1000, 1, 1, seq, "bf16", micro_batch=micro, zero_config=zero, liger=liger)
    c = estimate(job, Setting(stage, "none", micro, 1, checkpointing))
    planned = (c.model_states + c.activations + c.loss_buffers + c.phase) / GIB
    assert abs(planned / measured - 1) <= 0.10, f"{run}: planned {planned:.1f} GiB, measured {measured}"


@settings(max_examples=100, deadline=None)
@given(s=shapes, micro=st.sampled_from([1, 4]), seq=st.sampled_from([256, 4096]), gc=st.booleans(), lora=st.booleans())
def test_liger_never_raises_activations_and_changes_nothing_where_its_kernels_do_not_apply(s, micro, seq, gc, lora):
    if lora:
        s = lora_of(s, 0.01)
    plain = activation_bytes(s, micro, seq, gc, "bf16")
    with_liger = activation_bytes(s, micro, seq, gc, "bf16", liger=True)
    assert with_liger <= plain
    assert (with_liger < plain) == (s.rms_norm and s.gated_mlp)  # Llama-like: RMSNorm and SwiGLU


# ---- plans users rely on (docs/memory-planning.md's examples) --------------------------------------------------------


@pytest.fixture(scope="module")
def llama8b():
    from published_shapes import llama_3_1_8b

    from llmft.planning.model_shape import model_shape

    config = llama_3_1_8b()
    return config, model_shape(config), model_shape(config, use_peft=True, lora_r=16)


def node_job(s, node, nodes, **kw):
    n = NODE_TYPES[node]
    return Job(s, n.gpu, n.host_ram_gib, nodes, n.gpus, kw.pop("max_length", 2048), "bf16", **kw)


def test_llama_8b_shape_is_counted_from_its_config(llama8b):
    _, full, lora = llama8b
    assert full.params == 8_030_261_248  # Llama-3.1-8B's published size
    assert full.largest_layer_params == 128256 * 4096
    assert (full.kv_heads, full.gated_mlp, full.rms_norm) == (8, True, True)
    assert lora.lora_params == 32 * 16 * ((4096 + 4096) + (4096 + 1024))  # PEFT's default targets: q_proj, v_proj


def test_full_fine_tune_of_8b_does_not_fit_two_g2_nodes_but_lora_does(llama8b):
    _, full, lora = llama8b
    assert full.checkpoint_dtype == "bf16"
    nothing = plan_memory(node_job(full, "g2-standard-4", 2, global_batch=32))
    assert nothing.recommended is None and "nothing fits" in nothing.reason
    rec = plan_memory(node_job(lora, "g2-standard-4", 2, global_batch=32)).recommended
    assert rec is not None and rec.setting.offload == "none"
    assert rec.as_dict()["gpu_total_gib"] <= 22.0 and rec.as_dict()["host_ram_gib_per_node"] <= 16


def test_a_converting_load_needs_a_copy_per_rank_and_zero3_avoids_it(llama8b):
    """Weights stored in fp32 but trained in bf16 (or TRL's fp32 default on a bf16 checkpoint): every ZeRO-0/1/2
    rank holds a converted copy while loading, which a 16 GB g2 host cannot; ZeRO-3 loads partitioned."""
    _, _, lora = llama8b
    stored_fp32 = dataclasses.replace(lora, checkpoint_dtype="fp32")
    plan = plan_memory(node_job(stored_fp32, "g2-standard-4", 2, global_batch=32))
    assert plan.recommended.setting.zero_stage == 3
    zero2 = [c for c in plan.candidates if c.setting.zero_stage == 2 and c.setting.offload == "none"]
    assert zero2 and all("host RAM" in c.why and "loading the weights" in c.why for c in zero2)
    in_place = estimate(node_job(lora, "g2-standard-4", 2), Setting(2, "none", 1, 1, True)).host
    assert in_place["loading"] == 0 and in_place["file_pages"] == lora.params * 2  # mapped, reclaimable, not counted


def test_8b_on_a2_highgpu_8g_fits_without_offload_and_warns_about_the_preemption_window(llama8b):
    _, full, _ = llama8b
    plan = plan_memory(node_job(full, "a2-highgpu-8g", 1, global_batch=64))
    rec = plan.recommended
    assert rec.setting.offload == "none" and rec.setting.micro_batch * rec.setting.grad_accum * 8 == 64
    [warning] = [w for w in plan.warnings if "USR1" in w]  # ~90 GiB of shards at Filestore's 100 MB/s
    # A Slurm run stops early enough for that save: 1.5 x the write time + the step + 60 s before the time limit.
    lead = 1.5 * rec.write_s + rec.step_s + 60
    assert (
        f"a Slurm run stops for its final save {lead:.0f} s ({lead / 60:.0f} min) before the time limit instead"
        in warning
    )
    assert 1400 < lead < 1600, lead  # 964 s to write
    # and the collective timeout it will run with: never shorter than 2 x that save, not transformers' 1800 s
    assert f"a dead node stops the job after at most {2 * rec.write_s:.0f} s (the collective timeout" in warning


def test_under_async_save_the_plan_states_the_lead_the_run_stops_at(llama8b):
    """--async_save: the final save first waits out a background write that may have just begun, so the run
    (llmft.training.job_deadline) stops 1.5 x 2 x the save + the step + 60 s before the time limit; the plan says
    the same number, not the one-save lead."""
    _, full, _ = llama8b
    job = dataclasses.replace(node_job(full, "a2-highgpu-8g", 1, global_batch=64), async_save=True)
    plan = plan_memory(job)
    rec = plan.recommended
    [warning] = [w for w in plan.warnings if "USR1" in w]
    lead = 1.5 * 2 * rec.write_s + rec.step_s + 60
    assert lead == final_save_lead(None, rec.write_s, rec.step_s, async_save=True)
    assert (
        f"a Slurm run stops for its final save {lead:.0f} s ({lead / 60:.0f} min) before the time limit instead "
        f"(1.5 x {rec.write_s:.0f} s x 2 + the step + 60 s; after its first save, 1.5 x the longest it measured x 2)"
        in warning
    ), warning
    assert "a final or stop save first waits out a background write in flight" in warning


def test_a_long_periodic_save_on_a_gpu_suggests_async_save_with_the_host_ram_it_needs(llama8b):
    """8B full fine-tune on a2-highgpu-8g (680 GiB per node): a 90 GiB checkpoint at 100 MB/s holds training for its
    whole write; the plan names --async_save and the host RAM it takes, which this node has. Not once it is on, not
    on a CPU run (measured: there the background write slows the steps more than it saves)."""
    _, full, _ = llama8b
    job = node_job(full, "a2-highgpu-8g", 1, global_batch=64)
    plan = plan_memory(job)
    rec = plan.recommended
    [hint] = [w for w in plan.warnings if "--async_save" in w]
    snapshot = estimate(dataclasses.replace(job, async_save=True), rec.setting).host["async_save"]
    assert snapshot >= 80 * 2**30  # the whole checkpoint's optimizer shards and weights on the one node
    assert hint.startswith(
        f"each periodic checkpoint holds training for its whole write ({rec.write_s:.0f} s at 100 MB/s)"
    )
    assert hint.endswith(
        f"for {round(snapshot / 2**30, 2)} GiB of host RAM on the first node, kept while the run lasts: "
        "this node's 680 GiB has room for it"
    )
    assert not [w for w in plan_memory(dataclasses.replace(job, async_save=True)).warnings if "--async_save" in w]
    # a node with room for the run but not for the snapshot too
    tight = dataclasses.replace(job, host_ram_gib=math.ceil(rec.host["peak"] / 2**30) + 1)
    assert plan_memory(tight).recommended.setting == rec.setting
    assert any(
        w.endswith(f"more than this node's {tight.host_ram_gib:g} GiB can spare") for w in plan_memory(tight).warnings
    )


def test_save_total_limit_beyond_free_disk_is_warned(llama8b):
    _, full, _ = llama8b
    job = node_job(full, "g6.12xlarge", 1, global_batch=16, save_total_limit=2, free_disk_gib=10_000)
    ckpt_gib = plan_memory(job).recommended.checkpoint / 2**30
    # Two kept plus the one being written (the oldest goes only once it is complete): 2.5 checkpoints' room is short.
    plan = plan_memory(dataclasses.replace(job, free_disk_gib=2.5 * ckpt_gib))
    assert any(
        w.startswith("save_total_limit 2 keeps 2 complete checkpoints while writing the next: 3 x ")
        and f"{2.5 * ckpt_gib:.1f} GiB free in the output directory" in w
        for w in plan.warnings
    ), plan.warnings
    roomy = plan_memory(dataclasses.replace(job, free_disk_gib=10_000))
    assert not any("save_total_limit" in w for w in roomy.warnings)


def test_4bit_needs_lora_and_a_capable_gpu_and_skips_zero3(llama8b):
    _, full, lora = llama8b
    with pytest.raises(MemoryPlanError, match="add --use_peft"):
        plan_memory(node_job(full, "g2-standard-4", 1, global_batch=8, load_in_4bit=True))
    with pytest.raises(MemoryPlanError, match="compute capability 7.5"):
        plan_memory(Job(lora, GPUS["V100-16GB"], 64, 1, 1, 512, "fp16", global_batch=8, load_in_4bit=True))
    plan = plan_memory(Job(lora, GPUS["T4"], 64, 1, 1, 512, "fp16", global_batch=8, load_in_4bit=True))
    assert plan.recommended is not None and {c.setting.zero_stage for c in plan.candidates} <= {0, 1, 2}
    four, sixteen = (
        estimate(plan.job, plan.recommended.setting),
        estimate(dataclasses.replace(plan.job, load_in_4bit=False), plan.recommended.setting),
    )
    assert four.model_states < 0.4 * sixteen.model_states


def test_impossible_numbers_are_refused_with_the_flag_named():
    s = shape()
    for bad, flag in (
        (dict(nnodes=0), "--nnodes"),
        (dict(max_length=-5), "--max_length"),
        (dict(mfu=1.5), "--mfu"),
        (dict(host_ram_gib=0.0), "host RAM"),
    ):
        with pytest.raises(MemoryPlanError, match=flag):
            plan_memory(dataclasses.replace(Job(s, GPUS["L4"], 16, 1, 1, 512, "bf16"), **bad))
    with pytest.raises(MemoryPlanError, match="not divisible by the world size 8"):
        plan_memory(Job(s, GPUS["L4"], 16, 1, 8, 512, "bf16", global_batch=12))


def test_the_consolidated_final_model_is_counted_on_the_first_node(llama8b):
    _, full, _ = llama8b
    job = node_job(full, "a2-highgpu-8g", 1, global_batch=64, save_consolidated=True)
    z3 = estimate(job, Setting(3, "none", 1, 8, True)).host
    assert z3["final_model"] == 2 * 2 * full.params  # the 16-bit model, and its bytes while safetensors writes them
    assert (
        estimate(dataclasses.replace(job, save_consolidated=False), Setting(3, "none", 1, 8, True)).host["final_model"]
        == 0
    )
    assert estimate(job, Setting(2, "none", 1, 8, True)).host["final_model"] == 0  # ZeRO-2 writes it whole anyway


def test_recomputation_under_zero2_is_preferred_to_zero3_without_it(llama8b):
    """LoRA on Llama-3.1-8B, 4 x L4, micro-batch up to 2: ZeRO-3 without recomputation fits, and so does ZeRO-2 with
    it; ZeRO-2 with recomputation is recommended (on an H100, 2x the tokens/s of ZeRO-3 without: bench/README.md),
    and the reason says ZeRO-3 would have fitted."""
    _, _, lora = llama8b
    job = node_job(lora, "g6.12xlarge", 1, global_batch=16, max_micro_batch=2)
    plan = plan_memory(job)
    zero3_plain = [
        c
        for c in plan.candidates
        if c.setting.zero_stage == 3 and c.setting.offload == "none" and not c.setting.gradient_checkpointing
    ]
    assert zero3_plain and zero3_plain[0].fits
    chosen = plan.recommended.setting
    # ZeRO-1, not 2: accumulation 2, and ZeRO-1 reduces the (adapter) gradients once per step
    assert (chosen.zero_stage, chosen.offload, chosen.gradient_checkpointing) == (1, "none", True)
    assert "ZeRO-3 without it would fit but trains slower" in plan.reason


def linked_job(s, node, nodes, **kw):
    """node_job on the node type's links, with llmft's ZeRO templates (their buckets and overlap_comm)."""
    from llmft.planning.comm import node_network
    from llmft.planning.ds_config import load_config, template_path

    zero = {stage: load_config(template_path(stage)).get("zero_optimization", {}) for stage in (0, 1, 2, 3)}
    return node_job(s, node, nodes, network=node_network(node, kw.pop("nccl_profile", None)), zero_config=zero, **kw)


def test_zero1_is_recommended_for_a_1b_model_on_eight_g2_nodes_because_it_models_faster():
    """The issue's case: a 1.24B full fine-tune on 8 x g2-standard-4 (10 Gbps), global batch 64, sequence 2048."""
    from published_shapes import llama_3_2_1b

    from llmft.planning.model_shape import model_shape

    plan = plan_memory(linked_job(model_shape(llama_3_2_1b()), "g2-standard-4", 8, global_batch=64))
    rec = plan.recommended
    assert (rec.setting.zero_stage, rec.setting.offload, rec.setting.gradient_checkpointing) == (1, "none", False)
    assert rec.setting.grad_accum > 1
    [zero2] = [
        c
        for c in plan.candidates
        if c.setting.zero_stage == 2 and c.setting.offload == "none" and not c.setting.gradient_checkpointing
    ]
    assert zero2.fits and rec.tokens_per_s > zero2.tokens_per_s  # the reason, not only the rule
    assert zero2.time.exposed_comm_s > rec.time.exposed_comm_s  # it moves the gradients once, not 4 times
    assert f"{rec.step_s:.1f} s a step against ZeRO-2's {zero2.step_s:.1f} s" in rec.why


def test_offload_rows_on_an_a2_node_count_their_pcie_copies(llama8b):
    _, full, _ = llama8b
    job = linked_job(full, "a2-highgpu-8g", 1, global_batch=64)
    for stage, offload in ((2, "optimizer"), (3, "optimizer"), (3, "optimizer+params")):
        setting = Setting(stage, offload, 1, 8, False)
        with_offload, without = estimate(job, setting), estimate(job, dataclasses.replace(setting, offload="none"))
        assert with_offload.time.host_s > 0 and without.time.host_s == 0
        assert with_offload.step_s == pytest.approx(without.step_s + with_offload.time.host_s)
        assert with_offload.tokens_per_s < without.tokens_per_s
    # Parameters offloaded too: fetched from the host for every gather, more than the optimizer alone moves.
    z3 = [estimate(job, Setting(3, o, 1, 8, False)).time.host_s for o in ("optimizer", "optimizer+params")]
    assert z3[0] < z3[1]


def test_zero2_reductions_per_micro_batch_make_more_accumulation_slower_on_a_slow_network(llama8b):
    _, full, _ = llama8b
    job = linked_job(full, "g2-standard-96", 2, global_batch=64)  # 8 L4s a node, 100 Gbps between the two
    times = [estimate(job, Setting(2, "optimizer", m, 4 // m, True)).time for m in (4, 2, 1)]
    exposed = [t.exposed_comm_s for t in times]
    assert exposed == sorted(exposed) and exposed[0] < exposed[-1]  # each micro-batch exposes its last bucket


def test_zero2_stays_where_the_backward_hides_its_reductions_and_zero1s_single_one_is_exposed(llama8b):
    """Two a3-highgpu-8g over their host NICs: each micro-batch's ZeRO-2 reduction hides behind its backward, while
    ZeRO-1's (no overlap_comm in llmft's template) waits after the last one, so ZeRO-1 is not taken for the rule alone."""
    _, full, _ = llama8b
    plan = plan_memory(linked_job(full, "a3-highgpu-8g", 2, global_batch=64))
    rec = plan.recommended
    assert (rec.setting.zero_stage, rec.setting.offload) == (2, "none") and rec.setting.grad_accum > 1
    [zero1] = [
        c
        for c in plan.candidates
        if c.setting.zero_stage == 1
        and c.setting.offload == "none"
        and c.setting.gradient_checkpointing == rec.setting.gradient_checkpointing
    ]
    assert zero1.fits and zero1.tokens_per_s < rec.tokens_per_s
    assert zero1.time.exposed_comm_s == pytest.approx(zero1.time.comm_s)
    assert zero1.time.exposed_comm_s > rec.time.exposed_comm_s

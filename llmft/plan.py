"""The run plan: world, micro-batch, accumulation, global batch, ZeRO config and precision, before any model loads.

`llmft train` computes it in every process; `llmft plan` prints it on a login node or in a batch
script's first lines, so a user sees (and a bad knob fails) before GPUs are spent.

    llmft plan --global_batch_size 32 --per_device_train_batch_size 2 --nnodes 2 --nproc_per_node 4
    llmft plan --global_batch_size 32 --per_device_train_batch_size 2 --zero_stage 3 --offload   # world from Slurm/torchrun env
    llmft plan --global_batch_size 32 --per_device_train_batch_size 2 --print_launch   # + the line slurm/run_llm.slurm launches from

With --model it is a memory plan (llmft.planning.memory): will it fit, and what should it run with? The model is built
from its config on the meta device (no weights are read); the hardware is a catalogue GPU or node type, or
this machine's GPUs and RAM when neither is given.

    llmft plan --model meta-llama/Llama-3.1-8B --node_type a2-highgpu-8g --global_batch_size 64 --max_length 2048
    llmft plan --model runs/llama-cfg --node_type g2-standard-4 --nnodes 2 --use_peft --lora_r 16 --json
    llmft plan --model runs/llama-cfg --gpu L4 --host_ram_gb 192 --nproc_per_node 4 --write plans/l4
    llmft plan --model runs/llama-cfg --node_type a2-highgpu-8g --nnodes 2 --write plans/a100 --scheduler pbs
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from llmft.command import command_parser, report_error
from llmft.data import cache, padding
from llmft.data.cache import load_prepared_train
from llmft.data.loading import DataError
from llmft.errors import LlmftError
from llmft.planning import comm, ds_config, memory, methods, sequence_parallel
from llmft.planning.allocation import AllocationError, job_nodes, numa_binding, parse_node_lines
from llmft.planning.batch import plan_batch
from llmft.planning.conversion import plan_conversion
from llmft.planning.ds_config import load_config, template_path
from llmft.planning.hardware import AUTO_PRECISION, PRECISIONS, choose_precision
from llmft.planning.memory import MemoryPlanError, plan_long_context, plan_memory
from llmft.planning.model_shape import cap_max_length, load_model_config, model_positions, model_shape
from llmft.planning.preference import mark_precomputed, plan_with_reference
from llmft.planning.run_plan import (
    TRAIN_DEFAULTS,
    Hardware,
    PlanError,
    RunPlan,
    make_plan,
    memory_job,
    planned_liger,
    resolve_hardware,
)
from llmft.planning.speed_defaults import choose_recomputation
from llmft.planning.world import CpuSplit, World, cpu_split, discover_cpus, discover_world

# ---- the memory plan (--model): llmft.planning.memory on a model shape and the hardware --------------------------------------


def network_assumption(network: comm.NodeNetwork) -> str:
    """The plan's one line on how communication was costed (llmft.planning.comm's docstring says why)."""
    between = f"{network.network_gbps:g} Gbps network" + (f" ({network.network})" if network.network else "")
    faster = "".join(f"; --nccl_profile {p}: {g:g} Gbps over {n}" for p, g, n in network.fabrics)
    return (
        f"communication over the node's {between}{faster}, or {network.intra_link} inside one node, at "
        f"{comm.LINK_EFFICIENCY:.0%} of the link; ZeRO-2/3 reduce gradients behind each micro-batch's own backward, "
        "its last bucket exposed; ZeRO-0/1's reduction at the step's end and the all-gather after it exposed "
        "(llmft.planning.comm)"
    )


def format_memory_plan(mplan, hardware: Hardware, tried: list[str] | None = None, advice: str = "") -> list[str]:
    """The memory plan as printed: the model and hardware, the recommendation and why, the candidate table,
    warnings, and the assumptions behind the numbers; `tried`: what each other sequence parallelism breaks;
    `advice`: a preference method's reference line (llmft.planning.preference)."""
    job, shape = mplan.job, mplan.job.shape
    train = f"LoRA: {shape.trainable / 1e6:.1f}M trainable" if shape.lora else "full fine-tuning"
    if job.load_in_4bit:
        train += " on 4-bit weights"
    entry = job.method_entry
    if not methods.is_default(entry.name):
        train += f", --method {entry.name} ({entry.sequences_per_example} sequences per {entry.batch_unit[:-1]})"
    batch = f"global batch {job.global_batch}" if job.global_batch else "no global batch given"
    out = [
        f"llmft plan: model {shape.name}: {shape.params / 1e9:.2f}B parameters, {train}; {job.precision}, "
        f"sequence {job.max_length}, {batch}",
        f"llmft plan: hardware {hardware.describe(job.nnodes, job.nproc_per_node)}; world size {job.world}",
    ]
    out += sequence_lines(mplan, tried or [])
    if advice:
        out.append(advice)
    if mplan.recommended is not None:
        out.append(f"llmft plan: recommended {mplan.recommended.setting.describe()}")
        out.append(f"llmft plan: why: {mplan.reason}")
    else:
        out.append(f"llmft plan: {mplan.reason}")
    out.append(
        "  stage offload           micro accum ckpt tiled    | states  activ   loss  phase  other    GPU | host/node | ckpt GiB  write s | tokens/s | fits"
    )
    for c in _table_rows(mplan.candidates):
        s, d = c.setting, c.as_dict()
        tps = "-" if c.tokens_per_s is None else f"{c.tokens_per_s:.0f}"
        out.append(
            f"  {s.zero_stage:<5} {s.offload:<17} {s.micro_batch:>5} {s.grad_accum:>5} {'on' if s.gradient_checkpointing else 'off':<4}"
            f" {savers_column(s):<8} |"
            f" {d['model_states_gib'] + d['reference_gib']:6.1f} {d['activations_gib']:6.1f} {d['loss_buffers_gib']:6.1f} {round(d['phase_gib'], 1) + 0.0:6.1f}"
            f" {d['overhead_gib']:6.1f} {d['gpu_total_gib']:6.1f} | {d['host_ram_gib_per_node']:9.1f} | {d['checkpoint_gib']:8.1f} {c.write_s:8.0f} |"
            f" {tps:>8} | {'yes' if c.fits else 'no: ' + c.why}"
        )
    conversion = conversion_line(mplan, hardware)
    if conversion:
        out.append(conversion)
    out += [f"llmft plan: warning: {w}" for w in mplan.warnings]
    peak = (
        f"MFU {job.mfu:.0%} of {job.gpu.peak_tflops:g} TFLOP/s at every stage (ZeRO-3 and offload are slower: "
        "ZeRO-3 measured 2.8x slower than ZeRO-2 on one H100)"
        if job.gpu is not None and job.gpu.peak_tflops
        else "no peak known: tokens/s not estimated"
    )
    device = (
        f"{memory.CUDA_CONTEXT_GIB:g} GiB CUDA context + {memory.FRAGMENTATION:.0%} fragmentation per GPU, "
        f"{memory.PROCESS_HOST_GIB['cuda']:g} GiB host per process"
        if job.gpu is not None
        else f"CPU processes: device memory is host memory, {memory.PROCESS_HOST_GIB['cpu']:g} GiB host per process"
    )
    lora = "; LoRA dropout on (TRL's default 0.05; 0 keeps less)" if job.shape.lora else ""
    if job.liger and memory.liger_kernels_apply(job.shape):
        lora += "; Liger's RMSNorm/SwiGLU kernels, which keep fewer activations (--use_liger_kernel false: without)"
    elif job.gpu is not None and job.gpu.has_bf16 and memory.liger_kernels_apply(job.shape):
        lora += "; without Liger's kernels, which llmft train turns on where liger-kernel is installed and keep fewer activations (--use_liger_kernel true counts them)"
    network = "no node type: communication not modelled" if job.network is None else network_assumption(job.network)
    if job.gpu is not None and any(o != "none" for o in job.offloads):
        network += (
            f"; CPU offload's copies over each GPU's PCIe link at {comm.host_link_gbytes_s(job.gpu.name):g} GB/s, "
            "not hidden (its CPU optimizer step is not modelled)"
        )
    if job.reference_strategy != "none":
        device += "; states include the reference's weights and its forward's transient (llmft.planning.memory)"
    if any(c.phase for c in mplan.candidates):
        device += (
            "; phase: ZeRO-1/2/3 make the fp32 gradient partition (in states) and a flat copy of the 16-bit one only "
            "in the optimizer step, after the activations and loss buffers are freed: the peak is the larger phase"
        )
    out.append(
        f"llmft plan: assumed: {device}; {peak}{lora}; {network}; checkpoints written at {job.write_mb_s:g} MB/s; "
        f"the Slurm script's USR1 warning {job.preempt_window_s:g} s before the time limit (llmft.planning.memory documents each term)"
    )
    return out


def savers_column(setting) -> str:
    """The table's memory savers beyond ZeRO: '-', 'mlp' (--tiled_mlp), 'mlp+act' (and --activation_offloading)."""
    parts = (["mlp"] if setting.tiled_mlp else []) + (["act"] if setting.activation_offloading else [])
    return "+".join(parts) or "-"


def sequence_lines(mplan, tried: list[str]) -> list[str]:
    """Under sequence parallelism: the layout, each rank's share of a sample, and the all-to-all traffic; and what
    the other N tried break (smaller ones when this one fits; every other one when nothing fits)."""
    job = mplan.job
    verdict = (
        "a smaller sequence parallelism does not fit (with the tiling and offload allowed)"
        if mplan.recommended is not None
        else "not with the tiling, offload and sequence parallelism allowed either"
    )
    others = [f"llmft plan: {verdict}: {line}" for line in tried]
    if job.sequence_parallel == 1:
        return others
    layout = sequence_parallel.plan_layout(job.world, job.sequence_parallel)
    out = [
        f"llmft plan: sequence parallelism: {layout.line()}; each rank holds {job.rank_length} of a sample's "
        f"{job.max_length} tokens"
    ]
    est = mplan.recommended
    if est is not None:
        link = (
            "link not modelled (no --node_type)"
            if job.network is None
            else comm.ulysses_link(job.network, job.sequence_parallel, job.nproc_per_node)[1]
        )
        took = "" if est.time is None or job.network is None else f", {est.time.sequence_s:.2f} s a step"
        layer = memory.ulysses_bytes_per_layer(
            job.shape, est.setting.micro_batch, job.max_length, job.precision, job.sequence_parallel
        )
        out.append(
            f"llmft plan: Ulysses all-to-all: {layer / 2**20:.0f} MiB per rank a layer and pass, "
            f"{memory.gib(est.sequence_bytes)} GiB a step, over the {link}{took}, not hidden behind compute"
        )
    return out + others


def conversion_line(mplan, hardware: Hardware) -> str | None:
    """The recommended setting's elastic resume (llmft.training.elastic: a checkpoint continued on another world size
    goes through DeepSpeed's universal format): ds_to_universal's workers, host RAM and time on one of these nodes,
    beside the ranks of the node waiting for it."""

    est = mplan.recommended
    if est is None or est.setting.zero_stage == 0:
        return None
    job = mplan.job
    waiting = (job.nproc_per_node - 1) * memory.PROCESS_HOST_GIB["cpu" if job.gpu is None else "cuda"] * memory.GIB
    cpus = hardware.cpus_per_node or discover_cpus()[0]
    conv = plan_conversion(
        trainable=job.shape.trainable,
        largest_tensor=job.shape.largest_layer_params,
        saved_world=job.world,
        budget_bytes=int(job.host_ram_gib * memory.GIB - waiting),
        cpus=cpus,
        io_mb_s=job.write_mb_s,
    )
    verdict = "" if conv.fits else ": does not fit even with one worker of each (resume on the same world size)"
    return f"llmft plan: elastic resume on another world size (ds_to_universal): {conv.describe()}{verdict}"


def _table_rows(candidates):
    """One row per (stage, offload, tiling, activation offload): the first that fits in llmft's order (the candidates' order), else the one
    needing least memory. --json lists every candidate."""
    rows = {}
    for c in candidates:
        key = (c.setting.zero_stage, c.setting.offload, c.setting.tiled_mlp, c.setting.activation_offloading)
        best = rows.get(key)
        if (
            best is None
            or not best.fits
            and (c.fits or c.gpu_total + c.host["peak"] < best.gpu_total + best.host["peak"])
        ):
            rows[key] = c
    return list(rows.values())


def memory_plan_json(mplan) -> dict:
    shape = mplan.job.shape
    method = (
        {"method": mplan.job.method, "reference": mplan.job.reference_strategy}
        if not methods.is_default(mplan.job.method)
        else {}
    )
    return {
        **method,
        "params": shape.total,
        "trainable_params": shape.trainable,
        "sequence_parallel": mplan.job.sequence_parallel,
        "recommended": None if mplan.recommended is None else mplan.recommended.as_dict(),
        "reason": mplan.reason,
        "warnings": mplan.warnings,
        "candidates": [c.as_dict() for c in mplan.candidates],
    }


def submission_knobs(args, est, global_batch: int, sequence_parallel: int = 1) -> list[str]:
    """The job scripts' knobs (KEY=VALUE) for the recommended setting: the same for slurm/run_llm.slurm and
    pbs/run_llm.pbs."""
    s = est.setting
    knobs = [f"MODEL={args.model}", f"GLOBAL_BATCH={global_batch}", f"MICRO_BATCH={s.micro_batch}"]
    if sequence_parallel > 1:
        knobs.append(f"SEQUENCE_PARALLEL={sequence_parallel}")
    if s.offload == "optimizer" and s.zero_stage == 3:
        knobs.append(f"DS_CONFIG={template_path(3, 'optimizer')}")
    else:
        knobs += [f"ZERO_STAGE={s.zero_stage}", f"OFFLOAD={0 if s.offload == 'none' else 1}"]
    if args.use_peft:
        knobs.append("LORA=1")
    if not methods.is_default(args.method):
        knobs.append(f"METHOD={args.method}")
    knobs += data_knobs(args)
    extra = [
        "--gradient_checkpointing",
        "true" if s.gradient_checkpointing else "false",
        "--max_length",
        str(args.max_length),
        *s.flags(),
    ]
    extra += data_flags(args)
    if args.use_peft:
        extra += ["--lora_r", str(args.lora_r)]
        if args.lora_target_modules:
            extra += ["--lora_target_modules", *args.lora_target_modules]
    if args.precompute_ref_log_probs and not s.precompute_ref_log_probs:
        extra += ["--precompute_ref_log_probs", "true"]
    if args.load_in_4bit:
        extra.append("--load_in_4bit")
    if args.save_consolidated:
        extra.append("--save_consolidated")
    if args.async_save:
        extra.append("--async_save")
    if args.use_liger_kernel is not None:  # the plan counted what was asked: the run must do the same
        extra += ["--use_liger_kernel", "true" if args.use_liger_kernel else "false"]
    knobs.append("EXTRA_ARGS=" + " ".join(extra))
    return knobs


def sbatch_line(args, est, world: World, global_batch: int, sequence_parallel: int = 1) -> str:
    """The run_llm.slurm submission that runs the recommended setting, asking Slurm for the host memory it needs."""
    export = "--export=ALL," + ",".join(submission_knobs(args, est, global_batch, sequence_parallel))
    # The host memory the plan needs per node (rounded up), not the whole node: others' jobs may share it.
    mem = math.ceil(est.host["peak"] / 2**30)
    return (
        f"sbatch --nodes={world.nnodes} --gpus-per-node={world.procs_per_node} --mem={mem}G slurm/run_llm.slurm "
        f"{shlex.quote(export)}"
    )


def qsub_line(
    args, est, world: World, global_batch: int, gpus: bool, cpus_per_node: int | None, sequence_parallel: int = 1
) -> str:
    """The pbs/run_llm.pbs submission: one chunk per node (place=scatter) with its CPUs, GPUs and the host memory
    the plan needs, the walltime, and every knob in -v (a value holding a comma quoted, as qsub -v needs)."""
    knobs = submission_knobs(args, est, global_batch, sequence_parallel)
    variables = ",".join(f"{k.split('=', 1)[0]}='{k.split('=', 1)[1]}'" if "," in k else k for k in knobs)
    mem = math.ceil(est.host["peak"] / 2**30)
    per_node = world.procs_per_node if gpus else 0
    ncpus = cpus_per_node or 4 * max(1, per_node)  # pbs/run_llm.pbs's default: 4 CPUs per GPU
    select = f"{world.nnodes}:ncpus={ncpus}" + (f":ngpus={per_node}" if gpus else "") + f":mem={mem}gb"
    return (
        f"qsub -l select={select} -l place=scatter -l walltime={args.walltime} -v {shlex.quote(variables)} "
        "pbs/run_llm.pbs"
    )


def data_knobs(args) -> list[str]:
    """The run_llm.slurm knobs of the data and length the plan was made for: every one explicit, so the line never
    falls back to the script's defaults (its hub dataset, its GLOBAL_BATCH)."""
    knobs = []
    if args.dataset_mixture:  # the whole mixture trains: the script refuses DATASET and DATA_PERCENTAGE beside it
        knobs.append(f"MIXTURE={args.dataset_mixture}")
    else:
        if args.dataset_name:
            knobs.append(f"DATASET={args.dataset_name}")
        knobs.append(f"DATA_PERCENTAGE={args.data_percentage:g}")
    if args.max_steps is not None:
        knobs.append(f"MAX_STEPS={args.max_steps}")
    knobs.append(f"EPOCHS={args.num_train_epochs:g}")
    return knobs


DATA_FLAGS = (
    "prompt_column",
    "completion_column",
    "messages_column",
    "dataset_text_field",
    "dataset_format",
    "prompt_template",
    "role_map",
)


def data_flags(args) -> list[str]:
    """The `llmft train` flags for the data's columns, format and loss (EXTRA_ARGS, which the script splits on
    spaces: a value holding one is refused, naming the way through a --config YAML)."""
    out = []
    for name in DATA_FLAGS:
        value = getattr(args, name)
        if value and value != "auto":
            if any(c.isspace() for c in value):
                raise PlanError(
                    f"--{name} {value!r} holds whitespace, and run_llm.slurm splits EXTRA_ARGS on spaces: put "
                    f"{name}: in a YAML file and give EXTRA_ARGS=--config FILE, or plan without --write"
                )
            out += [f"--{name}", value]
    if args.assistant_only_loss is not None:
        out += ["--assistant_only_loss", str(args.assistant_only_loss).lower()]
    if args.drop_long_records:
        out.append("--drop_long_records")
    return out


def data_fit_lines(args, positions: int | None) -> list[str]:
    """--dataset_name or --dataset_mixture with --model: the data prepared as `llmft train` prepares it (cached, so the
    run reuses it) and its fit against max_length, one line per split (llmft.data.fit), with the warning naming the fix."""

    from transformers import AutoTokenizer
    from trl import SFTConfig

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as e:
        raise PlanError(
            f"{'--dataset_mixture' if args.dataset_mixture else '--dataset_name'} needs the model's tokenizer, and {args.model} has none loadable "
            f"({str(e).strip().splitlines()[0][:200]}): give a model directory with its tokenizer files"
        ) from None
    opts = cache.DataOptions(
        dataset_name=args.dataset_name or "",
        dataset_mixture=args.dataset_mixture,
        prompt_column=args.prompt_column,
        completion_column=args.completion_column,
        messages_column=args.messages_column,
        text_field=args.dataset_text_field or "text",
        data_percentage=args.data_percentage,
        dataset_format=args.dataset_format,
        prompt_template=args.prompt_template,
        role_map=args.role_map,
        assistant_only_loss=args.assistant_only_loss,
        drop_long_records=args.drop_long_records,
    )
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="llmft-plan-") as tmp:
        sft = SFTConfig(
            output_dir=tmp,
            report_to="none",
            activation_checkpointing=False,
            use_cpu=True,
            bf16=False,
            max_length=args.max_length,
            dataset_text_field=args.dataset_text_field or "text",
        )
        try:
            cache.check_options(opts)
            cache.prepare(opts, tokenizer, sft, log=lines.append, positions=positions)
        except DataError as e:
            raise PlanError(str(e)) from None
    return [f"llmft plan: {line}" for line in lines]


def write_plan_files(directory: Path, args, mplan, world: World, hardware) -> list[Path]:
    """--write DIR: the resolved DeepSpeed config of the recommended setting and the sbatch line that runs it
    (--scheduler pbs: the qsub line, qsub.txt)."""

    est = mplan.recommended
    s = est.setting
    sp = mplan.job.sequence_parallel
    dp = world.world_size // sp  # the global batch counts data-parallel ranks (a sequence group trains one sample)
    batch = plan_batch(dp, s.micro_batch, global_batch=s.micro_batch * s.grad_accum * dp)
    cfg = ds_config.resolve(
        load_config(template_path(s.zero_stage, s.offload)),
        batch,
        mplan.job.precision,
        gradient_clipping=TRAIN_DEFAULTS["clip"],
        lr=TRAIN_DEFAULTS["lr"],
        betas=TRAIN_DEFAULTS["betas"],
        eps=TRAIN_DEFAULTS["eps"],
        weight_decay=TRAIN_DEFAULTS["weight_decay"],
        hidden_size=mplan.job.shape.hidden,
    )
    if sp > 1:  # as llmft train writes it: DeepSpeed counts the world, llmft's global batch data-parallel ranks only
        cfg = {**cfg, "train_batch_size": "auto"}
    directory.mkdir(parents=True, exist_ok=True)
    written = [ds_config.write_resolved(cfg, directory)]
    if args.scheduler == "pbs":
        line = qsub_line(args, est, world, batch.global_batch, hardware.gpu is not None, hardware.cpus_per_node, sp)
    else:
        line = sbatch_line(args, est, world, batch.global_batch, sp)
    (directory / submission_file(args)).write_text(line + "\n")
    (directory / "plan.json").write_text(json.dumps(memory_plan_json(mplan), indent=2) + "\n")
    written += [directory / submission_file(args), directory / "plan.json"]
    return written


def submission_file(args) -> str:
    return "qsub.txt" if args.scheduler == "pbs" else "sbatch.txt"


def memory_main(args, world: World) -> tuple[int, World]:
    """`llmft plan --model ...`: the candidate table and the recommendation (or --json); the exit code and the
    world it planned for."""

    hardware = resolve_hardware(args.gpu, args.gpu_memory_gb, args.node_type, args.host_ram_gb)
    if args.nproc_per_node is None and hardware.gpus_per_node:
        world = World(world.nnodes, hardware.gpus_per_node, world.source)
    precision = choose_precision(args.precision, hardware.gpu)
    config = load_model_config(args.model, args.trust_remote_code)
    if args.max_length is None:
        args.max_length = TRAIN_DEFAULTS["max_length"]
    max_length = args.max_length
    if max_length < 1:
        raise PlanError(f"--max_length must be a positive integer, got {max_length}")
    if args.lora_r is None:
        args.lora_r = 16  # TRL's default
    positions = model_positions(config)
    capped, note = cap_max_length(config, max_length)  # llmft train caps it the same way
    if note and not args.json:
        print(f"llmft plan: {note}")
    args.max_length = max_length = capped
    shape = model_shape(
        config, use_peft=args.use_peft, lora_r=args.lora_r, lora_target_modules=args.lora_target_modules
    )
    micro = None if args.auto else args.per_device_train_batch_size
    job = memory_job(
        shape,
        hardware,
        world,
        max_length=max_length,
        precision=precision,
        global_batch=args.global_batch_size,
        micro_batch=micro,
        max_micro_batch=args.per_device_train_batch_size if args.auto else None,
        grad_accum=args.gradient_accumulation_steps,
        gradient_checkpointing=args.gradient_checkpointing,
        zero_stage=args.zero_stage,
        offload=args.offload or None,
        deepspeed=args.deepspeed,
        load_in_4bit=args.load_in_4bit,
        attention=args.attn_implementation or "sdpa",
        save_total_limit=args.save_total_limit,
        output_dir=args.output_dir or None,
        write_mb_s=args.write_mb_s,
        mfu=args.mfu,
        save_consolidated=args.save_consolidated,
        async_save=args.async_save,
        nccl_profile=args.nccl_profile,
        sequence_parallel=args.sequence_parallel or 1,
        tiled_mlp=args.tiled_mlp,
        activation_offloading=args.activation_offloading,
        liger=planned_liger(args.use_liger_kernel, hardware.gpu, config.model_type),
        method=args.method or methods.DEFAULT,
        precompute_ref_log_probs=args.precompute_ref_log_probs,
    )
    search = args.sequence_parallel is None and not args.auto
    try:
        # a preference method's reference first (llmft.planning.preference), on the same search as the plan's
        asked = job.reference is not None
        planned, _, advice = plan_with_reference(job, lambda j: plan_long_context(j, search).plan)
        job = replace(job, reference=planned.reference)  # the search below starts where it would have
        # llmft train --auto keeps the N it is given; the plan otherwise finds the smallest that fits
        long_context = plan_long_context(job, search_sequence_parallel=search)
    except MemoryPlanError as e:
        raise PlanError(str(e)) from None
    mplan, job = long_context.plan, long_context.plan.job
    if advice.strategy == "precomputed" and not asked:
        mplan = mark_precomputed(mplan)
    fit = data_fit_lines(args, positions) if args.dataset_name or args.dataset_mixture else []
    written = []
    if args.write and mplan.recommended is not None:
        world_ = World(job.nnodes, job.nproc_per_node, world.source)
        written = write_plan_files(Path(args.write), args, mplan, world_, hardware)
    if args.json:
        print(json.dumps({**memory_plan_json(mplan), **getattr(args, "extra_json", {})}, indent=2))
    else:
        print("\n".join(format_memory_plan(mplan, hardware, long_context.tried, advice.line) + fit))
        for path in written:
            print(f"llmft plan: wrote {path}")
        if written:
            print(f"llmft plan: run it: {(Path(args.write) / submission_file(args)).read_text().strip()}")
            if not args.dataset_name and not args.dataset_mixture:
                print(
                    "llmft plan: warning: no --dataset_name: the line trains on run_llm.slurm's default dataset; "
                    "add DATASET=your.jsonl to it, or plan with --dataset_name"
                )
    if mplan.recommended is None:
        print(f"llmft plan: error: {mplan.reason}{hardware.allocation_hint(mplan)}", file=sys.stderr)
        return 2, world
    return 0, world


def check_memory(args, plan: RunPlan) -> tuple[list[str], str | None]:
    """--check_memory: does the run plan's own setting (its stage, offload, micro-batch and accumulation) fit this
    job's GPUs and the host memory it may use (llmft.planning.allocation)? Returns (lines, error): the error names
    the limit and, where the allocation is the limit, the sbatch flag that fixes it. A model whose config cannot be
    read here (a hub id on an offline node) is said, not checked: training reads it again and fails there."""

    try:
        config = load_model_config(args.model, args.trust_remote_code)
    except MemoryPlanError as e:
        return [f"llmft plan: memory not checked: {e}"], None
    hardware = resolve_hardware(args.gpu, args.gpu_memory_gb, args.node_type, args.host_ram_gb)
    precision = choose_precision(args.precision, hardware.gpu)
    max_length = args.max_length or TRAIN_DEFAULTS["max_length"]
    max_length, _ = cap_max_length(config, max_length)  # llmft train caps it the same way
    shape = model_shape(
        config, use_peft=args.use_peft, lora_r=args.lora_r or 16, lora_target_modules=args.lora_target_modules
    )
    b = plan.batch

    def planned(gradient_checkpointing: bool):
        try:
            job = memory_job(
                shape,
                hardware,
                plan.world,
                max_length=max_length,
                precision=precision,
                global_batch=b.global_batch,
                micro_batch=b.micro_batch,
                grad_accum=b.grad_accum,
                gradient_checkpointing=gradient_checkpointing,
                zero_stage=None if args.deepspeed else plan.zero_stage,
                offload=None if args.deepspeed else plan.offload_mode,
                deepspeed=args.deepspeed,
                load_in_4bit=args.load_in_4bit,
                attention=args.attn_implementation or "sdpa",
                save_consolidated=args.save_consolidated,
                async_save=args.async_save,
                nccl_profile=args.nccl_profile,
                sequence_parallel=plan.sequence_parallel,
                tiled_mlp=bool(args.tiled_mlp),
                activation_offloading=bool(args.activation_offloading),
                liger=planned_liger(args.use_liger_kernel, hardware.gpu, config.model_type),
                method=args.method or methods.DEFAULT,
                precompute_ref_log_probs=args.precompute_ref_log_probs,
            )
            # the planner's recommendation is said beside the check; the check counts the reference as llmft train
            # holds it (precomputed when asked, the adapter disabled under LoRA, else a copy)
            _, _, advice = plan_with_reference(job)
            mplan = plan_memory(job)
        except MemoryPlanError as e:
            raise PlanError(str(e)) from None
        [est] = [c for c in mplan.candidates if c.setting.micro_batch == b.micro_batch] or mplan.candidates[:1]
        return est, mplan, advice

    est, mplan, advice = planned(False)
    # not given: what llmft train decides (off where it fits without recomputation on a GPU, else TRL's on)
    recompute, _ = choose_recomputation(
        args.gradient_checkpointing, hardware.gpu, est.fits, est.gpu_total / 2**30, mplan.job.device_gib
    )
    if recompute:
        est, mplan, advice = planned(True)
    d = est.as_dict()
    where = hardware.describe(plan.world.nnodes, plan.world.procs_per_node)
    device = "GPU" if hardware.gpu is not None else "per process"
    reference = [advice.line] if advice.line else []
    if est.fits:
        return reference + [
            f"llmft plan: memory: {est.setting.describe()} fits ({device} {d['gpu_total_gib']} GiB, host "
            f"{d['host_ram_gib_per_node']} GiB per node) on {where}"
        ], None
    return (
        reference,
        f"memory: {est.setting.describe()} does not fit on {where}: {est.why}{hardware.allocation_hint(mplan)}",
    )


def make_parser(subparsers=None):
    description = "Print the resolved run plan (world, batch math, ZeRO config) without loading a model; with --model, a memory plan."
    parser = command_parser(subparsers, "plan", description)
    parser.add_argument("--global_batch_size", type=int, default=None)
    parser.add_argument(
        "--per_device_train_batch_size",
        type=int,
        default=None,
        help="micro-batch per process (default 8; with --model: searched, or the largest tried with --auto)",
    )
    parser.add_argument("--gradient_accumulation_steps", type=int, default=None)
    parser.add_argument("--nnodes", type=int, default=None, help="default: from Slurm/torchrun variables")
    parser.add_argument(
        "--nproc_per_node",
        type=int,
        default=None,
        help="default: the node type's GPUs, the GPUs Slurm gave the node, or local GPUs",
    )
    parser.add_argument("--zero_stage", type=int, default=None)
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--deepspeed", default=None)
    parser.add_argument(
        "--sequence_parallel",
        type=int,
        default=None,
        help="Ulysses groups of N ranks: the global batch is planned over world / N data-parallel ranks (with "
        "--model: each rank holds 1/N of a sample; default: the smallest N that fits, 1 if it does)",
    )
    parser.add_argument("--precision", default="auto", choices=PRECISIONS)
    parser.add_argument("--output_dir", default="")
    parser.add_argument(
        "--nodes",
        default=None,
        metavar="FILE",
        help="the `llmft node:` lines of every node of the job (slurm/run_llm.slurm runs "
        "`python -m llmft.planning.allocation` on each): plan with the smallest node's memory, refuse "
        "GPUs spread unevenly or a fabric a node lacks, and choose the NUMA binding",
    )
    parser.add_argument(
        "--numa_binding", default="auto", help="with --nodes: auto, off, node, socket, exclusive, core-complex"
    )
    parser.add_argument(
        "--prepared",
        default=None,
        metavar="DIR",
        help="prepared data (the directory `llmft prepare` prints, or a run's --output_dir): its padding "
        "share and what padding-free batches and --packing would change",
    )
    parser.add_argument(
        "--print_launch",
        action="store_true",
        help="also print the world and CPU split as one 'llmft launch: key=value ...' line (read by slurm/run_llm.slurm)",
    )
    add_memory_plan_arguments(parser)
    parser.set_defaults(func=main)
    return parser


def add_memory_plan_arguments(parser) -> None:
    """The flags of a memory plan (--model) and of the run's data and length it is made for."""
    mem = parser.add_argument_group("memory plan (--model)")
    mem.add_argument(
        "--model", default=None, help="model directory, a directory holding only config.json, or a hub id"
    )
    mem.add_argument(
        "--gpu", default=None, help="L4, A100-40GB, A100-80GB, H100-80GB, H200, ... (llmft.planning.hardware.GPUS)"
    )
    mem.add_argument(
        "--gpu_memory_gb", type=float, default=None, help="GPU memory in GiB (an unlisted GPU, or to override)"
    )
    mem.add_argument(
        "--node_type",
        default=None,
        help="g2-standard-4, a2-highgpu-8g, g6.12xlarge, p4d.24xlarge, ... (llmft.planning.hardware.NODE_TYPES)",
    )
    mem.add_argument(
        "--nccl_profile",
        default=None,
        choices=comm.NCCL_PROFILES,
        help="slurm/run_llm.slurm's NCCL_PROFILE the job runs with: a3-highgpu-8g reaches its 800 Gbps GPUDirect-TCPX "
        "only with gcp-tcpx (else its 200 Gbps host NIC)",
    )
    mem.add_argument(
        "--host_ram_gb",
        type=float,
        default=None,
        help="host RAM per node in GiB (default: the node type's, or this machine's)",
    )
    mem.add_argument("--max_length", type=int, default=None, help="tokens per sequence (default: TRL's 1024)")
    mem.add_argument(
        "--gradient_checkpointing",
        default=None,
        type=lambda v: _bool(v, "--gradient_checkpointing"),
        help="true/false: only that; default: both tried",
    )
    mem.add_argument("--use_peft", action="store_true", help="LoRA adapters on a frozen model")
    mem.add_argument("--lora_r", type=int, default=None, help="LoRA rank (default: TRL's 16)")
    mem.add_argument("--lora_target_modules", nargs="+", default=None, help="default: PEFT's for the architecture")
    mem.add_argument("--load_in_4bit", action="store_true", help="QLoRA: frozen weights in 4-bit (needs --use_peft)")
    add_method_arguments(mem)
    add_kernel_arguments(mem)
    mem.add_argument(
        "--save_total_limit",
        type=int,
        default=None,
        help="checkpoints kept (checked against --output_dir's free space)",
    )
    mem.add_argument(
        "--save_consolidated", action="store_true", help="count the 16-bit model gathered at the end (ZeRO-3 rows)"
    )
    mem.add_argument(
        "--async_save", action="store_true", help="count the host RAM of checkpoints written in the background"
    )
    mem.add_argument(
        "--write_mb_s",
        type=float,
        default=None,
        help="checkpoint write bandwidth, MB/s (default: the provider's shared filesystem in llmft's blueprints)",
    )
    mem.add_argument(
        "--mfu", type=float, default=None, help="model FLOPs utilisation for the tokens/s estimate (default 0.35)"
    )
    add_long_context_arguments(mem)
    mem.add_argument(
        "--check_memory",
        action="store_true",
        help="print the run plan (as without --model) and check that its setting fits this job's GPUs and "
        "host memory; exit 2 naming the limit when it does not (slurm/run_llm.slurm runs it)",
    )
    mem.add_argument(
        "--auto",
        action="store_true",
        help="what `llmft train --auto` picks: micro-batches up to --per_device_train_batch_size",
    )
    mem.add_argument(
        "--check_model",
        action="store_true",
        help="only read the model's config as llmft train will and print one line (slurm/run_llm.slurm's DRY_RUN=1 "
        "runs it); exit 2 naming the problem when a local model's config does not read",
    )
    mem.add_argument("--json", action="store_true", help="print the plan as JSON")
    mem.add_argument(
        "--write", default=None, metavar="DIR", help="write the recommended DeepSpeed config and sbatch line to DIR"
    )
    mem.add_argument(
        "--scheduler",
        default="slurm",
        choices=("slurm", "pbs"),
        help="the submission --write writes: slurm (sbatch.txt) or pbs (qsub.txt: select, place, walltime, -v knobs)",
    )
    mem.add_argument("--walltime", default=None, help="with --scheduler pbs: the job's walltime (HH:MM:SS; 04:00:00)")
    mem.add_argument("--trust_remote_code", action="store_true")
    add_run_data_arguments(parser)


def add_method_arguments(mem) -> None:
    """The training method (llmft.planning.methods) and how its reference is held (llmft.planning.preference)."""
    mem.add_argument(
        "--method",
        default=None,
        help=f"as llmft train's: {', '.join(methods.METHODS)} (default sft); a preference method's pairs and "
        "reference are counted, and the plan recommends how to hold the reference",
    )
    mem.add_argument(
        "--precompute_ref_log_probs",
        default=False,
        type=lambda v: _bool(v, "--precompute_ref_log_probs"),
        nargs="?",
        const=True,
        help="as llmft train's: plan the reference precomputed (default: the plan chooses)",
    )


def add_kernel_arguments(mem) -> None:
    """The kernels the run uses, which decide the activations it keeps."""
    mem.add_argument("--attn_implementation", default=None, choices=["sdpa", "flash_attention_2"], help="default sdpa")
    mem.add_argument(
        "--use_liger_kernel",
        default=None,
        type=lambda v: _bool(v, "--use_liger_kernel"),
        nargs="?",
        const=True,
        help="true/false: count Liger's kernels (fewer activations) or not; default: as llmft train decides with "
        "this machine's liger-kernel (on for a bf16 GPU and a Llama-like model where it is installed)",
    )


def add_long_context_arguments(mem) -> None:
    """The memory savers for long sequences a memory plan may choose, or is told to use: each takes true or false, or
    stands alone for true; left out, the plan turns it on only when the sequence does not fit without it."""
    for flag, what in (
        ("--tiled_mlp", "DeepSpeed's TiledMLP"),
        ("--activation_offloading", "TRL's activation offload to host RAM, with gradient checkpointing"),
    ):
        mem.add_argument(
            flag,
            default=None,
            type=lambda v, flag=flag: _bool(v, flag),
            nargs="?",
            const=True,
            help=f"{what} (true/false; default: on only when the sequence does not fit without it)",
        )


def add_run_data_arguments(parser) -> None:
    """The flags of the run's data and length a memory plan is made for (its fit, and the --write sbatch line)."""
    run = parser.add_argument_group("the data and length of the run (--model; in the --write sbatch line)")
    run.add_argument(
        "--dataset_name", default=None, help="your data (.jsonl, ...): its fit against --max_length is counted"
    )
    run.add_argument(
        "--dataset_mixture",
        default=None,
        metavar="FILE",
        help="a mixture YAML (as llmft train --dataset_mixture) instead of --dataset_name: its fit is counted, and "
        "the --write line gives MIXTURE=FILE",
    )
    run.add_argument("--prompt_column", default=None)
    run.add_argument("--completion_column", default=None)
    run.add_argument("--messages_column", default=None)
    run.add_argument("--dataset_text_field", default=None)
    run.add_argument(
        "--dataset_format", default=None, help="as llmft train's: auto (the default, from the fields) or a format"
    )
    run.add_argument("--prompt_template", default=None, help="as llmft train's: a preset (alpaca, gsm8k) or format")
    run.add_argument("--role_map", default=None, help="as llmft train's: speaker names -> roles (bot=assistant)")
    run.add_argument(
        "--assistant_only_loss",
        default=None,
        type=lambda v: _bool(v, "--assistant_only_loss"),
        help="true/false, as llmft train's (default: on for chat data)",
    )
    run.add_argument(
        "--drop_long_records", action="store_true", help="as llmft train's: drop records longer than --max_length"
    )
    run.add_argument("--data_percentage", type=float, default=100.0, help="default 100 (all of it)")
    run.add_argument("--num_train_epochs", type=float, default=3.0, help="default 3 (llmft train's)")
    run.add_argument("--max_steps", type=int, default=None)


def _bool(value: str, flag: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False

    raise argparse.ArgumentTypeError(f"{flag} takes true or false, not {value!r}")


MEMORY_ONLY = (
    "gpu",
    "gpu_memory_gb",
    "node_type",
    "nccl_profile",
    "host_ram_gb",
    "max_length",
    "gradient_checkpointing",
    "use_peft",
    "lora_r",
    "lora_target_modules",
    "load_in_4bit",
    "method",
    "precompute_ref_log_probs",
    "attn_implementation",
    "save_total_limit",
    "save_consolidated",
    "async_save",
    "tiled_mlp",
    "activation_offloading",
    "use_liger_kernel",
    "write_mb_s",
    "mfu",
    "auto",
    "json",
    "write",
    "trust_remote_code",
    "dataset_name",
    "dataset_mixture",
    *DATA_FLAGS,
    "assistant_only_loss",
    "drop_long_records",
    "max_steps",
    "check_memory",
    "check_model",
)


def check_model(args) -> str:
    """--check_model: the one line on the model's config, read as llmft train reads it (llmft.planning.model_shape);
    a local model whose config does not read is an error, a hub id that cannot be reached from here is said."""
    model = args.model
    local = Path(model).exists() or model.startswith((".", "/", "~")) or model.count("/") > 1
    try:
        config = load_model_config(model, args.trust_remote_code)
    except MemoryPlanError as e:
        if local:
            raise PlanError(str(e)) from None
        return f"llmft plan: model: {model} not checked: {e}"
    positions = model_positions(config)
    return (
        f"llmft plan: model: the config of {model} reads ({getattr(config, 'model_type', None) or 'unknown type'}, "
        f"{positions if positions else 'unstated'} positions)"
    )


def main(args) -> int:

    try:
        check_submission_flags(args)
        check_method(args)
        if args.check_model:
            if not args.model:
                raise PlanError("--check_model needs --model (the model whose config to read)")
            print(check_model(args))
            return 0
        launch_extra = apply_node_facts(args.nodes, args.numa_binding) if args.nodes else {}
        world = discover_world()
        if args.nnodes is not None or args.nproc_per_node is not None:
            nnodes = world.nnodes if args.nnodes is None else args.nnodes  # 0 is a mistake to report, not "unset"
            procs = world.procs_per_node if args.nproc_per_node is None else args.nproc_per_node
            world = World(nnodes, procs, "arguments")
        if world.nnodes < 1 or world.procs_per_node < 1:
            raise PlanError("--nnodes and --nproc_per_node must be positive")
        if args.model and not args.check_memory:
            if args.deepspeed and (args.zero_stage is not None or args.offload):
                raise PlanError("give either --zero_stage/--offload or --deepspeed, not both")
            if args.json and args.print_launch:
                raise PlanError("--print_launch adds a text line that --json output cannot hold: give one of them")
            padding = prepared_padding(args)
            if padding is not None:
                args.extra_json = {"padding": padding.as_dict()}
            rc, world = memory_main(args, world)
            if rc == 0 and not args.json:
                print_padding(padding)
                print_launch_lines(world, args.print_launch, launch_extra)
            return rc
        given = [
            f"--{name}"
            for name in MEMORY_ONLY
            if getattr(args, name) is not None
            and getattr(args, name) is not False
            or name in ("gradient_checkpointing", "assistant_only_loss")
            and getattr(args, name) is False
        ]
        if args.check_memory and (args.auto or args.json or args.write):
            raise PlanError(
                "--check_memory checks the setting given; --auto, --json and --write belong to the memory plan: "
                "drop --check_memory or them"
            )
        if given and not args.model:
            raise PlanError(f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} --model (a memory plan)")
        # Planning on a login node: say what the GPU nodes will pick (llmft.planning.hardware.choose_precision's rule).
        precision = AUTO_PRECISION if args.precision == "auto" else args.precision
        plan = make_plan(
            micro_batch=8
            if args.per_device_train_batch_size is None
            else args.per_device_train_batch_size,  # HF default
            global_batch=args.global_batch_size,
            grad_accum=args.gradient_accumulation_steps,
            zero_stage=args.zero_stage,
            offload=args.offload,
            deepspeed=args.deepspeed,
            precision=precision,
            output_dir=args.output_dir,
            world=world,
            sequence_parallel=args.sequence_parallel or 1,
        )
        print("\n".join(plan.lines()))
        if args.check_memory:
            lines, error = check_memory(args, plan)
            for line in lines:
                print(line)
            if error:
                raise PlanError(error)
        print_padding(prepared_padding(args, plan.batch.micro_batch))
        print_launch_lines(plan.world, args.print_launch, launch_extra)
    except LlmftError as e:
        return report_error("plan", e, all_ranks=True)
    return 0


def check_method(args) -> None:
    """--method names a method of llmft.planning.methods (one line with the choices otherwise);
    --precompute_ref_log_probs belongs to one with a reference."""
    entry = methods.method(args.method)
    if args.precompute_ref_log_probs and not entry.reference:
        raise PlanError(
            f"--precompute_ref_log_probs precomputes a reference model's log-probs; --method {entry.name} has none: "
            "drop it, or plan --method dpo or kto"
        )


def check_submission_flags(args) -> None:
    """--scheduler and --walltime shape the line --write writes: without it they would be ignored, so refused."""
    if (args.scheduler != "slurm" or args.walltime is not None) and not args.write:
        raise PlanError("--scheduler and --walltime shape the submission line --write writes: add --write DIR")
    if args.walltime is not None and args.scheduler != "pbs":
        raise PlanError("--walltime is the PBS job's (qsub -l walltime): add --scheduler pbs, or drop it")
    args.walltime = args.walltime or "04:00:00"
    if not re.fullmatch(r"\d+:[0-5]\d:[0-5]\d", args.walltime):
        raise PlanError(f"--walltime {args.walltime}: give HH:MM:SS, e.g. 04:00:00")


def apply_node_facts(path: str, numa_request: str) -> dict[str, str]:
    """--nodes FILE: plan with the smallest node's memory (LLMFT_HOST_RAM_GB for this process, and for the training
    processes through the launch line), after checking the nodes agree; the NUMA binding for torchrun."""

    try:
        text = Path(path).read_text()
    except OSError as e:
        raise AllocationError(f"--nodes {path}: cannot read it ({e.strerror})") from None
    nodes = parse_node_lines(text)
    memory = job_nodes(nodes)
    os.environ["LLMFT_HOST_RAM_GB"] = f"{memory.gib:g}"
    if memory.from_allocation:
        os.environ["LLMFT_HOST_RAM_SOURCE"] = memory.source
    else:
        os.environ.pop("LLMFT_HOST_RAM_SOURCE", None)
    mode, why = numa_binding(numa_request, nodes)
    per_node = ", ".join(f"{n.host} {n.memory.gib:g} GiB ({n.memory.source})" for n in nodes)
    print(
        f"llmft plan: nodes: {len(nodes)} x {nodes[0].gpus} GPU(s); memory the job may use: {per_node}; "
        f"planning with {memory.gib:g} GiB per node"
    )
    print(f"llmft plan: NUMA binding {why}")
    return {"host_ram_gb": f"{memory.gib:g}", "numa_binding": mode or "off"}


def prepared_padding(args, micro_batch: int | None = None):
    """llmft.padding's report for --prepared (None without it), with the plan's micro-batch and --max_length."""
    if not args.prepared:
        return None

    try:
        train = load_prepared_train(args.prepared)
    except (OSError, ValueError) as e:
        raise PlanError(f"--prepared {args.prepared}: {e}") from None
    micro = micro_batch or args.per_device_train_batch_size or 8
    return padding.padding_report(padding.prepared_lengths(train), micro, getattr(args, "max_length", None) or 1024)


def print_padding(report) -> None:
    if report is not None:
        for line in report.lines(packing=False, padding_free=False):
            print(f"llmft plan: {line}")


def print_launch_lines(world: World, print_launch: bool, extra: dict[str, str] | None = None) -> None:
    """Inside Slurm (or with --print_launch): the CPU split, and the line slurm/run_llm.slurm launches from."""
    cpus, source = discover_cpus()
    if source == "slurm" or print_launch:
        split = cpu_split(cpus, world.procs_per_node, source)
        print(f"llmft plan: {split.describe()}")
        if split.warning():
            print(f"llmft plan: warning: {split.warning()}")
        if print_launch:
            print(" ".join([launch_line(world, split), *(f"{k}={v}" for k, v in (extra or {}).items())]))


def launch_line(world: World, split: CpuSplit) -> str:
    """The launch decisions as one machine-readable line, so the Slurm script never recomputes them."""
    return (
        f"llmft launch: nnodes={world.nnodes} nproc_per_node={world.procs_per_node} cpus_per_node={split.cpus_per_node} "
        f"omp_num_threads={split.threads_per_process} dataloader_num_workers={split.dataloader_workers} "
        f"dataset_num_proc={split.dataset_num_proc}"
    )


if __name__ == "__main__":
    sys.exit(main(make_parser().parse_args()))

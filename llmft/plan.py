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
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

from llmft.planning.batch import BatchError, BatchPlan, plan_batch
from llmft.cli import command_parser
from llmft.planning.ds_config import (
    DSConfigError,
    load_config,
    offload_mode,
    offloads,
    template_path,
    zero_stage_of,
)
from llmft.planning.hardware import AUTO_PRECISION, PRECISIONS, HardwareError, choose_precision
from llmft.planning.world import CpuSplit, LaunchEnvError, World, cpu_split, discover_cpus, discover_world


class PlanError(ValueError):
    """Any reason a run cannot start; its message says what to change."""


@dataclass(frozen=True)
class RunPlan:
    world: World
    batch: BatchPlan
    ds_template: Path
    zero_stage: int
    offload: bool
    precision: str
    output_dir: str
    offload_mode: str = "none"
    auto: str = ""  # --auto: what the memory planner chose, and why

    def lines(self) -> list[str]:
        b = self.batch
        offload = {"none": "", "optimizer": " with CPU offload (optimizer)",
                   "optimizer+params": " with CPU offload (optimizer and parameters)"}[self.offload_mode]
        auto = [f"llmft plan: auto: {self.auto}"] if self.auto else []
        return auto + [
            f"llmft plan: {self.world.describe()}",
            f"llmft plan: micro-batch {b.micro_batch} per process",
            f"llmft plan: gradient accumulation {b.grad_accum}",
            f"llmft plan: global batch {b.global_batch} = micro-batch {b.micro_batch} x accumulation {b.grad_accum} x world size {b.world_size}",
            f"llmft plan: ZeRO stage {self.zero_stage}{offload} ({self.ds_template})",
            f"llmft plan: precision {self.precision}",
            f"llmft plan: checkpoint dir {self.output_dir or '(not set)'}",
        ]


def make_plan(
    *,
    micro_batch: int,
    global_batch: int | None = None,
    grad_accum: int | None = None,
    zero_stage: int | None = None,
    offload: bool | str = False,
    deepspeed: str | None = None,
    precision: str = "fp32",
    output_dir: str = "",
    world: World | None = None,
    auto: str = "",
) -> RunPlan:
    """Check everything that can be checked without a model; raise PlanError naming the fix."""
    try:
        world = world or discover_world()
        batch = plan_batch(world.world_size, micro_batch, global_batch, grad_accum)
        path = template_path(zero_stage, offload, deepspeed)
        config = load_config(path)
    except (BatchError, DSConfigError, LaunchEnvError) as e:
        raise PlanError(str(e)) from None
    return RunPlan(world, batch, path, zero_stage_of(config), offloads(config), precision, output_dir,
                   offload_mode(config), auto)


# ---- the memory plan (--model): llmft.planning.memory on a model shape and the hardware --------------------------------------

# What `llmft train` uses when a flag is not given (TRL's SFTConfig / HF's TrainingArguments defaults).
TRAIN_DEFAULTS = {"max_length": 1024, "lr": 2e-5, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "clip": 1.0}


@dataclass(frozen=True)
class Hardware:
    """The GPUs and host a memory plan is made for."""

    gpu: object  # llmft.planning.hardware.GPU, or None for CPU processes
    gpu_memory_gib: float | None
    host_ram_gib: float
    gpus_per_node: int | None
    provider: str | None
    node_type: str | None
    host_ram_source: str = ""  # what limits this job's host RAM when it is the allocation (llmft.planning.allocation)
    node_ram_gib: float | None = None  # the node's own RAM (MemTotal), when the allocation is the limit

    def describe(self, nnodes: int, nproc: int) -> str:
        if self.gpu is None:
            device = f"{nproc} CPU process{'es' if nproc > 1 else ''} per node (no GPU)"
        else:
            device = f"{nproc} x {self.gpu.name} ({self.gpu_memory_gib:g} GiB) per node"
        node = f"{self.node_type}: " if self.node_type else ""
        limit = f" (the job's limit: {self.host_ram_source})" if self.host_ram_source else ""
        return f"{nnodes} x {node}{device}, {self.host_ram_gib:g} GiB host RAM per node{limit}"

    def allocation_hint(self, mplan) -> str:
        """When the job's allocation (not the node) is the host-RAM limit and a bigger one makes a setting fit:
        the sbatch flag that asks for it. '' otherwise."""
        if not self.host_ram_source:
            return ""
        from llmft.planning.memory import GIB

        limit = mplan.job.device_gib
        gpu_fits = [c for c in mplan.candidates if limit is None or c.gpu_total <= limit * GIB]
        if not gpu_fits:
            return ""
        need = math.ceil(min(c.host["peak"] for c in gpu_fits) / GIB)
        if self.node_ram_gib is not None and need > self.node_ram_gib:
            return ""  # the whole node is too small: the plan's own message says what else to change
        return (f"; the job's allocation is the limit ({self.host_ram_source}): ask Slurm for {need} GiB per node "
                f"with sbatch --mem={need}G (or --mem=0 for the whole node)")


def resolve_hardware(gpu: str | None = None, gpu_memory_gb: float | None = None, node_type: str | None = None,
                     host_ram_gb: float | None = None) -> Hardware:
    """A catalogue node type, a GPU (by name or memory) with the host RAM given, or this machine."""
    from llmft.planning.hardware import GPU, gpu_by_name, local_gpu, local_host_memory, node_type_by_name

    if node_type:
        node = node_type_by_name(node_type)
        if gpu and gpu_by_name(gpu) != node.gpu:
            raise PlanError(f"--gpu {gpu} contradicts --node_type {node.name}, which has {node.gpu.name}; give one of them")
        return Hardware(node.gpu, node.gpu.memory_gib if gpu_memory_gb is None else gpu_memory_gb,
                        node.host_ram_gib if host_ram_gb is None else host_ram_gb, node.gpus,
                        node.provider, node.name)
    if gpu or gpu_memory_gb is not None:
        if host_ram_gb is None:
            raise PlanError("--gpu/--gpu_memory_gb needs --host_ram_gb (the node's RAM), or use --node_type")
        if gpu:
            g = gpu_by_name(gpu)
        else:  # an unlisted GPU: assume bf16 tensor cores (Ampere+), peak unknown
            g = GPU(f"GPU-{gpu_memory_gb:g}GiB", gpu_memory_gb, (8, 0), None)
        return Hardware(g, g.memory_gib if gpu_memory_gb is None else gpu_memory_gb, host_ram_gb, None, None, None)
    g = local_gpu()
    host, source, node_ram = host_ram_gb, "", None
    if host is None:
        memory = local_host_memory()
        host, source, node_ram = memory.gib, (memory.source if memory.from_allocation else ""), memory.node_gib
    count = None
    if g is not None:
        import torch

        count = torch.cuda.device_count()
    return Hardware(g, g.memory_gib if g else None, host, count, None, None, source, node_ram)


def memory_job(shape, hardware: Hardware, world: World, *, max_length: int, precision: str,
               global_batch: int | None = None, micro_batch: int | None = None, max_micro_batch: int | None = None,
               grad_accum: int | None = None, gradient_checkpointing: bool | None = None,
               zero_stage: int | None = None, offload: bool | str | None = None, deepspeed: str | None = None,
               load_in_4bit: bool = False, attention: str = "sdpa", save_total_limit: int | None = None,
               output_dir: str | None = None, write_mb_s: float | None = None, mfu: float | None = None,
               save_consolidated: bool = False):
    """The llmft.planning.memory Job for this model, hardware and run knobs (stage/offload restricted when given)."""
    import shutil

    from llmft.planning import memory
    stages, offload_modes = memory.Job.__dataclass_fields__["zero_stages"].default, memory.OFFLOADS
    zero_config = {}
    try:
        if deepspeed:
            cfg = load_config(template_path(None, False, deepspeed))
            stages, offload_modes = (zero_stage_of(cfg),), (offload_mode(cfg),)
            zero_config = {zero_stage_of(cfg): cfg.get("zero_optimization", {})}
        else:
            if zero_stage is not None:
                stages = (zero_stage,)
            if offload is True:
                offload_modes = ("optimizer", "optimizer+params")
            elif isinstance(offload, str):
                offload_modes = (offload,)
            elif offload is False or zero_stage is not None:
                offload_modes = ("none",)
            for stage in (0, 1, 2, 3):
                zero_config[stage] = load_config(template_path(stage)).get("zero_optimization", {})
    except DSConfigError as e:
        raise PlanError(str(e)) from None
    free = None
    if output_dir:
        where = Path(output_dir).resolve()
        while not where.exists() and where != where.parent:
            where = where.parent
        free = shutil.disk_usage(where).free / 2**30
    return memory.Job(
        shape=shape, gpu=hardware.gpu, host_ram_gib=hardware.host_ram_gib, nnodes=world.nnodes,
        nproc_per_node=world.procs_per_node, max_length=max_length, precision=precision, global_batch=global_batch,
        micro_batch=micro_batch, max_micro_batch=max_micro_batch, grad_accum=grad_accum,
        gpu_memory_gib=hardware.gpu_memory_gib, gradient_checkpointing=gradient_checkpointing, zero_stages=stages,
        offloads=offload_modes, load_in_4bit=load_in_4bit, attention=attention, zero_config=zero_config,
        save_total_limit=save_total_limit, free_disk_gib=free,
        write_mb_s=memory.WRITE_MB_S.get(hardware.provider, memory.WRITE_MB_S[None]) if write_mb_s is None else write_mb_s,
        mfu=memory.DEFAULT_MFU if mfu is None else mfu, save_consolidated=save_consolidated,
    )


def format_memory_plan(mplan, hardware: Hardware) -> list[str]:
    """The memory plan as printed: the model and hardware, the recommendation and why, the candidate table,
    warnings, and the assumptions behind the numbers."""
    from llmft.planning import memory
    job, shape = mplan.job, mplan.job.shape
    train = f"LoRA: {shape.trainable / 1e6:.1f}M trainable" if shape.lora else "full fine-tuning"
    if job.load_in_4bit:
        train += " on 4-bit weights"
    batch = f"global batch {job.global_batch}" if job.global_batch else "no global batch given"
    out = [
        f"llmft plan: model {shape.name}: {shape.params / 1e9:.2f}B parameters, {train}; {job.precision}, "
        f"sequence {job.max_length}, {batch}",
        f"llmft plan: hardware {hardware.describe(job.nnodes, job.nproc_per_node)}; world size {job.world}",
    ]
    if mplan.recommended is not None:
        out.append(f"llmft plan: recommended {mplan.recommended.setting.describe()}")
        out.append(f"llmft plan: why: {mplan.reason}")
    else:
        out.append(f"llmft plan: {mplan.reason}")
    out.append("  stage offload           micro accum ckpt | states  activ   loss  other    GPU | host/node | ckpt GiB  write s | tokens/s | fits")
    for c in _table_rows(mplan.candidates):
        s, d = c.setting, c.as_dict()
        tps = "-" if c.tokens_per_s is None else f"{c.tokens_per_s:.0f}"
        out.append(
            f"  {s.zero_stage:<5} {s.offload:<17} {s.micro_batch:>5} {s.grad_accum:>5} {'on' if s.gradient_checkpointing else 'off':<4} |"
            f" {d['model_states_gib']:6.1f} {d['activations_gib']:6.1f} {d['loss_buffers_gib']:6.1f} {d['overhead_gib']:6.1f}"
            f" {d['gpu_total_gib']:6.1f} | {d['host_ram_gib_per_node']:9.1f} | {d['checkpoint_gib']:8.1f} {c.write_s:8.0f} |"
            f" {tps:>8} | {'yes' if c.fits else 'no: ' + c.why}"
        )
    out += [f"llmft plan: warning: {w}" for w in mplan.warnings]
    peak = (f"MFU {job.mfu:.0%} of {job.gpu.peak_tflops:g} TFLOP/s at every stage (ZeRO-3 and offload are slower: "
            "ZeRO-3 measured 2.8x slower than ZeRO-2 on one H100)" if job.gpu is not None and job.gpu.peak_tflops
            else "no peak known: tokens/s not estimated")
    device = (f"{memory.CUDA_CONTEXT_GIB:g} GiB CUDA context + {memory.FRAGMENTATION:.0%} fragmentation per GPU, "
              f"{memory.PROCESS_HOST_GIB['cuda']:g} GiB host per process" if job.gpu is not None
              else f"CPU processes: device memory is host memory, {memory.PROCESS_HOST_GIB['cpu']:g} GiB host per process")
    lora = "; LoRA dropout on (TRL's default 0.05; 0 keeps less)" if job.shape.lora else ""
    out.append(f"llmft plan: assumed: {device}; {peak}{lora}; checkpoints written at {job.write_mb_s:g} MB/s; "
               f"the Slurm script's USR1 warning {job.preempt_window_s:g} s before the time limit (llmft.planning.memory documents each term)")
    return out


def _table_rows(candidates):
    """One row per (stage, offload): the first that fits in llmft's order (the candidates' order), else the one
    needing least memory. --json lists every candidate."""
    rows = {}
    for c in candidates:
        key = (c.setting.zero_stage, c.setting.offload)
        best = rows.get(key)
        if best is None or not best.fits and (c.fits or c.gpu_total + c.host["peak"] < best.gpu_total + best.host["peak"]):
            rows[key] = c
    return list(rows.values())


def memory_plan_json(mplan) -> dict:
    shape = mplan.job.shape
    return {
        "params": shape.total,
        "trainable_params": shape.trainable,
        "recommended": None if mplan.recommended is None else mplan.recommended.as_dict(),
        "reason": mplan.reason,
        "warnings": mplan.warnings,
        "candidates": [c.as_dict() for c in mplan.candidates],
    }


def sbatch_line(args, est, world: World, global_batch: int) -> str:
    """The run_llm.slurm submission that runs the recommended setting, asking Slurm for the host memory it needs."""
    import shlex

    s = est.setting
    knobs = [f"MODEL={args.model}", f"GLOBAL_BATCH={global_batch}", f"MICRO_BATCH={s.micro_batch}"]
    if s.offload == "optimizer" and s.zero_stage == 3:
        knobs.append(f"DS_CONFIG={template_path(3, 'optimizer')}")
    else:
        knobs += [f"ZERO_STAGE={s.zero_stage}", f"OFFLOAD={0 if s.offload == 'none' else 1}"]
    if args.use_peft:
        knobs.append("LORA=1")
    knobs += data_knobs(args)
    extra = ["--gradient_checkpointing", "true" if s.gradient_checkpointing else "false", "--max_length", str(args.max_length)]
    extra += data_flags(args)
    if args.use_peft:
        extra += ["--lora_r", str(args.lora_r)]
        if args.lora_target_modules:
            extra += ["--lora_target_modules", *args.lora_target_modules]
    if args.load_in_4bit:
        extra.append("--load_in_4bit")
    if args.save_consolidated:
        extra.append("--save_consolidated")
    knobs.append("EXTRA_ARGS=" + " ".join(extra))
    export = "--export=ALL," + ",".join(knobs)
    # The host memory the plan needs per node (rounded up), not the whole node: others' jobs may share it.
    mem = math.ceil(est.host["peak"] / 2**30)
    return (f"sbatch --nodes={world.nnodes} --gpus-per-node={world.procs_per_node} --mem={mem}G slurm/run_llm.slurm "
            f"{shlex.quote(export)}")


def data_knobs(args) -> list[str]:
    """The run_llm.slurm knobs of the data and length the plan was made for: every one explicit, so the line never
    falls back to the script's defaults (its hub dataset, 10 epochs, 10% of the data)."""
    knobs = []
    if args.dataset_name:
        knobs.append(f"DATASET={args.dataset_name}")
    knobs.append(f"DATA_PERCENTAGE={args.data_percentage:g}")
    if args.max_steps is not None:
        knobs.append(f"MAX_STEPS={args.max_steps}")
    knobs.append(f"EPOCHS={args.num_train_epochs:g}")
    return knobs


def data_flags(args) -> list[str]:
    """The `llmft train` flags for the data's columns (EXTRA_ARGS)."""
    out = []
    for name in ("prompt_column", "completion_column", "messages_column", "dataset_text_field"):
        if getattr(args, name):
            out += [f"--{name}", getattr(args, name)]
    return out


def data_fit_lines(args, positions: int | None) -> list[str]:
    """--dataset_name with --model: the data prepared as `llmft train` prepares it (cached, so the run reuses it) and its
    fit against max_length, one line per split (llmft.data.fit), with the warning naming the fix."""
    import dataclasses
    import tempfile

    from llmft import prepare
    from llmft.data.loading import DataError

    from transformers import AutoTokenizer
    from trl import SFTConfig

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as e:
        raise PlanError(f"--dataset_name needs the model's tokenizer, and {args.model} has none loadable "
                        f"({str(e).strip().splitlines()[0][:200]}): give a model directory with its tokenizer files") from None
    opts = prepare.DataOptions(dataset_name=args.dataset_name, prompt_column=args.prompt_column,
                               completion_column=args.completion_column, messages_column=args.messages_column,
                               text_field=args.dataset_text_field or "text", data_percentage=args.data_percentage)
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="llmft-plan-") as tmp:
        sft = SFTConfig(output_dir=tmp, report_to="none", use_cpu=True, bf16=False, max_length=args.max_length,
                        dataset_text_field=args.dataset_text_field or "text")
        try:
            prepare.check_options(opts)
            prepare.prepare(opts, tokenizer, sft, log=lines.append, positions=positions)
        except DataError as e:
            raise PlanError(str(e)) from None
    return [f"llmft plan: {line}" for line in lines]


def write_plan_files(directory: Path, args, mplan, world: World) -> list[Path]:
    """--write DIR: the resolved DeepSpeed config of the recommended setting and the sbatch line that runs it."""
    import json

    from llmft.planning import ds_config
    est = mplan.recommended
    s = est.setting
    batch = plan_batch(world.world_size, s.micro_batch, global_batch=s.micro_batch * s.grad_accum * world.world_size)
    cfg = ds_config.resolve(
        load_config(template_path(s.zero_stage, s.offload)), batch, mplan.job.precision,
        gradient_clipping=TRAIN_DEFAULTS["clip"], lr=TRAIN_DEFAULTS["lr"], betas=TRAIN_DEFAULTS["betas"],
        eps=TRAIN_DEFAULTS["eps"], weight_decay=TRAIN_DEFAULTS["weight_decay"], hidden_size=mplan.job.shape.hidden,
    )
    directory.mkdir(parents=True, exist_ok=True)
    written = [ds_config.write_resolved(cfg, directory)]
    line = sbatch_line(args, est, world, batch.global_batch)
    (directory / "sbatch.txt").write_text(line + "\n")
    (directory / "plan.json").write_text(json.dumps(memory_plan_json(mplan), indent=2) + "\n")
    written += [directory / "sbatch.txt", directory / "plan.json"]
    return written


def memory_main(args, world: World) -> tuple[int, World]:
    """`llmft plan --model ...`: the candidate table and the recommendation (or --json); the exit code and the
    world it planned for."""
    import json

    from llmft.planning.memory import MemoryPlanError, plan_memory
    from llmft.planning.model_shape import load_model_config, model_shape

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
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if positions and max_length > positions:  # llmft train clips it the same way
        if not args.json:
            print(f"llmft plan: max_length {max_length} exceeds the model's {positions} positions; using {positions}")
        args.max_length = max_length = positions
    shape = model_shape(config, use_peft=args.use_peft, lora_r=args.lora_r, lora_target_modules=args.lora_target_modules)
    micro = None if args.auto else args.per_device_train_batch_size
    job = memory_job(
        shape, hardware, world, max_length=max_length, precision=precision, global_batch=args.global_batch_size,
        micro_batch=micro, max_micro_batch=args.per_device_train_batch_size if args.auto else None,
        grad_accum=args.gradient_accumulation_steps, gradient_checkpointing=args.gradient_checkpointing,
        zero_stage=args.zero_stage, offload=args.offload or None, deepspeed=args.deepspeed,
        load_in_4bit=args.load_in_4bit, attention=args.attn_implementation or "sdpa", save_total_limit=args.save_total_limit,
        output_dir=args.output_dir or None, write_mb_s=args.write_mb_s, mfu=args.mfu,
        save_consolidated=args.save_consolidated,
    )
    try:
        mplan = plan_memory(job)
    except MemoryPlanError as e:
        raise PlanError(str(e)) from None
    fit = data_fit_lines(args, positions) if args.dataset_name else []
    written = []
    if args.write and mplan.recommended is not None:
        written = write_plan_files(Path(args.write), args, mplan, World(job.nnodes, job.nproc_per_node, world.source))
    if args.json:
        print(json.dumps(memory_plan_json(mplan), indent=2))
    else:
        print("\n".join(format_memory_plan(mplan, hardware) + fit))
        for path in written:
            print(f"llmft plan: wrote {path}")
        if written:
            print(f"llmft plan: run it: {(Path(args.write) / 'sbatch.txt').read_text().strip()}")
            if not args.dataset_name:
                print("llmft plan: warning: no --dataset_name: the line trains on run_llm.slurm's default dataset; "
                      "add DATASET=your.jsonl to it, or plan with --dataset_name")
    if mplan.recommended is None:
        print(f"llmft plan: error: {mplan.reason}{hardware.allocation_hint(mplan)}", file=sys.stderr)
        return 2, world
    return 0, world


def check_memory(args, plan: RunPlan) -> tuple[list[str], str | None]:
    """--check_memory: does the run plan's own setting (its stage, offload, micro-batch and accumulation) fit this
    job's GPUs and the host memory it may use (llmft.planning.allocation)? Returns (lines, error): the error names
    the limit and, where the allocation is the limit, the sbatch flag that fixes it. A model whose config cannot be
    read here (a hub id on an offline node) is said, not checked: training reads it again and fails there."""
    from llmft.planning.memory import MemoryPlanError, plan_memory
    from llmft.planning.model_shape import load_model_config, model_shape

    try:
        config = load_model_config(args.model, args.trust_remote_code)
    except MemoryPlanError as e:
        return [f"llmft plan: memory not checked: {e}"], None
    hardware = resolve_hardware(args.gpu, args.gpu_memory_gb, args.node_type, args.host_ram_gb)
    precision = choose_precision(args.precision, hardware.gpu)
    max_length = args.max_length or TRAIN_DEFAULTS["max_length"]
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    max_length = min(max_length, positions) if positions else max_length
    shape = model_shape(config, use_peft=args.use_peft, lora_r=args.lora_r or 16, lora_target_modules=args.lora_target_modules)
    b = plan.batch
    try:
        job = memory_job(
            shape, hardware, plan.world, max_length=max_length, precision=precision, global_batch=b.global_batch,
            micro_batch=b.micro_batch, grad_accum=b.grad_accum,
            gradient_checkpointing=bool(args.gradient_checkpointing),  # llmft train's default: off
            zero_stage=None if args.deepspeed else plan.zero_stage, offload=None if args.deepspeed else plan.offload_mode,
            deepspeed=args.deepspeed, load_in_4bit=args.load_in_4bit, attention=args.attn_implementation or "sdpa",
            save_consolidated=args.save_consolidated,
        )
        mplan = plan_memory(job)
    except MemoryPlanError as e:
        raise PlanError(str(e)) from None
    [est] = [c for c in mplan.candidates if c.setting.micro_batch == b.micro_batch] or mplan.candidates[:1]
    d = est.as_dict()
    where = hardware.describe(plan.world.nnodes, plan.world.procs_per_node)
    device = "GPU" if hardware.gpu is not None else "per process"
    if est.fits:
        return [f"llmft plan: memory: {est.setting.describe()} fits ({device} {d['gpu_total_gib']} GiB, host "
                f"{d['host_ram_gib_per_node']} GiB per node) on {where}"], None
    return [], f"memory: {est.setting.describe()} does not fit on {where}: {est.why}{hardware.allocation_hint(mplan)}"


def auto_choice(model: str, world: World, *, precision: str, max_micro_batch: int, global_batch: int | None,
                grad_accum: int | None, max_length: int, use_peft: bool, lora_r: int, lora_target_modules,
                allow_gradient_checkpointing: bool, save_total_limit: int | None, output_dir: str,
                attention: str | None, load_in_4bit: bool, save_consolidated: bool, trust_remote_code: bool = False,
                keep_zero_stage: int | None = None):
    """`llmft train --auto`: the memory planner's recommendation for this machine's GPUs and RAM (every rank
    computes the same answer: run_llm.slurm exports the smallest node's allocation as LLMFT_HOST_RAM_GB).
    keep_zero_stage: a resumed run's stage (its checkpoints load only under it); offload and batch stay free.
    Returns (Setting, one line saying what was chosen and why); PlanError when nothing fits."""
    import dataclasses

    from llmft.planning.memory import MemoryPlanError, plan_memory
    from llmft.planning.model_shape import load_model_config, model_shape

    hardware = resolve_hardware()
    try:
        config = load_model_config(model, trust_remote_code)
        positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        max_length = min(max_length, positions) if positions else max_length  # llmft train clips it the same way
        shape = model_shape(config, use_peft=use_peft, lora_r=lora_r, lora_target_modules=lora_target_modules)
        if global_batch is None:
            global_batch = max_micro_batch * (grad_accum or 1) * world.world_size
        job = memory_job(
            shape, hardware, world, max_length=max_length, precision=precision, global_batch=global_batch,
            max_micro_batch=max_micro_batch, gradient_checkpointing=None if allow_gradient_checkpointing else False,
            load_in_4bit=load_in_4bit, attention=attention or "sdpa", save_total_limit=save_total_limit,
            output_dir=output_dir, save_consolidated=save_consolidated,
        )
        if keep_zero_stage is not None:
            job = dataclasses.replace(job, zero_stages=(keep_zero_stage,))
        mplan = plan_memory(job)
    except MemoryPlanError as e:
        raise PlanError(f"--auto: {e}") from None
    where = hardware.describe(world.nnodes, world.procs_per_node)
    if mplan.recommended is None:
        raise PlanError(f"--auto: on {where}: {mplan.reason}{hardware.allocation_hint(mplan)}")
    est = mplan.recommended
    device = "GPU" if hardware.gpu is not None else "per process"
    line = (f"{est.setting.describe()} ({device} {est.as_dict()['gpu_total_gib']} GiB, host "
            f"{est.as_dict()['host_ram_gib_per_node']} GiB per node) on {where}: {mplan.reason}")
    if keep_zero_stage is not None:
        line += f"; ZeRO-{keep_zero_stage} kept: the run being resumed was trained with it"
    return est.setting, line


def make_parser(subparsers=None):
    description = "Print the resolved run plan (world, batch math, ZeRO config) without loading a model; with --model, a memory plan."
    parser = command_parser(subparsers, "plan", description)
    parser.add_argument("--global_batch_size", type=int, default=None)
    parser.add_argument("--per_device_train_batch_size", type=int, default=None,
                        help="micro-batch per process (default 8; with --model: searched, or the largest tried with --auto)")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=None)
    parser.add_argument("--nnodes", type=int, default=None, help="default: from Slurm/torchrun variables")
    parser.add_argument("--nproc_per_node", type=int, default=None,
                        help="default: the node type's GPUs, the GPUs Slurm gave the node, or local GPUs")
    parser.add_argument("--zero_stage", type=int, default=None)
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--deepspeed", default=None)
    parser.add_argument("--precision", default="auto", choices=PRECISIONS)
    parser.add_argument("--output_dir", default="")
    parser.add_argument("--nodes", default=None, metavar="FILE",
                        help="the `llmft node:` lines of every node of the job (slurm/run_llm.slurm runs "
                             "`python -m llmft.planning.allocation` on each): plan with the smallest node's memory, refuse "
                             "GPUs spread unevenly or a fabric a node lacks, and choose the NUMA binding")
    parser.add_argument("--numa_binding", default="auto", help="with --nodes: auto, off, node, socket, exclusive, core-complex")
    parser.add_argument("--print_launch", action="store_true",
                        help="also print the world and CPU split as one 'llmft launch: key=value ...' line (read by slurm/run_llm.slurm)")
    mem = parser.add_argument_group("memory plan (--model)")
    mem.add_argument("--model", default=None, help="model directory, a directory holding only config.json, or a hub id")
    mem.add_argument("--gpu", default=None, help="L4, A100-40GB, A100-80GB, H100-80GB, H200, ... (llmft.planning.hardware.GPUS)")
    mem.add_argument("--gpu_memory_gb", type=float, default=None, help="GPU memory in GiB (an unlisted GPU, or to override)")
    mem.add_argument("--node_type", default=None, help="g2-standard-4, a2-highgpu-8g, g6.12xlarge, p4d.24xlarge, ... (llmft.planning.hardware.NODE_TYPES)")
    mem.add_argument("--host_ram_gb", type=float, default=None, help="host RAM per node in GiB (default: the node type's, or this machine's)")
    mem.add_argument("--max_length", type=int, default=None, help="tokens per sequence (default: TRL's 1024)")
    mem.add_argument("--gradient_checkpointing", default=None, type=lambda v: _bool(v, "--gradient_checkpointing"),
                     help="true/false: only that; default: both tried")
    mem.add_argument("--use_peft", action="store_true", help="LoRA adapters on a frozen model")
    mem.add_argument("--lora_r", type=int, default=None, help="LoRA rank (default: TRL's 16)")
    mem.add_argument("--lora_target_modules", nargs="+", default=None, help="default: PEFT's for the architecture")
    mem.add_argument("--load_in_4bit", action="store_true", help="QLoRA: frozen weights in 4-bit (needs --use_peft)")
    mem.add_argument("--attn_implementation", default=None, choices=["sdpa", "flash_attention_2"], help="default sdpa")
    mem.add_argument("--save_total_limit", type=int, default=None, help="checkpoints kept (checked against --output_dir's free space)")
    mem.add_argument("--save_consolidated", action="store_true", help="count the 16-bit model gathered at the end (ZeRO-3 rows)")
    mem.add_argument("--write_mb_s", type=float, default=None, help="checkpoint write bandwidth, MB/s (default: the provider's shared filesystem in llmft's blueprints)")
    mem.add_argument("--mfu", type=float, default=None, help="model FLOPs utilisation for the tokens/s estimate (default 0.35)")
    mem.add_argument("--check_memory", action="store_true",
                     help="print the run plan (as without --model) and check that its setting fits this job's GPUs and "
                          "host memory; exit 2 naming the limit when it does not (slurm/run_llm.slurm runs it)")
    mem.add_argument("--auto", action="store_true", help="what `llmft train --auto` picks: micro-batches up to --per_device_train_batch_size")
    mem.add_argument("--json", action="store_true", help="print the plan as JSON")
    mem.add_argument("--write", default=None, metavar="DIR", help="write the recommended DeepSpeed config and sbatch line to DIR")
    mem.add_argument("--trust_remote_code", action="store_true")
    run = parser.add_argument_group("the data and length of the run (--model; in the --write sbatch line)")
    run.add_argument("--dataset_name", default=None, help="your data (.jsonl, ...): its fit against --max_length is counted")
    run.add_argument("--prompt_column", default=None)
    run.add_argument("--completion_column", default=None)
    run.add_argument("--messages_column", default=None)
    run.add_argument("--dataset_text_field", default=None)
    run.add_argument("--data_percentage", type=float, default=100.0, help="default 100 (all of it)")
    run.add_argument("--num_train_epochs", type=float, default=3.0, help="default 3 (llmft train's)")
    run.add_argument("--max_steps", type=int, default=None)
    parser.set_defaults(func=main)
    return parser


def _bool(value: str, flag: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    import argparse

    raise argparse.ArgumentTypeError(f"{flag} takes true or false, not {value!r}")


MEMORY_ONLY = ("gpu", "gpu_memory_gb", "node_type", "host_ram_gb", "max_length", "gradient_checkpointing", "use_peft",
               "lora_r", "lora_target_modules", "load_in_4bit", "attn_implementation", "save_total_limit",
               "save_consolidated", "write_mb_s", "mfu", "auto", "json", "write", "trust_remote_code", "dataset_name",
               "prompt_column", "completion_column", "messages_column", "dataset_text_field", "max_steps",
               "check_memory")


def main(args) -> int:
    from llmft.planning.memory import MemoryPlanError
    from llmft.planning.allocation import AllocationError

    try:
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
            rc, world = memory_main(args, world)
            if rc == 0 and not args.json:
                print_launch_lines(world, args.print_launch, launch_extra)
            return rc
        given = [f"--{name}" for name in MEMORY_ONLY if getattr(args, name) is not None and getattr(args, name) is not False
                 or name == "gradient_checkpointing" and args.gradient_checkpointing is False]
        if args.check_memory and (args.auto or args.json or args.write):
            raise PlanError("--check_memory checks the setting given; --auto, --json and --write belong to the memory plan: "
                            "drop --check_memory or them")
        if given and not args.model:
            raise PlanError(f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} --model (a memory plan)")
        # Planning on a login node: say what the GPU nodes will pick (llmft.planning.hardware.choose_precision's rule).
        precision = AUTO_PRECISION if args.precision == "auto" else args.precision
        plan = make_plan(
            micro_batch=8 if args.per_device_train_batch_size is None else args.per_device_train_batch_size,  # HF default
            global_batch=args.global_batch_size,
            grad_accum=args.gradient_accumulation_steps,
            zero_stage=args.zero_stage,
            offload=args.offload,
            deepspeed=args.deepspeed,
            precision=precision,
            output_dir=args.output_dir,
            world=world,
        )
        print("\n".join(plan.lines()))
        if args.check_memory:
            lines, error = check_memory(args, plan)
            for line in lines:
                print(line)
            if error:
                raise PlanError(error)
        print_launch_lines(plan.world, args.print_launch, launch_extra)
    except (PlanError, LaunchEnvError, HardwareError, MemoryPlanError, AllocationError) as e:
        print(f"llmft plan: error: {e}", file=sys.stderr)
        return 2
    return 0


def apply_node_facts(path: str, numa_request: str) -> dict[str, str]:
    """--nodes FILE: plan with the smallest node's memory (LLMFT_HOST_RAM_GB for this process, and for the training
    processes through the launch line), after checking the nodes agree; the NUMA binding for torchrun."""
    import os

    from llmft.planning.allocation import AllocationError, job_nodes, numa_binding, parse_node_lines

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
    print(f"llmft plan: nodes: {len(nodes)} x {nodes[0].gpus} GPU(s); memory the job may use: {per_node}; "
          f"planning with {memory.gib:g} GiB per node")
    print(f"llmft plan: NUMA binding {why}")
    return {"host_ram_gb": f"{memory.gib:g}", "numa_binding": mode or "off"}


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
    return (f"llmft launch: nnodes={world.nnodes} nproc_per_node={world.procs_per_node} cpus_per_node={split.cpus_per_node} "
            f"omp_num_threads={split.threads_per_process} dataloader_num_workers={split.dataloader_workers} "
            f"dataset_num_proc={split.dataset_num_proc}")


if __name__ == "__main__":
    sys.exit(main(make_parser().parse_args()))

"""The run plan: world, micro-batch, accumulation, global batch, ZeRO config and precision, before any model loads.

`llmft train` computes it in every process (`make_plan`, and `auto_choice` for --auto); `llmft plan` prints it on
a login node or in a batch script's first lines, so a user sees (and a bad knob fails) before GPUs are spent.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

from llmft.errors import LlmftError
from llmft.planning import comm, memory
from llmft.planning.batch import BatchError, BatchPlan, plan_batch
from llmft.planning.ds_config import DSConfigError, load_config, offload_mode, offloads, template_path, zero_stage_of
from llmft.planning.hardware import (
    GPU,
    choose_liger,
    gpu_by_name,
    liger_model_types,
    local_gpu,
    local_host_memory,
    node_type_by_name,
)
from llmft.planning.memory import GIB, MemoryPlanError, plan_with_savers
from llmft.planning.model_shape import cap_max_length, load_model_config, model_shape
from llmft.planning.preference import plan_with_reference
from llmft.planning.sequence_parallel import Layout, SequenceParallelError, plan_layout
from llmft.planning.world import LaunchEnvError, World, discover_world


class PlanError(LlmftError, ValueError):
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
    sequence_parallel: int = 1  # --sequence_parallel N: batch.world_size counts the data-parallel ranks

    def lines(self) -> list[str]:
        b = self.batch
        layout = []
        ranks = f"world size {b.world_size}"
        if self.sequence_parallel > 1:
            layout = [f"llmft plan: {Layout(self.world.world_size, self.sequence_parallel).line()}"]
            ranks = f"data-parallel size {b.world_size}"
        offload = {
            "none": "",
            "optimizer": " with CPU offload (optimizer)",
            "optimizer+params": " with CPU offload (optimizer and parameters)",
        }[self.offload_mode]
        auto = [f"llmft plan: auto: {self.auto}"] if self.auto else []
        return auto + [
            f"llmft plan: {self.world.describe()}",
            *layout,
            f"llmft plan: micro-batch {b.micro_batch} per process",
            f"llmft plan: gradient accumulation {b.grad_accum}",
            f"llmft plan: global batch {b.global_batch} = micro-batch {b.micro_batch} x accumulation {b.grad_accum} x {ranks}",
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
    sequence_parallel: int = 1,
) -> RunPlan:
    """Check everything that can be checked without a model; raise PlanError naming the fix. Under sequence
    parallelism the batch is planned over the data-parallel ranks (a group of N trains the same samples)."""
    try:
        world = world or discover_world()
        layout = plan_layout(world.world_size, sequence_parallel)
        batch = plan_batch(layout.data_parallel, micro_batch, global_batch, grad_accum)
        path = template_path(zero_stage, offload, deepspeed)
        config = load_config(path)
    except (BatchError, DSConfigError, LaunchEnvError, SequenceParallelError) as e:
        raise PlanError(str(e)) from None
    return RunPlan(
        world,
        batch,
        path,
        zero_stage_of(config),
        offloads(config),
        precision,
        output_dir,
        offload_mode(config),
        auto,
        sequence_parallel,
    )


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
    cpus_per_node: int | None = (
        None  # a catalogue node type's vCPUs; None: this job's (llmft.planning.world.discover_cpus)
    )

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

        limit = mplan.job.device_gib
        gpu_fits = [c for c in mplan.candidates if limit is None or c.gpu_total <= limit * GIB]
        if not gpu_fits:
            return ""
        need = math.ceil(min(c.host["peak"] for c in gpu_fits) / GIB)
        if self.node_ram_gib is not None and need > self.node_ram_gib:
            return ""  # the whole node is too small: the plan's own message says what else to change
        return (
            f"; the job's allocation is the limit ({self.host_ram_source}): ask Slurm for {need} GiB per node "
            f"with sbatch --mem={need}G (or --mem=0 for the whole node)"
        )


def resolve_hardware(
    gpu: str | None = None,
    gpu_memory_gb: float | None = None,
    node_type: str | None = None,
    host_ram_gb: float | None = None,
) -> Hardware:
    """A catalogue node type, a GPU (by name or memory) with the host RAM given, or this machine."""

    if node_type:
        node = node_type_by_name(node_type)
        if gpu and gpu_by_name(gpu) != node.gpu:
            raise PlanError(
                f"--gpu {gpu} contradicts --node_type {node.name}, which has {node.gpu.name}; give one of them"
            )
        return Hardware(
            node.gpu,
            node.gpu.memory_gib if gpu_memory_gb is None else gpu_memory_gb,
            node.host_ram_gib if host_ram_gb is None else host_ram_gb,
            node.gpus,
            node.provider,
            node.name,
            cpus_per_node=node.vcpus,
        )
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


def memory_job(
    shape,
    hardware: Hardware,
    world: World,
    *,
    max_length: int,
    precision: str,
    global_batch: int | None = None,
    micro_batch: int | None = None,
    max_micro_batch: int | None = None,
    grad_accum: int | None = None,
    gradient_checkpointing: bool | None = None,
    zero_stage: int | None = None,
    offload: bool | str | None = None,
    deepspeed: str | None = None,
    load_in_4bit: bool = False,
    attention: str = "sdpa",
    save_total_limit: int | None = None,
    output_dir: str | None = None,
    write_mb_s: float | None = None,
    mfu: float | None = None,
    save_consolidated: bool = False,
    async_save: bool = False,
    nccl_profile: str | None = None,
    sequence_parallel: int = 1,
    tiled_mlp: bool | None = False,
    activation_offloading: bool | None = False,
    liger: bool = False,
    method: str = "sft",
    precompute_ref_log_probs: bool = False,
):
    """The llmft.planning.memory Job for this model, hardware and run knobs (stage/offload restricted when given);
    method: llmft train --method; the reference precomputed if asked, else llmft.planning.preference chooses;
    nccl_profile: slurm/run_llm.slurm's NCCL_PROFILE, which decides the network a fabric node reaches.
    tiled_mlp, activation_offloading: None lets the planner switch them on when nothing fits without them
    (activation offloading only on GPUs: CPU processes hold activations in host memory already)."""

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
        shape=shape,
        gpu=hardware.gpu,
        host_ram_gib=hardware.host_ram_gib,
        nnodes=world.nnodes,
        nproc_per_node=world.procs_per_node,
        max_length=max_length,
        precision=precision,
        global_batch=global_batch,
        micro_batch=micro_batch,
        max_micro_batch=max_micro_batch,
        grad_accum=grad_accum,
        gpu_memory_gib=hardware.gpu_memory_gib,
        gradient_checkpointing=gradient_checkpointing,
        zero_stages=stages,
        offloads=offload_modes,
        load_in_4bit=load_in_4bit,
        attention=attention,
        zero_config=zero_config,
        save_total_limit=save_total_limit,
        free_disk_gib=free,
        write_mb_s=memory.WRITE_MB_S.get(hardware.provider, memory.WRITE_MB_S[None])
        if write_mb_s is None
        else write_mb_s,
        mfu=memory.DEFAULT_MFU if mfu is None else mfu,
        save_consolidated=save_consolidated,
        async_save=async_save,
        network=comm.node_network(hardware.node_type, nccl_profile) if hardware.node_type else None,
        sequence_parallel=sequence_parallel,
        tiled_mlps=(False, True) if tiled_mlp is None else (tiled_mlp,),
        activation_offloads=((False, True) if hardware.gpu is not None else (False,))
        if activation_offloading is None
        else (activation_offloading,),
        liger=liger,
        method=method,
        reference="precomputed" if precompute_ref_log_probs else None,
    )


def planned_liger(requested: bool | None, gpu: GPU | None, model_type: str) -> bool:
    """Whether the planned run uses Liger's kernels, which keep fewer activations: as asked (llmft train refuses
    what cannot run), else as llmft train decides (llmft.planning.hardware.choose_liger) with this machine's
    liger-kernel; a plan made where it is not installed counts the kernels only when asked."""
    if requested is not None:
        return requested
    return choose_liger(None, gpu, model_type, liger_model_types() if gpu is not None else None)[0]


def run_estimate(
    model: str,
    plan: RunPlan,
    gpu: GPU | None,
    *,
    gradient_checkpointing: bool,
    max_length: int,
    use_peft: bool,
    lora_r: int,
    lora_target_modules,
    load_in_4bit: bool,
    attention: str | None,
    deepspeed: str | None,
    tiled_mlp: bool,
    activation_offloading: bool,
    use_liger_kernel: bool | None,
    trust_remote_code: bool = False,
    method: str = "sft",
    precompute_ref_log_probs: bool = False,
) -> tuple[memory.Estimate, float | None]:
    """The planner's estimate for a run whose setting is chosen (the plan's stage, offload, micro-batch and
    accumulation) on this machine's RAM and `gpu` (the process's own, llmft.planning.hardware.local_gpu), with or
    without recomputation; and the GPU's usable GiB (None on CPU). llmft train's defaults ask it
    (llmft.planning.speed_defaults); PlanError when no estimate can be made."""
    hardware = resolve_hardware()
    if gpu != hardware.gpu:  # the GPU the caller decides for (tests drive an L4, A100, H100 and T4 from a CPU)
        hardware = dataclasses.replace(hardware, gpu=gpu, gpu_memory_gib=gpu.memory_gib if gpu else None)
    try:
        config = load_model_config(model, trust_remote_code)
        max_length, _ = cap_max_length(config, max_length)
        shape = model_shape(config, use_peft=use_peft, lora_r=lora_r, lora_target_modules=lora_target_modules)
        b = plan.batch
        job = memory_job(
            shape,
            hardware,
            plan.world,
            max_length=max_length,
            precision=plan.precision,
            global_batch=b.global_batch,
            micro_batch=b.micro_batch,
            grad_accum=b.grad_accum,
            gradient_checkpointing=gradient_checkpointing,
            zero_stage=None if deepspeed else plan.zero_stage,
            offload=None if deepspeed else plan.offload_mode,
            deepspeed=deepspeed,
            load_in_4bit=load_in_4bit,
            attention=attention or "sdpa",
            sequence_parallel=plan.sequence_parallel,
            tiled_mlp=tiled_mlp,
            activation_offloading=activation_offloading,
            liger=planned_liger(use_liger_kernel, hardware.gpu, config.model_type),
            method=method,
            precompute_ref_log_probs=precompute_ref_log_probs,
        )
        mplan = memory.plan_memory(job)  # the reference as llmft train holds it (precomputed only when asked)
    except MemoryPlanError as e:
        raise PlanError(str(e)) from None
    [est] = [c for c in mplan.candidates if c.setting.micro_batch == b.micro_batch] or mplan.candidates[:1]
    return est, job.device_gib


def auto_choice(
    model: str,
    world: World,
    *,
    precision: str,
    max_micro_batch: int,
    global_batch: int | None,
    grad_accum: int | None,
    max_length: int,
    use_peft: bool,
    lora_r: int,
    lora_target_modules,
    allow_gradient_checkpointing: bool,
    save_total_limit: int | None,
    output_dir: str,
    attention: str | None,
    load_in_4bit: bool,
    save_consolidated: bool,
    trust_remote_code: bool = False,
    async_save: bool = False,
    keep_zero_stage: int | None = None,
    sequence_parallel: int = 1,
    tiled_mlp: bool | None = None,
    activation_offloading: bool | None = None,
    use_liger_kernel: bool | None = None,
    method: str = "sft",
    precompute_ref_log_probs: bool = False,
):
    """`llmft train --auto`: the memory planner's recommendation for this machine's GPUs and RAM (every rank
    computes the same answer: run_llm.slurm exports the smallest node's allocation as LLMFT_HOST_RAM_GB).
    keep_zero_stage: a resumed run's stage (its checkpoints load only under it); offload and batch stay free.
    tiled_mlp, activation_offloading: True when asked for; None lets the planner turn them on when the sequence
    does not fit without them. method, precompute_ref_log_probs: a preference method's reference is planned as
    llmft.planning.preference chooses (the Setting's precompute_ref_log_probs says when it chose to precompute).
    Returns (Setting, one line saying what was chosen and why); PlanError when nothing fits."""

    hardware = resolve_hardware()
    try:
        config = load_model_config(model, trust_remote_code)
        max_length, _ = cap_max_length(config, max_length)  # llmft train caps it the same way
        shape = model_shape(config, use_peft=use_peft, lora_r=lora_r, lora_target_modules=lora_target_modules)
        if global_batch is None:
            global_batch = max_micro_batch * (grad_accum or 1) * (world.world_size // max(1, sequence_parallel))
        job = memory_job(
            shape,
            hardware,
            world,
            max_length=max_length,
            precision=precision,
            global_batch=global_batch,
            max_micro_batch=max_micro_batch,
            gradient_checkpointing=None if allow_gradient_checkpointing else False,
            load_in_4bit=load_in_4bit,
            attention=attention or "sdpa",
            save_total_limit=save_total_limit,
            output_dir=output_dir,
            save_consolidated=save_consolidated,
            async_save=async_save,
            sequence_parallel=sequence_parallel,
            tiled_mlp=tiled_mlp,
            activation_offloading=activation_offloading,
            liger=planned_liger(use_liger_kernel, hardware.gpu, config.model_type),
            method=method,
            precompute_ref_log_probs=precompute_ref_log_probs,
        )
        if keep_zero_stage is not None:
            job = dataclasses.replace(job, zero_stages=(keep_zero_stage,))
        job, mplan, advice = plan_with_reference(job, plan_with_savers)
    except MemoryPlanError as e:
        raise PlanError(f"--auto: {e}") from None
    where = hardware.describe(world.nnodes, world.procs_per_node)
    if mplan.recommended is None:
        raise PlanError(f"--auto: on {where}: {mplan.reason}{hardware.allocation_hint(mplan)}")
    est = mplan.recommended
    device = "GPU" if hardware.gpu is not None else "per process"
    line = (
        f"{est.setting.describe()} ({device} {est.as_dict()['gpu_total_gib']} GiB, host "
        f"{est.as_dict()['host_ram_gib_per_node']} GiB per node) on {where}: {mplan.reason}"
    )
    if keep_zero_stage is not None:
        line += f"; ZeRO-{keep_zero_stage} kept: the run being resumed was trained with it"
    if advice.line:
        line += "; " + advice.line.removeprefix("llmft plan: ")
    return est.setting, line

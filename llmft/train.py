"""Fine-tuning with TRL's trainers on DeepSpeed ZeRO, with llmft's batch math and checkpoint safety: SFTTrainer by
default, DPOTrainer, KTOTrainer or RewardTrainer with `--method dpo|kto|reward` (llmft.planning.methods: the method's
TRL config is the parser's, its trainer runs with llmft's checkpoint mixin, and TRL tokenises its pairs).

# One process (CPU or one GPU)
```bash
llmft train --model_name_or_path gpt2 --dataset_name data.jsonl --output_dir runs/gpt2-sft \
    --global_batch_size 32 --per_device_train_batch_size 4 --zero_stage 2 --num_train_epochs 3
```

# Several processes: llmft keeps the global batch and derives the accumulation
```bash
torchrun --nproc_per_node 4 -m llmft.train --model_name_or_path meta-llama/Llama-3.1-8B \
    --dataset_name data.jsonl --output_dir runs/llama --global_batch_size 64 \
    --per_device_train_batch_size 2 --zero_stage 3 --gradient_checkpointing --report_to wandb
```

# LoRA, packing, and a YAML file holding any of the flags (command-line flags win)
```bash
llmft train --config run.yaml --use_peft --lora_r 16 --lora_alpha 32 --lora_target_modules q_proj v_proj --packing
```

# Let the memory planner pick stage, offload, micro-batch and recomputation for this job's GPUs
```bash
torchrun --nproc_per_node 4 -m llmft.train --model_name_or_path meta-llama/Llama-3.1-8B --dataset_name data.jsonl \
    --output_dir runs/llama --global_batch_size 64 --per_device_train_batch_size 8 --max_length 2048 --auto
```

# Direct preference optimisation on {"prompt", "chosen", "rejected"} records (TRL's flags keep TRL's names)
```bash
llmft train --method dpo --model_name_or_path runs/sft --dataset_name pairs.jsonl --output_dir runs/dpo --beta 0.1
```

Every flag of the method's TRL config (`SFTConfig`, `DPOConfig`, ...) and `TrainingArguments` takes effect with TRL's
names, or stops the run saying why (llmft/training/flag_policy.py lists each); another method's flag is refused. llmft adds `--zero_stage`, `--offload`, `--auto`,
`--global_batch_size`, `--data_percentage`, `--precision`, `--save_consolidated` and column mapping. Weights
load in the training precision (bf16 on Ampere+ GPUs) unless `--dtype` says otherwise. A rerun with the same `--output_dir` resumes from
the newest complete checkpoint of the same run (llmft_run.json), on any number of GPUs (llmft.training.elastic);
a different run there is refused. Started without torchrun on a machine with several GPUs, it stops and
prints the torchrun command.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import re
import socket
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from llmft.checkpoint import run_dir
from llmft.command import exit_process, report_error
from llmft.data import loading as data
from llmft.data import pairs
from llmft.data.cache import DataOptions, Prepared, check_options, prepare, write_run_record
from llmft.data.method_data import check_method_options, check_records_fit, first_record_columns
from llmft.data.mixture import mixture_fingerprint, read_mixture
from llmft.data.padding import padding_report, prepared_lengths
from llmft.errors import LlmftError, TrainError
from llmft.planning import ds_config, methods, sequence_parallel, stop_request, world
from llmft.planning.hardware import choose_attention, choose_liger, flash_attn_installed, liger_model_types, local_gpu
from llmft.planning.memory import estimated_save_s
from llmft.planning.model_shape import cap_max_length, model_positions, model_shape
from llmft.planning.op_prebuild import deepspeed_arch_list
from llmft.planning.qlora import QuantRequest, bitsandbytes_version, choose_quantization, recorded_settings
from llmft.planning.run_plan import PlanError, RunPlan, auto_choice, make_plan, run_estimate
from llmft.planning.speed_defaults import choose_recomputation, choose_torch_compile
from llmft.planning.world import LaunchEnvError, discover_world, launch_problem, log, rank0
from llmft.training import (
    build_locks,
    checkpoint_async_save,
    checkpoint_checks,
    checkpoint_save,
    elastic,
    garbage_collection,
    host_memory,
    job_deadline,
    launcher,
    metrics,
    packing,
    process_group_timeout,
    profile_step,
    reference,
    rerun,
    run_identity,
    tiled_mlp,
    ulysses,
    upstream_noise,
)
from llmft.training.arguments import LlmftArguments
from llmft.training.callbacks import checkpoint_callbacks, compile_report
from llmft.training.deepspeed_env import (
    defer_deepspeed_compile_decorators,
    single_process_defaults,
    skip_deepspeed_shm_op,
    use_proc_cpuinfo_for_deepspeed,
)
from llmft.training.flags import (
    TrainParser,
    check_flags,
    check_method_features,
    check_profile_step,
    import_class,
    method_argument,
    parse_train_flags,
)
from llmft.training.metrics import log_perplexity
from llmft.training.model_files import (
    ModelFiles,
    check_model_task,
    load_model_files,
    model_init_kwargs,
    train_precision,
    trainer_arguments,
    with_checkpointing,
)
from llmft.training.stage_weights import restore_source_name, stage_weights
from llmft.training.wandb_env import guard_wandb


@dataclass(frozen=True)
class RunSettings:
    """What the user asked for: TRL's three argument objects and llmft's, as parsed. Steps that decide something
    (--auto's gradient checkpointing, the capped max_length) return a new RunSettings; nothing mutates one."""

    script: object  # trl.ScriptArguments
    training: object  # trl.SFTConfig
    model: object  # trl.ModelConfig
    llmft: LlmftArguments
    # flags not given, which llmft then decides by the measurements (llmft.planning.speed_defaults):
    # "gradient_checkpointing", "torch_compile"
    llmft_decides: frozenset = frozenset()

    @classmethod
    def from_flags(cls, script, training, model, llmft) -> RunSettings:
        """The parsed flags, with the speed flags that were not given (TrainParser records which) left to llmft."""
        given = getattr(training, "llmft_speed_flags_given", {})
        return cls(script, training, model, llmft, frozenset(flag for flag, was in given.items() if not was))

    def with_training(self, **changes) -> RunSettings:
        training = self.training
        if "gradient_checkpointing" in changes:  # see with_checkpointing: both names or the copy undoes it
            training = with_checkpointing(training, changes.pop("gradient_checkpointing"))
        return dataclasses.replace(self, training=dataclasses.replace(training, **changes) if changes else training)


@dataclass(frozen=True)
class Decisions:
    """What llmft decided before loading anything large: precision, the run plan, the optimizer, QLoRA, the data."""

    cuda: bool
    gpu: object  # llmft.planning.hardware.GPU or None
    precision: str
    plan: RunPlan
    ds_template: dict
    quantization: dict | None
    data_options: DataOptions


@dataclass(frozen=True)
class ResumeDecision:
    """Where the run starts: a checkpoint to resume (perhaps on another world size) or nothing; or nothing to do."""

    checkpoint: Path | None
    identity: dict
    elastic_resume: object | None  # llmft.training.elastic.Resume
    finished: str | None  # the line saying the run is already complete
    schedule_changes: tuple[str, ...] = ()  # schedule flags changed since the checkpoint (llmft.training.rerun)


def main(script_args, training_args, model_args, llmft_args) -> int:
    """`llmft train` after its flags are parsed: the one-line error of any LlmftError, exit code 2."""
    try:
        return train(RunSettings.from_flags(script_args, training_args, model_args, llmft_args))
    except LlmftError as e:
        return report_error("train", e)


def train(run: RunSettings) -> int:
    """The training path, as named steps; `clock` attributes start-up time to imports, loading, data and DeepSpeed."""
    clock = metrics.StartupClock()  # everything before this point was interpreter start-up and imports
    clock.add("import", clock.elapsed())
    with clock.phase("import"):
        import torch

    with clock.phase("model_load"):
        run = start_from_sft_model(run)
    run, decided = check_run(run, cuda=torch.cuda.is_available(), gpu=local_gpu())
    with clock.phase("model_load"):
        files = stage_model_weights(load_model_files(run.model, run.training), decided)
    resume = decide_resume(run, decided)
    if resume.finished:
        log(resume.finished)
        return 0
    decided = announce_plan(run, decided, resume, files.config)
    run, attention = choose_model_settings(run, decided, files.config)
    with clock.phase("data"):
        prepared = prepare_data(run, decided, files)
    run = choose_compile_default(run, decided, resume, files.config, len(prepared.train))
    resolved = write_deepspeed_config(run, decided, resume, files.config)
    with clock.phase("import"):
        prepare_process()
    upstream_noise.quiet_accumulation_mismatch(
        decided.plan.batch.grad_accum
    )  # the Trainer gives accelerate 1 by design
    with clock.phase("deepspeed_init"):
        trainer, callbacks = build_trainer(run, decided, resume, files, prepared, resolved, attention, clock)
    garbage_collection.resume_after_startup()
    with training_recorded(run):
        result = trainer.train(resume_from_checkpoint=trainer.args.resume_from_checkpoint)
        return finish(run, decided, trainer, callbacks, prepared, result)


def stop_file(run: RunSettings) -> str:
    """The stop file every rank polls (llmft.planning.stop_request.stop_file): the flag's, the job's, or the run's."""
    return stop_request.stop_file(run.llmft.stop_file, os.environ, run.training.output_dir)


@contextlib.contextmanager
def training_recorded(run: RunSettings):
    """While the run trains, its directory says where a stop request goes (`llmft stop RUN_DIR` reads it); written
    once training starts, so a run refused before then (bad data, a plan that does not fit) writes nothing."""
    if rank0():
        stop_request.record_training(run.training.output_dir, stop_file(run), os.environ)
    try:
        yield
    finally:
        if rank0():
            stop_request.forget_training(run.training.output_dir)


def check_run(run: RunSettings, *, cuda: bool, gpu) -> tuple[RunSettings, Decisions]:
    """Every check that needs no model: required flags, flag policy, precision, batch math (or --auto), the DeepSpeed
    template and optimizer, QLoRA, data options. A bad knob fails here, before anything large loads."""
    script, training, model, extra = run.script, run.training, run.model, run.llmft
    if not model.model_name_or_path:
        raise TrainError("--model_name_or_path is required (a hub name or a local model directory)")
    if not script.dataset_name and not extra.dataset_mixture:
        raise TrainError(
            "--dataset_name (or --dataset_mixture) is required (a .jsonl/.json/.parquet/.csv file or directory, or a hub dataset)"
        )
    entry = methods.method(extra.method)
    check_flags(script, training, model, cuda=cuda, method_name=entry.name)
    check_method_features(extra, entry)
    check_profile_step(extra.profile_step, training.max_steps)
    precision = train_precision(training, extra, gpu)
    grad_accum = training.gradient_accumulation_steps if training.gradient_accumulation_steps != 1 else None
    micro, zero_stage, offload, auto_line = training.per_device_train_batch_size, extra.zero_stage, extra.offload, ""
    if extra.auto:
        setting, auto_line = choose_automatically(run, precision, grad_accum)
        micro, zero_stage, offload, grad_accum = (
            setting.micro_batch,
            setting.zero_stage,
            setting.offload,
            setting.grad_accum,
        )
        run = run.with_training(
            gradient_checkpointing=setting.gradient_checkpointing, activation_offloading=setting.activation_offloading
        )
        if setting.precompute_ref_log_probs:  # the planner fits the job only without the copy
            run = run.with_training(precompute_ref_log_probs=True)
        run = dataclasses.replace(run, llmft=dataclasses.replace(extra, tiled_mlp=setting.tiled_mlp))
    plan = make_plan(
        micro_batch=micro,
        global_batch=extra.global_batch_size,
        grad_accum=grad_accum,
        zero_stage=zero_stage,
        offload=offload,
        deepspeed=training.deepspeed,
        precision=precision,
        output_dir=training.output_dir,
        auto=auto_line,
        sequence_parallel=extra.sequence_parallel,
    )
    if not extra.auto:  # --auto chose recomputation with the rest of the setting
        run = choose_recomputation_default(run, plan, gpu)
    if extra.save_consolidated and (plan.zero_stage != 3 or model.use_peft):
        raise TrainError(
            "--save_consolidated gathers a ZeRO-3 model at the end; "
            + (
                "a LoRA run saves its adapter (llmft export RUN --out DIR writes a merged model)"
                if model.use_peft
                else f"under ZeRO-{plan.zero_stage} the final model is written whole already"
            )
        )
    template = ds_config.choose_optimizer(
        ds_config.load_config(plan.ds_template),
        training.optim,
        optim_args=training.optim_args,
        user_config=training.deepspeed is not None,
    )
    quantization = choose_quantization(
        QuantRequest.from_model_args(model),
        gpu=gpu,
        zero_stage=plan.zero_stage,
        offload=plan.offload,
        use_peft=model.use_peft,
        precision=precision,
        bitsandbytes=bitsandbytes_version(),
    )
    data_options = DataOptions.from_args(script, run.training, extra)
    check_options(data_options, training.eval_strategy, getattr(training, "dataset_kwargs", None))
    check_method_options(entry, data_options)
    return run, Decisions(cuda, gpu, precision, plan, template, quantization, data_options)


def planned_estimate(run: RunSettings, plan: RunPlan, gpu, gradient_checkpointing: bool):
    """The planner's estimate for this run's own setting on this machine's GPU and RAM
    (llmft.planning.run_plan.run_estimate), and the GPU's usable GiB."""
    training, model = run.training, run.model
    return run_estimate(
        model.model_name_or_path,
        plan,
        gpu,
        gradient_checkpointing=gradient_checkpointing,
        max_length=training.max_length or 1024,
        use_peft=model.use_peft,
        lora_r=model.lora_r,
        lora_target_modules=model.lora_target_modules,
        load_in_4bit=model.load_in_4bit,
        attention=model.attn_implementation,
        deepspeed=training.deepspeed,
        tiled_mlp=bool(run.llmft.tiled_mlp),
        activation_offloading=bool(training.activation_offloading),
        use_liger_kernel=True
        if training.liger_kernel_config and training.use_liger_kernel is None
        else training.use_liger_kernel,
        trust_remote_code=training.trust_remote_code,
        method=methods.method(run.llmft.method).name,
        precompute_ref_log_probs=bool(getattr(training, "precompute_ref_log_probs", False)),
    )


def choose_recomputation_default(run: RunSettings, plan: RunPlan, gpu) -> RunSettings:
    """Gradient checkpointing when --gradient_checkpointing is not given: off on a GPU where the planner says this
    run fits without it (llmft.planning.speed_defaults.choose_recomputation), said in one line."""
    requested = None if "gradient_checkpointing" in run.llmft_decides else bool(run.training.gradient_checkpointing)
    fits = needs = has = None
    if requested is None and gpu is not None:
        try:
            est, has = planned_estimate(run, plan, gpu, gradient_checkpointing=False)
            fits, needs = est.fits, est.gpu_total / 2**30
        except PlanError as e:
            log(f"gradient checkpointing: no memory plan for this run ({e}); keeping TRL's default")
    on, why = choose_recomputation(requested, gpu, fits, needs, has)
    if why:
        log(why)
    return run.with_training(gradient_checkpointing=on) if on != bool(run.training.gradient_checkpointing) else run


def choose_compile_default(run: RunSettings, decided: Decisions, resume, model_config, rows: int) -> RunSettings:
    """torch.compile when --torch_compile is not given: on where it was measured and this run is planned to train
    long enough to repay its compile (llmft.planning.speed_defaults.choose_torch_compile), said in one line."""
    training, plan = run.training, decided.plan
    requested = None if "torch_compile" in run.llmft_decides else bool(training.torch_compile)

    def planned_train_s() -> float | None:
        b = plan.batch
        steps = (
            training.max_steps
            if training.max_steps > 0
            else math.ceil(training.num_train_epochs * rows / b.global_batch)
        )
        done = re.fullmatch(r"checkpoint-(\d+)", resume.checkpoint.name) if resume.checkpoint else None
        steps -= int(done.group(1)) if done else 0
        try:
            est, _ = planned_estimate(run, plan, decided.gpu, bool(training.gradient_checkpointing))
        except PlanError:
            return None
        if not est.tokens_per_s:
            return None
        return max(steps, 0) * b.global_batch * (training.max_length or 1024) / est.tokens_per_s

    layers = getattr(model_config, "num_hidden_layers", None) or getattr(model_config, "n_layer", None) or 1
    on, why = choose_torch_compile(
        requested,
        decided.gpu,
        packing=bool(getattr(training, "packing", False)),
        zero_stage=plan.zero_stage,
        use_peft=bool(run.model.use_peft),
        sequence_parallel=run.llmft.sequence_parallel,
        layers=layers,
        planned_train_s=planned_train_s,
    )
    if why:
        log(why)
    return run.with_training(torch_compile=on) if on != bool(training.torch_compile) else run


def choose_automatically(run: RunSettings, precision: str, grad_accum: int | None):
    """--auto: llmft.planning.run_plan.auto_choice for this job's world, GPUs and RAM; refuses the flags it would override."""
    training, model, extra = run.training, run.model, run.llmft
    if extra.zero_stage is not None or extra.offload or training.deepspeed:
        raise TrainError(
            "--auto chooses the ZeRO stage and offload itself: drop --zero_stage/--offload/--deepspeed, or --auto"
        )
    # A rerun continues the run in --output_dir: its checkpoints load only under the stage they were written with.
    record = (
        run_identity.read_record(training.output_dir) if run_identity.has_training_state(training.output_dir) else None
    )
    keep = record.get("zero_stage") if record else None
    return auto_choice(
        model.model_name_or_path,
        discover_world(),
        precision=precision,
        max_micro_batch=training.per_device_train_batch_size,
        global_batch=extra.global_batch_size,
        grad_accum=grad_accum,
        max_length=training.max_length or 1024,
        use_peft=model.use_peft,
        lora_r=model.lora_r,
        lora_target_modules=model.lora_target_modules,
        allow_gradient_checkpointing=bool(training.gradient_checkpointing),
        save_total_limit=training.save_total_limit,
        output_dir=training.output_dir,
        attention=model.attn_implementation,
        load_in_4bit=model.load_in_4bit,
        save_consolidated=extra.save_consolidated,
        trust_remote_code=training.trust_remote_code,
        keep_zero_stage=keep if isinstance(keep, int) else None,
        async_save=extra.async_save,
        sequence_parallel=extra.sequence_parallel,
        tiled_mlp=True if extra.tiled_mlp else None,
        activation_offloading=True if training.activation_offloading else None,
        method=methods.method(extra.method).name,
        precompute_ref_log_probs=bool(getattr(training, "precompute_ref_log_probs", False)),
        use_liger_kernel=True
        if training.liger_kernel_config and training.use_liger_kernel is None
        else training.use_liger_kernel,
    )


def start_from_sft_model(run: RunSettings) -> RunSettings:
    """--model_name_or_path naming an SFT LoRA adapter (an SFT run's output, one of its checkpoints, an exported
    adapter): the run starts from that SFT model, base + adapter merged once into llmft's cache
    (llmft.training.reference.merged_sft_model), loaded as the base. A new LoRA adapter trains on top of it, so the
    reference with the adapter disabled is the SFT model, never the bare base; a full fine-tune's reference copy is
    the SFT model too."""
    adapter = reference.sft_adapter_source(run.model.model_name_or_path)
    if adapter is None:
        return run
    merged = reference.merged_sft_model(adapter, trust=bool(run.training.trust_remote_code), rank0=rank0(), log=log)
    model = copy.copy(run.model)  # not dataclasses.replace: ModelConfig's __post_init__ rewrites some fields
    model.model_name_or_path = str(merged)
    return dataclasses.replace(run, model=model)


def stage_model_weights(files: ModelFiles, decided: Decisions) -> ModelFiles:
    """Under ZeRO-0/1/2 every process loads the whole model: from shared storage it is copied to node-local disk once
    per node first (llmft.training.stage_weights), and every process loads the copy."""
    if decided.plan.zero_stage >= 3:
        return files
    return files._replace(
        weights=stage_weights(files.weights, decided.plan.world.procs_per_node), source=files.weights
    )


def decide_resume(run: RunSettings, decided: Decisions) -> ResumeDecision:
    """Which checkpoint the run continues from (llmft.checkpoint.run_dir), whether the directory holds this same run
    (llmft.training.run_identity: a different run is refused), and whether anything is left to train."""
    training, plan = run.training, decided.plan
    checkpoint = run_dir.resolve_resume(training.output_dir, training.resume_from_checkpoint)
    given = (
        run.llmft.global_batch_size is not None
    )  # if not, a resume keeps the checkpoint's global batch on any world
    identity = run_identity.run_identity(
        run.script,
        training,
        run.model,
        run.llmft,
        zero_stage=plan.zero_stage,
        global_batch=elastic.kept_global_batch(checkpoint, plan.batch.global_batch, global_batch_given=given),
        dataset_fingerprint=(
            mixture_fingerprint(read_mixture(run.llmft.dataset_mixture, decided.data_options.seed))
            if run.llmft.dataset_mixture
            else data.content_fingerprint(run.script.dataset_name, run.script.dataset_config)
        ),
    )
    identity["hyperparameters"] = rerun.hyperparameters(training)  # recorded, not compared: rerun.decide
    identity["quantization_settings"] = recorded_settings(decided.quantization)  # what `llmft export` repeats
    identity["sequence_parallel"] = plan.sequence_parallel
    if checkpoint:
        saved_sp = (run_identity.read_record(training.output_dir) or {}).get("sequence_parallel", 1)
        if saved_sp != plan.sequence_parallel:
            raise TrainError(
                f"{checkpoint} was trained with --sequence_parallel {saved_sp}; resume with --sequence_parallel "
                f"{saved_sp} (changing N on a resume is not supported), or start a new --output_dir"
            )
    accepted = run_identity.check_same_run(training.output_dir, identity, training.resume_from_checkpoint)
    schedule_changes = []
    if checkpoint:
        saved = run_identity.read_record(training.output_dir) or {}
        schedule_changes = [
            c
            for c in rerun.decide(
                saved.get("hyperparameters"),
                identity["hyperparameters"],
                deepspeed_scheduler="scheduler" in decided.ds_template,
                output_dir=training.output_dir,
            )
            if c.split()[0].lstrip("-") in rerun.SCHEDULE_FLAGS
        ]
    finished = run_dir.nothing_left_to_train(
        training.output_dir, checkpoint, training.max_steps, training.num_train_epochs
    )
    if finished:
        return ResumeDecision(checkpoint, identity, None, finished)
    if rank0():  # this run trains here: a save cut off earlier must neither be written into again nor rotated over
        for line in run_dir.set_aside_incomplete(training.output_dir):
            log(line)
    resuming = checkpoint and elastic.plan_resume(
        checkpoint, plan.world.world_size, plan.zero_stage, plan.batch, global_batch_given=given
    )
    moved = resuming and (resuming.universal or resuming.saved_world not in (None, resuming.world))
    if moved and plan.sequence_parallel > 1:  # another world or stage under Ulysses: not tested, so refused
        raise TrainError(
            f"{checkpoint} was saved by {resuming.saved_world} ranks; a --sequence_parallel run resumes on the same "
            f"number of ranks ({resuming.saved_world}) and ZeRO stage: run it there, or start a new --output_dir"
        )
    if accepted:
        log(f"continuing on purpose with new settings: {'; '.join(accepted)}")
    return ResumeDecision(checkpoint, identity, resuming or None, None, tuple(schedule_changes))


def announce_plan(run: RunSettings, decided: Decisions, resume: ResumeDecision, model_config=None) -> Decisions:
    """Print the plan every rank runs (another world keeps the checkpoint's global batch: the accumulation follows)."""
    plan = decided.plan
    if resume.elastic_resume:
        plan = dataclasses.replace(plan, batch=resume.elastic_resume.batch)
    if rank0():
        print("\n".join(plan.lines()), flush=True)
        entry = methods.method(run.llmft.method)
        print(f"llmft plan: method {entry.name} ({entry.description}); the global batch counts {entry.batch_unit}")
    if resume.elastic_resume:
        sizing = None
        if resume.elastic_resume.universal and rank0() and model_config is not None:
            # the conversion sized for this node: its memory and CPUs, and the ranks waiting here
            shape = model_shape(
                model_config,
                use_peft=run.model.use_peft,
                lora_r=run.model.lora_r,
                lora_target_modules=run.model.lora_target_modules,
            )
            sizing = (shape.trainable, shape.largest_layer_params, plan.world.procs_per_node)
        log(resume.elastic_resume.describe(elastic.prepare(resume.elastic_resume, rank0(), log, sizing=sizing)))
    else:
        log(f"starting a new run in {run.training.output_dir}")
    if resume.schedule_changes:
        log(
            f"schedule changed since the checkpoint: {'; '.join(resume.schedule_changes)}; the Trainer builds the schedule "
            "from these flags, so they take effect from the resumed step"
        )
    if decided.quantization:
        log(
            f"QLoRA: base model loaded in {'4' if decided.quantization.get('load_in_4bit') else '8'}-bit (bitsandbytes)"
        )
    return dataclasses.replace(decided, plan=plan)


def choose_model_settings(run: RunSettings, decided: Decisions, model_config) -> tuple[RunSettings, str]:
    """The run's max_length (capped at the model's positions), LoRA targets as PEFT reads them, the attention
    implementation (llmft.planning.hardware.choose_attention; packing's own kernel when samples are packed),
    padding-free batches (llmft.training.packing.choose_padding_free) and Liger's kernels
    (llmft.planning.hardware.choose_liger)."""
    training, model, gpu = run.training, run.model, decided.gpu
    entry = methods.method(run.llmft.method)
    check_model_task(entry.model_task, model_config, entry.name)
    # TRL turns a single --lora_target_modules value into a string, which PEFT reads as a regex over full
    # module names: `c_attn` would then match nothing. A plain name means "modules called that".
    target = model.lora_target_modules
    if isinstance(target, str) and target != "all-linear" and re.fullmatch(r"[\w.]+", target):
        # a copy, not dataclasses.replace: ModelConfig's __post_init__ would turn [target] back into a string
        model = copy.copy(model)
        model.lora_target_modules = [target]
        run = dataclasses.replace(run, model=model)
    max_length, note = cap_max_length(model_config, training.max_length)
    if note:
        log(note)
    run = run.with_training(max_length=max_length)
    attention = choose_attention(
        model.attn_implementation,
        gpu,
        flash_attn_installed(),
        packing.model_attentions(model_config, training.trust_remote_code),
    )
    masks_from_positions = packing.masks_from_position_ids(model_config, training.trust_remote_code)
    capability = gpu.compute_capability if gpu is not None else None
    sp = run.llmft.sequence_parallel
    sequence_parallel.check_model(
        sp,
        model_config.model_type,
        getattr(model_config, "num_attention_heads", None),
        getattr(model_config, "num_key_value_heads", None),
    )
    # the gradient correction, decided here so a config it cannot correct is refused before the model loads
    sequence_parallel.gradient_scale(decided.plan.zero_stage, sp, ds_config.reduce_scatter(decided.ds_template))
    if entry.packing:  # a method whose rows TRL can pack or lay out padding-free
        run, attention = choose_row_layout(run, decided, model_config, attention, masks_from_positions)
    training = run.training
    use_liger, why = choose_liger(
        training.use_liger_kernel,
        gpu,
        model_config.model_type,
        liger_model_types() if gpu is not None else None,  # its import needs Triton: only where a GPU is
        training.liger_kernel_config,
    )
    if use_liger and training.use_liger_kernel is None:  # llmft's choice: TRL's deprecation warning is not the user's
        warnings.filterwarnings("ignore", message=r"`use_liger_kernel=True` is deprecated", category=FutureWarning)
    run = run.with_training(use_liger_kernel=use_liger)
    if why:
        log(why)
    packed_note = ""
    if attention == packing.PACKED_SDPA:
        packed_note = (
            ": PyTorch's varlen flash kernel on the packed samples"
            if packing.packed_kernel_for(
                model_config, cuda=decided.cuda, precision=decided.precision, capability=capability
            )
            == "varlen"
            else ": SDPA on each packed sample"
        )
    log(f"attention {attention}" + (" (auto)" if model.attn_implementation in (None, "auto") else "") + packed_note)
    return run, attention


def choose_row_layout(run: RunSettings, decided: Decisions, model_config, attention: str, masks_from_positions):
    """Padding-free batches (llmft.training.packing.choose_padding_free) and packing's attention, for a method whose
    rows TRL packs (llmft.planning.methods: Method.packing)."""
    training, gpu, sp = run.training, decided.gpu, run.llmft.sequence_parallel
    capability = gpu.compute_capability if gpu is not None else None
    requested_padding_free = training.padding_free
    if sp > 1 and requested_padding_free is None and attention not in sequence_parallel.BOUNDARY_AWARE:
        requested_padding_free = False  # llmft's own choice never mixes samples under Ulysses
    padding_free, why = packing.choose_padding_free(
        requested=requested_padding_free,
        packing=training.packing,
        cuda=decided.cuda,
        micro_batch=decided.plan.batch.micro_batch,
        attention=attention,
        kernel=packing.packed_kernel_for(
            model_config, cuda=decided.cuda, precision=decided.precision, capability=capability
        ),
        masks_from_positions=masks_from_positions,
        sliding_window=packing.uses_sliding_window(model_config),
    )
    run = run.with_training(padding_free=padding_free)
    training = run.training
    if why:
        log(why)
    sequence_parallel.check_attention(sp, attention, training.packing, training.padding_free)
    if training.packing or training.padding_free:
        attention = packing.check_packing(
            packing=training.packing,
            padding_free=training.padding_free,
            strategy=training.packing_strategy,
            attention=attention,
            masks_from_positions=masks_from_positions,
            sliding_window=packing.uses_sliding_window(model_config),
        )
        if attention == packing.PACKED_SDPA:
            packing.register_packed_sdpa()
    return run, attention


def prepare_data(run: RunSettings, decided: Decisions, files: ModelFiles) -> Prepared:
    """The data, tokenised once (rank 0; the other ranks wait on the files) or reused from the cache; for a method
    TRL tokenises itself (DPO, KTO, reward models), its records from llmft.data.pairs."""
    entry = methods.method(run.llmft.method)
    if entry.prepared_by == "trl":
        return method_records(run, decided, entry, files.tokenizer)
    check_records_fit(entry, first_record_columns(decided.data_options) or ())  # pairs given to --method sft
    tokenizer = files.tokenizer
    prepared = prepare(
        decided.data_options,
        tokenizer,
        run.training,
        log=log,
        timeout=run.llmft.prepare_timeout,
        positions=model_positions(files.config),
    )
    if prepared.shape == "messages":
        data.ensure_chat_template(tokenizer)
    records = prepared.info["records"]
    mixed = prepared.info.get("mixture")
    where = (
        ", ".join(f"{s['records']} from {s['path']}" for s in mixed["sources"])
        if mixed
        else f"{run.llmft.data_percentage:g}% of the split"
    )
    log(
        f"dataset {run.script.dataset_name or 'mixture ' + run.llmft.dataset_mixture}: {records['train']} records "
        f"({prepared.info.get('format') or prepared.shape}, {where})"
        + (f", {records['eval']} for evaluation" if prepared.eval is not None else "")
        + (f"; loss on {prepared.info['loss_on']}" if prepared.info.get("loss_on") else "")
    )
    if rank0():
        write_run_record(run.training.output_dir, decided.data_options, prepared)
        report = padding_report(
            prepared_lengths(prepared.train), decided.plan.batch.micro_batch, run.training.max_length
        )
        for line in report.lines(packing=run.training.packing, padding_free=bool(run.training.padding_free)):
            log(line)
    return prepared


def method_records(run: RunSettings, decided: Decisions, entry, tokenizer) -> Prepared:
    """The records TRL's trainer tokenises, in its shape (llmft.data.pairs: each dropped record counted by reason, the
    fit of each split against max_length said in one line), counted in one line."""
    opts = decided.data_options
    found = pairs.prepare_method_data(opts, entry, tokenizer, run.training.max_length, log=log)
    records = {"train": len(found.train), "eval": len(found.eval) if found.eval is not None else 0}
    fmt = found.shaped[0].format
    info = {"records": records, "format": fmt}
    fingerprint = data.content_fingerprint(opts.dataset_name, opts.dataset_config)
    prepared = Prepared(found.train, found.eval, fmt, Path(), fingerprint, False, info)
    log(
        f"dataset {run.script.dataset_name}: {records['train']} {fmt} records "
        f"({run.llmft.data_percentage:g}% of the split; TRL's {entry.trainer_class.split(':')[-1]} tokenises them)"
        + (f", {records['eval']} for evaluation" if prepared.eval is not None else "")
    )
    if rank0():
        write_run_record(run.training.output_dir, opts, prepared)
    return prepared


def write_deepspeed_config(run: RunSettings, decided: Decisions, resume: ResumeDecision, model_config) -> dict:
    """The concrete DeepSpeed config (every "auto" resolved), written beside the checkpoints with the run record."""
    training = run.training
    resolved = ds_config.resolve(
        decided.ds_template,
        decided.plan.batch,
        decided.precision,
        gradient_clipping=training.max_grad_norm,
        lr=training.learning_rate,
        betas=(training.adam_beta1, training.adam_beta2),
        eps=training.adam_epsilon,
        weight_decay=training.weight_decay,
        hidden_size=getattr(model_config, "hidden_size", None),
    )
    if resume.elastic_resume and resume.elastic_resume.universal:
        resolved = elastic.with_universal_load(resolved)
    if decided.plan.sequence_parallel > 1:
        # HF checks train_batch_size against micro x accumulation x all ranks before accelerate sets it to the
        # data-parallel ranks' batch (llmft's global batch): "auto" lets both do their part, and DeepSpeed checks the end
        resolved = {**resolved, "train_batch_size": "auto"}
    # the optimizer DeepSpeed can run here: FusedAdam needs nvcc (GPU) or c++ (CPU) unless prebuilt
    adam = ds_config.with_adam_kernel(
        resolved,
        ds_config.adam_kernel(cuda=decided.cuda, offload=ds_config.offloads(resolved), **ds_config.local_adam_facts()),
    )
    if adam is not resolved:
        resolved = adam
        log(
            "DeepSpeed's FusedAdam is not prebuilt and no CUDA compiler (nvcc) is here to build it: the optimizer runs as "
            "torch.optim.AdamW (DeepSpeed's torch_adam); install the CUDA toolkit (nvcc) and run `llmft prebuild` once, or use the Dockerfile's image"
            if decided.cuda
            else "DeepSpeed's CPU FusedAdam needs a C++ compiler (c++) to load and none is here (a container image without "
            "one?): the optimizer runs as torch.optim.AdamW (DeepSpeed's torch_adam); install g++ to use FusedAdam"
        )
    if rank0():  # every check passed: this directory now holds this run (refused reruns never get here)
        run_identity.record_run(training.output_dir, resume.identity)
        run_identity.record_launch(training.output_dir, run_identity.launch_record(sys.argv[1:], dict(os.environ)))
        log(f"DeepSpeed config written to {ds_config.write_resolved(resolved, Path(training.output_dir))}")
    return resolved


def prepare_process() -> None:
    """This process's environment before DeepSpeed starts: a world of one outside torchrun, stale op-build locks
    cleared (once per node), and DeepSpeed's op builds kept from slow or failing paths."""
    single_process_defaults()  # outside torchrun: a world of one, before DeepSpeed reads the environment
    upstream_noise.use_keyed_extensions_dir(log)  # this environment's op cache, unless TORCH_EXTENSIONS_DIR is set
    upstream_noise.say_op_builds(log)  # a line before DeepSpeed compiles an op (minutes, silent otherwise)
    if os.environ.get("LOCAL_RANK", "0") == "0":  # before any rank can load an op (they build after rendezvous)
        for finding in build_locks.clear_stale_build_locks(build_locks.extensions_root()):
            print(f"llmft: {socket.gethostname()}: {finding.message}", flush=True)  # every node's, not rank 0's
    skip_deepspeed_shm_op()  # an op training never uses that DeepSpeed would compile at start-up on CPU
    use_proc_cpuinfo_for_deepspeed()  # DeepSpeed's CPU op loads ask py-cpuinfo, 1 s a call
    defer_deepspeed_compile_decorators()  # DeepSpeed's Muon module calls torch.compile at import: 1.45 s a rank
    arch_list = deepspeed_arch_list(os.environ.get("TORCH_CUDA_ARCH_LIST"))
    if arch_list:  # before DeepSpeed JIT-builds its first op (FusedAdam) in this process
        log(
            f"TORCH_CUDA_ARCH_LIST {os.environ['TORCH_CUDA_ARCH_LIST']!r} -> {arch_list!r} for DeepSpeed's op builds "
            "(it cannot read arch-specific targets such as 9.0a)"
        )
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list


@dataclass(frozen=True)
class RunCallbacks:
    publish: object  # PublishCompleteCheckpoint
    stop: object  # GracefulStop
    meter: metrics.Meter


def build_trainer(
    run: RunSettings,
    decided: Decisions,
    resume: ResumeDecision,
    files: ModelFiles,
    prepared: Prepared,
    resolved: dict,
    attention: str,
    clock: metrics.StartupClock,
):
    """SFTTrainer on DeepSpeed with llmft's callbacks. ZeRO-3 partitions the model while loading it (zero.Init), which
    needs DeepSpeed's comm layer up; on GPUs HF starts it, on the CPU path it would see a world of one."""
    import deepspeed
    from transformers import BitsAndBytesConfig
    from trl import get_peft_config

    entry = methods.method(run.llmft.method)
    args = trainer_arguments(
        run.training,
        plan=decided.plan,
        precision=decided.precision,
        resolved_ds_config=resolved,
        cuda=decided.cuda,
        max_length=run.training.max_length,
        resume=resume.checkpoint,
        prepared_by=entry.prepared_by,
    )
    args.model_init_kwargs = model_init_kwargs(
        run.model, run.training, decided.quantization, decided.precision, attention
    )
    apply_sequence_parallel(args, run, decided, attention)
    quantization = decided.quantization
    quantization_config = (
        BitsAndBytesConfig(**{k: v for k, v in quantization.items() if k != "model_dtype"}) if quantization else None
    )
    _ = args.device  # accelerate creates the process group (gloo on CPU, nccl on GPUs)
    deepspeed.init_distributed(dist_backend="nccl" if decided.cuda else "gloo")
    PublishCompleteCheckpoint, GracefulStop = checkpoint_callbacks()
    before_loading = host_memory.current_rss()
    stop = GracefulStop(stop_file(run))
    make_writer = None
    if run.llmft.async_save:

        def make_writer():
            """The background writer in the DeepSpeed engine's place; a save is synchronous when training stops after it."""
            try:
                return checkpoint_async_save.install(
                    trainer.model_wrapped,
                    synchronous=lambda: (
                        trainer.control.should_training_stop or trainer.state.global_step >= trainer.state.max_steps
                    ),
                    delay_s=job_deadline.save_delay_s() if rank0() else 0.0,  # a test hook: a slow filesystem
                )
            except ValueError as e:
                raise TrainError(str(e)) from None

    publish = PublishCompleteCheckpoint(
        decided.plan.zero_stage, decided.plan.batch, run.training.save_total_limit, make_writer
    )
    with clock.phase("data"), metrics.timing_model_load(clock):  # collating set-up is data, loading weights model_load
        trainer_class, kept = choose_reference(run, decided, files, args, method_trainer_class(run, decided, entry))
        trainer = trainer_class(
            model=files.weights,
            args=args,
            train_dataset=prepared.train,
            eval_dataset=prepared.eval,
            processing_class=files.tokenizer,
            peft_config=get_peft_config(run.model),
            quantization_config=quantization_config,
            callbacks=[publish, stop, rerun.callback(log)],
        )
    install_tiled_mlp(run, trainer.model, files.config)
    ulysses.install_epoch_adapter(trainer)  # Ulysses' loader reseeded each epoch (llmft.training.ulysses)
    if files.source:  # saved configs and adapters name the model, not its node-local copy
        restore_source_name(trainer.model, files.weights, files.source)
    trainer.add_callback(host_memory.report_callback(before_loading, host_memory.peak_rss()))
    trainer.add_callback(compile_report(trainer))
    if entry.loss_is_nll:  # exp(eval loss) is a perplexity only for a token NLL loss
        log_perplexity(trainer)
    guard_wandb(trainer, log)
    meter = metrics.attach(trainer, clock, decided.gpu, entry.reference)  # step line, W&B, run_summary.json
    report_reference(trainer, meter, kept)
    if run.llmft.profile_step is not None:
        trainer.add_callback(profile_step.callback(run.llmft.profile_step, args.output_dir, meter))
    save_estimate = estimated_save_s(
        *job_deadline.parameter_counts(trainer.model), decided.plan.zero_stage, decided.precision
    )
    stop.deadline = job_deadline.JobDeadline.for_this_job(
        lambda: save_estimate, args.output_dir, async_save=run.llmft.async_save
    )
    timeout = process_group_timeout.callback(
        log,
        given_s=args.ddp_timeout if run.llmft.ddp_timeout_given else None,
        estimated_save_s=save_estimate,
        longest_save_s=job_deadline.read_longest_save(Path(args.output_dir) / job_deadline.SAVE_RECORD),
    )
    trainer.add_callback(timeout)  # last: it reads every other callback's should_save
    job_deadline.time_each_save(trainer, stop.deadline, log, timeout, publish)
    return trainer, RunCallbacks(publish, stop, meter)


def method_trainer_class(run: RunSettings, decided: Decisions, entry):
    """The method's TRL trainer (llmft.planning.methods) with the llmft mixins its entry names: the checkpoint
    writer for all, the sync-free steps and Ulysses' gradient correction for SFT."""
    trainer_class = checkpoint_save.trainer_class(
        run.llmft.save_consolidated, base=import_class(entry.trainer_class), mixins=entry.mixins
    )
    if "ulysses" in entry.mixins:
        trainer_class = ulysses.mixin_class(
            trainer_class,
            sequence_parallel.gradient_scale(
                decided.plan.zero_stage, decided.plan.sequence_parallel, ds_config.reduce_scatter(decided.ds_template)
            ),
        )
    return trainer_class


def choose_reference(run: RunSettings, decided: Decisions, files: ModelFiles, args, trainer_class):
    """The method's reference model (llmft.training.reference.choose_reference), named in one line; with
    --precompute_ref_log_probs the trainer class keeps TRL's pass in llmft's cache (reference.precompute_kept).
    Returns the trainer class and the store (None when nothing is precomputed)."""
    precompute = bool(getattr(run.training, "precompute_ref_log_probs", False))
    chosen = reference.choose_reference(
        methods.method(run.llmft.method).reference,
        use_peft=bool(run.model.use_peft),
        zero_stage=decided.plan.zero_stage,
        precompute=precompute,
        sft_model=reference.merged_from(files.source or files.weights),
    )
    if chosen.line:
        log(chosen.line)
    if chosen.strategy != "precomputed":
        return trainer_class, None
    reference.check_precompute(precompute, trainer_class)
    store = reference.reference_store(
        weights_dir=files.weights,
        trainer_class=trainer_class,
        args=args,
        tokenizer=files.tokenizer,
        dtype=args.model_init_kwargs.get("dtype"),
        quantized=bool(decided.quantization),
        log=log,
    )
    return reference.precompute_kept(trainer_class, store), store


def report_reference(trainer, meter: metrics.Meter, kept) -> None:
    """The reference copy's engine in one line (its ZeRO stage, this rank's share), and the precompute's counts,
    time and size in run_summary.json (`reference_log_probs`)."""
    line = reference.describe_engine(getattr(trainer, "ref_model", None))
    if line:
        log(line)
    if kept is not None:
        meter.extra["reference_log_probs"] = kept.record


def apply_sequence_parallel(args, run: RunSettings, decided: Decisions, attention: str) -> None:
    """Ulysses for the Trainer: accelerate's ParallelismConfig, the resume skip inside its loader, and the padding
    that splits each row in N equal parts (llmft.training.ulysses, llmft.planning.sequence_parallel)."""
    sp = decided.plan.sequence_parallel
    args.parallelism_config = ulysses.parallelism_config(sp, decided.plan.batch.world_size, attention)
    if sp > 1:
        ulysses.install_resume_skip()
    args.pad_to_multiple_of = sequence_parallel.pad_to_multiple_of(
        sp, run.training.pad_to_multiple_of, decided.cuda, run.training.max_length
    )


def install_tiled_mlp(run: RunSettings, model, config) -> None:
    """--tiled_mlp (or --auto's choice): DeepSpeed's TiledMLP on the model's MLPs, said in one line."""
    if run.llmft.tiled_mlp:
        tiled = tiled_mlp.install(model, getattr(config, "model_type", "this"))
        log(f"tiled MLP: DeepSpeed's TiledMLP on {tiled} MLPs (one shard per {config.hidden_size} tokens a rank)")


def finish(run: RunSettings, decided: Decisions, trainer, callbacks: RunCallbacks, prepared: Prepared, result) -> int:
    """After training: a stopped run has saved its checkpoint; a finished one scores held-out data if asked, writes
    the final model, checks it, and marks the run done. The summary is written either way."""
    args, step = trainer.args, trainer.state.global_step
    if callbacks.publish.refused:
        raise TrainError(callbacks.publish.refused)
    if callbacks.stop.stopped_at is not None:
        log(
            f"{'stopped for the time limit' if callbacks.stop.for_time_limit else 'stop requested'}; saved checkpoint-{step}"
        )
    else:
        if prepared.eval is not None and args.eval_strategy == "no":
            trainer.evaluate()  # evaluation data without --eval_strategy: scored once, at the end
        with callbacks.meter.outside_training("save"):  # run_summary.json's save_seconds includes the final save
            trainer.save_model(args.output_dir)
            bad = checkpoint_checks.check_save(args.output_dir, trainer.model, rank0())
        if bad:
            raise TrainError(
                f"the final model in {args.output_dir} is not what was trained: {'; '.join(bad)}; run not marked done"
            )
        trainer.save_state()  # trainer_state.json (log history) beside the model, for llmft report
        if rank0():
            run_dir.mark_done(args.output_dir, step)
        log(
            f"training complete at step {step}; "
            + checkpoint_save.final_model_note(
                args.output_dir, step, decided.plan.zero_stage, run.model.use_peft, run.llmft.save_consolidated
            )
        )
    if rank0():
        log(
            "run summary written to "
            + str(
                callbacks.meter.write_summary(
                    args.output_dir, result.training_loss, trainer.state.global_step, held_out_metric(run, trainer)
                )
            )
        )
    if hasattr(trainer, "end"):
        trainer.end()
    return 0


def held_out_metric(run: RunSettings, trainer) -> dict:
    """The method's held-out metric (llmft.planning.methods: a reward model's accuracy on held-out pairs) from the
    last evaluation, for run_summary.json, said in one line; {} without one or without evaluation data."""
    name = methods.method(run.llmft.method).held_out_metric
    key = f"eval_{name}"
    found = [entry[key] for entry in trainer.state.log_history if key in entry] if name else []
    if not found:
        return {}
    log(f"held-out {name}: {found[-1]:.4f} (last evaluation, step {trainer.state.global_step})")
    return {key: round(float(found[-1]), 6)}


def make_parser(subparsers=None, method_name: str | None = None):
    """llmft.training.flags.TrainParser (TRL's parser, with llmft's precision and DeepSpeed-file handling) for the four
    dataclasses; the second is the method's TRL config (llmft.planning.methods: SFTConfig for sft, DPOConfig for dpo).

    As a subcommand, `subparsers` must have been made with parser_class=TrainParser (llmft.cli does)."""
    import torch
    from trl import ModelConfig, ScriptArguments

    entry = methods.method(method_name)
    dataclass_types = (ScriptArguments, import_class(entry.config_class), ModelConfig, LlmftArguments)
    if subparsers is not None:
        parser = subparsers.add_parser(
            "train", help="Fine-tune with TRL's trainers on DeepSpeed ZeRO", dataclass_types=dataclass_types
        )
    else:
        parser = TrainParser(dataclass_types, prog="llmft train")
    parser.method_name = entry.name
    # llmft trains on CPU exactly when no GPU is visible. dtype: unset means "the training precision" (TRL's default
    # would load fp32 weights on every rank of a bf16 run).
    # assistant_only_loss: unset means on for chat data (llmft.data.cache.assistant_only); TRL's False would train on
    # the users' turns
    parser.set_known_defaults(use_cpu=not torch.cuda.is_available(), dtype=None, assistant_only_loss=None)
    if not entry.packing:  # llmft decides padding-free only where the method's rows can be laid out so
        parser.set_known_defaults(padding_free=False)
    return parser


def cli(parser, argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    nproc_per_node, argv, problem = launcher.take_nproc_per_node(argv)
    if problem:
        return report_error("train", problem)
    if nproc_per_node is not None and not {"-h", "--help"} & set(argv):  # torchrun's agent in this process
        garbage_collection.resume_after_startup()  # the agent runs for the whole job; its ranks pause their own
        return launcher.launch(nproc_per_node, argv)
    if not {"-h", "--help"} & set(argv):
        try:
            problem = launch_problem(os.environ, world._cuda_device_count(), argv)
        except LaunchEnvError as e:
            problem = str(e)
        if problem:  # before anything loads (HF reads these variables while parsing): several GPUs but one process
            return report_error("train", problem)
    try:
        name = methods.method(method_argument(argv)).name
    except LlmftError as e:
        return report_error("train", e)
    if getattr(parser, "method_name", None) != name:  # the method chooses the config dataclass the parser reads
        parser = make_parser(method_name=name)
    parsed = parse_train_flags(parser, argv)
    if isinstance(parsed, str):
        return report_error("train", parsed)
    return main(*parsed)


if __name__ == "__main__":  # every rank torchrun starts (`-m llmft.train`)
    launcher.end_with_the_agent()  # first: a rank never outlives its torchrun
    garbage_collection.pause_for_startup()  # before make_parser imports torch and TRL
    exit_process(cli(make_parser()))

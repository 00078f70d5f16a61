"""Supervised fine-tuning with TRL's SFTTrainer on DeepSpeed ZeRO, with llmft's batch math and checkpoint safety.

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

Every `SFTConfig`/`TrainingArguments` flag takes effect with TRL's names, or stops the run saying why
(llmft/training/flags.py lists each). llmft adds `--zero_stage`, `--offload`, `--auto`,
`--global_batch_size`, `--data_percentage`, `--precision`, `--save_consolidated` and column mapping. Weights
load in the training precision (bf16 on Ampere+ GPUs) unless `--dtype` says otherwise. A rerun with the same `--output_dir` resumes from
the newest complete checkpoint of the same run (llmft_run.json), on any number of GPUs (llmft.training.elastic);
a different run there is refused. Started without torchrun on a machine with several GPUs, it stops and
prints the torchrun command.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import os
import re
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from llmft.training import build_locks

from llmft.checkpoint import run_dir as checkpoints

from llmft.data import loading as data

from llmft.planning import ds_config

from llmft.training import elastic

from llmft.training import host_memory

from llmft.training import hub

from llmft.training import metrics

from llmft.training import packing

from llmft import prepare

from llmft.training import rerun

from llmft.training import run_identity

from llmft.training import save_checks as saved_weights

from llmft.training import saving
from llmft.training.flags import FlagError, TrainParser, check_flags
from llmft.planning.hardware import (HardwareError, check_liger, choose_attention, choose_precision, flash_attn_installed,
                            liger_model_types, local_gpu)
from llmft.planning.world import (LaunchEnvError, deepspeed_arch_list, launch_problem, rank0, single_process_defaults,
                              skip_deepspeed_shm_op, use_proc_cpuinfo_for_deepspeed)
from llmft.plan import PlanError, auto_choice, make_plan
from llmft.planning.qlora import QuantizationError, QuantRequest, bitsandbytes_version, choose_quantization
from llmft.training.stage_weights import restore_source_name, stage_weights


@dataclass
class LlmftArguments:
    """What llmft adds to TRL's flags."""

    zero_stage: int | None = field(default=None, metadata={"help": "ZeRO stage 0-3, using ds_configs/zeroN.json (default 2)."})
    offload: bool = field(default=False, metadata={"help": "Offload optimizer state (and ZeRO-3 parameters) to CPU."})
    global_batch_size: int | None = field(
        default=None, metadata={"help": "Samples per optimizer step over all processes; accumulation is derived from it."}
    )
    data_percentage: float = field(default=100.0, metadata={"help": "Train on this percentage (0-100] of the training split."})
    precision: str = field(default="auto", metadata={"help": "auto (bf16 on Ampere+, fp16 on older GPUs, fp32 on CPU), bf16, fp16 or fp32."})
    prompt_column: str | None = field(default=None, metadata={"help": "Dataset field holding the prompt (e.g. question)."})
    completion_column: str | None = field(default=None, metadata={"help": "Dataset field holding the completion (e.g. answer)."})
    messages_column: str | None = field(default=None, metadata={"help": "Dataset field holding chat messages."})
    stop_file: str | None = field(
        default=None,
        metadata={"help": "When this file appears, save a complete checkpoint and stop (default: $LLMFT_STOP_FILE)."},
    )
    auto: bool = field(
        default=False,
        metadata={"help": "Let llmft's memory planner pick the ZeRO stage, CPU offload, micro-batch (up to "
                          "--per_device_train_batch_size) and gradient checkpointing (never on with "
                          "--gradient_checkpointing false) for this job's GPUs and RAM; see `llmft plan --model`."},
    )
    save_consolidated: bool = field(
        default=False,
        metadata={"help": "ZeRO-3: gather the 16-bit model on rank 0 into --output_dir at the end (needs about twice "
                          "its 16-bit size in host RAM there; `llmft plan --save_consolidated` counts it)."},
    )
    # --bf16/--fp16 as the user gave them (None: not given), recorded by llmft.training.flags.TrainParser; not flags themselves.
    bf16_flag: bool | None = field(default=None, init=False, repr=False)
    fp16_flag: bool | None = field(default=None, init=False, repr=False)
    eval_dataset_name: str | None = field(
        default=None, metadata={"help": "Evaluation data: a file/directory, or a hub dataset (its --dataset_test_split)."}
    )
    eval_split_ratio: float | None = field(
        default=None, metadata={"help": "Hold out this fraction (0-1) of the training split for evaluation (deterministic)."}
    )
    prepare_timeout: float = field(
        default=7200.0, metadata={"help": "Seconds the other ranks wait for rank 0 to prepare (tokenise) the data."}
    )


class TrainError(RuntimeError):
    """A run that cannot start; reported as one line and exit code 2."""


def log(msg: str) -> None:
    if rank0():
        print(f"llmft: {msg}", flush=True)


STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
STOP_VOTE_MAX_DELAY_S = 0.5


def steps_between_stop_votes(seconds: float, steps: int, max_delay_s: float = STOP_VOTE_MAX_DELAY_S) -> int:
    """How many optimizer steps until the ranks next vote on stopping, from the time the last `steps` took.

    Every rank must stop at the same step, so a stop request is voted on with an all-reduce; on every step that is a
    collective and a host sync that costs a fast step 1-2% (bench/README.md, bench_overhead). Voting every k steps,
    with k steps taking at most `max_delay_s`, bounds how much later a stop starts saving (against the 120 s the
    Slurm script leaves before the time limit) and keeps a vote per step wherever a step takes longer."""
    if steps <= 0 or seconds <= 0:
        return 1
    return max(1, min(1000, int(max_delay_s * steps / seconds)))


def worker_ignores_stop_signals(init_fn, worker_id: int) -> None:
    """A DataLoader worker leaves SIGTERM/SIGUSR1 to its rank. Slurm signals every process of a step (a requeue,
    preemption, `scancel`), and a worker killed by it ends the rank with "DataLoader worker ... is killed by signal"
    before the stop's checkpoint is written. The rank shuts its workers down itself; they exit when it dies."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if init_fn is not None:
        init_fn(worker_id)


def kill_leftover_workers() -> None:
    """At the rank's exit, SIGKILL the DataLoader workers still alive. They ignore SIGTERM (above), and SIGTERM is what
    multiprocessing sends them at exit before an unbounded join (a run stopped mid-epoch still holds its iterator
    then), and what torch sends a worker that did not stop on request (pytorch#39570): the rank would never exit
    (seen: a 2-node Slurm job held at torchrun's exit barrier after its stop checkpoint). Daemonic children are
    ended at exit anyway; this only makes it certain."""
    import multiprocessing

    workers = [child for child in multiprocessing.active_children() if child.daemon]
    if not workers:
        return
    # torch's SIGCHLD handler would raise "DataLoader worker ... killed" for workers of a live iterator (a run
    # stopped mid-epoch keeps one until exit, when torch no longer shuts workers down itself)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in workers:
        child.kill()
    for child in workers:
        child.join(timeout=5)


def _callbacks():
    """Trainer callbacks, defined lazily so importing llmft.train stays cheap."""
    import torch
    import torch.distributed as dist
    from transformers import TrainerCallback

    def all_ranks_max(*values: int, device) -> list[int]:
        if not (dist.is_available() and dist.is_initialized()):
            return list(values)
        t = torch.tensor(values, dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    class PublishCompleteCheckpoint(TrainerCallback):
        """After every rank has written its shard and the saved weights hold the model, publish checkpoint-N/llmft_complete.json.

        Weights that do not (empty, missing tensors, zeros): no marker, training stops, `refused` says why.
        """

        def __init__(self, zero_stage: int, batch, keep: int | None = None):
            self.zero_stage, self.batch, self.keep = zero_stage, batch, keep  # keep: --save_total_limit
            self.refused: str | None = None

        def on_save(self, args, state, control, model=None, **kwargs):
            ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            report = checkpoints.rank_report(ckpt, args.process_index)  # what this rank wrote, as its node sees it
            reports = [report]
            if dist.is_initialized():
                reports = [None] * dist.get_world_size()
                dist.all_gather_object(reports, report)  # also the barrier: every rank has finished saving
            bad = saved_weights.check_save(ckpt, model, state.is_world_process_zero)
            if all_ranks_max(int(bool(bad)), device=args.device)[0]:
                self.refused = f"{ckpt} not published as complete: {'; '.join(bad) or 'see rank 0'}"
                control.should_training_stop = True
            elif state.is_world_process_zero:
                if checkpoints.mark_complete(ckpt, args.world_size, self.zero_stage, reports, self.batch):
                    log(f"saved complete checkpoint {ckpt}")
                    # --save_total_limit, applied here (the Trainer gets None): only now is the new one complete
                    for gone in checkpoints.rotate(args.output_dir, self.keep, state.best_model_checkpoint):
                        log(f"deleted {gone.name} (--save_total_limit {self.keep} counts complete checkpoints only)")
                else:
                    missing = [r for r, files in enumerate(reports) if not files]
                    log(f"warning: not marking {ckpt} complete: rank(s) {missing} reported no files")
            if dist.is_initialized():
                dist.barrier()

    class GracefulStop(TrainerCallback):
        """On SIGUSR1/SIGTERM or when the stop file appears: finish this step, save, stop (for preemption).

        The ranks vote at the first step, then every steps_between_stop_votes steps; the vote carries each rank's
        proposal for the next interval and all take the smallest, so every rank votes (and stops) at the same step."""

        def __init__(self, stop_file: str | None):
            self.stop_file = stop_file
            self.requested = False
            self.stopped_at: int | None = None
            self.next_vote: int | None = None  # the global step of the next vote; None: at the next step
            self.last_vote: tuple[int, float] | None = None  # (global step, time) of the last vote

        def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
            for sig in STOP_SIGNALS:
                signal.signal(sig, self._request)
            atexit.unregister(kill_leftover_workers)  # once, and after multiprocessing's own exit hook so it runs first
            atexit.register(kill_leftover_workers)
            # accelerate's DataLoaderShard wraps the torch DataLoader that forks the workers (per epoch, after this)
            loader = getattr(train_dataloader, "base_dataloader", train_dataloader)
            if loader is not None and loader.num_workers > 0:
                loader.worker_init_fn = functools.partial(worker_ignores_stop_signals, loader.worker_init_fn)

        def _request(self, signum, frame):
            self.requested = True

        def on_step_end(self, args, state, control, **kwargs):
            step, now = state.global_step, time.monotonic()
            if self.next_vote is not None and step < self.next_vote:
                return
            interval = 1
            if self.last_vote is not None:
                interval = steps_between_stop_votes(now - self.last_vote[1], step - self.last_vote[0])
            asked = self.requested or bool(state.is_world_process_zero and self.stop_file and os.path.exists(self.stop_file))
            stop, smallest = all_ranks_max(int(asked), -interval, device=args.device)  # max of -interval: the smallest
            self.next_vote, self.last_vote = step - smallest, (step, now)
            if stop and step < state.max_steps:
                control.should_save = True
                control.should_training_stop = True
                self.stopped_at = state.global_step

    return PublishCompleteCheckpoint, GracefulStop


def compile_report(trainer):
    """A callback that says, when training starts, whether --torch_compile took effect: accelerate compiles the
    DeepSpeed engine's module (DeepSpeedEngine.compile), and the first steps then pay the compilation (26 s for
    the demo model on 2 CPU cores, bench/bench_compile.py; again when batch shapes change). Requested but not applied: an error."""
    from transformers import TrainerCallback

    class CompileReport(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if not args.torch_compile:
                return
            engine = trainer.model_wrapped
            if not getattr(engine, "is_compiled", False):
                raise TrainError(f"--torch_compile was not applied to the model ({type(engine).__name__}): "
                                 "use accelerate and DeepSpeed versions that compile DeepSpeed engines, or drop --torch_compile")
            mode = args.torch_compile_mode or "default"
            log(f"torch.compile on (backend {args.torch_compile_backend or 'inductor'}, mode {mode}): "
                "the first steps compile, and steps whose batch shapes are new may compile again")

    return CompileReport()


def train_precision(training_args, llmft_args, gpu) -> str:
    """llmft.planning.hardware.choose_precision with --precision and the --bf16/--fp16 flags as given.

    Called without llmft's parser (main() from Python), only an fp16=True is a choice: SFTConfig sets bf16 on
    by default, so its bf16 says nothing about what the user asked."""
    bf16, fp16 = llmft_args.bf16_flag, llmft_args.fp16_flag
    if bf16 is None and fp16 is None and training_args.fp16:
        fp16 = True
    return choose_precision(llmft_args.precision, gpu, bf16=bf16, fp16=fp16)


def load_model_files(model_args, training_args):
    """The model's config and tokenizer (small files), at the asked revision, and the path to load the weights
    from; a missing model is one line. A hub model is downloaded once per job first (llmft.training.hub: one process,
    the others wait), then every process loads the local snapshot."""
    from transformers import AutoConfig, AutoTokenizer

    name = model_args.model_name_or_path
    path = Path(name).expanduser()
    if name.startswith(("/", "./", "../", "~")) or path.exists():
        if not path.exists():
            raise TrainError(f"model directory {name} not found: pass an existing local model directory or a hub model name")
        if not path.is_dir() or not (path / "config.json").is_file():
            raise TrainError(f"{name} is not a model directory (no config.json in it): pass a directory saved with "
                             "save_pretrained, or a hub model name")
    name = hub.resolve_model(name, model_args.model_revision)
    kwargs = {"revision": model_args.model_revision, "trust_remote_code": training_args.trust_remote_code}
    loaded = []
    for what, cls in (("config", AutoConfig), ("tokenizer", AutoTokenizer)):
        try:
            loaded.append(cls.from_pretrained(name, **kwargs))
        except (OSError, ValueError) as e:
            reason = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            raise TrainError(f"cannot load the {what} of {name} (revision {model_args.model_revision}): {reason}") from None
    return loaded[0], loaded[1], name


def model_init_kwargs(model_args, training_args, quantization: dict | None, precision: str = "fp32",
                      attention: str | None = None) -> dict:
    """How SFTTrainer loads the weights: the same revision as the config and tokenizer, llmft's QLoRA dtype, the
    attention implementation llmft chose (llmft.planning.hardware.choose_attention, llmft.training.packing.check_packing).

    Weights load in the precision the run trains in (an explicit --dtype wins), never an fp32 copy per rank on a
    bf16 run (issue 9: 32 GB of host RAM per rank for an 8B model). On CPU that is fp32, as before."""
    kwargs = {"trust_remote_code": training_args.trust_remote_code, "revision": model_args.model_revision}
    if attention or model_args.attn_implementation:
        kwargs["attn_implementation"] = attention or model_args.attn_implementation
    kwargs["dtype"] = model_args.dtype or {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[precision]
    if quantization:
        kwargs["dtype"] = quantization["model_dtype"]
    kwargs.update(training_args.model_init_kwargs or {})
    return kwargs


def trainer_arguments(training_args, *, plan, precision, resolved_ds_config, cuda: bool, max_length, resume):
    """The SFTConfig the Trainer runs with: the user's, with what llmft decided (flags.POLICY names each field)."""
    return dataclasses.replace(
        training_args,
        deepspeed=resolved_ds_config,
        per_device_train_batch_size=plan.batch.micro_batch,
        gradient_accumulation_steps=plan.batch.grad_accum,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        use_cpu=not cuda,  # without it accelerate sees world size 1 on CPU and DeepSpeed fails
        dataloader_pin_memory=training_args.dataloader_pin_memory and cuda,
        max_length=max_length,
        resume_from_checkpoint=str(resume) if resume else None,
        save_total_limit=None,  # applied by llmft after each checkpoint is complete (PublishCompleteCheckpoint)
        dataset_kwargs={**(training_args.dataset_kwargs or {}), "skip_prepare_dataset": True},  # llmft.prepare did it
        assistant_only_loss=False,  # already in the prepared labels (and TRL would check the untokenised format)
    )


def choose_automatically(script_args, training_args, model_args, llmft_args, precision: str, grad_accum):
    """--auto: llmft.plan.auto_choice for this job's world, GPUs and RAM; refuses the flags it would override."""
    if llmft_args.zero_stage is not None or llmft_args.offload or training_args.deepspeed:
        raise TrainError("--auto chooses the ZeRO stage and offload itself: drop --zero_stage/--offload/--deepspeed, or --auto")
    from llmft.planning.world import discover_world

    # A rerun continues the run in --output_dir: its checkpoints load only under the stage they were written with.
    record = run_identity.read_record(training_args.output_dir) if run_identity.has_training_state(training_args.output_dir) else None
    keep = record.get("zero_stage") if record else None
    return auto_choice(
        model_args.model_name_or_path, discover_world(), precision=precision,
        max_micro_batch=training_args.per_device_train_batch_size, global_batch=llmft_args.global_batch_size,
        grad_accum=grad_accum, max_length=training_args.max_length or 1024, use_peft=model_args.use_peft,
        lora_r=model_args.lora_r, lora_target_modules=model_args.lora_target_modules,
        allow_gradient_checkpointing=bool(training_args.gradient_checkpointing),
        save_total_limit=training_args.save_total_limit, output_dir=training_args.output_dir,
        attention=model_args.attn_implementation, load_in_4bit=model_args.load_in_4bit,
        save_consolidated=llmft_args.save_consolidated, trust_remote_code=training_args.trust_remote_code,
        keep_zero_stage=keep if isinstance(keep, int) else None,
    )


def with_checkpointing(training_args, on: bool):
    """training_args with gradient checkpointing on or off. transformers 5 resolves `gradient_checkpointing` into
    `activation_checkpointing` and a copy keeps the resolved name, so both are set (one alone is silently undone)."""
    return dataclasses.replace(training_args, activation_checkpointing=on, gradient_checkpointing=on)


def main(script_args, training_args, model_args, llmft_args) -> int:
    """Check everything cheap first, then build the trainer and train (or resume)."""
    try:
        return _train(script_args, training_args, model_args, llmft_args)
    except (TrainError, PlanError, HardwareError, packing.PackingError, data.DataError, ds_config.DSConfigError,
            checkpoints.CheckpointError, FlagError, QuantizationError, run_identity.RunMismatch, rerun.RerunRefused, LaunchEnvError,
            hub.HubError) as e:
        if rank0():
            print(f"llmft train: error: {e}", file=sys.stderr, flush=True)
        return 2


def _train(script_args, training_args, model_args, llmft_args) -> int:
    clock = metrics.StartupClock()  # everything before this point was interpreter start-up and imports
    clock.add("import", clock.elapsed())
    with clock.phase("import"):
        import torch

    from llmft import eval as evaluation
    from llmft import tracking

    # 1. Cheap checks: flags, batch math, DeepSpeed template, optimizer, QLoRA, model files, data options, resume point.
    if not model_args.model_name_or_path:
        raise TrainError("--model_name_or_path is required (a hub name or a local model directory)")
    if not script_args.dataset_name:
        raise TrainError("--dataset_name is required (a .jsonl/.json/.parquet/.csv file or directory, or a hub dataset)")
    cuda = torch.cuda.is_available()
    check_flags(script_args, training_args, model_args, cuda=cuda)
    gpu = local_gpu()
    precision = train_precision(training_args, llmft_args, gpu)
    grad_accum = training_args.gradient_accumulation_steps if training_args.gradient_accumulation_steps != 1 else None
    micro, zero_stage, offload, auto_line = training_args.per_device_train_batch_size, llmft_args.zero_stage, llmft_args.offload, ""
    if llmft_args.auto:
        setting, auto_line = choose_automatically(script_args, training_args, model_args, llmft_args, precision, grad_accum)
        micro, zero_stage, offload = setting.micro_batch, setting.zero_stage, setting.offload
        training_args = with_checkpointing(training_args, setting.gradient_checkpointing)
    plan = make_plan(
        micro_batch=micro,
        global_batch=llmft_args.global_batch_size,
        grad_accum=setting.grad_accum if llmft_args.auto else grad_accum,
        zero_stage=zero_stage,
        offload=offload,
        deepspeed=training_args.deepspeed,
        precision=precision,
        output_dir=training_args.output_dir,
        auto=auto_line,
    )
    if llmft_args.save_consolidated and (plan.zero_stage != 3 or model_args.use_peft):
        raise TrainError("--save_consolidated gathers a ZeRO-3 model at the end; "
                         + ("a LoRA run saves its adapter (llmft infer --merge --export DIR writes a merged model)"
                            if model_args.use_peft else f"under ZeRO-{plan.zero_stage} the final model is written whole already"))
    template = ds_config.choose_optimizer(ds_config.load_config(plan.ds_template), training_args.optim,
                                          optim_args=training_args.optim_args, user_config=training_args.deepspeed is not None)
    quantization = choose_quantization(QuantRequest.from_model_args(model_args), gpu=gpu, zero_stage=plan.zero_stage,
                                       offload=plan.offload, use_peft=model_args.use_peft, precision=precision,
                                       bitsandbytes=bitsandbytes_version())
    data_options = prepare.DataOptions.from_args(script_args, training_args, llmft_args)
    prepare.check_options(data_options, training_args.eval_strategy, training_args.dataset_kwargs)
    with clock.phase("model_load"):
        model_config, tokenizer, model_path = load_model_files(model_args, training_args)
        source_path = model_path
        if plan.zero_stage < 3:  # every process loads the whole model: from node-local disk, read once per node
            model_path = stage_weights(model_path, plan.world.procs_per_node)
    resume = checkpoints.resolve_resume(training_args.output_dir, training_args.resume_from_checkpoint)
    given = llmft_args.global_batch_size is not None  # if not, a resume keeps the checkpoint's global batch on any world
    identity = run_identity.run_identity(
        script_args, training_args, model_args, llmft_args, zero_stage=plan.zero_stage,
        global_batch=elastic.kept_global_batch(resume, plan.batch.global_batch, global_batch_given=given),
        dataset_fingerprint=data.content_fingerprint(script_args.dataset_name, script_args.dataset_config),
    )
    identity["hyperparameters"] = rerun.hyperparameters(training_args)  # recorded, not compared: rerun.decide
    accepted = run_identity.check_same_run(training_args.output_dir, identity, training_args.resume_from_checkpoint)
    schedule_changes = []
    if resume:
        saved = run_identity.read_record(training_args.output_dir) or {}
        schedule_changes = [c for c in rerun.decide(saved.get("hyperparameters"), identity["hyperparameters"],
                                                    deepspeed_scheduler="scheduler" in template, output_dir=training_args.output_dir)
                            if c.split()[0].lstrip("-") in rerun.SCHEDULE_FLAGS]
    finished = checkpoints.nothing_left_to_train(training_args.output_dir, resume, training_args.max_steps,
                                                 training_args.num_train_epochs)
    if finished:
        log(finished)
        return 0
    if rank0():  # this run trains here: a save cut off earlier must neither be written into again nor rotated over
        for line in checkpoints.set_aside_incomplete(training_args.output_dir):
            log(line)
    resuming = resume and elastic.plan_resume(
        resume, plan.world.world_size, plan.zero_stage, plan.batch, global_batch_given=given
    )
    if resuming:  # another world keeps the checkpoint's global batch: the accumulation follows
        plan = dataclasses.replace(plan, batch=resuming.batch)
    if rank0():
        print("\n".join(plan.lines()), flush=True)
    log(resuming.describe(elastic.prepare(resuming, rank0(), log)) if resuming else f"starting a new run in {training_args.output_dir}")
    if accepted:
        log(f"continuing on purpose with new settings: {'; '.join(accepted)}")
    if schedule_changes:
        log(f"schedule changed since the checkpoint: {'; '.join(schedule_changes)}; the Trainer builds the schedule from these "
            "flags, so they take effect from the resumed step")
    if quantization:
        log(f"QLoRA: base model loaded in {'4' if quantization.get('load_in_4bit') else '8'}-bit (bitsandbytes)")

    # TRL turns a single --lora_target_modules value into a string, which PEFT reads as a regex over full
    # module names: `c_attn` would then match nothing. A plain name means "modules called that".
    target = model_args.lora_target_modules
    if isinstance(target, str) and target != "all-linear" and re.fullmatch(r"[\w.]+", target):
        model_args.lora_target_modules = [target]

    # 2. The run's max_length and attention (the tokenizer and model config are loaded above).
    with clock.phase("import"):
        from trl import get_peft_config

    max_length, note = prepare.resolve_max_length(model_config, training_args.max_length)
    if note:
        log(note)
    attention = choose_attention(model_args.attn_implementation, gpu, flash_attn_installed(),
                                 packing.model_attentions(model_config, training_args.trust_remote_code))
    if training_args.packing or training_args.padding_free:
        attention = packing.check_packing(
            packing=training_args.packing, padding_free=training_args.padding_free, strategy=training_args.packing_strategy,
            attention=attention, masks_from_positions=packing.masks_from_position_ids(model_config, training_args.trust_remote_code),
            sliding_window=packing.uses_sliding_window(model_config),
        )
        if attention == packing.PACKED_SDPA:
            packing.register_packed_sdpa()
    if training_args.use_liger_kernel:
        check_liger(gpu, model_config.model_type, liger_model_types(), training_args.liger_kernel_config)
    packed_note = ""
    if attention == packing.PACKED_SDPA:
        packed_note = (": PyTorch's varlen flash kernel on the packed samples"
                       if packing.packed_kernel_for(model_config, cuda=cuda, precision=precision) == "varlen"
                       else ": SDPA on each packed sample")
    log(f"attention {attention}" + (" (auto)" if model_args.attn_implementation in (None, "auto") else "") + packed_note)

    # 3. The data, tokenised once (rank 0; the other ranks wait on the files) or reused from the cache.
    with clock.phase("data"):
        prepared = prepare.prepare(data_options, tokenizer, dataclasses.replace(training_args, max_length=max_length), log=log,
                                   timeout=llmft_args.prepare_timeout, positions=prepare.model_positions(model_config))
    if prepared.shape == "messages":
        data.ensure_chat_template(tokenizer)
    records = prepared.info["records"]
    log(f"dataset {script_args.dataset_name}: {records['train']} records ({prepared.shape}, {llmft_args.data_percentage:g}% of the split)"
        + (f", {records['eval']} for evaluation" if prepared.eval is not None else ""))
    if rank0():
        prepare.write_run_record(training_args.output_dir, data_options, prepared)

    # 4. The concrete DeepSpeed config, written where the run's checkpoints go.
    resolved = ds_config.resolve(
        template,
        plan.batch,
        precision,
        gradient_clipping=training_args.max_grad_norm,
        lr=training_args.learning_rate,
        betas=(training_args.adam_beta1, training_args.adam_beta2),
        eps=training_args.adam_epsilon,
        weight_decay=training_args.weight_decay,
        hidden_size=getattr(model_config, "hidden_size", None),
    )
    if resuming and resuming.universal:
        resolved = elastic.with_universal_load(resolved)
    if cuda:  # the optimizer DeepSpeed can run here: FusedAdam needs nvcc unless prebuilt
        adam = ds_config.with_adam_kernel(resolved, ds_config.adam_kernel(
            cuda=cuda, offload=ds_config.offloads(resolved), **ds_config.local_adam_facts()))
        if adam is not resolved:
            resolved = adam
            log("DeepSpeed's FusedAdam is not prebuilt and no CUDA compiler (nvcc) is here to build it: the optimizer runs as "
                "torch.optim.AdamW (DeepSpeed's torch_adam); install the CUDA toolkit or prebuild DeepSpeed's ops for FusedAdam")
    if rank0():  # every check passed: this directory now holds this run (refused reruns never get here)
        run_identity.record_run(training_args.output_dir, identity)
        log(f"DeepSpeed config written to {ds_config.write_resolved(resolved, Path(training_args.output_dir))}")

    single_process_defaults()  # outside torchrun: a world of one, before DeepSpeed reads the environment
    if os.environ.get("LOCAL_RANK", "0") == "0":  # before any rank can load an op (they build after rendezvous)
        for finding in build_locks.clear_stale_build_locks(build_locks.extensions_root()):
            print(f"llmft: {socket.gethostname()}: {finding.message}", flush=True)  # every node's, not rank 0's
    with clock.phase("import"):
        skip_deepspeed_shm_op()  # an op training never uses that DeepSpeed would compile at start-up on CPU
        use_proc_cpuinfo_for_deepspeed()  # DeepSpeed's CPU op loads ask py-cpuinfo, 1 s a call
    arch_list = deepspeed_arch_list(os.environ.get("TORCH_CUDA_ARCH_LIST"))
    if arch_list:  # before DeepSpeed JIT-builds its first op (FusedAdam) in this process
        log(f"TORCH_CUDA_ARCH_LIST {os.environ['TORCH_CUDA_ARCH_LIST']!r} -> {arch_list!r} for DeepSpeed's op builds "
            "(it cannot read arch-specific targets such as 9.0a)")
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list
    with clock.phase("deepspeed_init"):  # TrainingArguments with a DeepSpeed config sets up DeepSpeed's config object
        args = trainer_arguments(training_args, plan=plan, precision=precision, resolved_ds_config=resolved, cuda=cuda,
                                 max_length=max_length, resume=resume)
    args.model_init_kwargs = model_init_kwargs(model_args, training_args, quantization, precision, attention)
    quantization_config = None
    if quantization:
        from transformers import BitsAndBytesConfig

        quantization_config = BitsAndBytesConfig(**{k: v for k, v in quantization.items() if k != "model_dtype"})

    # 5. Train. ZeRO-3 partitions the model while loading it (zero.Init), which needs DeepSpeed's comm layer up;
    # on GPUs HF starts it, on the CPU path it would see a world of one and reject the batch sizes.
    with clock.phase("import"):
        import deepspeed

    with clock.phase("deepspeed_init"):
        _ = args.device  # accelerate creates the process group (gloo on CPU, nccl on GPUs)
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    PublishCompleteCheckpoint, GracefulStop = _callbacks()
    before_loading = host_memory.current_rss()
    stop = GracefulStop(llmft_args.stop_file or os.environ.get("LLMFT_STOP_FILE"))
    publish = PublishCompleteCheckpoint(plan.zero_stage, plan.batch, training_args.save_total_limit)
    with clock.phase("data"), metrics.timing_model_load(clock):  # collating set-up is data, loading weights model_load
        trainer = saving.trainer_class(llmft_args.save_consolidated)(
            model=model_path,
            args=args,
            train_dataset=prepared.train,
            eval_dataset=prepared.eval,
            processing_class=tokenizer,
            peft_config=get_peft_config(model_args),
            quantization_config=quantization_config,
            callbacks=[publish, stop, rerun.callback(log)],
        )
    restore_source_name(trainer.model, model_path, source_path)
    trainer.add_callback(host_memory.report_callback(before_loading, host_memory.peak_rss()))
    trainer.add_callback(compile_report(trainer))
    evaluation.log_perplexity(trainer)
    tracking.guard_wandb(trainer, log)
    meter = metrics.attach(trainer, clock, gpu)  # step line, W&B metrics, run_summary.json
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    step = trainer.state.global_step
    if publish.refused:
        raise TrainError(publish.refused)
    if stop.stopped_at is not None:
        log(f"stop requested; saved checkpoint-{step}")
    else:
        if prepared.eval is not None and args.eval_strategy == "no":
            trainer.evaluate()  # evaluation data without --eval_strategy: scored once, at the end
        with meter.outside_training("save"):  # run_summary.json's save_seconds includes the final save
            trainer.save_model(args.output_dir)
            bad = saved_weights.check_save(args.output_dir, trainer.model, rank0())
        if bad:
            raise TrainError(f"the final model in {args.output_dir} is not what was trained: {'; '.join(bad)}; run not marked done")
        trainer.save_state()  # trainer_state.json (log history) beside the model, for llmft report
        if rank0():
            checkpoints.mark_done(args.output_dir, step)
        log(f"training complete at step {step}; "
            + saving.final_model_note(args.output_dir, step, plan.zero_stage, model_args.use_peft, llmft_args.save_consolidated))
    if rank0():
        log(f"run summary written to {meter.write_summary(args.output_dir, result.training_loss)}")
    if hasattr(trainer, "end"):
        trainer.end()
    return 0


def make_parser(subparsers=None):
    """llmft.training.flags.TrainParser (TRL's parser, with llmft's precision and DeepSpeed-file handling) for the four dataclasses.

    As a subcommand, `subparsers` must have been made with parser_class=TrainParser (llmft.cli does)."""
    import torch
    from trl import ModelConfig, ScriptArguments, SFTConfig

    dataclass_types = (ScriptArguments, SFTConfig, ModelConfig, LlmftArguments)
    if subparsers is not None:
        parser = subparsers.add_parser("train", help="Fine-tune with SFTTrainer on DeepSpeed ZeRO", dataclass_types=dataclass_types)
    else:
        parser = TrainParser(dataclass_types, prog="llmft train")
    # llmft trains on CPU exactly when no GPU is visible. dtype: unset means "the training precision" (TRL's default
    # would load fp32 weights on every rank of a bf16 run).
    parser.set_defaults(use_cpu=not torch.cuda.is_available(), dtype=None)
    return parser


def cli(parser, argv: list[str] | None = None) -> int:
    import yaml

    from llmft.planning.world import _cuda_device_count

    argv = list(sys.argv[1:] if argv is None else argv)
    if not {"-h", "--help"} & set(argv):
        try:
            problem = launch_problem(os.environ, _cuda_device_count(), argv)
        except LaunchEnvError as e:
            problem = str(e)
        if problem:  # before anything loads (HF reads these variables while parsing): several GPUs but one process
            if rank0():
                print(f"llmft train: error: {problem}", file=sys.stderr, flush=True)
            return 2
    try:
        script_args, training_args, model_args, llmft_args = parser.parse_args_and_config(args=argv)
    except (ValueError, OSError, yaml.YAMLError) as e:  # HF/TRL validate flags in __post_init__; --config file problems
        if isinstance(e, OSError):
            message = f"cannot read {e.filename or 'the --config file'}: {e.strerror or e}"
        elif isinstance(e, yaml.YAMLError):
            message = f"the --config file is not valid YAML: {str(e).strip().splitlines()[0]}"
        else:
            message = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        if rank0():
            print(f"llmft train: error: {message}", file=sys.stderr, flush=True)
        return 2
    return main(script_args, training_args, model_args, llmft_args)


if __name__ == "__main__":
    sys.exit(cli(make_parser()))

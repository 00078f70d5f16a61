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

Every `SFTConfig`/`TrainingArguments` flag works, with TRL's names. llmft adds `--zero_stage`,
`--offload`, `--global_batch_size`, `--data_percentage`, `--precision` and column mapping. A rerun
with the same `--output_dir` resumes from the newest complete checkpoint; it never starts over.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from llmft import checkpoints, data, ds_config, prepare
from llmft.launch_env import rank0, single_process_defaults
from llmft.hardware import PRECISIONS, HardwareError
from llmft.plan import PlanError, local_precision, make_plan


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


def _callbacks():
    """Trainer callbacks, defined lazily so importing llmft.train stays cheap."""
    import torch
    import torch.distributed as dist
    from transformers import TrainerCallback

    def all_ranks_max(flag: bool, device) -> bool:
        if not (dist.is_available() and dist.is_initialized()):
            return flag
        t = torch.tensor([int(flag)], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    class PublishCompleteCheckpoint(TrainerCallback):
        """After every rank has written its shard, publish checkpoint-N/llmft_complete.json."""

        def __init__(self, zero_stage: int):
            self.zero_stage = zero_stage

        def on_save(self, args, state, control, **kwargs):
            if dist.is_initialized():
                dist.barrier()
            if state.is_world_process_zero:
                ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
                checkpoints.mark_complete(ckpt, args.world_size, self.zero_stage)
                log(f"saved complete checkpoint {ckpt}")
            if dist.is_initialized():
                dist.barrier()

    class GracefulStop(TrainerCallback):
        """On SIGUSR1/SIGTERM or when the stop file appears: finish this step, save, stop (for preemption)."""

        def __init__(self, stop_file: str | None):
            self.stop_file = stop_file
            self.requested = False
            self.stopped_at: int | None = None

        def on_train_begin(self, args, state, control, **kwargs):
            for sig in (signal.SIGUSR1, signal.SIGTERM):
                signal.signal(sig, self._request)

        def _request(self, signum, frame):
            self.requested = True

        def on_step_end(self, args, state, control, **kwargs):
            asked = self.requested or bool(state.is_world_process_zero and self.stop_file and os.path.exists(self.stop_file))
            if all_ranks_max(asked, args.device) and state.global_step < state.max_steps:
                control.should_save = True
                control.should_training_stop = True
                self.stopped_at = state.global_step

    class StepLog(TrainerCallback):
        """One line per logging step on rank 0: step, loss, learning rate, tokens per second."""

        def __init__(self):
            self.last = (time.time(), 0)

        def on_train_begin(self, args, state, control, **kwargs):
            self.last = (time.time(), state.num_input_tokens_seen)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not state.is_world_process_zero or not logs or "loss" not in logs:
                return
            now, tokens = time.time(), state.num_input_tokens_seen
            tps = (tokens - self.last[1]) / max(now - self.last[0], 1e-9)
            self.last = (now, tokens)
            logs["tokens_per_second"] = round(tps, 1)
            print(
                f"llmft: step {state.global_step}/{state.max_steps} loss {logs['loss']:.4f} "
                f"lr {logs.get('learning_rate', 0.0):.2e} tokens/s {tps:.0f}",
                flush=True,
            )

    return PublishCompleteCheckpoint, GracefulStop, StepLog


def requested_precision(training_args, llmft_args) -> str:
    """--precision, or an explicit --fp16 (TRL's SFTConfig turns bf16 on by default, so only fp16 is a choice)."""
    if llmft_args.precision not in PRECISIONS:
        raise TrainError(f"unknown --precision {llmft_args.precision!r}; use one of {', '.join(PRECISIONS)}")
    if llmft_args.precision == "auto" and training_args.fp16:
        return "fp16"
    return llmft_args.precision


def main(script_args, training_args, model_args, llmft_args) -> int:
    """Check everything cheap first, then build the trainer and train (or resume)."""
    try:
        return _train(script_args, training_args, model_args, llmft_args)
    except (TrainError, PlanError, HardwareError, data.DataError, ds_config.DSConfigError, checkpoints.CheckpointError) as e:
        if rank0():
            print(f"llmft train: error: {e}", file=sys.stderr, flush=True)
        return 2


def _train(script_args, training_args, model_args, llmft_args) -> int:
    import torch

    from llmft import eval as evaluation
    from llmft import tracking

    # 1. Cheap checks: batch math, DeepSpeed template, data, resume point. No model yet.
    if not model_args.model_name_or_path:
        raise TrainError("--model_name_or_path is required (a hub name or a local model directory)")
    if not script_args.dataset_name:
        raise TrainError("--dataset_name is required (a .jsonl/.json/.parquet/.csv file or directory, or a hub dataset)")
    if training_args.save_total_limit == 1:
        raise TrainError("--save_total_limit 1 can leave no complete checkpoint if a job dies while saving; use 2 or more")
    cuda = torch.cuda.is_available()
    precision = local_precision(requested_precision(training_args, llmft_args))
    grad_accum = training_args.gradient_accumulation_steps if training_args.gradient_accumulation_steps != 1 else None
    plan = make_plan(
        micro_batch=training_args.per_device_train_batch_size,
        global_batch=llmft_args.global_batch_size,
        grad_accum=grad_accum,
        zero_stage=llmft_args.zero_stage,
        offload=llmft_args.offload,
        deepspeed=training_args.deepspeed,
        precision=precision,
        output_dir=training_args.output_dir,
    )
    data_options = prepare.DataOptions.from_args(script_args, training_args, llmft_args)
    prepare.check_options(data_options, training_args.eval_strategy, training_args.dataset_kwargs)
    resume = checkpoints.resolve_resume(training_args.output_dir, training_args.resume_from_checkpoint)
    if resume:
        checkpoints.check_resumable(resume, plan.world.world_size, plan.zero_stage)
    if rank0():
        print("\n".join(plan.lines()), flush=True)
    log(f"resuming from {resume}" if resume else f"starting a new run in {training_args.output_dir}")

    # TRL turns a single --lora_target_modules value into a string, which PEFT reads as a regex over full
    # module names: `c_attn` would then match nothing. A plain name means "modules called that".
    target = model_args.lora_target_modules
    if isinstance(target, str) and target != "all-linear" and re.fullmatch(r"[\w.]+", target):
        model_args.lora_target_modules = [target]

    # 2. Tokenizer and model config (small files).
    from transformers import AutoConfig, AutoTokenizer
    from trl import SFTTrainer, get_peft_config

    model_config = AutoConfig.from_pretrained(model_args.model_name_or_path, trust_remote_code=training_args.trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, trust_remote_code=training_args.trust_remote_code)
    max_length, note = prepare.resolve_max_length(model_config, training_args.max_length)
    if note:
        log(note)

    # 3. The data, tokenised once (rank 0; the other ranks wait on the files) or reused from the cache.
    prepared = prepare.prepare(data_options, tokenizer, dataclasses.replace(training_args, max_length=max_length), log=log,
                               timeout=llmft_args.prepare_timeout)
    if prepared.shape == "messages":
        data.ensure_chat_template(tokenizer)
    records = prepared.info["records"]
    log(f"dataset {script_args.dataset_name}: {records['train']} records ({prepared.shape}, {llmft_args.data_percentage:g}% of the split)"
        + (f", {records['eval']} for evaluation" if prepared.eval is not None else ""))
    if rank0():
        prepare.write_run_record(training_args.output_dir, data_options, prepared)

    # 4. The concrete DeepSpeed config, written where the run's checkpoints go.
    resolved = ds_config.resolve(
        ds_config.load_config(plan.ds_template),
        plan.batch,
        precision,
        gradient_clipping=training_args.max_grad_norm,
        lr=training_args.learning_rate,
        betas=(training_args.adam_beta1, training_args.adam_beta2),
        eps=training_args.adam_epsilon,
        weight_decay=training_args.weight_decay,
        hidden_size=getattr(model_config, "hidden_size", None),
    )
    if rank0():
        log(f"DeepSpeed config written to {ds_config.write_resolved(resolved, Path(training_args.output_dir))}")

    single_process_defaults()  # outside torchrun: a world of one, before DeepSpeed reads the environment
    args = dataclasses.replace(
        training_args,
        deepspeed=resolved,
        per_device_train_batch_size=plan.batch.micro_batch,
        gradient_accumulation_steps=plan.batch.grad_accum,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        use_cpu=not cuda,  # without it accelerate sees world size 1 on CPU and DeepSpeed fails
        dataloader_pin_memory=cuda,
        include_num_input_tokens_seen="all",
        max_length=max_length,
        resume_from_checkpoint=str(resume) if resume else None,
        dataset_kwargs={**(training_args.dataset_kwargs or {}), "skip_prepare_dataset": True},  # prepared above
        assistant_only_loss=False,  # already in the prepared labels (and TRL would check the untokenised format)
    )
    model_init_kwargs = {"trust_remote_code": training_args.trust_remote_code, "revision": model_args.model_revision}
    if model_args.attn_implementation:
        model_init_kwargs["attn_implementation"] = model_args.attn_implementation
    if model_args.dtype not in (None, "auto"):
        model_init_kwargs["dtype"] = model_args.dtype  # else fp32 weights: DeepSpeed keeps exact fp32 masters
    model_init_kwargs.update(args.model_init_kwargs or {})
    args.model_init_kwargs = model_init_kwargs

    # 5. Train. ZeRO-3 partitions the model while loading it (zero.Init), which needs DeepSpeed's comm layer up;
    # on GPUs HF starts it, on the CPU path it would see a world of one and reject the batch sizes.
    import deepspeed

    _ = args.device  # accelerate creates the process group (gloo on CPU, nccl on GPUs)
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    PublishCompleteCheckpoint, GracefulStop, StepLog = _callbacks()
    stop = GracefulStop(llmft_args.stop_file or os.environ.get("LLMFT_STOP_FILE"))
    trainer = SFTTrainer(
        model=model_args.model_name_or_path,
        args=args,
        train_dataset=prepared.train,
        eval_dataset=prepared.eval,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
        callbacks=[PublishCompleteCheckpoint(plan.zero_stage), stop, StepLog()],
    )
    evaluation.log_perplexity(trainer)
    tracking.guard_wandb(trainer, log)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    step = trainer.state.global_step
    if stop.stopped_at is not None:
        log(f"stop requested; saved checkpoint-{step}")
    else:
        if prepared.eval is not None and args.eval_strategy == "no":
            trainer.evaluate()  # evaluation data without --eval_strategy: scored once, at the end
        trainer.save_model(args.output_dir)
        trainer.save_state()  # trainer_state.json (log history) beside the model, for llmft report
        if rank0():
            checkpoints.mark_done(args.output_dir, step)
        log(f"training complete at step {step}; model saved to {args.output_dir}")
    if hasattr(trainer, "end"):
        trainer.end()
    return 0


def make_parser(subparsers=None):
    import torch
    from trl import ModelConfig, ScriptArguments, SFTConfig, TrlParser

    dataclass_types = (ScriptArguments, SFTConfig, ModelConfig, LlmftArguments)
    if subparsers is not None:
        parser = subparsers.add_parser("train", help="Fine-tune with SFTTrainer on DeepSpeed ZeRO", dataclass_types=dataclass_types)
    else:
        parser = TrlParser(dataclass_types, prog="llmft train")
    # SFTConfig turns bf16 on by default, which HF rejects on a machine without CUDA unless use_cpu is set.
    parser.set_defaults(use_cpu=not torch.cuda.is_available())
    return parser


def cli(parser, argv: list[str] | None = None) -> int:
    try:
        script_args, training_args, model_args, llmft_args = parser.parse_args_and_config(args=argv)
    except ValueError as e:  # HF/TRL validate flags in __post_init__ (e.g. a --deepspeed file that does not exist)
        if rank0():
            print(f"llmft train: error: {str(e).strip().splitlines()[-1]}", file=sys.stderr, flush=True)
        return 2
    return main(script_args, training_args, model_args, llmft_args)


if __name__ == "__main__":
    sys.exit(cli(make_parser()))

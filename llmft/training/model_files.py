"""The model a run trains: its config and tokenizer, how its weights load, and the Trainer arguments llmft decides."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import NamedTuple

from llmft.errors import TrainError
from llmft.planning.hardware import choose_precision
from llmft.training import hub


def train_precision(training_args, llmft_args, gpu) -> str:
    """llmft.planning.hardware.choose_precision with --precision and the --bf16/--fp16 flags as given.

    Called without llmft's parser (main() from Python), only an fp16=True is a choice: SFTConfig sets bf16 on
    by default, so its bf16 says nothing about what the user asked."""
    bf16, fp16 = llmft_args.bf16_flag, llmft_args.fp16_flag
    if bf16 is None and fp16 is None and training_args.fp16:
        fp16 = True
    return choose_precision(llmft_args.precision, gpu, bf16=bf16, fp16=fp16)


class ModelFiles(NamedTuple):
    config: object  # transformers PretrainedConfig
    tokenizer: object
    weights: str  # the local directory (or hub snapshot) the weights load from
    source: str | None = None  # where the weights came from, when `weights` is a node-local copy of them


def load_model_files(model_args, training_args) -> ModelFiles:
    """The model's config and tokenizer (small files), at the asked revision, and the path to load the weights
    from; a missing model is one line. A hub model is downloaded once per job first (llmft.training.hub: one process,
    the others wait), then every process loads the local snapshot."""
    from transformers import AutoConfig, AutoTokenizer

    name = model_args.model_name_or_path
    path = Path(name).expanduser()
    if name.startswith(("/", "./", "../", "~")) or path.exists():
        if not path.exists():
            raise TrainError(
                f"model directory {name} not found: pass an existing local model directory or a hub model name"
            )
        if not path.is_dir() or not (path / "config.json").is_file():
            raise TrainError(
                f"{name} is not a model directory (no config.json in it): pass a directory saved with "
                "save_pretrained, or a hub model name"
            )
    name = hub.resolve_model(name, model_args.model_revision)
    kwargs = {"revision": model_args.model_revision, "trust_remote_code": training_args.trust_remote_code}
    loaded = []
    for what, cls in (("config", AutoConfig), ("tokenizer", AutoTokenizer)):
        try:
            loaded.append(cls.from_pretrained(name, **kwargs))
        except (OSError, ValueError) as e:
            reason = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            raise TrainError(
                f"cannot load the {what} of {name} (revision {model_args.model_revision}): {reason}"
            ) from None
    return ModelFiles(loaded[0], loaded[1], name)


def model_init_kwargs(
    model_args, training_args, quantization: dict | None, precision: str = "fp32", attention: str | None = None
) -> dict:
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


def trainer_arguments(
    training_args, *, plan, precision, resolved_ds_config, cuda: bool, max_length, resume, prepared_by: str = "llmft"
):
    """The config (SFTConfig, DPOConfig, ...) the Trainer runs with: the user's, with what llmft decided
    (flag_policy.POLICY names each field). Data TRL tokenises itself (prepared_by "trl": DPO, KTO, reward models)
    keeps TRL's max_length and preparation; fields a method's config lacks are not set."""
    changes = dict(
        deepspeed=resolved_ds_config,
        per_device_train_batch_size=plan.batch.micro_batch,
        gradient_accumulation_steps=plan.batch.grad_accum,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        use_cpu=not cuda,  # without it accelerate sees world size 1 on CPU and DeepSpeed fails
        dataloader_pin_memory=training_args.dataloader_pin_memory and cuda,
        # padding-free without packing: TRL refuses a max_length it would not enforce; llmft.prepare truncated already
        max_length=None
        if getattr(training_args, "padding_free", False) and not getattr(training_args, "packing", False)
        else max_length,
        resume_from_checkpoint=str(resume) if resume else None,
        save_total_limit=None,  # applied by llmft after each checkpoint is complete (PublishCompleteCheckpoint)
        dataset_kwargs={**(getattr(training_args, "dataset_kwargs", None) or {}), "skip_prepare_dataset": True},
        assistant_only_loss=False,  # already in the prepared labels (and TRL would check the untokenised format)
    )
    if prepared_by != "llmft":  # TRL tokenises and truncates the records itself
        changes.update(max_length=max_length)
        changes.pop("dataset_kwargs")  # else: llmft.prepare did it
    fields = {f.name for f in dataclasses.fields(training_args)}
    return dataclasses.replace(training_args, **{k: v for k, v in changes.items() if k in fields})


def with_checkpointing(training_args, on: bool):
    """training_args with gradient checkpointing on or off. transformers 5 resolves `gradient_checkpointing` into
    `activation_checkpointing` and a copy keeps the resolved name, so both are set (one alone is silently undone)."""
    return dataclasses.replace(training_args, activation_checkpointing=on, gradient_checkpointing=on)


def check_model_task(task: str, config, method_name: str) -> None:
    """A reward model (task "sequence_classification", llmft.planning.methods) is the base with a one-output score
    head, built by AutoModelForSequenceClassification: a base whose architecture has no such class is refused in one
    line before anything loads, not failed inside TRL."""
    if task != "sequence_classification":
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING

    if type(config) in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING:
        return
    if "AutoModelForSequenceClassification" in (getattr(config, "auto_map", None) or {}):
        return  # the model's own code has one (--trust_remote_code)
    raise TrainError(
        f"--method {method_name} puts a one-output score head on the base, but its architecture "
        f"({getattr(config, 'model_type', type(config).__name__)}) has no sequence-classification class in "
        "transformers (AutoModelForSequenceClassification): start from a base that has one (Llama, Qwen2, Mistral, "
        "GPT-2, ...)"
    )

"""What defines a run, recorded in its output directory, so a rerun resumes only the same experiment.

A rerun with the same --output_dir resumes from the newest complete checkpoint. That is right for a
requeued or resubmitted job, and wrong when the settings changed: the new run would silently continue
another model's optimizer state, data order and schedule. llmft writes `<output_dir>/llmft_run.json`
with the settings that define the run (model, dataset and its content fingerprint, LoRA/QLoRA settings,
max_length, packing, global batch, ZeRO stage) and refuses a rerun whose settings differ, naming each
difference and the way out. The world size is not part of it: the same run may continue on other GPUs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from llmft.checkpoint.run_dir import DONE_MARKER, RUN_RECORD, checkpoint_dirs, latest_complete
from llmft.errors import LlmftError

# key -> how a difference is named in the message
LABELS = {
    "method": "training method",
    "model": "model",
    "model_revision": "model revision",
    "dataset_fingerprint": "dataset content",
    "dataset_config": "dataset config",
    "dataset_split": "dataset split",
    "data_percentage": "data percentage",
    "columns": "dataset columns",
    "lora": "LoRA settings",
    "quantization": "QLoRA quantization",
    "quantization_settings": "QLoRA 4-bit settings",
    "max_length": "max_length",
    "packing": "packing",
    "global_batch": "global batch",
    "zero_stage": "ZeRO stage",
}


class RunMismatch(LlmftError, ValueError):
    """The output directory holds a different run; the message names the differences and the way out."""


def _model_id(name: str) -> str:
    path = Path(name).expanduser()
    return str(path.resolve()) if path.exists() else name


def run_identity(
    script_args, training_args, model_args, llmft_args, *, dataset_fingerprint: str, global_batch: int, zero_stage: int
) -> dict:
    """The settings that make two runs the same experiment, as a JSON-able dict (keys as in LABELS)."""
    lora = None
    if model_args.use_peft:
        target = model_args.lora_target_modules
        lora = {
            "r": model_args.lora_r,
            "alpha": model_args.lora_alpha,
            "dropout": model_args.lora_dropout,
            "target_modules": [target] if isinstance(target, str) else target,
            "target_parameters": model_args.lora_target_parameters,
            "modules_to_save": model_args.lora_modules_to_save,
            "rslora": model_args.use_rslora,
            "dora": model_args.use_dora,
        }
    quant = "4bit" if model_args.load_in_4bit else "8bit" if model_args.load_in_8bit else None
    return {
        "method": getattr(llmft_args, "method", "sft"),  # a record written before --method existed is SFT's
        "model": _model_id(model_args.model_name_or_path),
        "model_revision": model_args.model_revision,
        "dataset": _model_id(
            script_args.dataset_name or getattr(llmft_args, "dataset_mixture", None) or ""
        ),  # shown, not compared
        "dataset_fingerprint": dataset_fingerprint,
        "dataset_config": script_args.dataset_config,
        "dataset_split": script_args.dataset_train_split,
        "data_percentage": llmft_args.data_percentage,
        "columns": {
            "prompt": llmft_args.prompt_column,
            "completion": llmft_args.completion_column,
            "messages": llmft_args.messages_column,
            "text": getattr(training_args, "dataset_text_field", "text"),
        },
        "lora": lora,
        "quantization": quant,
        "max_length": training_args.max_length,
        "packing": getattr(training_args, "packing", False),
        "global_batch": global_batch,
        "zero_stage": zero_stage,
    }


def _short(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} {_short(v)}" for k, v in value.items() if v not in (None, False)) + "}"
    if isinstance(value, list):
        return " ".join(map(str, value))
    return "none" if value is None else str(value)


def differences(saved: dict, current: dict) -> list[str]:
    """One 'label old -> new' entry per setting that differs (settings a record lacks are not compared)."""
    out = []
    for key, label in LABELS.items():
        if key in saved and saved[key] != current.get(key):
            if isinstance(saved[key], dict) and isinstance(current.get(key), dict):
                for sub in sorted(set(saved[key]) | set(current[key])):
                    if saved[key].get(sub) != current[key].get(sub):
                        out.append(f"{label}: {sub} {_short(saved[key].get(sub))} -> {_short(current[key].get(sub))}")
                continue
            old, new = _short(saved[key]), _short(current.get(key))
            if key == "dataset_fingerprint":
                old, new = f"{saved.get('dataset', '?')} ({old})", f"{current.get('dataset', '?')} ({new})"
            out.append(f"{label} {old} -> {new}")
    return out


def has_training_state(output_dir: str | Path) -> bool:
    """Whether the directory holds anything a rerun would continue: a checkpoint-N or a finished run."""
    return bool(checkpoint_dirs(output_dir)) or (Path(output_dir) / DONE_MARKER).exists()


def read_record(output_dir: str | Path) -> dict | None:
    path = Path(output_dir) / RUN_RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except ValueError:
        raise RunMismatch(f"{path} is not valid JSON: restore it, or use a new --output_dir") from None
    if not isinstance(record, dict):
        raise RunMismatch(f"{path} does not hold a JSON object: restore it, or use a new --output_dir")
    return record


def check_same_run(output_dir: str | Path, identity: dict, resume_requested: str | None) -> list[str]:
    """Refuse a rerun into a directory holding a different run, unless --resume_from_checkpoint PATH says so.

    Returns the differences that an explicit resume accepts (empty when the runs match or nothing is recorded).
    """
    record = read_record(output_dir)
    if record is None or not has_training_state(output_dir):
        return []
    diffs = differences(record, identity)
    if not diffs or resume_requested not in (None, "", "latest"):
        return diffs
    ckpt = latest_complete(output_dir)
    way_out = "use a new --output_dir" + (
        f", or continue this run with the new settings on purpose: --resume_from_checkpoint {ckpt}" if ckpt else ""
    )
    raise RunMismatch(f"{output_dir} holds another run ({'; '.join(diffs)}): {way_out}")


def record_run(output_dir: str | Path, identity: dict) -> Path:
    """Write the record (atomically); call on one rank once every check has passed, before training."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / RUN_RECORD
    tmp = path.with_name(f".{RUN_RECORD}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(identity, indent=2) + "\n")
    os.replace(tmp, path)
    return path


LAUNCH_RECORD = "llmft_launch.json"  # how the run was started: for the model card `llmft export` writes
_VERSIONED = ("torch", "transformers", "trl", "deepspeed", "peft", "accelerate", "datasets", "llmft")


def _is_secret_flag(name: str) -> bool:
    """--hub_token, --push_to_hub_token, --token: an access token (--eos_token and --pad_token name tokens, not secrets)."""
    name = name.lower()
    return name == "--token" or ("hub" in name and "token" in name)


def redact_secrets(argv: list[str]) -> list[str]:
    """The flags with any access token's value hidden (`--hub_token X`, `--hub_token=X`): the command goes into a
    model card."""
    out, hide_next = [], False
    for arg in argv:
        name = arg.split("=", 1)[0]
        if hide_next:
            out.append("<redacted>")
            hide_next = False
        elif arg.startswith("--") and _is_secret_flag(name) and "=" in arg:
            out.append(name + "=<redacted>")
        else:
            out.append(arg)
            hide_next = arg.startswith("--") and _is_secret_flag(name)
    return out


def launch_record(argv: list[str], env: dict) -> dict:
    """The exact command, where it ran (nodes, processes per node, scheduler and job) and the package versions.

    The command is `llmft train` with this process's flags (under torchrun every rank has the same ones); the
    environment is only read for its numbers and the scheduler's job id, never stored whole (it may hold tokens)."""
    import shlex
    from importlib import metadata

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    world = int(env.get("WORLD_SIZE", "1") or 1)
    local = int(env.get("LOCAL_WORLD_SIZE", str(world)) or world)
    scheduler = "slurm" if env.get("SLURM_JOB_ID") else "pbs" if env.get("PBS_JOBID") else None
    return {
        "command": shlex.join(["llmft", "train", *redact_secrets(argv)]),
        "world_size": world,
        "nnodes": max(1, world // max(1, local)),
        "nproc_per_node": local,
        "scheduler": scheduler,
        "job_id": env.get("SLURM_JOB_ID") or env.get("PBS_JOBID") or None,
        "versions": {name: version(name) for name in _VERSIONED},
    }


def record_launch(output_dir: str | Path, record: dict) -> Path:
    path = Path(output_dir) / LAUNCH_RECORD
    tmp = path.with_name(f".{LAUNCH_RECORD}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)
    return path

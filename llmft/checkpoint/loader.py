"""Load a model for inference or evaluation: from ZeRO shards (no DeepSpeed), a run directory, or an exported model.

`llmft infer` and `llmft eval` both load through here, so they pick the same checkpoint, device and dtype.
"""

from __future__ import annotations

import glob
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from llmft.checkpoint.run_dir import choose_checkpoint, tag_dir
from llmft.checkpoint.zero import CheckpointError, ZeroCheckpoint, is_tag_dir, open_checkpoint
from llmft.planning.hardware import choose_precision, local_gpu, torch_dtype
from llmft.planning.model_shape import model_positions

DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def _step_of(path: Path) -> int:
    m = re.search(r"(\d+)$", path.name)
    return int(m.group(1)) if m else -1


def _tag_dir_in(path: Path) -> Path:
    """Map a tag dir, a checkpoint dir (with `latest` or global_step*) or a run dir to one tag dir.

    Which checkpoint of a run is llmft.checkpoint.run_dir.choose_checkpoint's decision (the one training resumes from)."""

    if path.is_file() and path.name.endswith("_states.pt"):
        path = path.parent
    if is_tag_dir(path):
        return path
    if not path.is_dir():
        raise CheckpointError(
            f"{path} is not a directory: pass a global_stepN directory, a checkpoint-N directory or a run's output directory"
        )
    tag = tag_dir(path)
    if tag is not None:
        return tag
    ckpt, notes = choose_checkpoint(path, unmarked_ok=True)
    for note in notes:
        print(f"llmft infer: {note}", file=sys.stderr)
    if ckpt is not None:
        return _tag_dir_in(ckpt)
    if notes:
        raise CheckpointError(
            f"{path} holds no complete checkpoint ({notes[0].removeprefix('skipping ')}): "
            "pass a complete checkpoint-N directory, or resume training to write one"
        )
    raise CheckpointError(
        f"{path} holds no DeepSpeed checkpoint (no *model_states.pt, no 'latest' file, no global_step* or checkpoint-* directories): "
        "pass a global_stepN directory, a checkpoint-N directory or a run's output directory"
    )


def resolve_checkpoint(paths: list[str]) -> tuple[Path, str | None]:
    """One tag directory for the given paths (a shell glob may hand several: the highest step wins).

    Returns the tag directory and, when a choice was made, a note saying which one.
    """
    tags = []
    for p in paths:
        path = Path(p)
        if not path.exists():
            if glob.has_magic(p):
                raise CheckpointError(
                    f"no checkpoint matched {p} (the shell passed the pattern through unexpanded): check the directory and the pattern"
                )
            raise CheckpointError(f"{p} does not exist: check the path")
        tags.append(_tag_dir_in(path))
    tags = sorted(set(tags), key=lambda t: (_step_of(t), str(t)))
    chosen = tags[-1]
    note = f"{len(tags)} checkpoints given; using the highest step: {chosen}" if len(tags) > 1 else None
    return chosen, note


@dataclass
class Source:
    """Where config, tokenizer and (for LoRA) base weights come from."""

    config: str
    tokenizer: str
    adapter_dir: Path | None = None


def find_source(tag_dir: Path, model_name: str | None) -> Source:
    """Config and tokenizer: --model_name if given, else llmft's files beside the tag directory
    (for LoRA: the adapter's base model); the tokenizer saved with the checkpoint is preferred."""
    ckpt_dir = tag_dir.parent
    adapter = ckpt_dir / "adapter_config.json"
    adapter_dir = ckpt_dir if adapter.is_file() else None
    if model_name:
        config = model_name
    elif adapter_dir:
        config = json.loads(adapter.read_text()).get("base_model_name_or_path")
        if not config:
            raise CheckpointError(f"{adapter} names no base_model_name_or_path: pass --model_name with the base model")
    elif (ckpt_dir / "config.json").is_file():
        config = str(ckpt_dir)
    else:
        raise CheckpointError(
            f"no config.json beside {tag_dir} (a plain DeepSpeed checkpoint): pass --model_name with the base model it was trained from, e.g. --model_name gpt2"
        )
    has_tok = any((ckpt_dir / f).is_file() for f in _TOKENIZER_FILES)
    tokenizer = str(ckpt_dir) if has_tok and not model_name else config
    return Source(config=config, tokenizer=tokenizer, adapter_dir=adapter_dir)


def pick_device(name: str | None) -> str:
    import torch

    if name is None:
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise CheckpointError(f"--device {name} but CUDA is not available here: use --device cpu")
        index = torch.device(name).index or 0
        if index >= torch.cuda.device_count():
            raise CheckpointError(
                f"--device {name} but this machine has {torch.cuda.device_count()} CUDA device(s): use cuda:0 or cpu"
            )
    return name


_PRECISION_OF = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def pick_dtype(name: str | None, device: str, exporting: bool):
    """llmft.planning.hardware.choose_precision for the device (auto: bf16 on Ampere+, fp16 on older GPUs, fp32 on CPU;
    bf16 asked on a GPU without it is refused). Exports keep the checkpoint's fp32 unless --dtype says otherwise:
    there the dtype is how the weights are stored, not what a GPU computes in."""
    import torch

    requested = "auto" if name in (None, "auto") else _PRECISION_OF[DTYPES[name]]
    if exporting:
        return torch.float32 if requested == "auto" else torch_dtype(requested)
    try:
        gpu = local_gpu(torch.device(device).index or 0) if device.startswith("cuda") else None
        return torch_dtype(choose_precision(requested, gpu, inference=True))
    except ValueError as e:
        raise CheckpointError(
            str(e).replace("--precision fp16", "--dtype float16").replace("--precision fp32", "--dtype float32")
        ) from None


def _hf(what: str, src: str, fn):
    try:
        return fn()
    except (OSError, ValueError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"cannot load the {what} of {src} ({reason}): pass --model_name with a local model directory or a hub name you can download"
        ) from None


def check_generates_text(config, src: str) -> None:
    """llmft infer, eval and export read a causal LM. A reward model (`llmft train --method reward`: a one-output score
    head, saved as ...ForSequenceClassification) has no LM head to generate with: one line, not a model built with a
    random head or a shard that names no layer."""
    scorers = [a for a in (getattr(config, "architectures", None) or []) if a.endswith("ForSequenceClassification")]
    if scorers:
        raise CheckpointError(
            f"{src} is a reward model ({scorers[0]}: a one-output score head), not a model that generates text: "
            "its held-out accuracy is run_summary.json's eval_accuracy; score pairs with it in Python "
            "(AutoModelForSequenceClassification)"
        )


def _empty_model(config, dtype, device):
    """Build the architecture without random init (the weights are overwritten from the shards)."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        from transformers.modeling_utils import no_init_weights
    with no_init_weights(), torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()
    return model


def _strip(name: str) -> str:
    for prefix in ("module.", "_orig_mod."):
        if name.startswith(prefix):
            name = name[len(prefix) :]
    return name


def fill_from_checkpoint(model, ckpt: ZeroCheckpoint, src: str, allow_missing=lambda name: False) -> None:
    """Copy the checkpoint into the model's own tensors, after checking names and shapes match."""
    params = model.state_dict(keep_vars=True)
    dest = {}
    for name, shape in ckpt.shapes.items():
        if name in ckpt.shared:
            continue
        target = params.get(_strip(name))
        if target is None and "lora_" in name:
            raise CheckpointError(
                f"{ckpt.tag_dir} holds LoRA weights ({name}) but no adapter_config.json beside it: "
                "copy the run's adapter_config.json into the checkpoint directory"
            )
        if target is None:
            raise CheckpointError(
                f"checkpoint tensor {name} does not exist in {src}: --model_name must name the base model the checkpoint was trained from"
            )
        if tuple(target.shape) != tuple(shape):
            raise CheckpointError(
                f"checkpoint layer {name} has shape {tuple(shape)} but {src} expects {tuple(target.shape)}: "
                "--model_name must name the base model the checkpoint was trained from"
            )
        dest[name] = target.data
    covered = {_strip(n) for n in ckpt.shapes}
    ptrs = {t.data_ptr() for t in dest.values()}
    missing = [n for n, t in params.items() if n not in covered and t.data_ptr() not in ptrs and not allow_missing(n)]
    if missing:
        raise CheckpointError(
            f"the checkpoint has no weights for {missing[0]} ({len(missing)} tensors of {src} missing): "
            "--model_name must name the base model the checkpoint was trained from"
        )
    import torch

    with torch.no_grad():
        ckpt.read_into(dest)
    ckpt.release()  # unmap the shards: the pages read stay counted in RSS while mapped


def model_from_checkpoint(ckpt: ZeroCheckpoint, config, dtype=None, device: str = "cpu", name: str = "the model"):
    """A causal LM built from `config` and filled in place from the shards (no tokenizer, no LoRA)."""
    import torch

    model = _empty_model(config, dtype or torch.float32, device)
    fill_from_checkpoint(model, ckpt, name)
    return model.eval()


@dataclass
class Loaded:
    model: object
    tokenizer: object
    ckpt: ZeroCheckpoint
    source: Source
    seconds: float


def load(
    tag_dir: Path,
    model_name: str | None = None,
    device: str = "cpu",
    dtype=None,
    merge: bool = False,
    trust: bool = False,
) -> Loaded:
    """Model + tokenizer from a tag directory, weights read from the shards into the model in place."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    dtype = dtype or torch.float32
    ckpt = open_checkpoint(tag_dir, trust)
    src = find_source(tag_dir, model_name)
    config = _hf("config", src.config, lambda: AutoConfig.from_pretrained(src.config))
    check_generates_text(config, src.config)
    tokenizer = _hf("tokenizer", src.tokenizer, lambda: AutoTokenizer.from_pretrained(src.tokenizer))
    if src.adapter_dir is None:
        model = model_from_checkpoint(ckpt, config, dtype, device, src.config)
    else:
        from peft import PeftConfig, PeftModel

        peft_config = PeftConfig.from_pretrained(src.adapter_dir)
        has_base = any("lora_" not in n for n in ckpt.shapes)
        if has_base:  # frozen base weights were saved in the shards too
            base = _empty_model(config, dtype, device)
        else:  # HF Trainer excludes frozen weights: they come from the base model
            base = _hf(
                "weights", src.config, lambda: AutoModelForCausalLM.from_pretrained(src.config, dtype=dtype).to(device)
            )
        model = PeftModel(base, peft_config)
        model.to(device=device, dtype=dtype)
        fill_from_checkpoint(
            model, ckpt, f"{src.config} + LoRA adapter", allow_missing=lambda n: not has_base and "lora_" not in n
        )
        if merge:
            model = model.merge_and_unload()
    model.eval()
    return Loaded(model, tokenizer, ckpt, src, time.perf_counter() - t0)


def new_token_budget(prompt_tokens: int, max_new_tokens: int, positions: int | None) -> tuple[int, str | None]:
    """(new tokens to generate, a note when the model's positions cut --max_new_tokens). A prompt that leaves no room
    is a CheckpointError naming its length and the limit (a model cannot see past its positions)."""
    if not positions or prompt_tokens + max_new_tokens <= positions:
        return max_new_tokens, None
    room = positions - prompt_tokens
    if room < 1:
        raise CheckpointError(
            f"the prompt has {prompt_tokens} tokens and the model reads at most {positions} positions: "
            "shorten the prompt"
        )
    return room, (
        f"the prompt has {prompt_tokens} tokens: generating at most {room} new tokens, up to the model's "
        f"{positions} positions (not --max_new_tokens {max_new_tokens})"
    )


def generate(
    model,
    tokenizer,
    texts: list[str],
    max_new_tokens=50,
    temperature=None,
    top_p=None,
    seed=None,
    stream=False,
    say=None,
) -> list[dict]:
    """Batched generation, greedy unless temperature/top_p ask for sampling; streams a single prompt. New tokens stop at
    the model's positions (new_token_budget; `say` gets the note)."""
    import torch
    from transformers import TextStreamer

    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    device = next(model.parameters()).device
    enc = tokenizer(texts, return_tensors="pt", padding=True).to(device)
    max_new_tokens, note = new_token_budget(
        int(enc["input_ids"].shape[1]), max_new_tokens, model_positions(model.config)
    )
    if note and say is not None:
        say(note)
    sample = (temperature is not None and temperature > 0) or top_p is not None
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=sample, pad_token_id=tokenizer.pad_token_id)
    if sample:
        kwargs.update(
            temperature=temperature if temperature else 1.0, top_p=top_p if top_p is not None else 1.0, top_k=None
        )
    else:
        kwargs.update(temperature=None, top_p=None, top_k=None)
    if seed is not None:
        torch.manual_seed(seed)
    if stream and len(texts) == 1:
        kwargs["streamer"] = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    with torch.no_grad():
        out = model.generate(**enc, **kwargs)
    new = out[:, enc["input_ids"].shape[1] :]
    results = []
    for text, ids in zip(texts, new):
        ids = ids[ids != tokenizer.pad_token_id] if tokenizer.pad_token_id != tokenizer.eos_token_id else ids
        results.append(
            {
                "prompt": text,
                "completion": tokenizer.decode(ids, skip_special_tokens=True),
                "new_tokens": int(ids.numel()),
            }
        )
    return results


@dataclass
class Model:
    model: object
    tokenizer: object
    checkpoint: str
    step: int | None
    run_dir: Path


_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "adapter_model.safetensors")


def is_exported(path: Path) -> bool:
    """A Hugging Face model directory (weights + config), not a DeepSpeed checkpoint or run."""

    if not path.is_dir() or is_tag_dir(path) or (path / "latest").is_file():
        return False
    if any(path.glob("global_step*")) or any(path.glob("checkpoint-*")):
        return False
    return any((path / w).is_file() for w in _WEIGHTS)


def _step_from_state(directory: Path) -> int | None:
    try:
        return int(json.loads((directory / "trainer_state.json").read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_model(path: str, model_name: str | None, device: str, dtype, trust: bool) -> Model:
    """Load one checkpoint the way `llmft infer` does (exact fp32 masters from the ZeRO shards), or an export."""

    p = Path(path)
    if is_exported(p):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        def load_exported():
            if (p / "adapter_config.json").is_file() and not (p / "config.json").is_file():
                from peft import AutoPeftModelForCausalLM

                return AutoPeftModelForCausalLM.from_pretrained(p, dtype=dtype).merge_and_unload()
            return AutoModelForCausalLM.from_pretrained(p, dtype=dtype)

        model = _hf("model", str(p), load_exported).to(device).eval()
        tokenizer = _hf("tokenizer", model_name or str(p), lambda: AutoTokenizer.from_pretrained(model_name or p))
        return Model(model, tokenizer, str(p), _step_from_state(p), p)
    tag_dir, _ = resolve_checkpoint([path])
    loaded = load(tag_dir, model_name, device, dtype, merge=True, trust=trust)
    ckpt_dir = tag_dir.parent
    run_dir = ckpt_dir.parent if ckpt_dir.name.startswith("checkpoint-") else ckpt_dir
    return Model(loaded.model, loaded.tokenizer, str(tag_dir), loaded.ckpt.step, run_dir)

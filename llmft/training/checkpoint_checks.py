"""Check the model or adapter file a save wrote before the checkpoint is published as complete.

Under ZeRO-3 every rank holds a slice of each parameter; a save that forgets to gather writes empty
tensors, zeros, or drops tensors, and the file still looks like a checkpoint (an empty LoRA adapter
under ZeRO-3 is a long-standing failure: TRL #4416, PEFT #2892, DeepSpeed #7900). llmft compares
what is on disk with what the model in training holds:

- the file exists and is a readable safetensors file with tensors in it;
- every tensor the model has is there, at its full (unpartitioned) shape;
- no tensor is all zeros while the model's is not (a LoRA `lora_B` starts at zero: once trained it is not).

The facts about the live model come from each rank's own slice (one all-reduce, no gathering), so the
check costs little even for a ZeRO-3 model that no rank holds whole. Only files are read, so it holds
whichever way the weights were gathered or saved.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

ADAPTER_FILE = "adapter_model.safetensors"
MODEL_FILE = "model.safetensors"
MODEL_INDEX = "model.safetensors.index.json"
_SAMPLE_ROWS = 16


@dataclass(frozen=True)
class Tensor:
    """One parameter of the model in training: the names a save may give it, its full shape, whether it is non-zero."""

    names: tuple[str, ...]  # tied parameters have several; one of them must be in the file
    shape: tuple[int, ...]
    nonzero: bool


def _is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "active_adapter")


def _saved_names(model, names: list[str]) -> dict[str, str]:
    """Parameter name -> the key a save writes: PEFT's own renaming for adapters, the name itself otherwise."""
    if not _is_peft(model):
        return {n: n[len("module.") :] if n.startswith("module.") else n for n in names}
    import torch
    from peft import get_peft_model_state_dict

    markers = {n: torch.tensor([float(i)]) for i, n in enumerate(names)}
    saved = get_peft_model_state_dict(model, state_dict=markers, adapter_name=model.active_adapter)
    return {names[int(t.item())]: key for key, t in saved.items() if t.numel() == 1}


def live_tensors(model) -> list[Tensor]:
    """What the save must contain: the adapter's tensors for a PEFT model, every parameter otherwise.

    Collective when torch.distributed is up (one all-reduce of one flag per tensor): call it on every rank.
    """
    import torch
    import torch.distributed as dist

    groups: dict[int, list] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), [p, []])[1].append(name)
    if _is_peft(model):
        groups = {k: v for k, v in groups.items() if v[0].requires_grad and any("lora_" in n for n in v[1])}
    params = list(groups.values())
    mapping = _saved_names(model, [n for _, names in params for n in names])
    flags = torch.zeros(len(params), dtype=torch.float32)
    for i, (p, _) in enumerate(params):
        local = getattr(p, "ds_tensor", None)  # ZeRO-3: this rank's slice; p.data is an empty placeholder
        local = p.data if local is None else local
        flags[i] = float(local.numel() > 0 and bool(local.detach().ne(0).any()))
    if dist.is_available() and dist.is_initialized():
        # NCCL reduces GPU tensors only (ZeRO-3 offload keeps the slices themselves on the CPU).
        device = (
            torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        )
        flags = flags.to(device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        flags = flags.cpu()
    out = []
    for (p, names), flag in zip(params, flags.tolist()):
        shape = tuple(getattr(p, "ds_shape", None) or p.shape)
        saved = tuple(mapping[n] for n in names if n in mapping)
        if saved:
            out.append(Tensor(saved, shape, bool(flag)))
    return out


def _weight_files(directory: Path, adapter: bool) -> list[Path]:
    """The files a save of this model writes into `directory` (none for a full model saved as ZeRO shards only)."""
    if adapter:
        return [directory / ADAPTER_FILE]
    index = directory / MODEL_INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return [index]
        return [directory / s for s in shards]
    single = directory / MODEL_FILE
    return [single] if single.exists() else []


def _all_zero(f, name: str) -> bool:
    """Zero everywhere? Small tensors are read whole; large ones by a few rows spread over them, then whole if those are zero."""
    sl = f.get_slice(name)
    shape = sl.get_shape()
    numel = 1
    for d in shape:
        numel *= d
    if numel > (1 << 20) and len(shape) >= 1 and shape[0] >= _SAMPLE_ROWS:
        step = shape[0] // _SAMPLE_ROWS
        if any(bool(sl[i * step : i * step + 1].ne(0).any()) for i in range(_SAMPLE_ROWS)):
            return False
    return not bool(f.get_tensor(name).ne(0).any())


def problems(directory: str | Path, expected: list[Tensor], adapter: bool) -> list[str]:
    """What is wrong with the weights saved in `directory`, each naming the file; [] when they hold the model."""
    from safetensors import safe_open

    directory = Path(directory)
    files = _weight_files(directory, adapter)
    found: dict[str, tuple[Path, tuple[int, ...]]] = {}
    out = []
    for path in files:
        if not path.is_file():
            out.append(f"{path} is missing")
            continue
        if path.stat().st_size == 0:
            out.append(f"{path} is empty (0 bytes)")
            continue
        try:
            with safe_open(str(path), framework="pt") as f:
                keys = list(f.keys())
                for k in keys:
                    found[k] = (path, tuple(f.get_slice(k).get_shape()))
        except Exception as e:  # safetensors raises its own error types for a truncated or garbled header
            out.append(f"{path} is not a readable safetensors file ({str(e).strip() or type(e).__name__})")
            continue
        if not keys:
            out.append(f"{path} holds no tensors")
    if out or not files:
        return out
    zero_checks: dict[Path, list[str]] = {}
    for t in expected:
        key = next((n for n in t.names if n in found), None)
        if key is None:
            where = files[0] if len(files) == 1 else directory / MODEL_INDEX
            out.append(f"{where} is missing {t.names[0]} (shape {list(t.shape)})")
            continue
        path, shape = found[key]
        if shape != t.shape:
            out.append(
                f"{path}: {key} has shape {list(shape)}, the model's is {list(t.shape)} (a partition saved instead of the whole tensor)"
            )
        elif t.nonzero:
            zero_checks.setdefault(path, []).append(key)
    for path, keys in zero_checks.items():
        with safe_open(str(path), framework="pt") as f:
            zeros = [k for k in keys if _all_zero(f, k)]
        if zeros:
            out.append(f"{path}: {zeros[0]} is all zeros but the model's is not ({len(zeros)} such tensors)")
    return out


def check_save(directory: str | Path, model, is_writer: bool) -> list[str]:
    """Run on every rank after a save: the live facts (collective), then the file check on the writing rank."""
    expected = live_tensors(model)
    return problems(directory, expected, adapter=_is_peft(model)) if is_writer else []

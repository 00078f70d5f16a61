"""A served model from a checkpoint: the Hugging Face directory `llmft export` writes, file by file.

Each file has its own function, and each decision its own pure function beside it:

- weights: sharded safetensors (`huggingface_hub.split_torch_state_dict_into_shards` decides the shards and the
  `model.safetensors.index.json`, as `save_pretrained` does), one tensor per storage: a tied LM head is written once,
  under the input embedding's name, and `config.json` says `tie_word_embeddings` to match;
- `config.json` with the exported dtype;
- `generation_config.json`: vLLM and SGLang stop on its `eos_token_id`, so it lists the chat template's end-of-turn
  token (`<|im_end|>`, `<|eot_id|>`) beside the tokenizer's EOS; a served chat model otherwise never stops;
- the tokenizer as training saved it beside the checkpoint, chat template included;
- for LoRA, the adapter directory vLLM's `--enable-lora` reads (`adapter_config.json`, `adapter_model.safetensors`).

The model is built in the export dtype and filled from the shards in place (llmft.checkpoint.loader), and
safetensors (0.6+) writes each shard from the tensors' own memory, so host memory stays near the exported size
(bench/bench_export_memory.py measures it).
"""

from __future__ import annotations

import json
from pathlib import Path

from llmft.checkpoint.run_dir import COMPLETE_MARKER, RUN_RECORD, CheckpointError, incomplete_reason

INDEX_FILE = "model.safetensors.index.json"
EXPORT_RECORD = "llmft_export.json"  # what was exported from where, and the greedy tokens the checks compare
LORA_MODES = ("merged", "adapter", "both")
ADAPTER_SUBDIR = "adapter"  # --lora both: the merged model at the top, the adapter beside it


def parse_shard_size(text: str) -> int:
    """--max_shard_size as bytes, in huggingface_hub's notation (5GB, 500MB, 2GiB, or a number of bytes)."""
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        size = parse_size_to_int(str(text).strip())
    except ValueError:
        size = 0
    if size <= 0:
        raise CheckpointError(
            f"--max_shard_size {text!r} is not a size: give a number with a unit, such as 5GB, 500MB or 2GiB"
        )
    return size


def check_out_dir(out: Path, flag: str = "--out") -> None:
    """The export goes to a new or empty directory: nothing of the user's is overwritten."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "a file" if not out.is_dir() else "a directory that is not empty"
        raise CheckpointError(f"{flag} {out} is {what}: give a new or empty directory (nothing is overwritten)")


def check_complete(tag_dir: Path) -> None:
    """A named checkpoint written by llmft must carry its completeness marker: a half-written one exports garbage."""
    ckpt_dir = Path(tag_dir).parent
    run_dir = ckpt_dir.parent
    llmft_wrote_it = (ckpt_dir / COMPLETE_MARKER).exists() or (run_dir / RUN_RECORD).exists()
    if ckpt_dir.name.startswith("checkpoint-") and llmft_wrote_it:
        reason = incomplete_reason(ckpt_dir)
        if reason is not None:
            raise CheckpointError(
                f"{reason}: export a complete checkpoint (pass the run directory for its newest complete one)"
            )


def first_special_token(text: str, specials: list[str]) -> str | None:
    """The special token that starts first in `text` (the longest where two start at the same place), or None."""
    found = [(text.find(s), -len(s), s) for s in specials if s and s in text]
    return min(found)[2] if found else None


_REPLY = "LLMFT-EXPORT-REPLY"


def end_of_turn_token(tokenizer) -> str | None:
    """The special token the chat template writes right after an assistant's reply (`<|im_end|>`, `<|eot_id|>`,
    the EOS for templates that end turns with it); None without a template or where no special token follows."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _REPLY}]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
    except Exception:  # a template that rejects this conversation (a required system turn, say): no evidence
        return None
    if _REPLY not in text:
        return None
    after = text[text.rindex(_REPLY) + len(_REPLY) :]
    specials = sorted(set(tokenizer.all_special_tokens) | set(tokenizer.get_added_vocab()))
    return first_special_token(after, specials)


def stop_token_ids(eos_id, end_of_turn_id: int | None) -> int | list[int] | None:
    """generation_config's eos_token_id: the EOS, with the end-of-turn token added where it differs."""
    ids = list(eos_id) if isinstance(eos_id, (list, tuple)) else ([] if eos_id is None else [eos_id])
    if end_of_turn_id is not None and end_of_turn_id not in ids:
        ids.append(end_of_turn_id)
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else ids


def template_stops(tokenizer, eos_id) -> tuple[str | None, int | list[int] | None]:
    """(the chat template's end-of-turn token, the stop ids: `eos_id` with that token's id added where it differs)."""
    eot = end_of_turn_token(tokenizer)
    eot_id = tokenizer.convert_tokens_to_ids(eot) if eot is not None else None
    return eot, stop_token_ids(eos_id, eot_id)


def unique_tensors(state_dict: dict) -> tuple[dict, list[str]]:
    """One entry per storage, the first name kept (the input embedding before a tied LM head), and the names
    dropped as aliases; transformers ties them again on load from `tie_word_embeddings`."""
    kept, dropped, seen = {}, [], set()
    for name, tensor in state_dict.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            dropped.append(name)
            continue
        seen.add(key)
        kept[name] = tensor
    return kept, dropped


def write_weights(model, out: Path, max_shard_size: int) -> dict:
    """Sharded safetensors (an index when there is more than one shard); returns {"files", "tied", "bytes"}."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    tensors, aliases = unique_tensors(model.state_dict())
    split = split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        save_file({n: tensors[n].contiguous() for n in names}, out / filename, metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    return {"files": sorted(split.filename_to_tensors), "tied": aliases, "bytes": total}


def write_config(model, out: Path, dtype, tied: bool) -> None:
    """config.json saying what the weights are: their dtype, and whether the LM head is the input embedding; with the
    KV cache on (training turns `use_cache` off under gradient checkpointing, and transformers' generate reads it)."""
    config = model.config
    config.architectures = [type(model).__name__]  # as save_pretrained does: servers pick the model class from it
    config.dtype = dtype
    config.tie_word_embeddings = tied
    if getattr(config, "use_cache", None) is False:
        config.use_cache = True
    if hasattr(config, "get_text_config") and config.get_text_config() is not config:
        config.get_text_config().tie_word_embeddings = tied
    config.save_pretrained(out)


def write_generation_config(model, tokenizer, source_dir: Path | None, out: Path) -> dict:
    """generation_config.json: training's own (beside the checkpoint) or the model config's, with the stop tokens."""
    from transformers import GenerationConfig

    if source_dir is not None and (Path(source_dir) / "generation_config.json").is_file():
        gen = GenerationConfig.from_pretrained(source_dir)
    else:
        gen = GenerationConfig.from_model_config(model.config)
    eos = gen.eos_token_id if gen.eos_token_id is not None else tokenizer.eos_token_id  # id 0 is an EOS too
    eot, gen.eos_token_id = template_stops(tokenizer, eos)
    if gen.pad_token_id is None and tokenizer.pad_token_id is not None:
        gen.pad_token_id = tokenizer.pad_token_id
    gen.save_pretrained(out)
    return {"end_of_turn": eot, "eos_token_id": gen.eos_token_id}


def write_model_dir(model, tokenizer, out: Path, dtype, max_shard_size: int, source_dir: Path | None) -> dict:
    """A full model directory: weights, config, generation config, tokenizer. Returns what was decided."""
    out.mkdir(parents=True, exist_ok=True)
    weights = write_weights(model, out, max_shard_size)
    write_config(model, out, dtype, tied=bool(weights["tied"]))
    stops = write_generation_config(model, tokenizer, source_dir, out)
    tokenizer.save_pretrained(out)
    return {**weights, **stops}


def write_adapter_dir(peft_model, tokenizer, out: Path) -> dict:
    """The LoRA adapter alone (adapter_config.json, adapter_model.safetensors) with the tokenizer: what vLLM's
    `--enable-lora --lora-modules NAME=DIR` and PEFT's `PeftModel.from_pretrained` read."""
    out.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return {"files": sorted(p.name for p in out.iterdir())}


def write_record(out: Path, record: dict) -> None:
    (Path(out) / EXPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")


def read_record(out: Path) -> dict:
    path = Path(out) / EXPORT_RECORD
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        raise CheckpointError(
            f"{out} has no readable {EXPORT_RECORD}: --check reads a directory `llmft export` wrote"
        ) from None


def read_run_record(tag_dir: Path) -> dict:
    """The run's llmft_run.json (beside its checkpoint-N directories); {} for a checkpoint llmft did not write."""
    ckpt_dir = Path(tag_dir).parent
    run_dir = ckpt_dir.parent if ckpt_dir.name.startswith("checkpoint-") else ckpt_dir
    try:
        record = json.loads((run_dir / RUN_RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}

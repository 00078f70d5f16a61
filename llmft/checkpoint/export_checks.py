"""The checks at the end of every `llmft export` (and of `llmft export --check DIR` alone).

1. The files vLLM and SGLang read are there and agree with each other (`file_problems`; docs/inference.md lists
   them with where each server reads them).
2. The directory loads with transformers in a fresh process (`python -m llmft.checkpoint.export_checks DIR`), so
   nothing the exporting process still holds in memory can make it pass.
3. Greedy generation there gives exactly the tokens the checkpoint gave when it was exported: the export
   recorded them (llmft_export.json) from the model `llmft infer` loads from the ZeRO shards, in the export dtype.
4. A chat prompt stops at the chat template's end-of-turn token before max_new_tokens, stopping on what
   generation_config.json lists, as vLLM does.

Greedy generation here is one prompt at a time without padding, stopping on generation_config.json's
eos_token_id: the same inputs on both sides, so any difference is in the weights or the files.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PLAIN_PROMPTS = ("What is 2 plus 3?", "The capital of France is")
CHAT_PROMPT = "Spell apple backwards."
MAX_NEW_TOKENS = 32
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def prompts_for(tokenizer) -> list[dict]:
    """The check prompts: plain text, and one chat turn where the tokenizer has a template."""
    rows = [{"text": p, "chat": False} for p in PLAIN_PROMPTS]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": CHAT_PROMPT}], tokenize=False, add_generation_prompt=True
        )
        rows.append({"text": text, "chat": True})
    return rows


def greedy_tokens(model, tokenizer, prompts: list[dict], stop_ids, max_new_tokens: int = MAX_NEW_TOKENS) -> list:
    """The new token ids of greedy generation for each prompt, stopping on `stop_ids`."""
    import torch

    out = []
    for row in prompts:
        ids = tokenizer(row["text"], return_tensors="pt", add_special_tokens=not row["chat"]).input_ids
        with torch.no_grad():
            gen = model.generate(
                ids.to(model.device),
                attention_mask=torch.ones_like(ids).to(model.device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                eos_token_id=stop_ids,
                pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
            )
        out.append(gen[0, ids.shape[1] :].tolist())
    return out


def stop_ids_of(generation_config: dict) -> list[int]:
    eos = generation_config.get("eos_token_id")
    return list(eos) if isinstance(eos, list) else ([] if eos is None else [eos])


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def weight_problems(directory: Path) -> tuple[list[str], dict[str, str]]:
    """(problems, tensor name -> file) for the safetensors weights: a single file, or an index whose every shard is
    present and holds the tensors the index names."""
    from safetensors import safe_open

    index = _json(directory / "model.safetensors.index.json")
    single = directory / "model.safetensors"
    if index is None and not single.is_file():
        return ["no model.safetensors and no model.safetensors.index.json"], {}
    weight_map = index.get("weight_map", {}) if index else None
    files = sorted(set(weight_map.values())) if weight_map is not None else ["model.safetensors"]
    problems, found = [], {}
    for name in files:
        if not (directory / name).is_file():
            problems.append(f"the index names {name}, which is missing")
            continue
        with safe_open(directory / name, framework="pt") as f:
            found.update({key: name for key in f.keys()})
    if weight_map is not None:
        wrong = [k for k, v in weight_map.items() if found.get(k) != v]
        if wrong:
            problems.append(f"the index puts {wrong[0]} in {weight_map[wrong[0]]}, which does not hold it")
    return problems, found


def file_problems(directory: Path) -> list[str]:
    """What a server would trip on in a full model directory; empty when every file is there and consistent."""
    directory = Path(directory)
    config = _json(directory / "config.json")
    if config is None:
        return ["no readable config.json"]
    problems = [] if config.get("architectures") else ["config.json names no architectures"]
    problems += [] if config.get("model_type") else ["config.json has no model_type"]
    weights, tensors = weight_problems(directory)
    problems += weights
    tied = config.get("tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings"))
    if tied and "lm_head.weight" in tensors:
        problems.append("config.json ties the word embeddings but the weights hold a separate lm_head.weight")
    if tied is False and tensors and not any(k.endswith("lm_head.weight") for k in tensors):
        problems.append("config.json unties the word embeddings but the weights hold no lm_head.weight")
    if not any((directory / f).is_file() for f in TOKENIZER_FILES):
        problems.append("no tokenizer.json or tokenizer.model")
    if not (directory / "tokenizer_config.json").is_file():
        problems.append("no tokenizer_config.json")
    gen = _json(directory / "generation_config.json")
    if gen is None:
        problems.append("no readable generation_config.json (vLLM and SGLang read its eos_token_id)")
    elif not stop_ids_of(gen):
        problems.append("generation_config.json has no eos_token_id")
    elif any(not 0 <= i < config.get("vocab_size", 1 << 62) for i in stop_ids_of(gen)):
        problems.append(f"generation_config.json's eos_token_id {gen['eos_token_id']} is outside the vocabulary")
    return problems


def adapter_problems(directory: Path) -> list[str]:
    """What vLLM's --enable-lora would trip on: adapter_config.json's fields, the adapter weights' names."""
    from safetensors import safe_open

    directory = Path(directory)
    config = _json(directory / "adapter_config.json")
    if config is None:
        return ["no readable adapter_config.json"]
    problems = [f"adapter_config.json has no {k}" for k in ("r", "lora_alpha", "target_modules") if not config.get(k)]
    if config.get("peft_type") != "LORA":
        problems.append(f"adapter_config.json's peft_type is {config.get('peft_type')!r}, not 'LORA'")
    weights = directory / "adapter_model.safetensors"
    if not weights.is_file():
        return problems + ["no adapter_model.safetensors"]
    with safe_open(weights, framework="pt") as f:
        keys = list(f.keys())
    if not keys or not all(k.startswith("base_model.model.") and ".lora_" in k for k in keys):
        problems.append("adapter_model.safetensors holds tensors that are not LoRA weights under base_model.model.")
    return problems


def generate_from_dir(directory: Path, prompts: list[dict], max_new_tokens: int, stop_ids: list[int]) -> list:
    """Load the directory as a server would (transformers, the dtype its config says) and generate greedily, stopping
    on its generation_config.json's eos_token_id (an adapter directory has none: the base model's, `stop_ids`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = Path(directory)
    if (directory / "adapter_config.json").is_file() and not (directory / "config.json").is_file():
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(directory, dtype="auto")
    else:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype="auto")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    gen = _json(directory / "generation_config.json") or {}
    stops = stop_ids_of(gen) or stop_ids
    return greedy_tokens(model.eval(), tokenizer, prompts, stops, max_new_tokens)


def in_fresh_process(directory: Path, prompts: list[dict], max_new_tokens: int, stop_ids: list[int]) -> list:
    """generate_from_dir in a new Python process: only the files on disk reach it."""
    request = json.dumps({"prompts": prompts, "max_new_tokens": max_new_tokens, "stop_ids": stop_ids})
    proc = subprocess.run(
        [sys.executable, "-m", "llmft.checkpoint.export_checks", str(directory)],
        input=request,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"loading {directory} in a fresh process failed: {tail[0]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def generation_problems(record: dict, got: list, stop_ids: list[int]) -> list[str]:
    """Compare the fresh process's tokens with the recorded ones, and check the chat prompt stopped on a stop token."""
    problems = []
    for row, want, have in zip(record["prompts"], record["tokens"], got):
        if have != want:
            at = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), min(len(want), len(have)))
            problems.append(
                f"greedy tokens for {row['text']!r} differ from the checkpoint's at new token {at} "
                f"({len(want)} from the checkpoint, {len(have)} from the export)"
            )
    for row, have in zip(record["prompts"], got):
        if row["chat"] and not (have and have[-1] in stop_ids and len(have) < record["max_new_tokens"]):
            problems.append(
                f"the chat prompt ran {len(have)} tokens without stopping on {stop_ids} (generation_config.json's "
                "eos_token_id): a server would not stop either; the model may be undertrained"
            )
    return problems


def run_checks(directory: Path, record: dict) -> list[str]:
    """Every check on an exported directory (a full model, an adapter, or both); returns the problems found."""
    directory = Path(directory)
    problems = []
    for sub, kind in record.get("directories", {}).items():
        where = directory / sub if sub != "." else directory
        found = file_problems(where) if kind == "model" else adapter_problems(where)
        problems += [f"{where}: {p}" for p in found]
    if problems:
        return problems
    try:  # the directory's top: the model, or the adapter when it is exported alone
        got = in_fresh_process(directory, record["prompts"], record["max_new_tokens"], record["stop_ids"])
    except RuntimeError as e:
        return [str(e)]
    return generation_problems(record, got, record["stop_ids"])


def _main() -> int:
    request = json.loads(sys.stdin.read())
    tokens = generate_from_dir(Path(sys.argv[1]), request["prompts"], request["max_new_tokens"], request["stop_ids"])
    print(json.dumps(tokens))
    return 0


if __name__ == "__main__":
    sys.exit(_main())

"""Tiny, offline stand-ins for a hub model and dataset: for the demo, the tests and benchmarks.

Nothing is downloaded: the tokenizer is trained locally on generated text, the model is built
from a GPT-2-style config with random weights, and the instruction data is generated in code.

    llmft tiny --out runs/tiny            # writes runs/tiny/model and runs/tiny/data.jsonl (llmft/tiny.py)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from llmft.data.loading import DEFAULT_CHAT_TEMPLATE

_WORDS = (
    "apple river stone cloud garden window silver forest candle bridge ocean paper "
    "yellow mountain rabbit thunder pepper lantern violet meadow"
).split()


def make_examples(n: int, seed: int = 0) -> list[dict[str, str]]:
    """Generate n small instruction examples (arithmetic and word tasks) as prompt/completion pairs."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        kind = rng.randrange(3)
        if kind == 0:
            a, b = rng.randrange(10), rng.randrange(10)
            out.append({"prompt": f"What is {a} plus {b}?", "completion": f"{a} plus {b} is {a + b}."})
        elif kind == 1:
            w = rng.choice(_WORDS)
            out.append({"prompt": f"Spell {w} backwards.", "completion": f"{w} backwards is {w[::-1]}."})
        else:
            ws = rng.sample(_WORDS, 3)
            out.append({"prompt": f"Repeat: {' '.join(ws)}", "completion": " ".join(ws)})
    return out


def as_format(examples: list[dict[str, str]], fmt: str) -> list[dict]:
    """Render prompt/completion examples in one of the dataset formats llmft accepts."""
    if fmt == "prompt_completion":
        return [{"prompt": e["prompt"] + "\n", "completion": e["completion"]} for e in examples]
    if fmt == "text":
        return [{"text": f"{e['prompt']}\n{e['completion']}"} for e in examples]
    if fmt == "messages":
        return [
            {"messages": [{"role": "user", "content": e["prompt"]}, {"role": "assistant", "content": e["completion"]}]}
            for e in examples
        ]
    if fmt == "question_answer":
        return [{"question": e["prompt"], "answer": e["completion"]} for e in examples]
    raise ValueError(f"unknown format {fmt!r}: use prompt_completion, text, messages or question_answer")


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def make_tokenizer(vocab_size: int = 512):
    """Train a byte-level BPE tokenizer on generated text; returns a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [f"{e['prompt']}\n{e['completion']}" for e in make_examples(4000, seed=1)]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|pad|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")
    fast.chat_template = DEFAULT_CHAT_TEMPLATE
    return fast


def make_model(
    tokenizer,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 2,
    n_positions: int = 256,
    seed: int = 0,
    arch: str = "gpt2",
    n_kv_head: int | None = None,
):
    """A randomly initialised causal LM sized for CPU tests: GPT-2-style, or Llama-style (`arch="llama"`: grouped KV
    heads, rotary positions, no dropout) where a test needs what GPT-2's config lacks (sequence parallelism)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if arch == "llama":
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=n_embd,
            intermediate_size=2 * n_embd,
            num_hidden_layers=n_layer,
            num_attention_heads=n_head,
            num_key_value_heads=n_kv_head or n_head,
            max_position_embeddings=n_positions,
            bos_token_id=tokenizer.eos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        return LlamaForCausalLM(config)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return GPT2LMHeadModel(config)


def make_model_dir(out: Path, **model_kwargs) -> Path:
    """Write a tiny model and its tokenizer as a Hugging Face model directory."""
    out = Path(out)
    tokenizer = make_tokenizer()
    model = make_model(tokenizer, **model_kwargs)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out

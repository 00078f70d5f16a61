"""Generate from a DeepSpeed ZeRO checkpoint without DeepSpeed: no process group, no engine.

The weights are read straight from the shards (see `llmft.checkpoint.zero`): exact fp32 master
weights for ZeRO stages 0-3, any number of ranks, with or without CPU offload, and peak memory close
to the model's own size. Optimizer moments are never read.

Usage:

    # llmft's own layout (config and tokenizer sit beside global_stepN)
    python -m llmft.infer runs/demo/out/checkpoint-4/global_step4 --prompt "What is 2 plus 3?"
    python -m llmft.infer runs/demo/out --prompt "What is 2 plus 3?"      # newest checkpoint of a run
    python -m llmft.infer runs/demo/out/checkpoint-*/global_step* --prompt "Hi"   # highest step wins

    # a plain `engine.save_checkpoint(dir)` checkpoint: name the base model for config + tokenizer
    python -m llmft.infer my_gpt2_checkpoint/global_step65110 --model_name gpt2 --prompt "Hello"

    # batches, sampling, chat template, JSON output
    python -m llmft.infer CKPT --prompt_file prompts.jsonl --chat --json
    python -m llmft.infer CKPT --prompt "Once" --temperature 0.8 --top_p 0.95 --seed 1

    # LoRA runs: base model + adapter; --merge folds the adapter in
    python -m llmft.infer runs/lora/checkpoint-4 --merge --prompt "Hi"

A model to serve (safetensors, configs, tokenizer, model card) is `llmft export` (llmft/export.py); `--export` here
names that command.

`llmft infer ...` takes the same arguments.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from llmft.checkpoint.loader import DTYPES, generate, load, pick_device, pick_dtype, resolve_checkpoint
from llmft.checkpoint.zero import CheckpointError
from llmft.command import command_parser, report_error
from llmft.data.loading import DataError, check_utf8
from llmft.errors import LlmftError

# --------------------------------------------------------------------------------------------------
# Which checkpoint


# --------------------------------------------------------------------------------------------------
# Which model


# --------------------------------------------------------------------------------------------------
# Prompts and generation


def read_prompts(prompts: list[str] | None, prompt_file: str | None) -> list:
    """--prompt values, then --prompt_file: one prompt per line, or JSONL with prompt/text/question or messages."""
    out: list = list(prompts or [])
    if prompt_file:
        path = Path(prompt_file)
        if not path.is_file():
            raise CheckpointError(f"--prompt_file {path} does not exist: check the path")

        try:
            check_utf8(path)
        except DataError as e:
            raise CheckpointError(str(e)) from None
        lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
        jsonl = path.suffix == ".jsonl" or (lines and lines[0].lstrip().startswith("{"))
        for i, line in enumerate(lines, 1):
            if not jsonl:
                out.append(line)
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise CheckpointError(
                    f"{path} line {i} is not valid JSON ({e.msg}): write one JSON object per line, or plain text prompts"
                ) from None
            if not isinstance(row, dict):
                raise CheckpointError(
                    f"{path} line {i} is a JSON {type(row).__name__}, not an object: write one {{...}} per line, or plain text prompts"
                )
            value = next((row[k] for k in ("messages", "prompt", "text", "question") if k in row), None)
            if value is None:
                raise CheckpointError(f"{path} line {i} has no prompt, text, question or messages field: add one")
            out.append(value)
        if not lines:
            raise CheckpointError(f"--prompt_file {path} is empty: put one prompt per line")
    return out


def render(tokenizer, prompt, chat: bool) -> str:
    """Chat prompts (or message lists) go through the tokenizer's chat template; plain text as is."""
    if isinstance(prompt, list) or chat:
        if not getattr(tokenizer, "chat_template", None):
            raise CheckpointError(
                "the tokenizer has no chat template: drop --chat (and message-list prompts) or use a tokenizer that has one"
            )
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return prompt


# --------------------------------------------------------------------------------------------------
# CLI


def make_parser(subparsers=None):

    parser = command_parser(
        subparsers, "infer", "Generate from a DeepSpeed ZeRO checkpoint (stages 0-3) without DeepSpeed."
    )
    parser.epilog = (
        "Example: python -m llmft.infer runs/demo/run/checkpoint-40/global_step40 --prompt 'What is 2 plus 3?'"
    )
    parser.add_argument(
        "checkpoint",
        nargs="+",
        help="global_stepN dir, checkpoint-N dir or run output dir (several: the highest step is used)",
    )
    parser.add_argument(
        "--model_name",
        "--model_name_or_path",
        dest="model_name",
        default=None,
        help="base model (hub name or directory) for config and tokenizer; required for plain DeepSpeed checkpoints",
    )
    parser.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    parser.add_argument("--prompt_file", help="one prompt per line, or JSONL with prompt/text/question/messages")
    parser.add_argument("--max_new_tokens", type=int, default=50)
    parser.add_argument(
        "--temperature", type=float, default=None, help="sample with this temperature (default: greedy)"
    )
    parser.add_argument("--top_p", type=float, default=None, help="nucleus sampling (default: greedy)")
    parser.add_argument("--seed", type=int, default=None, help="seed for sampling")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    parser.add_argument("--device", default=None, help="cuda:0 when available, else cpu")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="auto: bf16 on GPU, fp32 on CPU")
    parser.add_argument("--json", action="store_true", help="print one JSON document with all generations")
    parser.add_argument(
        "--export",
        type=Path,
        default=None,
        metavar="DIR",
        help="moved to its own command: llmft export CHECKPOINT --out DIR",
    )
    parser.add_argument("--merge", action="store_true", help="LoRA: fold the adapter into the base weights")
    parser.add_argument(
        "--trust_checkpoint",
        action="store_true",
        help="unpickle shards with full pickle (runs code stored in them); only for checkpoints you trust",
    )
    parser.set_defaults(func=main)
    return parser


def run(args) -> dict:
    """Everything main does, returning the JSON-able result; raises CheckpointError on bad input."""
    if args.export is not None:
        raise CheckpointError(
            f"--export moved to its own command: llmft export {' '.join(args.checkpoint)} --out {args.export}"
        )
    if args.max_new_tokens < 1:
        raise CheckpointError("--max_new_tokens must be at least 1")
    prompts = read_prompts(args.prompt, args.prompt_file)
    if not prompts:
        raise CheckpointError("nothing to do: give --prompt or --prompt_file")
    tag_dir, note = resolve_checkpoint(args.checkpoint)
    if note:
        print(f"llmft infer: {note}", file=sys.stderr)
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device, exporting=False)
    loaded = load(tag_dir, args.model_name, device, dtype, merge=args.merge, trust=args.trust_checkpoint)
    ck = loaded.ckpt
    print(
        f"llmft infer: loaded {tag_dir} (ZeRO-{ck.stage}, {ck.world_size} rank{'s' * (ck.world_size > 1)}, "
        f"{ck.numel() / 1e6:.2f}M stored values) on {device} as {str(dtype).replace('torch.', '')} in {loaded.seconds:.1f}s",
        file=sys.stderr,
    )
    result = {
        "checkpoint": str(tag_dir),
        "step": ck.step,
        "zero_stage": ck.stage,
        "world_size": ck.world_size,
        "model": loaded.source.config,
        "device": device,
        "dtype": str(dtype).replace("torch.", ""),
        "generations": [],
    }
    if prompts:
        texts = [render(loaded.tokenizer, p, args.chat) for p in prompts]
        stream = not args.json and len(texts) == 1
        if stream:
            print(texts[0], end="", flush=True)
        gens = generate(
            loaded.model,
            loaded.tokenizer,
            texts,
            args.max_new_tokens,
            args.temperature,
            args.top_p,
            args.seed,
            stream,
            say=lambda note: print(f"llmft infer: {note}", file=sys.stderr, flush=True),
        )
        result["generations"] = gens
        if not args.json and not stream:
            for i, g in enumerate(gens):
                if i:
                    print("-" * 40)
                print(g["prompt"] + g["completion"])
    if args.json:
        print(json.dumps(result, indent=2))
    return result


def main(args) -> int:
    try:
        run(args)
    except LlmftError as e:
        return report_error("infer", e, all_ranks=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(make_parser().parse_args()))

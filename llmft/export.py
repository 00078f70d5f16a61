"""Write a model a server can load from a checkpoint: `llmft export RUN_OR_CHECKPOINT --out DIR`.

    llmft export runs/x --out exported/x                     # the run's newest complete checkpoint, bf16
    llmft export runs/x/checkpoint-100 --out exported/x100 --dtype float32 --max_shard_size 2GB
    llmft export runs/lora --out exported/lora --lora both   # merged model at the top, the adapter in adapter/
    llmft export runs/x --out exported/x --push_to_hub my-org/my-model [--private]
    llmft export --check exported/x                          # the checks alone

The weights are read from the ZeRO shards as `llmft infer` reads them (no DeepSpeed, any stage, full or LoRA); the
directory gets sharded safetensors, config.json, generation_config.json (stopping at the chat template's end of turn),
the tokenizer with its chat template, a model card (README.md), and llmft_export.json (where it came from, and the
greedy tokens the checks compare). The checks then load it in a fresh process (llmft.checkpoint.export_checks).
"""

from __future__ import annotations

import gc
import os
import shutil
import sys
from pathlib import Path

from llmft.checkpoint import export_checks, model_card, publish, qlora_merge
from llmft.checkpoint.export import (
    ADAPTER_SUBDIR,
    LORA_MODES,
    check_complete,
    check_out_dir,
    parse_shard_size,
    read_record,
    read_run_record,
    template_stops,
    write_adapter_dir,
    write_model_dir,
    write_record,
)
from llmft.checkpoint.loader import DTYPES, find_source, load, resolve_checkpoint
from llmft.checkpoint.run_dir import CheckpointError
from llmft.command import command_parser, report_error
from llmft.errors import LlmftError


def say(line: str) -> None:
    print(f"llmft export: {line}", file=sys.stderr, flush=True)


def make_parser(subparsers=None):
    parser = command_parser(
        subparsers,
        "export",
        "Write a checkpoint as a model vLLM, SGLang and transformers load (safetensors, configs, tokenizer, card).",
    )
    parser.epilog = "Example: llmft export runs/x --out exported/x --push_to_hub my-org/my-model"
    parser.add_argument(
        "checkpoint",
        nargs="?",
        help="a run's output directory (its newest complete checkpoint), or a checkpoint-N or global_stepN directory",
    )
    parser.add_argument("--out", type=Path, default=None, help="a new or empty directory to write")
    parser.add_argument(
        "--model_name",
        "--model_name_or_path",
        dest="model_name",
        default=None,
        help="base model (directory or hub name) for config and tokenizer; required for plain DeepSpeed checkpoints",
    )
    parser.add_argument(
        "--dtype", default="bfloat16", choices=sorted(DTYPES), help="the weights' dtype (default bfloat16)"
    )
    parser.add_argument(
        "--max_shard_size", default="5GB", help="largest safetensors file (default 5GB; 500MB, 2GiB, ...)"
    )
    parser.add_argument(
        "--lora",
        default=None,
        choices=LORA_MODES,
        help="LoRA runs: merged (default: the adapter folded into the base), adapter (what vLLM's --enable-lora reads; "
        "kept in fp32), or both (the adapter in DIR/adapter/)",
    )
    parser.add_argument("--push_to_hub", default=None, metavar="ORG/NAME", help="upload DIR to this Hub repository")
    parser.add_argument("--private", action="store_true", help="with --push_to_hub: create the repository private")
    parser.add_argument(
        "--check", type=Path, default=None, metavar="DIR", help="only run the checks on an exported DIR"
    )
    parser.add_argument(
        "--trust_checkpoint",
        action="store_true",
        help="unpickle shards with full pickle (runs code stored in them); only for checkpoints you trust",
    )
    parser.set_defaults(func=main)
    return parser


def check_arguments(args) -> int:
    """Every argument decided before anything loads; returns the shard size in bytes."""
    if args.check is not None:
        exporting = (
            ("a checkpoint", args.checkpoint),
            ("--out", args.out),
            ("--model_name", args.model_name),
            ("--dtype", args.dtype != "bfloat16"),
            ("--max_shard_size", args.max_shard_size != "5GB"),
            ("--lora", args.lora),
            ("--push_to_hub", args.push_to_hub),
            ("--private", args.private),
            ("--trust_checkpoint", args.trust_checkpoint),
        )
        given = [flag for flag, value in exporting if value]
        if given:
            raise CheckpointError(f"--check DIR runs the checks alone: drop {given[0]}, or export without --check")
        return 0
    if not args.checkpoint or args.out is None:
        raise CheckpointError("give the checkpoint and --out DIR (llmft export RUN --out DIR), or --check DIR")
    if args.private and not args.push_to_hub:
        raise CheckpointError("--private applies to --push_to_hub: add --push_to_hub ORG/NAME, or drop --private")
    if args.push_to_hub:
        publish.check_repo_id(args.push_to_hub)
    check_out_dir(args.out)
    return parse_shard_size(args.max_shard_size)


def export_checkpoint(args, shard_bytes: int, out: Path) -> dict:
    """Load the checkpoint as `llmft infer` does, write DIR, record the greedy tokens; returns the record."""
    import torch

    tag_dir, note = resolve_checkpoint([args.checkpoint])
    if note:
        say(note)
    check_complete(tag_dir)
    source = find_source(tag_dir, args.model_name)
    lora = args.lora or "merged"
    if source.adapter_dir is None and args.lora is not None:
        raise CheckpointError(
            f"--lora {args.lora} but {tag_dir.parent} is a full fine-tune (no adapter_config.json): drop --lora"
        )
    run_record = read_run_record(tag_dir)
    problem = qlora_merge.merge_settings_problem(run_record, lora) if source.adapter_dir is not None else None
    if problem:
        raise CheckpointError(problem)
    dtype = getattr(torch, DTYPES[args.dtype])
    is_lora = source.adapter_dir is not None
    loaded = load(tag_dir, args.model_name, "cpu", torch.float32 if is_lora else dtype, trust=args.trust_checkpoint)
    say(f"loaded {tag_dir} (ZeRO-{loaded.ckpt.stage}, {loaded.ckpt.world_size} ranks) in {loaded.seconds:.1f}s")
    tokenizer = loaded.tokenizer
    directories, written = {}, {}
    if is_lora and lora in ("adapter", "both"):
        adapter_dir = out / ADAPTER_SUBDIR if lora == "both" else out
        write_adapter_dir(loaded.model, tokenizer, adapter_dir)
        directories[ADAPTER_SUBDIR if lora == "both" else "."] = "adapter"
    model = loaded.model
    dequantized = None
    if is_lora and lora in ("merged", "both"):
        if run_record.get("quantization"):
            dequantized = run_record[
                "quantization_settings"
            ]  # QLoRA: merged into the base as training held it, dequant(quant(W))
            count = qlora_merge.dequantize_base(model, run_record["quantization_settings"])
            say(
                f"QLoRA: {count} base layers quantized as the run did ({run_record['quantization_settings']}) and dequantized"
            )
        model = model.merge_and_unload().to(dtype)  # merged in fp32, then stored in the export dtype
    if not is_lora or lora in ("merged", "both"):
        written = write_model_dir(model, tokenizer, out, dtype, shard_bytes, tag_dir.parent)
        directories["."] = "model"
    # an adapter alone has no generation_config.json: the tokenizer's EOS with the template's end of turn
    eot, stops = (
        (written["end_of_turn"], written["eos_token_id"])
        if written
        else template_stops(tokenizer, tokenizer.eos_token_id)
    )
    stop_ids = export_checks.stop_ids_of({"eos_token_id": stops})
    prompts = export_checks.prompts_for(tokenizer)
    record = {
        "source": str(tag_dir),
        "step": loaded.ckpt.step,
        "zero_stage": loaded.ckpt.stage,
        "dtype": DTYPES[args.dtype],
        "lora": lora if is_lora else None,
        "dequantized_base": dequantized,  # QLoRA: merged into dequant(quant(W)), quantized with these settings
        "directories": directories,
        "end_of_turn": eot,
        "stop_ids": stop_ids,
        "prompts": prompts,
        "max_new_tokens": export_checks.MAX_NEW_TOKENS,
        "tokens": export_checks.greedy_tokens(model.eval(), tokenizer, prompts, stop_ids),
        "shards": written.get("files", []),
    }
    write_record(out, record)
    return record


def check(directory: Path) -> int:
    """Run the checks; 0 when all pass, 1 (and one line per problem) when one fails."""
    record = read_record(directory)
    problems = export_checks.run_checks(directory, record)
    for p in problems:
        say(f"check failed: {p}")
    if not problems:
        say(
            f"checks passed: {directory} loads in a fresh process, its greedy tokens equal the checkpoint's"
            + (", the chat prompt stops at its end of turn" if any(r["chat"] for r in record["prompts"]) else "")
        )
    return 1 if problems else 0


def staging_dir(out: Path) -> Path:
    """Where the export is written before it becomes DIR: beside it, on the same filesystem, hidden."""
    return out.parent / f".{out.name}.llmft-export-{os.getpid()}"


def run(args) -> int:
    shard_bytes = check_arguments(args)
    if args.check is not None:
        return check(args.check)
    out = Path(args.out)
    staging = staging_dir(out)
    try:
        record = export_checkpoint(args, shard_bytes, staging)
        gc.collect()  # the model is freed before the checks' process loads the export: the two never hold it together
        model_card.write_card(staging, record, repo=args.push_to_hub, name=out.name)
        os.replace(staging, out)  # DIR appears whole or not at all (an empty DIR is replaced)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # a failed export leaves nothing behind, and DIR as it was
    say(f"exported {record['source']} to {out}")
    code = check(Path(args.out))
    if code == 0 and args.push_to_hub:
        url = publish.push_folder(Path(args.out), args.push_to_hub, args.private, say=say)
        say(f"pushed to {url}")
    return code


def main(args) -> int:
    try:
        return run(args)
    except LlmftError as e:
        return report_error("export", e, all_ranks=True)


if __name__ == "__main__":
    sys.exit(main(make_parser().parse_args()))

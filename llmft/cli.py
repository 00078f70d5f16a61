"""The `llmft` command: one subcommand per module, each also runnable as `python -m llmft.<module>`.

    llmft train --model_name_or_path gpt2 --dataset_name data.jsonl --output_dir runs/x --zero_stage 2
    llmft plan --global_batch_size 32 --per_device_train_batch_size 2 --nnodes 2 --nproc_per_node 4
    llmft prepare --model_name_or_path gpt2 --dataset_name data.jsonl --max_length 1024 --packing
    llmft infer runs/x/checkpoint-100/global_step100 --prompt "Hello"
    llmft export runs/x --out exported/x [--push_to_hub my-org/my-model]
    llmft push exported/x my-org/my-model
    llmft eval runs/x --tasks gsm8k,minerva_math
    llmft report runs/x runs/y
    llmft prebuild
    llmft tiny --out runs/tiny
    llmft demo --out runs/demo

Only the chosen subcommand's module is imported, so `llmft plan` answers in a blink on a login node.
"""

from __future__ import annotations

import importlib
import sys

from llmft.command import CommandParser
from llmft.training import garbage_collection

COMMANDS = {
    "train": ("llmft.train", "fine-tune with TRL's trainers (--method sft|dpo|kto|reward) on DeepSpeed ZeRO"),
    "prepare": ("llmft.prepare", "tokenise (and pack) the data once into the shared cache; takes llmft train's flags"),
    "plan": ("llmft.plan", "print the run plan (world, batch math, ZeRO config) without loading a model"),
    "infer": ("llmft.infer", "generate text from a ZeRO checkpoint"),
    "export": ("llmft.export", "write a checkpoint as a served model: safetensors, configs, tokenizer, card, checks"),
    "push": ("llmft.push", "upload an exported directory to the Hugging Face Hub (from a login node)"),
    "eval": (
        "llmft.eval",
        "standard benchmarks (lm-evaluation-harness: gsm8k, minerva_math, mmlu, ...) on checkpoints",
    ),
    "report": ("llmft.report", "plots (PNG) and a Markdown summary of one or more runs"),
    "prebuild": (
        "llmft.prebuild",
        "compile DeepSpeed's GPU ops into DeepSpeed once (make venv does), so no job compiles",
    ),
    "tiny": ("llmft.tiny", "write a tiny offline model, tokenizer and dataset"),
    "demo": ("llmft.demo", "tiny model + data, a 2-process ZeRO-2 fine-tune on CPU, then inference"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = CommandParser(prog="llmft", description="DeepSpeed-centric LLM fine-tuning on Slurm clusters.")
    sub = top.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] not in COMMANDS:
        top.parse_args(argv or ["--help"])  # prints help, or the error for an unknown command
        return 2

    if argv[0] == "train":  # a process that trains: no cyclic collection until its start-up ends
        garbage_collection.pause_for_startup()
    try:
        return run_command(argv)
    finally:
        garbage_collection.end_pause()  # returned before training (an error, a finished run): the collector back on


def run_command(argv: list[str]) -> int:
    """Import the chosen subcommand's module only, and run it with the rest of argv."""
    module = importlib.import_module(COMMANDS[argv[0]][0])
    if argv[0] in (
        "train",
        "prepare",
    ):  # TRL's parser (llmft.training.flags.TrainParser): every SFTConfig flag, --config YAML
        return module.cli(module.make_parser(), argv[1:])
    subparsers = CommandParser(prog="llmft").add_subparsers()  # flags by full name only
    args = module.make_parser(subparsers).parse_args(argv[1:])
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())

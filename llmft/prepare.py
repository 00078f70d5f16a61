"""Tokenise (and pack) the training and evaluation data once, into a cache every run can reuse.

```bash
llmft prepare --model_name_or_path Qwen/Qwen2.5-0.5B --dataset_name data.jsonl --max_length 1024 --packing
llmft prepare --config run.yaml --eval_split_ratio 0.05    # the flags (or YAML) of `llmft train`
python -m llmft.prepare ...                               # the same
```

`llmft train` runs the same preparation (llmft.data.cache) before it builds the trainer, so preparing first (the
Slurm script can, as its own step before `srun`) only moves the work off the GPUs.
"""

from __future__ import annotations

import dataclasses
import sys

from llmft.command import report_error
from llmft.data.cache import DataOptions, check_options, prepare
from llmft.data.loading import DataError
from llmft.errors import LlmftError
from llmft.planning.model_shape import cap_max_length, model_positions
from llmft.planning.world import log
from llmft.training.arguments import LlmftArguments
from llmft.training.flags import TrainParser, parse_train_flags
from llmft.training.model_files import load_model_files


def make_parser(subparsers=None):
    import torch
    from trl import ModelConfig, ScriptArguments, SFTConfig

    dataclass_types = (ScriptArguments, SFTConfig, ModelConfig, LlmftArguments)
    description = "Tokenise (and pack) the data once into the shared cache; takes the flags of llmft train"
    if subparsers is not None:
        parser = subparsers.add_parser("prepare", help=description, dataclass_types=dataclass_types)
    else:
        parser = TrainParser(dataclass_types, prog="llmft prepare")
    parser.set_defaults(use_cpu=not torch.cuda.is_available())
    return parser


def load_tokenizer(model_args, training_args):
    """Tokenizer and the max_length the run uses (capped at the model's positions), loaded as llmft train loads
    them (llmft.training.model_files: same revision, a hub model downloaded once), so the tokens are the same."""
    files = load_model_files(model_args, training_args)
    max_length, note = cap_max_length(files.config, training_args.max_length)
    if note:
        log(note)
    return files.tokenizer, max_length, model_positions(files.config)


def main(script_args, training_args, model_args, llmft_args) -> int:
    try:
        if not model_args.model_name_or_path:
            raise DataError("--model_name_or_path is required (its tokenizer tokenises the data)")
        opts = DataOptions.from_args(script_args, training_args, llmft_args)
        check_options(opts, training_args.eval_strategy, training_args.dataset_kwargs)
        tokenizer, max_length, positions = load_tokenizer(model_args, training_args)
        args = dataclasses.replace(training_args, max_length=max_length)
        prepared = prepare(opts, tokenizer, args, log=log, timeout=llmft_args.prepare_timeout, positions=positions)
    except LlmftError as e:
        return report_error("prepare", e, all_ranks=True)
    log(
        f"ready: {len(prepared.train)} training sequences"
        + (f", {len(prepared.eval)} evaluation sequences" if prepared.eval is not None else "")
        + f" in {prepared.directory}"
    )
    return 0


def cli(parser, argv: list[str] | None = None) -> int:
    parsed = parse_train_flags(parser, argv)
    if isinstance(parsed, str):
        return report_error("prepare", parsed, all_ranks=True)
    return main(*parsed)


if __name__ == "__main__":
    sys.exit(cli(make_parser()))

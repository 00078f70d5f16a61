"""Tokenise (and pack) the training and evaluation data once, into a cache every run can reuse.

```bash
llmft prepare --model_name_or_path Qwen/Qwen2.5-0.5B --dataset_name data.jsonl --max_length 1024 --packing
llmft prepare --config run.yaml --eval_split_ratio 0.05    # the flags (or YAML) of `llmft train`
python -m llmft.prepare ...                               # the same
llmft prepare <train flags> --show 3                      # and print the first 3 prepared records, loss in «...»
```

`--show N` prints the first N prepared training records (sequences, when packed) as decoded text, each span of
tokens that carries loss between « and » (exactly that form: scripts and the docs rely on it). It reads the
prepared cache when these flags have one, and otherwise prepares first and says so: the mask can be checked
before any GPU hour is spent.

`llmft train` runs the same preparation (llmft.data.cache) before it builds the trainer, so preparing first (the
Slurm script can, as its own step before `srun`) only moves the work off the GPUs.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field

from llmft.command import report_error
from llmft.data import cache, pairs
from llmft.data.cache import DataOptions, check_options, prepare
from llmft.data.loading import DataError
from llmft.errors import LlmftError
from llmft.planning import methods
from llmft.planning.model_shape import cap_max_length, model_positions
from llmft.planning.world import log
from llmft.training.arguments import LlmftArguments
from llmft.training.flags import TrainParser, parse_train_flags
from llmft.training.model_files import load_model_files


@dataclass
class PrepareArguments:
    """What `llmft prepare` adds to `llmft train`'s flags."""

    show: int = field(
        default=0,
        metadata={"help": "Print the first N prepared training records, each span that carries loss between « and »."},
    )


@dataclass
class PrepareMethodArguments:
    """--method for `llmft prepare` while `llmft train`'s flags (LlmftArguments) have none of their own."""

    method: str | None = field(
        default=None,
        metadata={"help": "The training method whose data to prepare: sft (default), dpo, kto or reward."},
    )


LOSS_OPEN, LOSS_CLOSE = "«", "»"


def show_lines(ds, tokenizer, n: int) -> list[str]:
    """The first n records of a prepared split, decoded, each run of tokens whose label is not -100 between « and »
    (a split without labels trains on every token)."""
    out = []
    for i in range(min(n, len(ds))):
        row = ds[i]
        ids = row["input_ids"]
        labels = row.get("labels") or ids
        trained = [label != -100 for label in labels]
        text, start = [], 0
        for k in range(1, len(ids) + 1):
            if k == len(ids) or trained[k] != trained[start]:
                piece = tokenizer.decode(ids[start:k], skip_special_tokens=False, clean_up_tokenization_spaces=False)
                text.append(LOSS_OPEN + piece + LOSS_CLOSE if trained[start] else piece)
                start = k
        out.append(f"--- record {i + 1} of {len(ds)}: {len(ids)} tokens, {sum(trained)} with loss ---")
        out.append("".join(text))
    return out


def make_parser(subparsers=None):
    import torch
    from trl import ModelConfig, ScriptArguments, SFTConfig

    dataclass_types = (ScriptArguments, SFTConfig, ModelConfig, LlmftArguments, PrepareArguments)
    if "method" not in {f.name for f in dataclasses.fields(LlmftArguments)}:
        dataclass_types += (PrepareMethodArguments,)
    description = "Tokenise (and pack) the data once into the shared cache; takes the flags of llmft train"
    if subparsers is not None:
        parser = subparsers.add_parser("prepare", help=description, dataclass_types=dataclass_types)
    else:
        parser = TrainParser(dataclass_types, prog="llmft prepare")
    # assistant_only_loss unset: on for chat data, as llmft train decides it (llmft.data.cache.assistant_only)
    parser.set_defaults(use_cpu=not torch.cuda.is_available(), assistant_only_loss=None)
    return parser


def load_tokenizer(model_args, training_args):
    """Tokenizer and the max_length the run uses (capped at the model's positions), loaded as llmft train loads
    them (llmft.training.model_files: same revision, a hub model downloaded once), so the tokens are the same."""
    files = load_model_files(model_args, training_args)
    max_length, note = cap_max_length(files.config, training_args.max_length)
    if note:
        log(note)
    return files.tokenizer, max_length, model_positions(files.config)


def main(script_args, training_args, model_args, llmft_args, prepare_args=None, method_args=None) -> int:
    try:
        if not model_args.model_name_or_path:
            raise DataError("--model_name_or_path is required (its tokenizer tokenises the data)")
        opts = DataOptions.from_args(script_args, training_args, llmft_args)
        check_options(opts, training_args.eval_strategy, training_args.dataset_kwargs)
        tokenizer, max_length, positions = load_tokenizer(model_args, training_args)
        args = dataclasses.replace(training_args, max_length=max_length)
        show = prepare_args.show if prepare_args is not None else 0
        if show < 0:
            raise DataError(f"--show {show}: give the number of prepared records to print (e.g. --show 3)")
        entry = methods.method(getattr(llmft_args, "method", None) or getattr(method_args, "method", None))
        if entry.prepared_by == "trl":
            return show_preference(opts, entry, tokenizer, args, show)
        prepared = prepare(opts, tokenizer, args, log=log, timeout=llmft_args.prepare_timeout, positions=positions)
    except LlmftError as e:
        return report_error("prepare", e, all_ranks=True)
    log(
        f"ready: {len(prepared.train)} training sequences"
        + (f", {len(prepared.eval)} evaluation sequences" if prepared.eval is not None else "")
        + f" in {prepared.directory}"
    )
    if show:
        log(
            f"the first {min(show, len(prepared.train))} of {len(prepared.train)} prepared training records, "
            + ("read from the cache" if prepared.reused else "prepared now (none was cached for these flags)")
            + f"; the loss is on the text between {LOSS_OPEN} and {LOSS_CLOSE}:"
        )
        for line in show_lines(prepared.train, tokenizer, show):
            print(line, flush=True)
    return 0


def show_preference(opts, entry, tokenizer, args, show: int) -> int:
    """A method whose TRL trainer tokenises its own data (DPO, KTO, reward models): the records shaped and checked,
    each dropped one counted, tokenised as the trainer will and their fit said (llmft.data.pairs); with --show, the
    first records after the chat template, each side's completion (what carries the loss) between « and »."""
    cache.apply_tokenizer_options(tokenizer, args)
    prepared = pairs.prepare_method_data(
        opts, entry, tokenizer, args.max_length, log=log, num_proc=args.dataset_num_proc
    )
    train, evaluation = prepared.train, prepared.eval
    log(
        f"ready: {len(train)} training {entry.batch_unit} ({prepared.shaped[0].describe()})"
        + (f", {len(evaluation)} for evaluation" if evaluation is not None else "")
        + f"; {entry.trainer_class.split(':')[-1]} tokenises them as above when training starts"
    )
    if show:
        log(
            f"the first {min(show, len(train))} of {len(train)} training records after the chat template; "
            f"the loss is on the text between {LOSS_OPEN} and {LOSS_CLOSE}:"
        )
        for line in pairs.show_lines(prepared.tokenised["train"], tokenizer, show):
            print(line, flush=True)
    return 0


def cli(parser, argv: list[str] | None = None) -> int:
    parsed = parse_train_flags(parser, argv)
    if isinstance(parsed, str):
        return report_error("prepare", parsed, all_ranks=True)
    return main(*parsed)


if __name__ == "__main__":
    sys.exit(cli(make_parser()))

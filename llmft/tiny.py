"""Write a tiny offline model, tokenizer and instruction dataset (llmft.data.synthetic) for trying llmft anywhere.

python -m llmft.tiny --out runs/tiny            # writes runs/tiny/model and runs/tiny/data.jsonl
python -m llmft.tiny --out runs/tiny --format messages --examples 512
python -m llmft.tiny --out runs/tiny --max_positions 2048    # a longer context for your own long records

The model reads --max_positions tokens (default 1024: TRL's default max_length, so a run on it is never capped
below its default). The tiny tokenizer takes about 1.2 characters a token of English: a GSM8K or Alpaca record of
about 1,100 characters (longer than most of either dataset's) fits whole (tests/test_plan_data.py); longer ones need
--max_positions 2048 and llmft train --max_length 2048.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from llmft.command import command_parser
from llmft.data.synthetic import as_format, make_examples, make_model_dir, write_jsonl

DEFAULT_POSITIONS = 1024
MAX_POSITIONS = 32768  # position embeddings of 32768 x n_embd: the tiny model stays tiny


def positions(value: str) -> int:
    """--max_positions: a whole number of tokens, 1 to MAX_POSITIONS."""
    try:
        n = int(value)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_POSITIONS:
        raise argparse.ArgumentTypeError(f"{value!r}: give a whole number of tokens from 1 to {MAX_POSITIONS}")
    return n


def make_parser(subparsers=None):
    parser = command_parser(subparsers, "tiny", "Write a tiny offline model, tokenizer and instruction dataset.")
    parser.add_argument("--out", type=Path, required=True, help="directory to write model/ and data.jsonl into")
    parser.add_argument("--examples", type=int, default=512)
    parser.add_argument(
        "--format", default="prompt_completion", choices=["prompt_completion", "text", "messages", "question_answer"]
    )
    parser.add_argument("--n_layer", type=int, default=2)
    parser.add_argument("--n_embd", type=int, default=64)
    parser.add_argument(
        "--max_positions",
        type=positions,
        default=DEFAULT_POSITIONS,
        help=f"the longest sequence the model reads, in tokens (default {DEFAULT_POSITIONS}: TRL's default max_length; "
        "GSM8K and Alpaca records of about 1,100 characters fit)",
    )
    parser.set_defaults(func=main)
    return parser


def main(args) -> None:
    model_dir = make_model_dir(
        args.out / "model", n_layer=args.n_layer, n_embd=args.n_embd, n_positions=args.max_positions
    )
    data = write_jsonl(as_format(make_examples(args.examples), args.format), args.out / "data.jsonl")
    print(
        f"tiny model: {model_dir} ({args.max_positions} positions)\n"
        f"dataset:    {data} ({args.examples} examples, {args.format})"
    )


if __name__ == "__main__":
    main(make_parser().parse_args())

"""Write a tiny offline model, tokenizer and instruction dataset (llmft.data.synthetic) for trying llmft anywhere.

python -m llmft.tiny --out runs/tiny            # writes runs/tiny/model and runs/tiny/data.jsonl
python -m llmft.tiny --out runs/tiny --format messages --examples 512
"""

from __future__ import annotations

from pathlib import Path

from llmft.command import command_parser
from llmft.data.synthetic import as_format, make_examples, make_model_dir, write_jsonl


def make_parser(subparsers=None):
    parser = command_parser(subparsers, "tiny", "Write a tiny offline model, tokenizer and instruction dataset.")
    parser.add_argument("--out", type=Path, required=True, help="directory to write model/ and data.jsonl into")
    parser.add_argument("--examples", type=int, default=512)
    parser.add_argument(
        "--format", default="prompt_completion", choices=["prompt_completion", "text", "messages", "question_answer"]
    )
    parser.add_argument("--n_layer", type=int, default=2)
    parser.add_argument("--n_embd", type=int, default=64)
    parser.set_defaults(func=main)
    return parser


def main(args) -> None:
    model_dir = make_model_dir(args.out / "model", n_layer=args.n_layer, n_embd=args.n_embd)
    data = write_jsonl(as_format(make_examples(args.examples), args.format), args.out / "data.jsonl")
    print(f"tiny model: {model_dir}\ndataset:    {data} ({args.examples} examples, {args.format})")


if __name__ == "__main__":
    main(make_parser().parse_args())

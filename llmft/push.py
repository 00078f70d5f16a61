"""Upload a directory `llmft export` wrote to the Hugging Face Hub: `llmft push DIR ORG/NAME [--private]`.

Compute nodes usually have no internet: export there (`llmft export RUN --out DIR`), then push from a login node.
The upload is huggingface_hub's `upload_folder` (llmft.checkpoint.publish): a rerun after an interruption sends only
what the Hub lacks. The token is huggingface_hub's own (HF_TOKEN, or `hf auth login`); it is never printed.
"""

from __future__ import annotations

import sys
from pathlib import Path

from llmft.checkpoint import publish
from llmft.command import command_parser, report_error
from llmft.errors import LlmftError


def make_parser(subparsers=None):
    parser = command_parser(subparsers, "push", "Upload a directory `llmft export` wrote to the Hugging Face Hub.")
    parser.epilog = "Example: llmft push exported/x my-org/my-model --private"
    parser.add_argument("directory", type=Path, help="the directory `llmft export --out` wrote")
    parser.add_argument("repo_id", metavar="ORG/NAME", help="the Hub repository (created if it does not exist)")
    parser.add_argument("--private", action="store_true", help="create the repository private")
    parser.set_defaults(func=main)
    return parser


def run(args) -> str:
    publish.check_repo_id(args.repo_id, flag="the repository")
    publish.check_folder(args.directory)
    return publish.push_folder(
        args.directory, args.repo_id, args.private, say=lambda line: print(f"llmft push: {line}", file=sys.stderr)
    )


def main(args) -> int:
    try:
        url = run(args)
    except LlmftError as e:
        return report_error("push", e)
    print(f"llmft push: pushed to {url}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(make_parser().parse_args()))

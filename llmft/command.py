"""What every `llmft` command shares: its parser's shape and how it reports a user's mistake.

A command module (train, plan, infer, ...) builds its parser with `command_parser`, so `llmft NAME` and
`python -m llmft.NAME` are the same program, and catches `LlmftError` in its `main` with `report_error`:
one line, on rank 0 only, exit code 2.
"""

from __future__ import annotations

import argparse
import sys

from llmft.errors import LlmftError
from llmft.planning.world import rank0
from llmft.training.launcher import write_error_line

USER_ERROR_EXIT = 2


def command_parser(subparsers, name: str, description: str) -> argparse.ArgumentParser:
    """The parser for `llmft NAME` (as a subcommand) or `python -m llmft.NAME` (standalone): one shape for both."""
    if subparsers is not None:
        return subparsers.add_parser(name, help=description, description=description)
    return argparse.ArgumentParser(prog=f"llmft {name}", description=description)


def report_error(command: str, error: LlmftError | str, *, all_ranks: bool = False) -> int:
    """Print `llmft COMMAND: error: MESSAGE` (rank 0 only, unless every rank's message matters) and return the exit code."""
    line = f"llmft {command}: error: {error}"
    if write_error_line(line):  # under `llmft train --nproc_per_node N`: the launcher prints it once
        return USER_ERROR_EXIT
    if all_ranks or rank0():
        print(line, file=sys.stderr, flush=True)
    return USER_ERROR_EXIT

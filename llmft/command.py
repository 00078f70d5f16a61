"""What every `llmft` command shares: its parser's shape and how it reports a user's mistake.

A command module (train, plan, infer, ...) builds its parser with `command_parser`, so `llmft NAME` and
`python -m llmft.NAME` are the same program. Its flags match only by their full name (CommandParser: argparse's
prefix matching is off, and an unknown flag is named with "did you mean", llmft.training.flag_names). It catches `LlmftError` in its `main` with `report_error`:
one line, on rank 0 only, exit code 2.
"""

from __future__ import annotations

import argparse
import sys

from llmft.errors import LlmftError
from llmft.planning.world import rank0
from llmft.training.flag_names import unknown_flag_message
from llmft.training.launcher import write_error_line

USER_ERROR_EXIT = 2


class CommandParser(argparse.ArgumentParser):
    """argparse without prefix matching (`--max_step` is not taken for `--max_steps`): an unknown flag, a prefix
    included, ends in one error line naming the flag(s) it was probably meant as. Its subcommands' parsers are
    CommandParsers too (argparse makes them of the parent's class)."""

    def __init__(self, *args, allow_abbrev: bool = False, **kwargs):
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)

    def parse_args(self, args=None, namespace=None):
        ns, rest = self.parse_known_args(args, namespace)
        if rest:
            self.error(unknown_flag_message(rest, _option_strings(self), self.prog))
        return ns


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string of the parser and of its subcommands' parsers."""
    out = []
    for action in parser._actions:
        out += action.option_strings
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out += _option_strings(sub)
    return out


def command_parser(subparsers, name: str, description: str) -> argparse.ArgumentParser:
    """The parser for `llmft NAME` (as a subcommand) or `python -m llmft.NAME` (standalone): one shape for both."""
    if subparsers is not None:
        return subparsers.add_parser(name, help=description, description=description, allow_abbrev=False)
    return CommandParser(prog=f"llmft {name}", description=description)


def report_error(command: str, error: LlmftError | str, *, all_ranks: bool = False) -> int:
    """Print `llmft COMMAND: error: MESSAGE` (rank 0 only, unless every rank's message matters) and return the exit code."""
    line = f"llmft {command}: error: {error}"
    if write_error_line(line):  # under `llmft train --nproc_per_node N`: the launcher prints it once
        return USER_ERROR_EXIT
    if all_ranks or rank0():
        print(line, file=sys.stderr, flush=True)
    return USER_ERROR_EXIT


def exit_process(code: int | None) -> None:
    """End a training process with `code` once everything it wrote is out, without interpreter finalization.

    The gloo threads of a process group outlive destroy_process_group(): DeepSpeed keeps references to its groups,
    and two gloo_tcp_loop and four pt_gloo_runloop threads per rank were still running at the end of a finished
    2-process `llmft train` (/proc/self/task). They end only when the groups are freed, during finalization, and a
    thread that ends there can abort the rank (SIGABRT, "terminate called without an active exception": seen in CI
    in a 3-rank DeepSpeed script), which torchrun reports as a failed rank of a finished run. So what finalization
    would do for the run is done here first, in its order: threading's shutdown (its own exit hooks, which stop
    thread pools such as torch.compile's, then a join of the non-daemon threads: joined first, a compiled run's pool
    threads waited forever), the exit handlers (W&B's finish, logging's flush, multiprocessing's children), the
    streams flushed; then the process leaves."""
    import atexit
    import os
    import threading

    threading._shutdown()  # what the interpreter calls first at exit (Py_FinalizeEx)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can reach it
            pass
    os._exit(0 if code is None else code)

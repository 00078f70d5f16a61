"""`llmft train --nproc_per_node N ...`: torchrun's agent run inside llmft's process, so a bad input reads as one line.

Under plain `torchrun -m llmft.train`, a rank that stops on a user error prints llmft's line and exits 2, and then
torchrun's own process raises ChildFailedError: Python prints its ~40-line traceback and failure table after
llmft's line, and that cannot be changed from inside the ranks. Here the same agent (torch.distributed.run, one
node, `--standalone` rendezvous) runs in-process: ranks write their line to torch's per-rank error file
(TORCHELASTIC_ERROR_FILE, torch's own JSON format) instead of printing it, and this process prints the first
failing rank's line once and exits 2. Other failures (a crash with a traceback) keep torch's failure table, exit 1.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import sys
import time

# Set by the launcher for its ranks: write the error line to TORCHELASTIC_ERROR_FILE only, the launcher prints it.
LAUNCHED_BY_LLMFT = "LLMFT_LAUNCHED"
LLMFT_LINE = "llmft_line"  # key of the error file's message that marks it as llmft's one line


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def end_with_the_agent(env=os.environ) -> bool:
    """A rank torchrun started is killed when torchrun dies (Linux's PR_SET_PDEATHSIG, SIGKILL); whether it was set.

    torchrun starts each rank in a session of its own (start_new_session in torch's SubprocessHandler). A scheduler
    that ends a job by killing its sessions, as PBS's mom does without the cgroups hook, kills torchrun and misses
    its ranks: measured on the local OpenPBS, after `qsig -s USR1` killed a job its rank ran on, reparented to init,
    holding what it held (on a GPU node, its GPU's memory). A rank whose torchrun is gone has nobody to answer to, so
    it ends with it. Only under torchrun (TORCHELASTIC_RUN_ID set); a torchrun that died before this ran ends the rank
    at once."""
    if "TORCHELASTIC_RUN_ID" not in env or not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL)) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # torchrun died before the signal was asked for
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def take_nproc_per_node(argv: list[str]) -> tuple[int | None, list[str], str | None]:
    """(--nproc_per_node's value or None, the remaining TRL flags, a problem line). Both `--f N` and `--f=N`."""
    rest: list[str] = []
    nproc: str | None = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--nproc_per_node":
            if i + 1 >= len(argv):
                return None, argv, "--nproc_per_node needs a number of processes, e.g. --nproc_per_node 4"
            nproc, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--nproc_per_node="):
            nproc = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    if nproc is None:
        return None, rest, None
    if not nproc.isdigit() or int(nproc) < 1:
        return None, rest, f"--nproc_per_node {nproc!r} is not a number of processes; give a whole number >= 1, e.g. 4"
    return int(nproc), rest, None


def write_error_line(line: str) -> bool:
    """Write llmft's one error line to torch's per-rank error file (if torchrun set one), in torch's format.

    Plain torchrun then shows this line (not 'To enable traceback see ...') in its failure table; llmft's
    launcher prints it alone. Returns whether the rank was started by llmft's launcher (so it need not print)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        data = {
            "message": {
                "message": line,
                LLMFT_LINE: line,
                "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))},
            }
        }
        try:
            with open(path, "w") as f:
                json.dump(data, f)
        except OSError:
            return False
    return bool(path) and os.environ.get(LAUNCHED_BY_LLMFT) == "1"


def failure_line(error) -> str | None:
    """llmft's line from a ChildFailedError: the first failing rank's, else any rank's (the first may have been
    stopped by a signal after another rank's error); None when no rank stopped on llmft's error."""
    first, _ = error.get_first_failure()
    ranks = [first] + sorted(rank for rank in error.failures if rank != first)
    for rank in ranks:
        message = error.failures[rank].message
        if isinstance(message, dict) and message.get(LLMFT_LINE):
            return message[LLMFT_LINE]
    return None


def launch(nproc_per_node: int, train_argv: list[str]) -> int:
    """Run `torchrun --standalone --nproc_per_node N -m llmft.train ARGV` in this process; its exit code."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # The agent's own log lines (the OMP_NUM_THREADS note, 'failed (exitcode: 2)', closing signals) would surround
    # the one line; a crash still shows torch's failure table below.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    logging.getLogger("torch.distributed.run").setLevel(logging.CRITICAL)
    os.environ[LAUNCHED_BY_LLMFT] = "1"
    args = torchrun.parse_args(
        ["--standalone", "--nproc_per_node", str(nproc_per_node), "-m", "llmft.train", *train_argv]
    )
    try:
        torchrun.run(args)
    except ChildFailedError as e:
        line = failure_line(e)
        if line is not None:
            print(line, file=sys.stderr, flush=True)
            return 2
        print(str(e), file=sys.stderr, flush=True)
        return 1
    return 0

"""Stop a run on purpose: every rank finishes its step, writes a complete checkpoint, and the run ends.

    llmft stop runs/llama                 # the run ends after its checkpoint; the same command (or job) resumes it
    llmft stop runs/llama --continue      # ... and its job goes on: Slurm requeues it, PBS submits its continuation

It writes the stop request the ranks already poll (llmft.planning.stop_request): the file named in the record the
running `llmft train` keeps in RUN_DIR, so it works the same for a Slurm job, a PBS job or a run started from a login
shell, from any host that sees RUN_DIR. A run from a login shell has no job to go on in: with --continue it still
stops, and says to run the same command again.
"""

from __future__ import annotations

import getpass
import os
import socket
from pathlib import Path

from llmft.command import command_parser, report_error
from llmft.errors import LlmftError
from llmft.planning import stop_request


class StopError(LlmftError):
    """RUN_DIR is not a run that is training now; one line, exit 2."""


def make_parser(subparsers=None):
    parser = command_parser(
        subparsers, "stop", "Stop a running training at its next step, with a complete checkpoint (any scheduler)."
    )
    parser.add_argument(
        "run_dir", type=Path, metavar="RUN_DIR", help="the run's --output_dir (a job's CHECKPOINT_DIR)"
    )
    parser.add_argument(
        "--continue",
        dest="go_on",
        action="store_true",
        help="then go on in the job: Slurm requeues it, PBS submits its continuation (a login-shell run: nothing to "
        "submit; run the same command again)",
    )
    parser.set_defaults(func=main)
    return parser


def running_record(run_dir: Path) -> dict:
    """The record of the llmft train that trains in `run_dir` now; a missing directory, one that is no run, and a run
    not training now (never started, finished, or its process gone) are refused, each in one line."""
    if not run_dir.is_dir():
        raise StopError(
            f"{run_dir} does not exist: give the --output_dir of a running llmft train (a job's CHECKPOINT_DIR)"
        )
    record = stop_request.read_training(run_dir)
    if record is None:
        is_run = (run_dir / "llmft_run.json").is_file() or (run_dir / ".llmft-job").is_file()
        if not is_run:
            raise StopError(
                f"{run_dir} is not an llmft run (no llmft_run.json): give the --output_dir of a running llmft train "
                "(a job's CHECKPOINT_DIR)"
            )
        raise StopError(
            f"no llmft train is training in {run_dir} now (it keeps {stop_request.TRAINING_RECORD} there while it "
            "trains; a job still setting up has not started it yet): nothing to stop"
        )
    if record.get("host") == socket.gethostname() and not pid_alive(int(record.get("pid") or 0)):
        raise StopError(
            f"the llmft train recorded in {run_dir} (pid {record.get('pid')} on this host) is no longer running: "
            "nothing to stop"
        )
    return record


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process (a job's): it exists
    return True


def what_follows(record: dict, run_dir: Path, go_on: bool) -> str:
    """The line said after the request: who was asked, and what the job does once the checkpoint is written."""
    ranks = "every rank finishes its step and writes a complete checkpoint"
    scheduler, job = record.get("scheduler"), record.get("job")
    if scheduler in ("slurm", "pbs"):
        name = "Slurm" if scheduler == "slurm" else "PBS"
        if go_on:
            then = "requeues itself" if scheduler == "slurm" else "submits its continuation"
            return f"asked {name} job {job} to stop: {ranks}, then the job {then} and resumes from it"
        return (
            f"asked {name} job {job} to stop: {ranks}, then the job ends; resubmit with CHECKPOINT_DIR={run_dir} to "
            "resume"
        )
    line = f"asked the llmft train in {run_dir} (pid {record.get('pid')} on {record.get('host')}) to stop: {ranks}"
    if go_on:
        return (
            line + "; --continue: a run started from a login shell has no job to go on in: run the same llmft "
            "train command again to resume from it"
        )
    return line + "; run the same llmft train command again to resume from it"


def stop(run_dir: Path, go_on: bool) -> str:
    record = running_record(run_dir)
    stop_request.ask(record["stop_file"], go_on, getpass.getuser())
    return what_follows(record, run_dir.resolve(), go_on)


def main(args) -> int:
    try:
        print(f"llmft stop: {stop(args.run_dir, args.go_on)}", flush=True)
    except LlmftError as e:
        return report_error("stop", e)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(make_parser().parse_args()))

"""A stop asked for on purpose: what `llmft stop RUN_DIR` writes, what `llmft train` polls, what a job's launcher reads.

Every rank of `llmft train` polls one stop file (llmft.training.callbacks.GracefulStop, by listing its directory): a
job's launcher names it (`LLMFT_STOP_FILE`, `.llmft-stop-<job>` in the run directory, which the launcher's own
SIGUSR1/SIGTERM handler touches), `--stop_file` names another, and a run started from a login shell without either
polls `RUN_DIR/.llmft-stop`. While it trains, global rank 0 keeps TRAINING_RECORD in the run directory: that file,
the scheduler and job it runs in, and its host and pid. `llmft stop` reads the record and writes the stop file with
what it asks for (JSON: `{"by": "llmft stop", "continue": ...}`); the ranks see it at their next vote, save a complete
checkpoint and stop; the launcher reads it before it removes it, so it knows the stop was asked for and whether to
go on (Slurm: requeue; PBS: submit the continuation). A file a signal handler touched is empty: a signal's stop.

Standard library only: the launchers run on a batch host's python3.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

TRAINING_RECORD = ".llmft-training.json"  # in the run directory while llmft train trains (global rank 0's)
LOCAL_STOP_FILE = ".llmft-stop"  # the stop file of a run no job or flag named one for
BY = "llmft stop"


def stop_file(flag: str | None, env: Mapping[str, str], output_dir: str | Path) -> str:
    """The file every rank polls: --stop_file, else the job's (LLMFT_STOP_FILE), else RUN_DIR/.llmft-stop. Every rank
    computes the same path from the same flags and environment."""
    return str(Path(flag or env.get("LLMFT_STOP_FILE") or Path(output_dir) / LOCAL_STOP_FILE).absolute())


def scheduler_of(env: Mapping[str, str]) -> tuple[str, str]:
    """("slurm" or "pbs", the job id) of the job this process runs in; ("", "") on a login shell."""
    if env.get("SLURM_JOB_ID"):
        return "slurm", env["SLURM_JOB_ID"]
    if env.get("PBS_JOBID"):
        return "pbs", env["PBS_JOBID"]
    return "", ""


def record_training(output_dir: str | Path, stop: str, env: Mapping[str, str]) -> None:
    """Global rank 0, as training starts: the record `llmft stop` reads. A run of its own (no job, no flag) drops a
    stale request a stopped earlier run left: a new run must not stop at its first step."""
    if stop == str((Path(output_dir) / LOCAL_STOP_FILE).absolute()):
        Path(stop).unlink(missing_ok=True)
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    scheduler, job = scheduler_of(env)
    record = {"stop_file": stop, "scheduler": scheduler, "job": job, "host": socket.gethostname(), "pid": os.getpid()}
    write_json(Path(output_dir) / TRAINING_RECORD, record)


def forget_training(output_dir: str | Path) -> None:
    """Global rank 0, as training ends (any way but a SIGKILL): nothing trains here any more."""
    (Path(output_dir) / TRAINING_RECORD).unlink(missing_ok=True)


def read_training(run_dir: Path) -> dict | None:
    """The record of the llmft train running in `run_dir` (None: none recorded, or unreadable)."""
    try:
        record = json.loads((run_dir / TRAINING_RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("stop_file") else None


def ask(stop: str | Path, go_on: bool, user: str) -> None:
    """Write the request into the stop file the ranks poll (whole, then renamed into place)."""
    write_json(Path(stop), {"by": BY, "continue": go_on, "user": user})


@dataclass(frozen=True)
class Request:
    by: str  # "llmft stop", or "signal" for a file a signal handler touched (empty)
    go_on: bool  # llmft stop --continue: the job goes on (Slurm requeues, PBS submits the continuation)


def read_request(stop: str | Path) -> Request | None:
    """What the stop file asks for (None: there is none), read before the launcher removes it. Listed first, as the
    ranks look for it (a stat can be answered from NFS's cache)."""
    path = Path(stop)
    try:
        if path.name not in os.listdir(path.parent):
            return None
        text = path.read_text().strip()
    except OSError:
        return None
    try:
        data = json.loads(text) if text else {}
    except ValueError:
        data = {}
    if not isinstance(data, dict) or data.get("by") != BY:
        return Request("signal", False)
    return Request(BY, bool(data.get("continue")))


def write_json(path: Path, data: Mapping) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(dict(data)) + "\n")
    os.replace(tmp, path)

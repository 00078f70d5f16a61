"""How long torchrun waits for its ranks after a SIGTERM, so that it never cuts a stop checkpoint Slurm still allows.

On a SIGTERM (scancel, scontrol requeue, preemption) every rank writes a stop checkpoint. Slurm sends SIGKILL KillWait
seconds after the SIGTERM; a preemption under `PreemptMode=REQUEUE`/`CANCEL` with a grace time first sends SIGTERM,
waits GraceTime (the partition's, or the QOS's under preempt/qos), and only then starts the KillWait count. torchrun
SIGKILLs its ranks after its own shutdown timeout (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s by default), so it is set past
the longest of these: max(KillWait, GraceTime + KillWait) + 30 s. A longer torchrun timeout costs nothing, since Slurm's
SIGKILL ends the step anyway; a shorter one cuts a save Slurm would have let finish.

llmft.launch.slurm gathers Slurm's text (`scontrol show config`, `scontrol show partition P`, `sacctmgr show qos Q`)
on the batch host and calls `kill_chain` with it; the parsing and the decision are here, tested directly.
"""

from __future__ import annotations

import re

TORCHRUN_MARGIN_S = 30  # past Slurm's SIGKILL: torchrun never acts first
DEFAULT_KILL_WAIT_S = 30  # Slurm's default KillWait


def slurm_seconds(text: str) -> int | None:
    """A Slurm duration as seconds: `600` (scontrol prints GraceTime in seconds), `[D-]HH:MM:SS` or `MM:SS` (sacctmgr
    prints `00:10:00`); None for an empty, UNLIMITED or unreadable value (the caller says it is unknown)."""
    text = text.strip()
    if re.fullmatch(r"\d+", text):
        return int(text)
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", text)
    if not m or (m.group(1) and not m.group(2)):
        return None
    days, hours, minutes, seconds = (int(g) if g else 0 for g in m.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def config_kill_wait(config_text: str) -> int | None:
    """KillWait from `scontrol show config` (`KillWait = 30 sec`), None when absent."""
    m = re.search(r"^KillWait\s*=\s*(\d+)", config_text, re.MULTILINE)
    return int(m.group(1)) if m else None


def partition_grace(partition_text: str) -> int | None:
    """GraceTime from `scontrol show partition P` (`GraceTime=600`), None when absent."""
    m = re.search(r"(?:^|\s)GraceTime=(\S+)", partition_text)
    return slurm_seconds(m.group(1)) if m else None


def shutdown_timeout(kill_wait: int, grace_times: list[int]) -> int:
    """torchrun's shutdown timeout: past Slurm's SIGKILL after KillWait, and after GraceTime + KillWait where a
    preemption grants a grace time (the largest one that may apply: a longer wait costs nothing, a shorter one cuts
    a save Slurm allows)."""
    grace = max(grace_times, default=0)
    return max(kill_wait, grace + kill_wait) + TORCHRUN_MARGIN_S


def _grace_said(kind: str, name: str, grace: int | None, problem: str) -> tuple[int | None, str]:
    """(the GraceTime to count, or None; what the log line says of it) for the job's partition or QOS."""
    if problem:
        return None, f"{kind} {name or '?'} GraceTime not read ({problem}): partition only"
    if not name:
        return None, f"no {kind}"
    if grace is None:
        return None, f"{kind} {name}'s GraceTime unknown"
    return grace, f"{kind} {name} GraceTime {grace} s"


def kill_chain(
    config_text: str,
    partition: str,
    partition_text: str | None,
    qos: str,
    qos_text: str | None,
    qos_problem: str = "",
) -> tuple[int, str]:
    """(torchrun's shutdown timeout, the log line saying where each number came from). `*_text` None: the command
    failed; `qos_problem`: why the QOS's GraceTime could not be read (no sacctmgr, no accounting storage)."""
    kill_wait = config_kill_wait(config_text)
    said = [
        f"Slurm's KillWait {kill_wait} s"
        if kill_wait is not None
        else f"KillWait unknown ({DEFAULT_KILL_WAIT_S} s assumed)"
    ]
    kill_wait = DEFAULT_KILL_WAIT_S if kill_wait is None else kill_wait
    p_grace = partition_grace(partition_text) if partition_text is not None else None
    q_grace = slurm_seconds(qos_text.strip().splitlines()[0]) if qos_text and qos_text.strip() else None
    graces = []
    for kind, name, grace, problem in (("partition", partition, p_grace, ""), ("QOS", qos, q_grace, qos_problem)):
        counted, words = _grace_said(kind, name, grace, problem)
        graces += [counted] if counted is not None else []
        said.append(words)
    timeout = shutdown_timeout(kill_wait, graces)
    line = (
        f"kill chain: {', '.join(said)}; a preempted job's ranks may save for up to {max(graces, default=0) + kill_wait} s "
        f"after the SIGTERM; torchrun waits {timeout} s for its ranks (TORCH_ELASTIC_SHUTDOWN_TIMEOUT)"
    )
    return timeout, line

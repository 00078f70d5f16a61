"""Which node a failed multi-node job should run without, and whether to run it again at all.

A job of many nodes fails as one: when one rank fails, its peers on every other node fail too ("remote process
exited", a closed connection, a collective timeout). Putting every node whose rank exited non-zero on the requeue's
exclude list excludes healthy nodes: one CUDA out-of-memory error, an assert or a bad record would exclude a node
per attempt until the partition can no longer run the job, and a dead NIC makes every node look failed. So a node is
excluded only on evidence about the node itself:

- it reported nothing (its torchrun never wrote its report: the node died, or its processes hung past Slurm's kill);
- its GPU failed: an Xid of a hardware kind, an uncorrectable ECC error or "fallen off the bus" in the node's kernel
  log (`journalctl -k` since the node's torchrun started, else `dmesg`), from `nvidia-smi`, or in the ranks' output;
- its fabric failed: NCCL's InfiniBand/network errors naming its device or port (`NET/IB`, `ibv_poll_cq`, a work
  completion with an error status, a port or link going down).

Everything else is what the node saw, not what it is: NCCL's "remote process exited", "unhandled system error",
"Connection reset by peer" and gloo's closed connection count like collective timeouts (the node waited for a peer
that failed). A Python exception in a rank (CUDA/torch out of memory, an assert, a bad record, `llmft train: error:`) is an
application failure: it fails the same way on any node, so it is said in one line with its cause and the job is not
requeued. "First" is torchrun's own root-cause time (its error summary's "Root Cause (first observed failure)"), not
when each torchrun exited, which mostly measures its shutdown wait.

Pure functions of text, so the tests give them any node's output. Each node whose torchrun failed makes its report
with `node_report` (in the job's node wrapper, llmft.launch.node, where its stderr and kernel log are); the batch
host's launcher (llmft.launch.slurm, llmft.launch.pbs) calls `read_reports` and `decide` as functions.
Test hook: with `LLMFT_TEST_KERNEL_LOG_DIR` set, node N's kernel log is the file `$LLMFT_TEST_KERNEL_LOG_DIR/N` (none:
an empty log) and nvidia-smi is not asked (tests/kill_hook writes an Xid there).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

from llmft.planning.world import expand_hostlist

# NVIDIA's Xid catalogue: the codes that mean the GPU, its memory or its links failed. Others (13 graphics engine
# exception, 31 MMU fault, 43 a stopped channel, 45 preemptive cleanup) are what an application's bad kernel or the
# end of a killed process cause, and say nothing about the hardware.
HARDWARE_XIDS = {
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping",
    64: "ECC page retirement or row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}
GPU_TEXT = re.compile(
    r"fallen off the bus|uncorrectable ECC error|double bit ECC|GPU is lost|"
    r"Unable to determine the device handle for GPU",
    re.I,
)
XID = re.compile(r"NVRM: Xid \([^)]*\): (\d+)")
FABRIC = re.compile(
    r"Got async event|ibv_poll_cq|Got completion from peer .* with status=(\d+)|"
    r"NET/IB\b.*\b(port|link)\b.*\b(down|error)\b|\blink (is )?down\b|\bport \d+ .*\bDOWN\b",
    re.I,
)
# A work completion with "transport retry counter exceeded" (12) or "RNR retry counter exceeded" (13) means the
# peer stopped answering: it names the peer's failure, not this node's.
PEER_STATUSES = {"12", "13"}
TIMEOUT = re.compile(
    r"Timed out waiting \d+ms for (recv|send)|Watchdog caught collective operation timeout|"
    r"collective operation timeout|NCCL communicator was aborted.*timeout",
    re.I,
)
PEER = re.compile(
    r"remote process exited|unhandled system error|Connection reset by peer|Connection closed by peer|"
    r"Connection refused|Broken pipe|remote process .* failed|DistNetworkError|"
    r"ProcessGroupNCCL.*(aborted|abort)",
    re.I,
)
OOM = re.compile(r"OutOfMemoryError|out of memory", re.I)
RANK_PREFIX = re.compile(r"^\[(default)?rank\d+\]:\s?")
EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Failure)|AssertionError)(: (.*))?$")
LAUNCHER_ERRORS = ("ChildFailedError", "SignalException")
LLMFT_ERROR = re.compile(r"^llmft( \w+)?: error: ")  # llmft's one-line errors (llmft.command.report_error)


@dataclass
class NodeReport:
    """What one node says about its failed torchrun: the root cause torchrun named, and what kind of failure it was."""

    node: str
    rc: int = 1
    rank: int | None = None
    exitcode: int | None = None
    time: str = ""  # torchrun's root-cause time, "2026-11-26_18:27:35" (the node's local time, to the second)
    kind: str = "failed"  # gpu, fabric, app, timeout, peer, signal, failed
    cause: str = ""  # the exception ("torch.OutOfMemoryError: CUDA out of memory ...") or the evidence line
    evidence: list[str] = field(default_factory=list)
    unread: list[str] = field(default_factory=list)  # what the probe could not read, and why


def root_cause(stderr: str) -> dict:
    """rank, exitcode, time and error_file from torchrun's "Root Cause (first observed failure)" block, if any."""
    block = stderr.split("Root Cause (first observed failure)", 1)
    if len(block) < 2:
        return {}
    found = {}
    for key, pattern in (
        ("time", r"^\s*time\s*:\s*(\S+)"),
        ("rank", r"^\s*rank\s*:\s*(\d+)"),
        ("exitcode", r"^\s*exitcode\s*:\s*(-?\d+)"),
        ("error_file", r"^\s*error_file\s*:\s*(\S+)"),
    ):
        match = re.search(pattern, block[1], re.M)
        if match:
            found[key] = int(match.group(1)) if key in ("rank", "exitcode") else match.group(1)
    return found


def exceptions(stderr: str) -> list[str]:
    """The exception line ("Type: message") ending each Python traceback in the ranks' output, in order, without
    torchrun's own ChildFailedError; and llmft's one-line errors (`llmft train: error: ...`)."""
    found, in_traceback = [], False
    for raw in stderr.splitlines():
        line = RANK_PREFIX.sub("", raw)
        if line.startswith("Traceback (most recent call last)"):
            in_traceback = True
        elif in_traceback and line and not line[0].isspace():
            in_traceback = False
            match = EXCEPTION_LINE.match(line.strip())
            if match and not match.group(1).endswith(LAUNCHER_ERRORS):
                found.append(line.strip())
        elif LLMFT_ERROR.match(line):
            found.append(line.strip())
    return found


def gpu_evidence(text: str) -> list[str]:
    """Lines saying a GPU of this node failed: a hardware Xid (HARDWARE_XIDS), an uncorrectable ECC error, a GPU
    fallen off the bus or lost. An Xid an application causes (13, 31, 43, 45) is not evidence: it follows the code."""
    found = []
    for line in text.splitlines():
        xid = XID.search(line)
        if xid:
            if int(xid.group(1)) in HARDWARE_XIDS:
                found.append(line.strip())
        elif GPU_TEXT.search(line):
            found.append(line.strip())
    return found


def fabric_evidence(text: str) -> list[str]:
    """Lines saying this node's network device or link failed: an InfiniBand async event on its HCA (a port error, a
    fatal error), a failed ibv_poll_cq, a work completion with a local error status, a port or link going down.
    A completion saying the peer stopped answering (status 12 or 13, what a healthy node sees when a peer's NIC
    dies), and a peer's failure seen over a healthy link ("remote process exited", a reset connection), are not."""
    found = []
    for line in text.splitlines():
        match = FABRIC.search(line)
        if match and match.group(1) not in PEER_STATUSES and not PEER.search(line):
            found.append(line.strip())
    return found


def classify(node: str, rc: int, stderr: str, kernel_log: str = "", unread: list[str] | None = None) -> NodeReport:
    """One node's report from its torchrun's stderr and its kernel log. The kind, in this order, because each is what
    explains the others: the GPU failed (gpu), the fabric failed (fabric), a rank raised an exception that is not a
    peer's failure or a timeout (app: the code or data; with 8 ranks a node, one OOM leaves 7 peer errors beside it),
    a rank timed out in a collective (timeout), a rank saw a peer fail (peer), a rank was killed by a signal other
    than the SIGTERM srun sends when another node failed (signal), else failed."""
    cause = root_cause(stderr)
    report = NodeReport(node=node, rc=rc, rank=cause.get("rank"), exitcode=cause.get("exitcode"))
    report.time = cause.get("time", "")
    report.unread = list(unread or [])
    gpu = gpu_evidence(kernel_log) + gpu_evidence(stderr)
    fabric = fabric_evidence(kernel_log) + fabric_evidence(stderr)
    raised = exceptions(stderr)
    own = [e for e in raised if not TIMEOUT.search(e) and not PEER.search(e)]
    if gpu:
        report.kind, report.cause, report.evidence = "gpu", gpu[0], gpu[:5]
    elif fabric:
        report.kind, report.cause, report.evidence = "fabric", fabric[0], fabric[:5]
    elif own:
        report.kind, report.cause = "app", own[0]
    elif TIMEOUT.search(stderr):
        report.kind, report.cause = "timeout", next((e for e in raised if TIMEOUT.search(e)), "collective timeout")
    elif PEER.search(stderr):
        report.kind = "peer"
        report.cause = next((e for e in raised if PEER.search(e)), PEER.search(stderr).group(0))
    elif report.exitcode is not None and report.exitcode < 0 and report.exitcode != -15:
        report.kind = "signal"
    return report


def read_kernel_log(node: str, since: float, run=subprocess.run, which=shutil.which) -> tuple[str, list[str]]:
    """The node's kernel messages since `since` (epoch seconds) and nvidia-smi's view of its GPUs; and what could not
    be read. `journalctl -k` first (all of the kernel's messages only for root and the systemd-journal/adm groups;
    it exits 0 and says so on stderr otherwise, or where the node keeps no journal), else `dmesg` (refused to other
    users where kernel.dmesg_restrict=1), then `nvidia-smi` (absent on a node without NVIDIA GPUs)."""
    test_dir = os.environ.get("LLMFT_TEST_KERNEL_LOG_DIR")
    if test_dir:
        path = Path(test_dir) / node
        return (path.read_text() if path.exists() else ""), []
    texts, unread = [], []
    journal = _try(run, ["journalctl", "-k", "--no-pager", "--since", f"@{int(since)}"])
    if journal is not None and journal[0] == 0 and not JOURNAL_UNREADABLE.search(journal[2]):
        texts.append(journal[1])
    else:
        dmesg = _try(run, ["dmesg", "--time-format", "iso"])
        if dmesg is None or dmesg[0] != 0:
            unread.append("the kernel log (journalctl -k and dmesg refused or missing)")
        else:
            texts.append(lines_since(dmesg[1], since))
    query = "--query-gpu=index,pci.bus_id,ecc.errors.uncorrected.volatile.total"
    smi = _try(run, ["nvidia-smi", query, "--format=csv,noheader"]) if which("nvidia-smi") else None
    if smi is None:
        unread.append("nvidia-smi (not installed)" if not which("nvidia-smi") else "nvidia-smi (did not answer)")
    else:  # a GPU off the bus makes nvidia-smi fail with "Unable to determine the device handle for GPU ..."
        texts.append(smi[1] + smi[2])
        texts += [f"nvidia-smi: GPU {line}: uncorrectable ECC error" for line in smi[1].splitlines() if _ecc(line)]
    return "\n".join(texts), unread


JOURNAL_UNREADABLE = re.compile(r"No journal files|not seeing messages|ermission|access", re.I)


def _try(run, command: list[str]) -> tuple[int, str, str] | None:
    """A command's exit status, stdout and stderr, or None where it is missing or did not finish in 30 s."""
    try:
        out = run(command, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.returncode, out.stdout or "", out.stderr or ""


def _ecc(csv_line: str) -> bool:
    """An nvidia-smi CSV line whose volatile uncorrected ECC count is above 0."""
    last = csv_line.rsplit(",", 1)[-1].strip()
    return last.isdigit() and int(last) > 0


def lines_since(dmesg_iso: str, since: float) -> str:
    """The lines of `dmesg --time-format iso` stamped at or after `since` (epoch seconds)."""
    kept = []
    for line in dmesg_iso.splitlines():
        stamp = line.split(" ", 1)[0].replace(",", ".")
        try:
            when = datetime.fromisoformat(stamp).timestamp()
        except ValueError:
            continue
        if when >= since:
            kept.append(line)
    return "\n".join(kept)


@dataclass
class Blame:
    """The failure of a job attempt as one line, and what it says about the nodes."""

    line: str
    exclude: list[str] = field(default_factory=list)  # nodes with evidence of their own failure
    deterministic: bool = False  # an application failure: it would fail the same way on any node
    fix: str = ""  # for a deterministic failure: how to fix it and resume


def first(reports: list[NodeReport]) -> NodeReport:
    """The report whose root cause torchrun observed first (its time; a report without one last)."""
    return min(reports, key=lambda r: (r.time == "", r.time))


def who(report: NodeReport) -> str:
    """ "rank 3 on node n2", or "a rank on node n2" where torchrun named none."""
    return f"rank {report.rank} on node {report.node}" if report.rank is not None else f"a rank on node {report.node}"


def signal_text(code: int | None) -> str:
    """ "exit code -9, SIGKILL" for -9; "exit code 1" for 1."""
    if code is None:
        return "exit code ?"
    if code < 0:
        try:
            return f"exit code {code}, {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exit code {code}"


def blame(reports: list[NodeReport], hosts: list[str], rc: int, trace_dir: str = "CHECKPOINT_DIR/nccl_trace") -> Blame:
    """The attempt's failure in one line, and the nodes to run without. A node is excluded only on evidence about it:
    its GPU or fabric failed (its report's kind), or it reported nothing while every node that did report only
    waited (timed out, or saw a peer fail): then it died or its processes hung. A node that reported nothing beside
    another's own failure is not evidence: Slurm's SIGKILL may have ended it before it wrote (its ranks were saving).
    Evidence on every node of the job points at something they share (a switch, the fabric), so none is excluded.
    An application failure with no hardware evidence anywhere is deterministic: it fails the same way on any node."""
    head = f"training failed (exit {rc})"
    if not reports:
        return Blame(
            f"{head}; no node reported the failing rank (a node that died reports nothing; see the lines above)"
        )
    waiting = [r for r in reports if r.kind in ("timeout", "peer")]
    own = [r for r in reports if r.kind not in ("timeout", "peer")]
    evidence = [r for r in reports if r.kind in ("gpu", "fabric")]
    reported = {r.node for r in reports}
    silent = [h for h in hosts if h not in reported]
    if own:
        known = [r for r in own if r.kind != "failed"]
        culprit = first(known or own)
        line = own_failure_line(head, culprit, first(waiting) if waiting else None)
    elif silent:
        dead = ", ".join(silent)
        line = f"{head}: node {dead} reported nothing (it died, or its processes hung): {waited(first(waiting))}"
        return Blame(line, exclude=silent)
    else:
        line = everyone_waited_line(head, first(waiting), trace_dir)
        return Blame(line)
    extra = [f"node {r.node}: {'GPU' if r.kind == 'gpu' else 'fabric'} failure: {r.cause}" for r in evidence]
    nodes = sorted({r.node for r in evidence}, key=lambda n: (n not in hosts, hosts.index(n) if n in hosts else 0, n))
    if nodes and len(hosts) > 1 and set(nodes) >= set(hosts):
        extra.append(
            "every node of the job shows it, so it is something they share (a switch, the fabric): no node is excluded"
        )
        nodes = []
    elif not nodes and culprit.kind in ("signal", "failed"):
        extra.append(
            f"no evidence against node {culprit.node} (no GPU Xid/ECC error or fabric error in its kernel log "
            f"or output{unread_text(culprit)}): it is not excluded"
        )
    deterministic = not evidence and culprit.kind == "app"
    return Blame(
        "\n".join([line, *extra]),
        exclude=nodes,
        deterministic=deterministic,
        fix=fix_for(culprit) if deterministic else "",
    )


def unread_text(report: NodeReport) -> str:
    """ "; not read there: the kernel log (...)" for what the node's probe could not read."""
    return f"; not read there: {', '.join(report.unread)}" if report.unread else ""


def own_failure_line(head: str, culprit: NodeReport, waiter: NodeReport | None) -> str:
    """The line for a rank that failed on its own: with its cause for an exception; or, when it did not end by itself
    (no exit code of its own, or srun's SIGTERM) while others waited for it, as a node that stopped answering: its
    rank hung (a GPU hang is such a rank too, with an Xid beside it)."""
    ended_on_its_own = culprit.kind == "app" or (culprit.exitcode is not None and culprit.exitcode != -15)
    if not ended_on_its_own and waiter is not None:
        there = f"rank {culprit.rank} there" if culprit.rank is not None else "a rank there"
        return f"{head}: node {culprit.node} stopped answering ({there} hung or died): {waited(waiter)}"
    rank = culprit.rank if culprit.rank is not None else "?"
    line = f"{head}: rank {rank} on node {culprit.node} failed first ({signal_text(culprit.exitcode)})"
    return f"{line}: {culprit.cause}" if culprit.kind == "app" else line


def waited(report: NodeReport) -> str:
    """How a waiting rank saw the failure: a collective timeout, or a peer's failure (NCCL/gloo)."""
    if report.kind == "timeout":
        return f"{who(report)} timed out waiting for it in a collective"
    return f"{who(report)} saw its peer fail ({report.cause})"


def everyone_waited_line(head: str, earliest: NodeReport, trace_dir: str) -> str:
    """Every node only waited: which rank hung or failed is not known, and no node is blamed."""
    if earliest.kind == "timeout":
        what = f"every node timed out waiting in a collective ({who(earliest)} first), so which rank hung is not known"
    else:
        what = f"every node saw a peer fail ({who(earliest)} first: {earliest.cause}), so which failed is not known"
    return (
        f"{head}: {what}: {trace_dir} holds the flight recorder's dumps "
        "(python -m torch.distributed.flight_recorder.fr_trace); no node is excluded"
    )


def fix_for(report: NodeReport) -> str:
    """What to change before resubmitting after an application failure."""
    if OOM.search(report.cause):
        return (
            "out of memory: lower MICRO_BATCH (GLOBAL_BATCH is kept), add --gradient_checkpointing to EXTRA_ARGS, "
            "or use ZERO_STAGE=3, OFFLOAD=1 or ZERO_STAGE=auto"
        )
    return "fix the code or the data it names (the rank's traceback is above)"


def usable_nodes(sinfo: str, reservation: str = "") -> list[str]:
    """The nodes that can run the job: `sinfo -h -N -o "%N %t"` lines of its partition in a state that can take a job
    (not down, drained, failing or unknown; a powered-down cloud node, `idle~`, can), and of its reservation (the
    `Nodes=` of `scontrol show reservation`), if it has one."""
    bad = ("down", "drain", "drng", "fail", "inval", "unk", "maint")
    nodes = []
    for line in sinfo.splitlines():
        parts = line.split()
        if len(parts) >= 2 and not parts[1].startswith(bad) and parts[0] not in nodes:
            nodes.append(parts[0])
    match = re.search(r"\bNodes=(\S+)", reservation)
    if match and match.group(1) != "(null)":
        reserved = set(expand_hostlist(match.group(1)))
        nodes = [n for n in nodes if n in reserved]
    return nodes


def guard_exclusion(
    exclude: list[str], already: list[str], usable: list[str] | None, needed: int
) -> tuple[list[str], str]:
    """The exclude list to set (already excluded nodes and the new ones), and a line when the new ones are dropped:
    a requeued job excluding so many nodes that fewer than its node count remain usable would pend forever (a fixed
    partition or a reservation of exactly the job's size). Where sinfo could not list the partition (`usable` None),
    nothing is added either: the same risk, unmeasured."""
    new = [n for n in exclude if n not in already]
    if not new:
        return already, ""
    them = "them" if len(new) > 1 else "it"
    if usable is None:
        return already, (
            f"not excluding node(s) {','.join(new)}: sinfo could not list the job's partition, so whether the job "
            f"could run without {them} is not known; the restart may run there again"
        )
    left = [n for n in usable if n not in already and n not in new]
    if len(left) < needed:
        return already, (
            f"not excluding node(s) {','.join(new)}: the job's partition has {len(usable)} usable node(s) (sinfo), "
            f"and without {them} {len(left)} would remain for the job's {needed}; the restart may run there again"
        )
    return already + new, ""


@dataclass(frozen=True)
class Restart:
    """How a job runs again after a failure, in its own words: the same job requeued (Slurm: `scontrol requeue`, and
    the nodes with evidence against them excluded while it pends), or a new job that continues the run (PBS: qsub
    has no exclusion, so those nodes are named in `cannot_exclude`'s advice instead)."""

    no: str  # the line's head when the job does not run again
    went_on: str  # what the earlier restarts were
    again: str  # the line when it does: {job} {n} {max} {step}
    cannot_exclude: str = ""  # set: nodes are never excluded, this advice names them ({nodes})


REQUEUE = Restart(
    "not requeueing",
    "the job was requeued",
    "requeueing job {job} (restart {n} of at most {max} after failures) from checkpoint-{step}",
)
CONTINUE = Restart(
    "not continued",
    "the run was continued in a new job",
    "continuing in a new job (after failures {n} of at most MAX_RESTARTS={max}) from checkpoint-{step}",
    "the new job may be placed on node(s) {nodes} again, and qsub cannot exclude nodes: ask for other nodes with "
    "-l select=...:host=, or have an administrator offline them",
)


@dataclass
class Attempt:
    """What the job script knows about the failed attempt."""

    job: str
    rc: int
    hosts: list[str]
    restarts: int  # restarts after failures so far
    max_restarts: int
    start_step: int  # the newest complete checkpoint when the attempt started (0: none)
    end_step: int  # and when it ended
    already_excluded: list[str] = field(default_factory=list)
    usable: list[str] | None = None  # the partition's usable nodes (None: sinfo could not tell)
    trace_dir: str = "CHECKPOINT_DIR/nccl_trace"  # where the flight recorder dumps
    restart: Restart = REQUEUE  # how the job runs again


def decide(reports: list[NodeReport], attempt: Attempt) -> tuple[list[str], bool, list[str]]:
    """(lines to say, whether to run again, the exclude list to set), for either scheduler (`attempt.restart` says
    how it runs again). Not again: an application failure (it would fail the same way: the line says how to fix and
    resume), MAX_RESTARTS reached, or an attempt that wrote no new complete checkpoint (another would fail the same
    way, at the same place). Else again, without the nodes with evidence against them, as far as the partition can
    spare them (or, where the scheduler cannot exclude nodes, naming them)."""
    found = blame(reports, attempt.hosts, attempt.rc, attempt.trace_dir)
    lines, how = found.line.split("\n"), attempt.restart
    resume = f"from checkpoint-{attempt.end_step}" if attempt.end_step else "from the start (no complete checkpoint)"
    if found.deterministic:
        lines.append(
            f"{how.no}: an application error fails the same way on any node; {found.fix}, then resubmit "
            f"with the same CHECKPOINT_DIR to resume {resume}"
        )
        return lines, False, attempt.already_excluded
    if attempt.restarts >= attempt.max_restarts:
        lines.append(
            f"{how.no}: {how.went_on} after failures {attempt.restarts} times, and MAX_RESTARTS={attempt.max_restarts}"
        )
        return lines, False, attempt.already_excluded
    if attempt.end_step <= attempt.start_step:
        newest = attempt.end_step or "none"
        lines.append(
            f"{how.no}: this attempt wrote no new complete checkpoint (newest: {newest}), "
            "so another would fail the same way"
        )
        return lines, False, attempt.already_excluded
    again = how.again.format(job=attempt.job, n=attempt.restarts + 1, max=attempt.max_restarts, step=attempt.end_step)
    if how.cannot_exclude:
        advice = f"; {how.cannot_exclude.format(nodes=','.join(found.exclude))}" if found.exclude else ""
        lines.append(again + advice)
        return lines, True, []
    exclude, note = guard_exclusion(found.exclude, attempt.already_excluded, attempt.usable, len(attempt.hosts))
    if note:
        lines.append(note)
    excluding = f", excluding node(s) {','.join(exclude)}" if exclude else ""
    lines.append(again + excluding)
    return lines, True, exclude


def read_reports(directory: Path) -> list[NodeReport]:
    """The reports the nodes wrote (node-*.json); one that cannot be read counts as a report of an unknown failure."""
    reports = []
    for path in sorted(directory.glob("node-*.json")):
        try:
            reports.append(NodeReport(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            reports.append(NodeReport(node=path.stem, cause=f"unreadable report {path.name}"))
    return reports


def node_report(node: str, rc: int, stderr: str, since: float) -> dict:
    """The report of a node whose torchrun failed, made on that node by the job's node wrapper (llmft.launch.node),
    where torchrun's stderr (the ranks' included) and the node's kernel log are: `since` is when torchrun started."""
    kernel_log, unread = read_kernel_log(node, since)
    return asdict(classify(node, rc, stderr, kernel_log, unread))

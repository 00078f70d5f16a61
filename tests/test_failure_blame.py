"""llmft.launch.failure_blame: a node is excluded from a requeued job only on evidence about the node, on the
output torchrun and the ranks really write (the error summaries below follow torch 2.x's format), for a job of 8
nodes x 8 GPUs unless a test says otherwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmft.launch import failure_blame as fb
from llmft.launch.failure_blame import Attempt, NodeReport, classify, decide

NODES = [f"gpu{i}" for i in range(1, 9)]


def summary(rank: int, exitcode: int, when: str, signal: str = "") -> str:
    """torchrun's error summary, as its elastic agent prints it when a rank of its node failed."""
    traceback = (
        f"Signal {-exitcode} ({signal}) received by PID 4242"
        if exitcode < 0
        else "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
    )
    return f"""E1126 {when[11:]}.151000 6086 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: {exitcode}) local_rank: {rank % 8} (pid: 4242) of binary: /venv/bin/python
Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
llmft.train FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : {when}
  host      : node.cluster.internal
  rank      : {rank} (local_rank: {rank % 8})
  exitcode  : {exitcode} (pid: 4242) {f"({signal})" if signal else ""}
  error_file: <N/A>
  traceback : {traceback}
============================================================
"""


def raised(rank: int, exception: str) -> str:
    """A rank's uncaught exception, as torch prints it once the process group exists ([rankN]: prefixes)."""
    return (
        f"[rank{rank}]: Traceback (most recent call last):\n"
        f'[rank{rank}]:   File "/venv/lib/python3.11/site-packages/llmft/train.py", line 412, in main\n'
        f"[rank{rank}]:     trainer.train(resume_from_checkpoint=resume)\n"
        f"[rank{rank}]: {exception}\n"
    )


NCCL_REMOTE = (
    "torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, "
    "remote process exited or there was a network error, NCCL version 2.21.5"
)
NCCL_SYSTEM = (
    "torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, "
    "unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5"
)
NCCL_TIMEOUT = (
    "torch.distributed.DistBackendError: [PG ID 0 PG GUID 0(default_pg) Rank 9] Watchdog caught collective operation "
    "timeout: WorkNCCL(SeqNum=8127, OpType=ALLREDUCE, NumelIn=262144, NumelOut=262144, Timeout(ms)=300000) ran for "
    "300004 milliseconds before timing out."
)
GLOO_CLOSED = (
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:2211"
)
RETRY_EXCEEDED = (
    "Last error:\nNET/IB : Got completion from peer 10.0.0.5<44556> with status=12 opcode=0 len=0 vendor err 129 (Send) "
    "localGid ::ffff:10.0.0.1 remoteGids::ffff:10.0.0.5 hca mlx5_0"
)
PORT_ERROR = "gpu5:2345:2401 [3] NCCL WARN NET/IB : mlx5_0:1 Got async event : port error"
XID_79 = "[Thu Nov 26 18:00:01 2026] NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, GPU has fallen off the bus."
XID_13 = "[Thu Nov 26 18:00:01 2026] NVRM: Xid (PCI:0000:3b:00): 13, pid=4242, Graphics Exception: ESR 0x404600=0x80"
XID_48 = "[Thu Nov 26 18:00:01 2026] NVRM: Xid (PCI:0000:3b:00): 48, pid=4242, An uncorrectable double bit error (DBE)"
OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.81 GiB. GPU 1 has a total capacity of 79.10 GiB "
    "of which 1.2 GiB is free."
)


def waited(node: str, rank: int, when: str, exception: str = NCCL_REMOTE, extra: str = "") -> NodeReport:
    """A node whose rank failed only because a peer did (exit 1 with a peer error, or a timeout)."""
    return classify(node, 1, raised(rank, exception) + extra + summary(rank, 1, when))


def attempt(**overrides) -> Attempt:
    fields = dict(
        job="4242",
        rc=1,
        hosts=list(NODES),
        restarts=0,
        max_restarts=3,
        start_step=100,
        end_step=200,
        usable=NODES + ["gpu9"],
    )
    fields.update(overrides)
    return Attempt(**fields)


def others(but: str, when: str = "2026-11-26_18:00:09", exception: str = NCCL_REMOTE) -> list[NodeReport]:
    return [waited(n, 8 * i, when, exception) for i, n in enumerate(NODES) if n != but]


def test_a_dead_node_reported_nothing_and_is_excluded():
    reports = [waited(n, 8 * i, "2026-11-26_18:05:00", NCCL_TIMEOUT) for i, n in enumerate(NODES) if n != "gpu4"]
    lines, requeue, exclude = decide(reports, attempt())
    assert lines[0] == (
        "training failed (exit 1): node gpu4 reported nothing (it died, or its processes hung): "
        "rank 0 on node gpu1 timed out waiting for it in a collective"
    )
    assert requeue and exclude == ["gpu4"]
    assert (
        lines[-1]
        == "requeueing job 4242 (restart 1 of at most 3 after failures) from checkpoint-200, excluding node(s) gpu4"
    )


def test_a_gpu_fallen_off_the_bus_excludes_its_node_and_only_it():
    """gpu3's kernel log has Xid 79; its rank died by SIGKILL; every other node saw NCCL's remote error."""
    reports = others("gpu3") + [
        classify("gpu3", 1, summary(19, -9, "2026-11-26_18:00:02", "SIGKILL"), kernel_log="boot\n" + XID_79 + "\n")
    ]
    lines, requeue, exclude = decide(reports, attempt())
    assert lines[0] == "training failed (exit 1): rank 19 on node gpu3 failed first (exit code -9, SIGKILL)"
    assert lines[1] == f"node gpu3: GPU failure: {XID_79}"
    assert requeue and exclude == ["gpu3"]


@pytest.mark.parametrize(
    "text, evidence",
    [
        (XID_79, True),
        (XID_48, True),
        ("NVRM: Xid (PCI:0000:3b:00): 94, pid=4242, Contained: SM (0x1). RST: No, D-RST: No", True),
        (XID_13, False),  # a graphics exception follows the application's code, not the hardware
        ("NVRM: Xid (PCI:0000:3b:00): 31, pid=4242, Ch 00000010, intr 10000000. MMU Fault", False),
        ("Unable to determine the device handle for GPU0000:3B:00.0: Unknown Error", True),  # nvidia-smi
        ("RuntimeError: CUDA error: uncorrectable ECC error encountered", True),
        ("nvidia 0000:3b:00.0: enabling device (0000 -> 0003)", False),
    ],
)
def test_gpu_evidence_is_a_hardware_xid_ecc_or_a_gpu_off_the_bus(text, evidence):
    assert bool(fb.gpu_evidence(text)) == evidence


def test_an_xid_an_application_causes_is_not_evidence_and_the_kill_is_retried_on_the_same_nodes():
    reports = others("gpu3") + [classify("gpu3", 1, summary(19, -9, "2026-11-26_18:00:02", "SIGKILL"), XID_13)]
    lines, requeue, exclude = decide(reports, attempt())
    assert lines[0] == "training failed (exit 1): rank 19 on node gpu3 failed first (exit code -9, SIGKILL)"
    assert lines[1].startswith("no evidence against node gpu3 (no GPU Xid/ECC error or fabric error")
    assert requeue and exclude == []
    assert lines[-1] == "requeueing job 4242 (restart 1 of at most 3 after failures) from checkpoint-200"


def test_a_dead_nic_excludes_its_node_not_the_peers_that_lost_it():
    """gpu5's HCA port failed (NCCL's async event there); every other node's ranks exit 1 with NCCL's remote error,
    whose "Last error" is the retry-exceeded completion a healthy node gets from a peer that stopped answering."""
    reports = [
        waited(n, 8 * i, "2026-11-26_18:00:03", NCCL_REMOTE, RETRY_EXCEEDED + "\n")
        for i, n in enumerate(NODES)
        if n != "gpu5"
    ]
    reports.append(waited("gpu5", 33, "2026-11-26_18:00:02", NCCL_SYSTEM, PORT_ERROR + "\n"))
    assert [r.kind for r in reports] == ["peer"] * 7 + ["fabric"]
    lines, requeue, exclude = decide(reports, attempt())
    assert lines[0] == "training failed (exit 1): rank 33 on node gpu5 failed first (exit code 1)"
    assert lines[1] == f"node gpu5: fabric failure: {PORT_ERROR}"
    assert requeue and exclude == ["gpu5"]


@pytest.mark.parametrize(
    "line",
    [
        PORT_ERROR,
        "gpu5:2345:2401 [3] NCCL WARN NET/IB : Got completion from peer 10.0.0.1<37512> with status=4 opcode=0 "
        "len=0 vendor err 0 (Send) localGid ::ffff:10.0.0.5 remoteGids::ffff:10.0.0.1 hca mlx5_0",
        "gpu5:2345:2401 [3] NCCL WARN NET/IB : ibv_poll_cq failed, error 5 (Input/output error)",
        "[Thu Nov 26 18:00:01 2026] mlx5_core 0000:0c:00.0 ib0: Link down",
    ],
)
def test_fabric_evidence_names_this_nodes_device_or_link(line):
    assert fb.fabric_evidence(line) == [line]


def test_nccl_remote_errors_on_every_node_exclude_none():
    """A NIC failure NCCL reports on every node alike ("remote process exited"): no node is known to be at fault."""
    reports = [waited(n, 8 * i, f"2026-11-26_18:00:0{i}") for i, n in enumerate(NODES)]
    lines, requeue, exclude = decide(reports, attempt())
    assert lines[0].startswith(
        "training failed (exit 1): every node saw a peer fail (rank 0 on node gpu1 first: torch.distributed."
        "DistBackendError: NCCL error in: "
    )
    assert lines[0].endswith(
        "so which failed is not known: CHECKPOINT_DIR/nccl_trace holds the flight recorder's dumps (python -m torch.distributed.flight_recorder.fr_trace); no node is excluded"
    )
    assert requeue and exclude == []


def test_timeouts_everywhere_exclude_none():
    reports = [waited(n, 8 * i, "2026-11-26_18:05:00", NCCL_TIMEOUT) for i, n in enumerate(NODES)]
    assert {r.kind for r in reports} == {"timeout"}
    lines, requeue, exclude = decide(reports, attempt())
    assert (
        "every node timed out waiting in a collective (rank 0 on node gpu1 first), so which rank hung is not known"
        in lines[0]
    )
    assert requeue and exclude == []


def test_a_cuda_oom_is_one_line_with_its_cause_and_stops_the_job():
    """gpu2's rank 9 runs out of GPU memory; its 7 neighbours on gpu2 and every other node see NCCL's remote error."""
    gpu2 = (
        raised(9, OOM) + "".join(raised(r, NCCL_REMOTE) for r in range(10, 16)) + summary(9, 1, "2026-11-26_18:00:01")
    )
    reports = others("gpu2") + [classify("gpu2", 1, gpu2)]
    lines, requeue, exclude = decide(reports, attempt())
    assert lines[0] == f"training failed (exit 1): rank 9 on node gpu2 failed first (exit code 1): {OOM}"
    assert lines[1] == (
        "not requeueing: an application error fails the same way on any node; out of memory: lower MICRO_BATCH "
        "(GLOBAL_BATCH is kept), add --gradient_checkpointing to EXTRA_ARGS, or use ZERO_STAGE=3, OFFLOAD=1 or "
        "ZERO_STAGE=auto, then resubmit with the same CHECKPOINT_DIR to resume from checkpoint-200"
    )
    assert len(lines) == 2 and not requeue and exclude == []


def test_an_assert_is_named_with_its_message_and_the_first_failure_is_torchruns_root_cause_time():
    """Two nodes raise; gpu7's torchrun observed its failure first (18:00:01), though gpu1's exited earlier."""
    reports = [
        classify(
            "gpu1",
            1,
            raised(0, "ValueError: record 17: 'messages' is not a list") + summary(0, 1, "2026-11-26_18:00:04"),
        ),
        *[waited(n, 8 * i, "2026-11-26_18:00:09") for i, n in enumerate(NODES) if n not in ("gpu1", "gpu7")],
        classify(
            "gpu7",
            1,
            raised(50, "AssertionError: labels and input_ids differ in length")
            + summary(50, 1, "2026-11-26_18:00:01"),
        ),
    ]
    lines, requeue, exclude = decide(reports, attempt(end_step=0, start_step=0))
    assert lines[0] == (
        "training failed (exit 1): rank 50 on node gpu7 failed first (exit code 1): "
        "AssertionError: labels and input_ids differ in length"
    )
    assert lines[1] == (
        "not requeueing: an application error fails the same way on any node; fix the code or the data it names "
        "(the rank's traceback is above), then resubmit with the same CHECKPOINT_DIR to resume from the start "
        "(no complete checkpoint)"
    )
    assert not requeue


def test_llmfts_one_line_error_is_an_application_failure():
    report = classify(
        "gpu1",
        1,
        "llmft train: error: --dataset_text_field text: no such column\n" + summary(0, 1, "2026-11-26_18:00:04"),
    )
    assert (report.kind, report.cause) == ("app", "llmft train: error: --dataset_text_field text: no such column")


def test_gloo_closed_connection_counts_like_a_timeout_not_as_evidence():
    report = waited("n1", 0, "2026-11-26_18:00:04", GLOO_CLOSED)
    assert report.kind == "peer"


def test_a_hung_rank_names_its_node_but_excludes_it_only_with_evidence():
    """n2's rank hung: n1 timed out waiting; srun's SIGTERM then ended n2's torchrun, which named no rank."""
    n1 = waited(
        "n1",
        0,
        "2026-11-26_18:00:30",
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 30000ms for recv operation to complete",
    )
    n2 = classify("n2", 143, "run_llm.slurm: node n2 stopping\n")
    lines, requeue, exclude = decide([n1, n2], attempt(hosts=["n1", "n2"], usable=["n1", "n2", "n3"]))
    assert lines[0] == (
        "training failed (exit 1): node n2 stopped answering (a rank there hung or died): "
        "rank 0 on node n1 timed out waiting for it in a collective"
    )
    assert requeue and exclude == []
    n2 = classify("n2", 143, "", kernel_log=XID_79)
    lines, requeue, exclude = decide([n1, n2], attempt(hosts=["n1", "n2"], usable=["n1", "n2", "n3"]))
    assert lines[0].startswith("training failed (exit 1): node n2 stopped answering (a rank there hung or died)")
    assert lines[1] == f"node n2: GPU failure: {XID_79}" and exclude == ["n2"]


def test_never_exclude_so_many_nodes_that_the_partition_cannot_run_the_job():
    reports = others("gpu3") + [classify("gpu3", 1, summary(19, -9, "2026-11-26_18:00:02", "SIGKILL"), XID_79)]
    sinfo = "\n".join(f"{n} alloc" for n in NODES) + "\ngpu9 down*\n"
    lines, requeue, exclude = decide(reports, attempt(usable=fb.usable_nodes(sinfo)))
    assert lines[-2] == (
        "not excluding node(s) gpu3: the job's partition has 8 usable node(s) (sinfo), and without it 7 would "
        "remain for the job's 8; the restart may run there again"
    )
    assert requeue and exclude == []
    # a spare that can run (idle, or a powered-down cloud node) leaves room
    lines, requeue, exclude = decide(reports, attempt(usable=fb.usable_nodes(sinfo.replace("down*", "idle~"))))
    assert exclude == ["gpu3"]
    # an exclusion already in place stays, and counts against the room
    lines, requeue, exclude = decide(
        reports, attempt(already_excluded=["gpu9"], usable=fb.usable_nodes(sinfo.replace("down*", "idle")))
    )
    assert exclude == ["gpu9"] and "7 would remain for the job's 8" in lines[-2]
    # sinfo could not answer: nothing added
    lines, requeue, exclude = decide(reports, attempt(usable=None))
    assert exclude == [] and lines[-2].startswith(
        "not excluding node(s) gpu3: sinfo could not list the job's partition"
    )


def test_usable_nodes_are_the_partitions_nodes_in_a_state_that_runs_jobs_and_in_the_reservation():
    sinfo = "n1 idle\nn1 idle\nn2 drain\nn3 down*\nn4 mix\nn5 idle~\nn6 alloc\n"
    assert fb.usable_nodes(sinfo) == ["n1", "n4", "n5", "n6"]
    reservation = "ReservationName=train StartTime=2026-11-26T00:00:00 Nodes=n[4-5] NodeCnt=2 Flags=\n"
    assert fb.usable_nodes(sinfo, reservation) == ["n4", "n5"]


def test_the_requeue_limits_still_apply():
    reports = others("gpu3") + [classify("gpu3", 1, summary(19, -9, "2026-11-26_18:00:02", "SIGKILL"), XID_79)]
    lines, requeue, _ = decide(reports, attempt(restarts=3))
    assert (
        lines[-1] == "not requeueing: the job was requeued after failures 3 times, and MAX_RESTARTS=3" and not requeue
    )
    lines, requeue, _ = decide(reports, attempt(end_step=100))
    assert (
        lines[-1]
        == "not requeueing: this attempt wrote no new complete checkpoint (newest: 100), so another would fail the same way"
    )
    lines, requeue, _ = decide([], attempt())
    assert lines[0].startswith("training failed (exit 1); no node reported the failing rank") and requeue


def test_the_kernel_log_since_the_start_and_what_could_not_be_read():
    def run(command, **_):
        if command[0] == "journalctl":
            return subprocess.CompletedProcess(command, 1, "", "Failed to get journal access: Permission denied")
        if command[0] == "dmesg":
            old = "2026-11-26T17:00:00,000000+00:00 NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus."
            new = "2026-11-26T18:00:01,000000+00:00 NVRM: Xid (PCI:0000:3b:00): 48, pid=2, DBE"
            return subprocess.CompletedProcess(command, 0, f"{old}\n{new}\n", "")
        raise FileNotFoundError(command[0])

    since = fb.datetime.fromisoformat("2026-11-26T18:00:00+00:00").timestamp()
    text, unread = fb.read_kernel_log("n1", since, run=run, which=lambda _: None)
    assert "Xid (PCI:0000:3b:00): 48" in text and ": 79," not in text
    assert unread == ["nvidia-smi (not installed)"]

    def refused(command, **_):
        if command[0] == "nvidia-smi":
            return subprocess.CompletedProcess(command, 0, "0, 00000000:3B:00.0, 0\n1, 00000000:5E:00.0, 3\n", "")
        return subprocess.CompletedProcess(command, 1, "", "dmesg: read kernel buffer failed: Operation not permitted")

    text, unread = fb.read_kernel_log("n1", since, run=refused, which=lambda _: "/usr/bin/nvidia-smi")
    assert unread == ["the kernel log (journalctl -k and dmesg refused or missing)"]
    assert fb.gpu_evidence(text) == ["nvidia-smi: GPU 1, 00000000:5E:00.0, 3: uncorrectable ECC error"]


def test_the_reports_the_node_wrapper_writes_decide_the_requeue(tmp_path, monkeypatch):
    """Each node's wrapper (llmft.launch.node, what srun runs on every node) writes its report when torchrun fails,
    from torchrun's stderr and the test kernel log; the batch host's decision from those reports names the node,
    excludes it and requeues."""
    kernel = tmp_path / "kernel"
    kernel.mkdir()
    (kernel / "n2").write_text(XID_79 + "\n")
    monkeypatch.setenv("LLMFT_TEST_KERNEL_LOG_DIR", str(kernel))
    reports = tmp_path / "reports"
    reports.mkdir()
    repo = str(Path(__file__).resolve().parents[1])
    for rank, (node, text) in enumerate(
        (
            ("n1", raised(0, GLOO_CLOSED) + summary(0, 1, "2026-11-26_18:00:03")),
            ("n2", summary(1, -9, "2026-11-26_18:00:02", "SIGKILL")),
        )
    ):
        (tmp_path / f"{node}.err").write_text(text)
        torchrun = f"import sys; sys.stderr.write(open({str(tmp_path / f'{node}.err')!r}).read()); sys.exit(1)"
        wrapper = [sys.executable, "-m", "llmft.launch.node", "--failures", str(reports), "--"]
        env = {**os.environ, "PYTHONPATH": repo, "SLURMD_NODENAME": node, "SLURM_NODEID": str(rank)}
        done = subprocess.run([*wrapper, sys.executable, "-c", torchrun], capture_output=True, text=True, env=env)
        assert done.returncode == 1, done
    assert json.loads((reports / "node-1.json").read_text())["kind"] == "gpu"
    lines, requeue, exclude = decide(
        fb.read_reports(reports),
        attempt(
            job="7",
            hosts=["n1", "n2"],
            start_step=0,
            end_step=2,
            usable=fb.usable_nodes("n1 alloc\nn2 alloc\nn3 idle\n"),
        ),
    )
    assert lines == [
        "training failed (exit 1): rank 1 on node n2 failed first (exit code -9, SIGKILL)",
        f"node n2: GPU failure: {XID_79}",
        "requeueing job 7 (restart 1 of at most 3 after failures) from checkpoint-2, excluding node(s) n2",
    ]
    assert requeue and exclude == ["n2"]


def test_no_evidence_says_what_the_node_could_not_read():
    unread = ["the kernel log (journalctl -k and dmesg refused or missing)", "nvidia-smi (not installed)"]
    killed = classify("gpu3", 1, summary(19, -9, "2026-11-26_18:00:02", "SIGKILL"), unread=unread)
    lines, requeue, exclude = decide(others("gpu3") + [killed], attempt())
    assert lines[1] == (
        "no evidence against node gpu3 (no GPU Xid/ECC error or fabric error in its kernel log or output; not read "
        "there: the kernel log (journalctl -k and dmesg refused or missing), nvidia-smi (not installed)): it is not "
        "excluded"
    )
    assert requeue and exclude == []


def test_evidence_on_every_node_points_at_what_they_share_and_excludes_none():
    """A switch fails: every node's HCA reports its port down, so no node is to blame more than the others."""
    link_down = "[Thu Nov 26 18:00:01 2026] mlx5_core 0000:0c:00.0 ib0: Link down"
    reports = [
        classify(n, 1, raised(8 * i, NCCL_SYSTEM) + summary(8 * i, 1, "2026-11-26_18:00:02"), link_down)
        for i, n in enumerate(NODES)
    ]
    lines, requeue, exclude = decide(reports, attempt())
    assert lines[-2] == (
        "every node of the job shows it, so it is something they share (a switch, the fabric): no node is excluded"
    )
    assert requeue and exclude == []


def test_a_continuation_names_the_nodes_it_cannot_exclude_and_says_it_in_its_own_words():
    """PBS goes on in a new job (llmft.launch.failure_blame.CONTINUE) and qsub cannot exclude a node: the same rules
    decide, the node with evidence against it is named in advice, never in an exclude list, and no sinfo is needed."""
    gpu = classify("gpu3", 1, summary(19, -9, "2026-11-26_18:00:02", "SIGKILL"), kernel_log=XID_79)
    lines, again, exclude = decide(others("gpu3") + [gpu], attempt(job="7.head", usable=None, restart=fb.CONTINUE))
    assert again and exclude == []
    assert lines[-1] == (
        "continuing in a new job (after failures 1 of at most MAX_RESTARTS=3) from checkpoint-200; the new job may "
        "be placed on node(s) gpu3 again, and qsub cannot exclude nodes: ask for other nodes with -l "
        "select=...:host=, or have an administrator offline them"
    )
    lines, again, _ = decide(others("gpu3") + [gpu], attempt(restarts=3, restart=fb.CONTINUE))
    assert not again and lines[-1] == (
        "not continued: the run was continued in a new job after failures 3 times, and MAX_RESTARTS=3"
    )

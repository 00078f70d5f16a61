"""The local OpenPBS cluster (pbs/local/) behaves as the PBS launcher relies on: a scattered two-chunk job gets one chunk
on each node and pbsdsh starts one task under each mom, arrays number their sub-jobs from PBS_ARRAY_INDEX, walltime
ends a job with SIGTERM and Exit_status -29, and qrerun requeues a rerunnable job but refuses any other.

These are checks of the cluster the launcher's tests run on, so that a launcher failure is not a cluster one in
disguise; each runs real jobs as the job user through pbs_server, pbs_sched and the two moms.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from pbs_cluster import PbsCluster


def write_script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)
    return path


def test_scatter_puts_one_chunk_on_each_node(pbs_cluster: PbsCluster, tmp_path):
    """select=2:ncpus=1 with place=scatter: exec_host names both nodes, PBS_NODEFILE lists pbs-n0 then pbs-n1, and
    pbsdsh runs task 0 under pbs-n0's mom and task 1 under pbs-n1's (each its own mom port), both given pbs-n0 as
    the first host: the rendezvous a torchrun-style launch uses. The job script reads it and passes it on: a task
    pbsdsh starts on the first node (the mother superior) has no PBS_NODEFILE in its environment."""
    d = pbs_cluster.job_dir(tmp_path)
    q = shlex.quote(str(d))
    task = f'echo "$PBS_NODENUM $0 $PBS_MOMPORT" > {q}/task.$PBS_NODENUM'
    pbsdsh = shlex.quote(str(pbs_cluster.bin / "pbsdsh"))
    script = write_script(
        d / "job.sh",
        f'cp "$PBS_NODEFILE" {q}/nodefile\n{pbsdsh} -- /bin/sh -c {shlex.quote(task)} "$(head -n 1 "$PBS_NODEFILE")"\n',
    )
    job_id = pbs_cluster.qsub(
        [
            "-l",
            "select=2:ncpus=1",
            "-l",
            "place=scatter",
            "-l",
            "walltime=00:10:00",
            "-o",
            str(d / "out"),
            "-e",
            str(d / "err"),
            str(script),
        ],
        cwd=d,
    )
    info = pbs_cluster.wait(job_id)
    assert info["Exit_status"] == 0, (info, pbs_cluster.logs_tail())
    assert [chunk.split("/")[0] for chunk in info["exec_host"].split("+")] == ["pbs-n0", "pbs-n1"], info["exec_host"]
    assert (d / "nodefile").read_text().split() == ["pbs-n0", "pbs-n1"]
    tasks = {}
    for n in (0, 1):
        nodenum, first_host, momport = (d / f"task.{n}").read_text().split()
        tasks[int(nodenum)] = (first_host, momport)
    assert sorted(tasks) == [0, 1]
    assert {first for first, _ in tasks.values()} == {"pbs-n0"}
    assert tasks[0][1] != tasks[1][1], f"both tasks ran under the same mom: {tasks}"


def test_array_job_runs_each_index(pbs_cluster: PbsCluster, tmp_path):
    """-J 1-3: three sub-jobs, each with its own PBS_ARRAY_INDEX, and the array finishes once all three have."""
    d = pbs_cluster.job_dir(tmp_path)
    script = write_script(d / "job.sh", f'echo "$PBS_ARRAY_INDEX" > {shlex.quote(str(d))}/index.$PBS_ARRAY_INDEX\n')
    job_id = pbs_cluster.qsub(["-J", "1-3", "-l", "walltime=00:10:00", "-o", str(d), "-e", str(d), str(script)], cwd=d)
    assert job_id.split(".")[0].endswith("[]"), job_id
    pbs_cluster.wait(job_id)
    subjobs = {jid: info for jid, info in pbs_cluster.qstat(job_id, subjobs=True).items() if jid != job_id}
    assert sorted(info["array_index"] for info in subjobs.values()) == [1, 2, 3], subjobs
    assert all(info.get("Exit_status") == 0 for info in subjobs.values()), subjobs
    assert sorted((d / f"index.{i}").read_text().strip() for i in (1, 2, 3)) == ["1", "2", "3"]


def test_walltime_sends_sigterm_then_ends_with_minus_29(pbs_cluster: PbsCluster, tmp_path):
    """At its walltime limit a job gets SIGTERM (a trap can still write its last words) and ends with Exit_status
    -29; nothing warns it earlier, so the launcher must time its own last checkpoint from the walltime.

    PBS signals a session's processes children first: a child that dies of it ends the shell's `wait` before the
    shell's own SIGTERM arrives, and on a loaded machine the shell then ran on and exited untrapped (CI, twice). The
    child here ignores it, so the shell always gets it while it waits; its trap ends the child. (llmft's launcher cannot
    make its pbsdsh children ignore it: pbsdsh installs its own SIGTERM handler and returns at once; the launcher waits
    for each node's exit record instead, longer once its own stop signal has come.)"""
    d = pbs_cluster.job_dir(tmp_path)
    q = shlex.quote(str(d))
    script = write_script(
        d / "job.sh",
        f"trap 'date +%s.%N > {q}/got-term; kill -KILL \"$child\"; exit 143' TERM\n"
        f"date +%s.%N > {q}/started\n"
        "(trap '' TERM; exec sleep 300) &\n"
        "child=$!\n"
        'wait "$child"\n'
        f"touch {q}/survived\n",
    )
    job_id = pbs_cluster.qsub(
        ["-l", "walltime=00:00:10", "-o", str(d / "out"), "-e", str(d / "err"), str(script)], cwd=d
    )
    info = pbs_cluster.wait(job_id)
    why = f"{info}\n{pbs_cluster.job_log(job_id)}"
    assert info["Exit_status"] == -29, why
    assert info["Resource_List"]["walltime"] == "00:00:10"
    assert (d / "started").exists(), why
    assert (d / "got-term").exists(), f"no SIGTERM caught; the trap was set at {(d / 'started').read_text()}{why}"
    assert float((d / "got-term").read_text()) > float((d / "started").read_text())
    assert not (d / "survived").exists()
    err = pbs_cluster.wait_for(
        "the job's stderr copied back", lambda: (d / "err").exists() and (d / "err").read_text()
    )
    assert "walltime" in err and "exceeded limit" in err, err


def rerun_counter_script(d: Path) -> Path:
    """A job that counts its runs in d/count and, on its first run only, sleeps until it is stopped."""
    q = shlex.quote(str(d))
    return write_script(
        d / "job.sh",
        f"n=$(( $(cat {q}/count 2>/dev/null || echo 0) + 1 ))\n"
        f'echo "$n" > {q}/count\n'
        'if [ "$n" = 1 ]; then sleep 600; fi\n',
    )


def test_qrerun_requeues_a_rerunnable_job(pbs_cluster: PbsCluster, tmp_path):
    """qrerun on a running `-r y` job: it is stopped, queued again and runs a second time (run_count 2)."""
    d = pbs_cluster.job_dir(tmp_path)
    job_id = pbs_cluster.qsub(
        ["-r", "y", "-l", "walltime=00:15:00", "-o", str(d), "-e", str(d), str(rerun_counter_script(d))], cwd=d
    )
    try:
        pbs_cluster.wait_for("the first run started", lambda: (d / "count").exists() and (d / "count").read_text())
        proc = pbs_cluster.qrerun(job_id)
        assert proc.returncode == 0, proc
        info = pbs_cluster.wait(job_id)
    finally:
        pbs_cluster.qdel(job_id)
    assert info["run_count"] == 2, info
    assert info["Exit_status"] == 0, info
    assert (d / "count").read_text().strip() == "2"


def test_qrerun_refuses_a_job_that_is_not_rerunnable(pbs_cluster: PbsCluster, tmp_path):
    """qrerun on a running `-r n` job fails ("not rerunnable") and the job goes on running: its first run only."""
    d = pbs_cluster.job_dir(tmp_path)
    job_id = pbs_cluster.qsub(
        ["-r", "n", "-l", "walltime=00:15:00", "-o", str(d), "-e", str(d), str(rerun_counter_script(d))], cwd=d
    )
    try:
        pbs_cluster.wait_for("the job started", lambda: (d / "count").exists() and (d / "count").read_text())
        proc = pbs_cluster.qrerun(job_id)
        assert proc.returncode != 0, proc
        assert "not rerunnable" in proc.stderr, proc
        info = pbs_cluster.job(job_id)
        assert info["job_state"] == "R" and info["run_count"] == 1, info
    finally:
        pbs_cluster.qdel(job_id)
    assert (d / "count").read_text().strip() == "1"

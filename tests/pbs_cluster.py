"""A real local OpenPBS cluster for the tests: pbs/local/start.sh once, pbs/local/stop.sh at the end.

Nothing here imitates PBS: jobs go through qsub to pbs_server, pbs_sched places them, and they run under the two
pbs_mom daemons pbs-n0 and pbs-n1 as the job user llmftjob (PBS refuses root's jobs). The cluster is one per machine
(fixed ports, names and install prefix), so the pytest sessions and xdist workers that want it share it: the first
starts it, the last to finish stops it (a lock and a list of users in its state directory).
If PBS cannot be built or started the tests FAIL (in CI and outside it), they never skip.
"""

from __future__ import annotations

import fcntl
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import require_tool, subprocess_env

REPO = Path(__file__).resolve().parents[1]
LOCAL = REPO / "pbs" / "local"
JOB_USER = "llmftjob"
# The cluster's state: every PBS_HOME, the logs, and the job users' directories (job_dir). Not under pytest's tmp_path:
# that is mode 700, and the datastore (as postgres) and the jobs (as llmftjob) must reach it.
STATE = Path(os.environ.get("LLMFT_PBS_TEST_DIR", "/tmp/llmft-pbs-tests"))
SBIN_PATH = os.pathsep.join(["/usr/sbin", "/sbin"])
# How long a test waits before calling a job hung. Guards against hangs, not speed claims: the 2-core CI machine runs
# these beside another pytest worker. A job that is done returns at once, so a generous guard costs time only when a
# test is failing anyway.
SHORT_JOB_S = 600
START_S = 1800  # a first start builds OpenPBS (6-7 min alone on 2 cores; make test-setup normally did it already)


def _proc_start(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat): with the pid, it names one process, never a recycled pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


class PbsCluster:
    def __init__(self, state: Path, prefix: Path):
        self.state = state
        self.prefix = prefix
        self.bin = prefix / "bin"

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for PBS commands: offline hub, quiet tokenizers, PBS's bin after the system's (PBS ships its own
        mpiexec, which must not shadow MPICH's or Open MPI's). qsub passes none of it to a job unless -v/-V says so."""
        env = subprocess_env(PATH=os.pathsep.join([os.environ.get("PATH", ""), SBIN_PATH, str(self.bin)]))
        for key in list(env):
            if key.startswith("PBS_"):
                env.pop(key)  # a test run inside a PBS job must not leak its job's PBS_* variables in
        env.update(extra)
        return env

    def cmd(self, args: list[str], check: bool = True, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
        """Run a PBS command (as root unless args say otherwise); on failure with check, its output in the error."""
        kwargs.setdefault("env", self.env())
        kwargs.setdefault("cwd", REPO)
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs)
        if check and proc.returncode != 0:
            raise AssertionError(f"{args} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
        return proc

    def job_dir(self, tmp_path: Path) -> Path:
        """A fresh directory the job user owns (a job's working directory, output files and whatever it writes),
        named after the test's tmp_path. It lives in the cluster's state directory until the fixture's next start."""
        base = self.state / "jobs"
        base.mkdir(mode=0o755, exist_ok=True)
        path = Path(tempfile.mkdtemp(prefix=f"{tmp_path.name}-", dir=base))
        user = pwd.getpwnam(JOB_USER)
        os.chown(path, user.pw_uid, user.pw_gid)
        path.chmod(0o755)
        return path

    def qsub(self, args: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
        """Submit as the job user; returns the job id ("12.pbs-head", or "13[].pbs-head" for an array).
        `args` are exactly what follows `qsub` on the command line, passed as an argument list (runuser, no shell).
        -f keeps qsub in the foreground: its background daemon would otherwise hold our output pipes open."""
        runuser = require_tool("runuser")
        out = self.cmd(
            [runuser, "-u", JOB_USER, "--", str(self.bin / "qsub"), "-f", *args], cwd=cwd, env=env or self.env()
        )
        return out.stdout.strip()

    def qstat(self, job_id: str, subjobs: bool = False) -> dict[str, dict]:
        """`qstat -x -f -F json` (-t: an array's sub-jobs too): job id -> attributes, finished jobs included."""
        args = [str(self.bin / "qstat"), "-x", "-f", "-F", "json", *(["-t"] if subjobs else []), job_id]
        out = self.cmd(args).stdout
        # strict=False: PBS writes a job's environment (Variable_List) with control characters left raw.
        return json.loads(out, strict=False).get("Jobs", {})

    def job(self, job_id: str) -> dict:
        """One job's `qstat -x -f -F json` attributes (job_state, Exit_status, exec_host, run_count, ...)."""
        jobs = self.qstat(job_id)
        assert job_id in jobs, f"qstat -x -f {job_id} did not list it: {sorted(jobs)}"
        return jobs[job_id]

    def wait(self, job_id: str, timeout: float = SHORT_JOB_S) -> dict:
        """Wait until the job has finished (job_state F), and for an array every sub-job too; returns job(job_id).
        A requeued job (qrerun) passes through Q and R again and keeps being waited for."""
        deadline = time.monotonic() + timeout
        while True:
            jobs = self.qstat(job_id, subjobs="[]" in job_id)
            states = {jid: info.get("job_state") for jid, info in jobs.items()}
            # A finished array's sub-jobs show X (expired) or F.
            if states and states.get(job_id) == "F" and all(s in ("F", "X") for s in states.values()):
                return jobs[job_id]
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} not finished after {timeout} s: {states}\n{self.logs_tail()}")
            time.sleep(1)

    def wait_for(self, what: str, ready, timeout: float = SHORT_JOB_S):
        """Poll `ready()` until it returns something true (a state the test waits for, such as a file a job writes)."""
        deadline = time.monotonic() + timeout
        while not (value := ready()):
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout} s\n{self.logs_tail()}")
            time.sleep(0.5)
        return value

    def qrerun(self, job_id: str) -> subprocess.CompletedProcess:
        """`qrerun JOB` as root (an operator's command); the caller checks returncode (a `-r n` job is refused)."""
        return self.cmd([str(self.bin / "qrerun"), job_id], check=False)

    def qdel(self, job_id: str) -> None:
        """Delete a job, running or queued (-W force: also when its mom does not answer)."""
        self.cmd([str(self.bin / "qdel"), "-W", "force", job_id], check=False)

    def job_log(self, job_id: str) -> str:
        """Every server, scheduler and mom log line that names the job (what PBS did to it, for a failure message)."""
        out = []
        for log in sorted(self.state.glob("*/*_logs/*")):
            lines = [line for line in log.read_text(errors="replace").splitlines() if f";{job_id};" in line]
            if lines:
                out.append(f"--- {log}\n" + "\n".join(lines))
        return "\n".join(out)

    def logs_tail(self, n: int = 30) -> str:
        out = []
        for log in sorted(self.state.glob("*/*_logs/*")):
            lines = log.read_text(errors="replace").splitlines()[-n:]
            out.append(f"--- {log}\n" + "\n".join(lines))
        return "\n".join(out)


@contextmanager
def _locked(path: Path):
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _users(path: Path) -> list[str]:
    """The live sessions listed in `path` ("PID STARTTIME" lines)."""
    if not path.exists():
        return []
    live = []
    for line in path.read_text().splitlines():
        pid, _, start = line.partition(" ")
        if pid.isdigit() and _proc_start(int(pid)) == start:
            live.append(line)
    return live


def _prefix(state: Path) -> Path | None:
    """The install prefix of the cluster started in `state`, from the environment file start.sh wrote there."""
    env_file = state / "env"
    for line in env_file.read_text().splitlines() if env_file.exists() else []:
        if line.startswith('export PATH="$PATH:') and line.endswith('/bin"'):
            return Path(line[len('export PATH="$PATH:') : -1]).parent
    return None


def start_cluster(state: Path) -> PbsCluster:
    """Start the cluster (building or restoring OpenPBS first where make test-setup has not)."""
    proc = subprocess.run(
        ["bash", str(LOCAL / "start.sh"), "--install", str(state)],
        capture_output=True,
        text=True,
        timeout=START_S,
        env={**os.environ, "PATH": os.environ.get("PATH", "") + os.pathsep + SBIN_PATH},
    )
    prefix = _prefix(state) if proc.returncode == 0 else None
    if prefix is None:
        stop_cluster(state)  # whatever it had started before it failed
        where = "CI=true" if os.environ.get("CI") == "true" else "this machine"
        pytest.fail(
            f"could not start the local OpenPBS cluster on {where} (a failure, never a skip; `make test` builds "
            f"OpenPBS first):\n{proc.stdout}\n{proc.stderr}",
            pytrace=False,
        )
    return PbsCluster(state, prefix)


def stop_cluster(state: Path) -> str:
    proc = subprocess.run(["bash", str(LOCAL / "stop.sh"), str(state)], capture_output=True, text=True, timeout=300)
    return proc.stdout + proc.stderr


def let_the_job_user_run(python: Path) -> None:
    """The test venv's interpreter is a symlink into a pyenv under /root (mode 700): the job user needs to pass
    through its directories (o+x, never o+r), or no job can start Python."""
    for parent in reversed(Path(os.path.realpath(python)).parents):
        mode = parent.stat().st_mode
        if not mode & 0o001:
            parent.chmod(mode | 0o001)


# ---- a checkout the job user can reach ---------------------------------------------------------------------
#
# The jobs run as JOB_USER and read this checkout (pbs/run_llm.pbs, qsub reads it as that user; llmft's source on
# PYTHONPATH) and its .venv. A clone inside a directory only its owner can enter (mode 700: a home directory, what
# `mktemp -d` makes) is out of their reach: every PBS test would fail alone with `qsub: script file:: Permission
# denied`. So the session starts from a bind mount of the checkout in the cluster's state directory, which the job
# user can enter: pytest is run again there, with the same arguments (the same files, the same .venv), before
# anything is collected. Where the checkout cannot be reached that way either, the session stops at once, in one line
# naming the directory and the fix.

STAGED_FROM = "LLMFT_TEST_STAGED_FROM"  # set in the session run again from the staged checkout: the original path


def closed_parent(path: Path) -> Path | None:
    """The first directory above `path` (or itself) another user cannot enter (no o+x), or None: what the job user
    would be stopped by (ACLs aside: a directory mode 700 has none that let it in)."""
    for directory in [*reversed(path.parents), path]:
        try:
            if not directory.stat().st_mode & 0o001:
                return directory
        except OSError:
            return directory
    return None


def staged_path(repo: Path) -> Path:
    """Where the checkout is mounted for the jobs: in the cluster's state directory, one name per checkout."""
    import hashlib

    return STATE / f"checkout-{hashlib.sha256(str(repo).encode()).hexdigest()[:8]}"


def staged_argv(argv: list[str], repo: Path, staged: Path) -> list[str]:
    """The command line run again from the staged checkout: every argument under the checkout moved there."""
    old = str(repo)
    return [staged.as_posix() + a[len(old) :] if a == old or a.startswith(old + "/") else a for a in argv]


def stage_for_the_job_user(config, repo: Path = REPO) -> None:
    """At the session's start, as root (the PBS tests need root; others do nothing): a checkout the job user cannot
    enter is mounted where it can, and pytest run again from there; where that fails, one line and exit 2."""
    closed = closed_parent(repo)
    venv_closed = closed_parent(Path(sys.prefix)) if not Path(sys.prefix).is_relative_to(repo) else None
    if os.geteuid() != 0 or os.environ.get(STAGED_FROM) or (closed is None and venv_closed is None):
        return
    fix = f"clone into a directory other users can enter (such as /tmp), or let them pass through: chmod o+x {closed or venv_closed}"
    if venv_closed is not None:
        pytest.exit(
            f"the PBS tests' job user {JOB_USER} cannot enter {venv_closed} (mode {venv_closed.stat().st_mode & 0o777:o}), "
            f"which holds the test environment {sys.prefix}: {fix}",
            returncode=2,
        )
    staged = staged_path(repo)
    STATE.mkdir(parents=True, exist_ok=True)
    STATE.chmod(0o755)
    staged.mkdir(exist_ok=True)
    if not os.path.ismount(staged):
        proc = subprocess.run(["mount", "--bind", str(repo), str(staged)], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.exit(
                f"the PBS tests' job user {JOB_USER} cannot enter {closed} (mode {closed.stat().st_mode & 0o777:o}), "
                f"above this checkout, and it could not be mounted where it can ({proc.stderr.strip()}): {fix}",
                returncode=2,
            )
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is not None:  # the session run again writes to this one's terminal, not to its capture files
        capture.stop_global_capturing()
    print(f"pbs_cluster: {closed} is closed to the job user {JOB_USER}: running the tests from {staged}", flush=True)
    cwd = Path.cwd()
    os.chdir(staged / cwd.relative_to(repo) if cwd.is_relative_to(repo) else cwd)
    argv = staged_argv([sys.executable, *sys.orig_argv[1:]], repo, staged)
    os.execve(argv[0], argv, {**os.environ, **vendored_source(repo), STAGED_FROM: str(repo)})


def vendored_source(repo: Path) -> dict[str, str]:
    """pbs/local/start.sh builds OpenPBS from the tarball vendored beside the checkout (../shared/vendor): named for
    the session run from the staged checkout, which has nothing beside it, unless LLMFT_PBS_SOURCE names one."""
    found = sorted(repo.parent.glob("shared/vendor/openpbs-*.tar.gz"))
    return {"LLMFT_PBS_SOURCE": str(found[-1])} if found and not os.environ.get("LLMFT_PBS_SOURCE") else {}


def pytest_configure(config) -> None:
    if not hasattr(config, "workerinput"):  # the session's controller, once, before any collection
        stage_for_the_job_user(config)


def pytest_unconfigure(config) -> None:
    """The staged session's controller leaves no mount behind."""
    if os.environ.get(STAGED_FROM) and not hasattr(config, "workerinput"):
        staged = staged_path(Path(os.environ[STAGED_FROM]))
        subprocess.run(["umount", "-l", str(staged)], capture_output=True)
        try:
            staged.rmdir()  # the empty mount point; never a directory with anything in it
        except OSError:
            pass


@pytest.fixture(scope="session")
def pbs_cluster() -> PbsCluster:
    """The machine's one test cluster, shared by this session's xdist workers (and any other session running now):
    started by the first user, stopped by the last. A cluster left by a session that died is stopped and started
    afresh."""
    STATE.mkdir(parents=True, exist_ok=True)
    STATE.chmod(0o755)
    let_the_job_user_run(Path(sys.executable))
    lock, users = STATE / "pytest.lock", STATE / "pytest.users"
    me = f"{os.getpid()} {_proc_start(os.getpid())}"
    with _locked(lock):
        live = _users(users)
        if live and (prefix := _prefix(STATE)):
            cluster = PbsCluster(STATE, prefix)  # started by another live session
        else:
            stop_cluster(STATE)  # whatever a session that died left running
            shutil.rmtree(STATE / "jobs", ignore_errors=True)
            cluster = start_cluster(STATE)
        users.write_text("".join(f"{line}\n" for line in [*live, me]))
    yield cluster
    with _locked(lock):
        live = [line for line in _users(users) if line != me]
        users.write_text("".join(f"{line}\n" for line in live))
        if not live:
            out = stop_cluster(STATE)
            pids = (STATE / "run" / "started.pids").read_text()
            assert pids == "", f"pbs/local/stop.sh left daemons recorded as running: {pids}\n{out}"

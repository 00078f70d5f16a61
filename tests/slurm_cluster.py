"""A real local Slurm cluster for the tests: slurm/local/start.sh once per session, stop.sh at the end.

Nothing here imitates Slurm: jobs go through sbatch to slurmctld and run on slurmd n1 and n2 (partition debug, the default),
and n3 besides them in the hidden partition spare.
If Slurm cannot be installed or started the tests FAIL (in CI and outside it), they never skip.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import subprocess_env

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "slurm" / "run_llm.slurm"
LOCAL = REPO / "slurm" / "local"
CONTAINER_TOOLS = REPO / "tests" / "container_tools.sh"
SBIN_PATH = os.pathsep.join(["/usr/sbin", "/sbin"])
# How long a test waits for a job before calling it hung. These guard against hangs and assert no speed: the 2-core CI
# machine runs these jobs beside another pytest worker and the other Pythons' set-up, and a job whose training takes
# 2 min alone has taken 10 there (test_slurm's module fixture runs five 2-rank jobs at once). A job that is done
# returns at once, so a generous guard costs time only when a test is failing anyway.
SHORT_JOB_S = 600  # a dry run, or a job that stops at its first check
TRAINING_JOB_S = 1800  # a job that trains, and may be requeued and train again


class SlurmCluster:
    def __init__(self, state: Path):
        self.state = state
        self.conf = state / "slurm.conf"
        self.tools: dict[str, Path] = {}  # enroot's prefix, pyxis's plugin, the test image (container_tools)

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for Slurm commands and jobs: offline hub, quiet tokenizers, this cluster's config.

        PATH and VIRTUAL_ENV look like a shell with the test venv activated, the way a user submits.
        """
        env = subprocess_env(
            SLURM_CONF=str(self.conf),
            VIRTUAL_ENV=sys.prefix,
            PATH=os.pathsep.join([str(Path(sys.prefix) / "bin"), os.environ.get("PATH", ""), SBIN_PATH]),
        )
        for key in ("SLURM_JOB_ID", "SLURM_JOBID", "EPOCHS", "CHECKPOINT_DIR", "DRY_RUN", "VENV", "MODEL", "DATASET"):
            env.pop(key, None)  # a test run inside a Slurm job, or a user's knobs, must not leak in
        env.update(extra)
        return env

    def cmd(
        self,
        args: list[str],
        cwd: Path | None = None,
        env: dict | None = None,
        check: bool = True,
        timeout: float = 60,
    ):
        proc = subprocess.run(
            args, cwd=cwd or REPO, env=env or self.env(), capture_output=True, text=True, timeout=timeout
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"{args} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
        return proc

    def sbatch(self, args: list[str], cwd: Path, **env: str) -> str:
        """Submit; returns the job id. `args` are exactly what follows `sbatch` on the command line."""
        out = self.cmd(["sbatch", "--parsable", *args], cwd=cwd, env=self.env(**env)).stdout.strip()
        return out.split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, Restarts, NodeList, ...)."""
        out = self.cmd(["scontrol", "show", "job", "-o", job_id]).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(
        self,
        job_id: str,
        timeout: float = 300,
        states=(
            "COMPLETED",
            "FAILED",
            "CANCELLED",
            "TIMEOUT",
            "NODE_FAIL",
            "OUT_OF_MEMORY",
            "BOOT_FAIL",
            "DEADLINE",
            "PREEMPTED",
        ),
    ) -> dict[str, str]:
        """Wait until the job reaches one of `states` (pending/requeued jobs keep waiting)."""
        deadline = time.time() + timeout
        info = self.job(job_id)
        while info.get("JobState") not in states:
            if time.time() > deadline:
                raise AssertionError(
                    f"job {job_id} still {info.get('JobState')} after {timeout}s: {info}\n{self.logs_tail()}"
                )
            time.sleep(1)
            info = self.job(job_id)
        return info

    def logs_tail(self, n: int = 30) -> str:
        out = []
        for log in sorted((self.state / "log").glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-n:]
            out.append(f"--- {log}\n" + "\n".join(lines))
        return "\n".join(out)


def container_tools() -> dict[str, Path]:
    """enroot's install tree, pyxis's plugin and the test image (tests/container_tools.sh: built once, then cached)."""
    proc = subprocess.run(["bash", str(CONTAINER_TOOLS)], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        pytest.fail(f"tests/container_tools.sh failed (make test-setup runs it):\n{proc.stderr}", pytrace=False)
    return {k: Path(v) for k, v in (line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)}


def pyxis_plugstack(state: Path, plugin: Path) -> Path:
    """A plugstack.conf loading the real pyxis: its runtime files in the cluster's state; container_scope=job, so a
    job's named containers are its own (pyxis_<job id>_<name>) and pyxis's job epilog removes them on each node."""
    state.mkdir(parents=True, exist_ok=True)
    plugstack = state / "plugstack.conf"
    plugstack.write_text(f"required {plugin} runtime_path={state / 'pyxis'} container_scope=job\n")
    return plugstack


def start_cluster(state: Path) -> SlurmCluster:
    """Start munge, slurmctld and slurmd n1-n3 (installed by `make test`'s set-up step, tests/system_deps.sh), with the
    real pyxis loaded and enroot on each slurmd's PATH (tests/container_tools.sh)."""
    tools = container_tools()
    plugstack = pyxis_plugstack(state, tools["PYXIS_PLUGIN"])
    proc = subprocess.run(
        ["bash", str(LOCAL / "start.sh"), "--plugstack", str(plugstack), "--enroot", str(tools["ENROOT_PREFIX"])]
        + [str(state)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PATH": os.environ.get("PATH", "") + os.pathsep + SBIN_PATH},
    )
    if proc.returncode != 0:
        where = "CI=true" if os.environ.get("CI") == "true" else "this machine"
        pytest.fail(
            f"could not start the local Slurm cluster on {where} (a failure, never a skip; `make test` installs Slurm first):\n"
            f"{proc.stdout}\n{proc.stderr}",
            pytrace=False,
        )
    cluster = SlurmCluster(state)
    cluster.tools = tools
    return cluster


def stop_cluster(state: Path) -> str:
    proc = subprocess.run(["bash", str(LOCAL / "stop.sh"), str(state)], capture_output=True, text=True, timeout=120)
    return proc.stdout + proc.stderr


def step_lines(log_text: str) -> list[int]:
    """Optimizer steps rank 0 reported (`llmft: step 5/20 loss ...`), in log order."""
    # Not anchored at line start: progress bars on stderr can share a line with them.
    return [int(m) for m in re.findall(r"llmft: step (\d+)/\d+ loss", log_text)]

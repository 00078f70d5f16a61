"""`make test` from a checkout inside a directory only its owner can enter (mode 700, as a home directory often is
and as `mktemp -d` makes): the PBS jobs' user cannot read the job script or the venv there, so the session runs
again from a bind mount of the checkout it can reach (tests/pbs_cluster.py, stage_for_the_job_user)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from conftest import subprocess_env
from pbs_cluster import REPO, STATE, closed_parent, staged_argv, staged_path, vendored_source


def test_the_first_closed_directory_above_a_checkout_is_found():
    base = Path(tempfile.mkdtemp(prefix="llmft-closed-"))  # in /tmp: pytest's tmp_path is itself under a 700 one
    try:
        base.chmod(0o755)
        private = base / "home"
        (private / "clone" / "pbs").mkdir(parents=True)
        private.chmod(0o700)
        assert closed_parent(private / "clone" / "pbs") == private
        private.chmod(0o701)  # others may pass through (o+x), not list
        assert closed_parent(private / "clone" / "pbs") is None
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=False)


def test_the_command_line_is_moved_to_the_staged_checkout(tmp_path):
    repo, staged = Path("/home/me/llmft"), Path("/tmp/llmft-pbs-tests/checkout-1")
    argv = [
        "/home/me/llmft/.venv/bin/python",
        "-m",
        "pytest",
        "-k",
        "x",
        "/home/me/llmft/tests/t.py",
        "/home/me/llmftx",
    ]
    assert staged_argv(argv, repo, staged) == [
        "/tmp/llmft-pbs-tests/checkout-1/.venv/bin/python",
        "-m",
        "pytest",
        "-k",
        "x",
        "/tmp/llmft-pbs-tests/checkout-1/tests/t.py",
        "/home/me/llmftx",  # only paths inside the checkout move
    ]
    assert staged_path(repo).parent == STATE and staged_path(repo) != staged_path(Path("/home/you/llmft"))


def test_a_pbs_test_passes_from_a_clone_in_a_mode_700_directory():
    """A clone of this checkout (its committed tree, with this checkout's .venv) in a `mktemp -d` directory, mode
    700: one real PBS test, run there with pytest, passes; the session said where it ran from and left no mount."""
    private = Path(tempfile.mkdtemp(prefix="llmft-private-"))
    try:
        assert private.stat().st_mode & 0o777 == 0o700
        clone = private / "llmft"
        subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(clone)], check=True)
        for name in ("tests", "llmft", "pbs"):  # this checkout's work, committed or not
            subprocess.run(["cp", "-a", f"{REPO}/{name}/.", f"{clone}/{name}/"], check=True)
        (clone / ".venv").symlink_to(Path(sys.prefix))
        # OpenPBS's source as this checkout finds it (vendored beside it), which the clone has nothing beside it for
        env = subprocess_env(PYTHONPATH=str(clone), **vendored_source(REPO))
        cmd = [str(clone / ".venv" / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        cmd += ["tests/test_pbs.py", "-k", "bad_knobs and abc"]
        proc = subprocess.run(cmd, cwd=clone, env=env, capture_output=True, text=True, timeout=1200)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0 and "1 passed" in out, out[-5000:]
        assert f"is closed to the job user llmftjob: running the tests from {staged_path(clone)}" in out, out[-3000:]
        assert not os.path.ismount(staged_path(clone))
    finally:
        subprocess.run(["rm", "-rf", str(private)], check=False)

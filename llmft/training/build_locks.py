"""Stale build locks of DeepSpeed's JIT-compiled ops, found and cleared before they hang a job.

DeepSpeed builds its C++/CUDA ops (cpu_adam, fused_adam, ...) through torch.utils.cpp_extension, which guards
every build *and every later load* with a lock file, `<extensions dir>/<pyXY_cuZZ>/<op>/lock`, created with
O_EXCL and removed when the build ends. A process killed mid-build (a preempted or cancelled first job on a
fresh node) leaves the file behind, and from then on every process that loads the op waits for it forever,
silently (torch's FileBaton has no timeout and records no owner). The builder keeps the file open while it
works, so a lock that no process on this machine holds open is stale:

- on a local filesystem (the node-local TORCH_EXTENSIONS_DIR the Slurm script sets) it is removed, with a line;
- on a network filesystem a builder on another machine cannot be seen, so an old lock is only named, with the
  command that removes it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

# Filesystems whose files only this machine's processes can hold open.
LOCAL_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs", "f2fs", "ramfs"})
# A lock on a shared filesystem this old is named (a build takes minutes; a cpu_adam build about one).
SHARED_LOCK_WARN_SECONDS = 15 * 60


@dataclass(frozen=True)
class LockFinding:
    path: Path
    removed: bool
    message: str


def extensions_root(env=None) -> Path:
    """Where torch.utils.cpp_extension builds ops: TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions."""
    env = os.environ if env is None else env
    root = env.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    cache = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "torch_extensions"


def filesystem_type(path: Path, mounts_text: str) -> str:
    """The type of the filesystem holding `path`, from /proc/mounts text (longest mount point that contains it)."""
    target = os.path.realpath(path)
    best, best_type = "", "unknown"
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        mount_point = fields[1].replace("\\040", " ")
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, best_type = mount_point, fields[2]
    return best_type


def paths_held_open(proc_root: Path = Path("/proc")) -> set[str]:
    """Every file that a process of this machine we may inspect has open (our own processes: enough, the
    extensions directory is per user)."""
    held = set()
    for fd_dir in proc_root.glob("[0-9]*/fd"):
        try:
            entries = list(os.scandir(fd_dir))
        except OSError:  # the process ended, or it is not ours
            continue
        for entry in entries:
            try:
                held.add(os.readlink(entry.path))
            except OSError:
                continue
    return held


def clear_stale_build_locks(
    root: Path, *, mounts_text: str | None = None, held: set[str] | None = None, now: float | None = None
) -> list[LockFinding]:
    """Find the op build locks under `root` that no process holds; remove those on a local filesystem."""
    # <root>/<pyXY_cuZZ>/<op>/lock under torch's default root; <root>/<op>/lock when TORCH_EXTENSIONS_DIR is set (torch
    # then builds directly in it: the Slurm script's node-local directory, llmft's per-environment one)
    locks = sorted(set(root.glob("*/*/lock")) | set(root.glob("*/lock"))) if root.is_dir() else []
    if not locks:
        return []
    if mounts_text is None:
        try:
            mounts_text = Path("/proc/mounts").read_text()
        except OSError:
            mounts_text = ""
    held = paths_held_open() if held is None else held
    now = time.time() if now is None else now
    findings = []
    for lock in locks:
        if str(lock.resolve()) in held:
            continue  # a build (or load) is running on this machine: wait for it, as torch does
        fs_type = filesystem_type(lock, mounts_text)
        if fs_type in LOCAL_FILESYSTEMS:
            try:
                lock.unlink()
            except FileNotFoundError:
                continue  # its builder just finished
            findings.append(
                LockFinding(
                    lock,
                    True,
                    f"removed a stale build lock {lock} (left by a build that was "
                    "killed; no process holds it) so the op can be built again",
                )
            )
            continue
        try:
            age = now - lock.stat().st_mtime
        except FileNotFoundError:
            continue
        if age >= SHARED_LOCK_WARN_SECONDS:
            findings.append(
                LockFinding(
                    lock,
                    False,
                    (
                        f"build lock {lock} on a {fs_type} filesystem is {age / 60:.0f} min old and no process here holds "
                        f"it: if no machine is building that op now, remove it (rm {lock}), else loading the op waits "
                        "forever; a node-local TORCH_EXTENSIONS_DIR avoids this"
                    ),
                )
            )
    return findings

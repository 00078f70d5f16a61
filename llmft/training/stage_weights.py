"""Model weights read once per node: staged from shared storage to node-local disk under ZeRO-0/1/2.

Under ZeRO-0/1/2 every process loads the whole model. From a shared filesystem (HF_HOME on /home over NFS, a
Filestore, Lustre, a FUSE bucket mount) that is (processes per node x nodes) full reads through one pipe: 8B in
bf16 on 8 nodes x 1 GPU is 128 GB, about 21 minutes at 100 MB/s before step 1. Here the first process on each
node copies the model directory's files once to node-local disk (`$LLMFT_STAGE_DIR`, default
`${TMPDIR:-/tmp}/llmft-$USER/models`); the node's other processes wait for it (a lock on the local disk) and
every process loads the local copy. The copy is keyed by the files' paths, sizes and mtimes, so a later job on
the same node reuses it. ZeRO-3 is left alone: it loads the weights partitioned (zero.Init).

What is shared is read from /proc/mounts: the mount holding the model, and its filesystem type (`shared_fs`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Callable, Mapping

# Filesystem types every node mounts from elsewhere: network and cluster filesystems, and FUSE mounts (gcsfuse,
# mountpoint-s3, sshfs, ...). Local ones (ext4, xfs, btrfs, tmpfs, overlay) are read at local-disk speed already.
SHARED_TYPES = (
    "nfs",
    "nfs4",
    "lustre",
    "gpfs",
    "cifs",
    "smb3",
    "beegfs",
    "ceph",
    "glusterfs",
    "9p",
    "wekafs",
    "panfs",
    "orangefs",
    "virtiofs",
)
MARKER = ".llmft-staged.json"


def mount_of(path: str, mounts_text: str) -> tuple[str, str] | None:
    """(mount point, filesystem type) of the mount holding an absolute path: the longest mount point that is a
    prefix of it, as /proc/mounts lists them (octal escapes such as \\040 for spaces decoded)."""
    best = None
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].encode().decode("unicode_escape")
        if path == point or path.startswith(point.rstrip("/") + "/") or point == "/":
            if best is None or len(point) >= len(best[0]):
                best = (point, fields[2])
    return best


def shared_fs(path: str, mounts_text: str) -> str | None:
    """The filesystem type when the path is on shared storage, else None."""
    found = mount_of(path, mounts_text)
    if found is None:
        return None
    fstype = found[1]
    return fstype if fstype in SHARED_TYPES or fstype.startswith("fuse") else None


def stage_root(env: Mapping[str, str]) -> Path:
    if env.get("LLMFT_STAGE_DIR"):
        return Path(env["LLMFT_STAGE_DIR"])
    user = env.get("USER") or str(os.getuid())
    return Path(env.get("TMPDIR") or "/tmp") / f"llmft-{user}" / "models"


def model_files(model_dir: Path) -> list[Path]:
    """The files from_pretrained reads: the directory's own files (config, tokenizer, weights, remote code), not
    its subdirectories (a run directory's checkpoints); hub snapshot symlinks followed."""
    return sorted(p for p in model_dir.iterdir() if p.is_file() and p.name != MARKER)


def stage_key(model_dir: Path, files: list[Path]) -> str:
    h = hashlib.sha256(str(model_dir.resolve()).encode())
    for f in files:
        st = f.stat()
        h.update(f"\n{f.name}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def stage_weights(
    model: str,
    procs_per_node: int,
    *,
    env: Mapping[str, str] | None = None,
    mounts_text: str | None = None,
    log: Callable[[str], None] | None = None,
) -> str:
    """The directory to load the weights from: a node-local copy when `model` is on shared storage (made once per
    node, by whichever process of the node comes first), else `model` itself. Logs what was copied, how fast, and
    the shared-storage reads it saves. Not staged (said, once) when the local disk has too little room."""
    env = os.environ if env is None else env
    node = env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    say = log or (lambda m: print(f"llmft: node {node}: {m}", flush=True))  # from whichever rank of a node acts
    path = Path(model)
    if not path.is_dir():
        return model
    if mounts_text is None:
        try:
            mounts_text = Path(
                env.get("LLMFT_PROC_MOUNTS", "/proc/mounts")
            ).read_text()  # LLMFT_PROC_MOUNTS: tests only
        except OSError:
            return model
    fstype = shared_fs(str(path.resolve()), mounts_text)
    if fstype is None:
        return model
    files = model_files(path)
    size = sum(f.stat().st_size for f in files)
    root = stage_root(env)
    target = root / f"{path.resolve().name}-{stage_key(path, files)}"
    if (target / MARKER).is_file():
        return str(target)
    try:
        root.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(root).free
    except OSError as e:
        say(f"weights not staged: cannot use {root} ({e.strerror}); every process reads {model} from {fstype}")
        return model
    from filelock import FileLock

    with FileLock(str(root / f".{target.name}.lock")):  # node-local: the node's processes queue here
        if (target / MARKER).is_file():
            return str(target)  # staged by another process of this node while this one waited
        if size * 1.05 > free:
            say(
                f"weights not staged: {size / 1e9:.1f} GB does not fit in the {free / 1e9:.1f} GB free in {root}; "
                f"every process reads {model} from {fstype} (set LLMFT_STAGE_DIR to a larger local disk)"
            )
            return model
        tmp = root / f".{target.name}.{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        started = time.perf_counter()
        for f in files:
            shutil.copyfile(f, tmp / f.name)  # follows hub-cache symlinks
        seconds = max(time.perf_counter() - started, 1e-6)
        (tmp / MARKER).write_text(
            json.dumps({"source": str(path.resolve()), "bytes": size, "seconds": seconds}) + "\n"
        )
        os.replace(tmp, target)
    saved = (procs_per_node - 1) * seconds
    say(
        f"staged the weights of {model} ({size / 1e9:.2f} GB, {len(files)} files) from {fstype} to node-local "
        f"{target} in {seconds:.1f}s ({size / 1e6 / seconds:.0f} MB/s); the node's {procs_per_node} process(es) load "
        f"the local copy: {procs_per_node - 1} full read(s) of shared storage saved, about {saved:.0f}s at that rate"
    )
    return str(target)


def restore_source_name(model, staged: str, source: str) -> None:
    """What the run saves names the model it was given (a hub snapshot or a shared directory), not the node-local
    copy it loaded: the configs' _name_or_path and a LoRA adapter's base_model_name_or_path (llmft infer reads it)."""
    if staged == source:
        return
    models = [model]
    if hasattr(model, "get_base_model"):
        models.append(model.get_base_model())
    for m in models:
        config = getattr(m, "config", None)
        if config is not None and getattr(config, "_name_or_path", None) == staged:
            config._name_or_path = source
    for peft_config in (getattr(model, "peft_config", None) or {}).values():
        if getattr(peft_config, "base_model_name_or_path", None) == staged:
            peft_config.base_model_name_or_path = source

"""Model downloads once per job: one process fetches from the Hugging Face Hub, the others wait, then read the cache.

Without this every rank of a job calls `from_pretrained` on a hub id at the same moment: N downloads of the
same files into the same (often network-shared) HF_HOME, N-fold traffic and Hub rate limits. Here the first
process to take a file lock in the cache downloads (`snapshot_download`, skipping weight formats transformers
does not load) and records the snapshot it got for this job; the others wait on the lock, then load that local
snapshot without contacting the Hub. Where each node has its own cache (a node-local HF_HOME) each node
downloads once. A requeued job (same torchrun run id) reuses the snapshot its first start recorded, so it
resumes on the same files even if the repository changed since.

    path = resolve_model("Qwen/Qwen2.5-0.5B", revision=None)   # -> .../hub/models--Qwen--Qwen2.5-0.5B/snapshots/<sha>
    path = resolve_model("/models/llama")                      # a local directory: returned as is, no lock
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Mapping

from llmft.errors import LlmftError

LOCK_SUBDIR = ".llmft-locks"
# Formats transformers never loads: original checkpoints (Llama's original/consolidated.*.pth), other frameworks.
SKIP_ALWAYS = (
    "original/*",
    "*.pth",
    "*.gguf",
    "*.onnx",
    "onnx/*",
    "*.msgpack",
    "*.h5",
    "*.ot",
    "*.tflite",
    "coreml/*",
    "openvino/*",
)


class HubError(LlmftError, ValueError):
    """A model that cannot be found or fetched; the message says what to do."""


def skip_patterns(repo_files: list[str]) -> list[str]:
    """Files not to download: other frameworks' formats, and PyTorch .bin weights where safetensors exist
    (transformers loads safetensors first; many repos carry both, doubling the download)."""
    skip = list(SKIP_ALWAYS)
    if any(f.endswith(".safetensors") and "/" not in f for f in repo_files):
        skip += ["*.bin", "*.pt", "*.ckpt"]
    return skip


def job_token(env: Mapping[str, str]) -> str | None:
    """The same string in every process of one job launch; None for a process running alone.

    torchrun's run id (the Slurm script sets it to the job id, kept across a requeue), else the
    rendezvous address torchrun gives every rank.
    """
    if env.get("WORLD_SIZE", "1") in ("", "1"):
        return None
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return f"run:{run_id}"
    return f"master:{env.get('SLURM_JOB_ID', '')}:{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@contextmanager
def _locked(path: Path):
    """An exclusive lock on `path` (flock, as huggingface_hub's own cache locks); without lock support, none."""
    from filelock import FileLock

    lock = FileLock(str(path))
    try:
        lock.acquire()
    except (OSError, NotImplementedError) as e:  # a filesystem without flock (e.g. Lustre mounted without -o flock)
        print(f"llmft: cannot lock {path} ({e}); every process downloads for itself", flush=True)
        yield
        return
    try:
        yield
    finally:
        lock.release()


def fetch_once(lock_dir: str | Path, key: str, token: str | None, download: Callable[[], str]) -> str:
    """`download()` once per `token` (one job) for `key`, under a lock in `lock_dir`; every caller gets its path.

    The first process in downloads and records the path (or the error) for its job; the job's other processes
    wait on the lock, then return the recorded path without downloading. A process without a token (alone)
    downloads under the lock, so concurrent jobs sharing the cache still take turns.
    """
    lock_dir = Path(lock_dir)
    lock_dir.mkdir(parents=True, exist_ok=True)
    name = _digest(key)
    stamp = lock_dir / f"{name}-{_digest(token)}.json" if token else None
    with _locked(lock_dir / f"{name}.lock"):
        if stamp is not None and stamp.is_file():
            try:
                record = json.loads(stamp.read_text())
            except ValueError:
                record = {}
            if record.get("error"):
                raise HubError(record["error"])
            if record.get("path") and Path(record["path"]).exists():
                return record["path"]
        try:
            path = download()
        except HubError as e:
            if stamp is not None:
                _write(stamp, {"key": key, "error": str(e), "at": time.time()})
            raise
        if stamp is not None:
            _write(stamp, {"key": key, "path": path, "at": time.time()})
        return path


def _write(path: Path, payload: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(payload) + "\n")
    os.replace(tmp, path)


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or name.endswith("/")


def _download_snapshot(repo_id: str, revision: str | None) -> str:
    """The local snapshot of a hub model, downloading what transformers will load; errors become HubError."""
    import httpx2  # huggingface_hub's HTTP client: its connection errors are not OSErrors
    from huggingface_hub import HfApi, snapshot_download, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    where = os.environ.get("HF_HOME") or "~/.cache/huggingface"
    print(
        f"llmft: downloading {repo_id} (revision {revision or 'main'}) into the Hugging Face cache ({where}); "
        f"the job's other processes wait for it",
        flush=True,
    )
    try:
        info = HfApi().model_info(repo_id, revision=revision)
        files = [s.rfilename for s in info.siblings or []]
        return snapshot_download(repo_id, revision=revision, ignore_patterns=skip_patterns(files))
    except GatedRepoError:
        raise HubError(
            f"model {repo_id} is gated: accept its license on https://huggingface.co/{repo_id} and set HF_TOKEN"
        ) from None
    except RepositoryNotFoundError:
        raise HubError(
            f"model {repo_id}: no such local directory, and no such model on the Hugging Face Hub "
            f"(a private model needs HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise HubError(f"model {repo_id} has no revision {revision!r}; check --model_revision") from None
    except (
        HfHubHTTPError,
        OSError,
        httpx2.TransportError,
    ) as e:  # no network on the compute nodes, Hub down, a full disk
        cached = try_to_load_from_cache(repo_id, "config.json", revision=revision)
        if isinstance(cached, str):  # downloaded before: transformers reads it from the cache
            print(
                f"llmft: the Hub is unreachable ({type(e).__name__}); using the cached copy of {repo_id}", flush=True
            )
            return str(Path(cached).parent)
        raise HubError(
            f"cannot download model {repo_id} ({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}); "
            f"download it where there is internet (hf download {repo_id}) into HF_HOME={where}, "
            f"or pass a local model directory"
        ) from None


def resolve_model(
    name_or_path: str,
    revision: str | None = None,
    env: Mapping[str, str] | None = None,
    download: Callable[[str, str | None], str] | None = None,
) -> str:
    """What to load: a local directory as is; a hub id fetched once per job into the cache (its snapshot path).

    In offline mode (HF_HUB_OFFLINE=1) the name is returned and transformers reads its cache.
    """
    env = os.environ if env is None else env
    if os.path.isdir(name_or_path):
        return name_or_path
    if os.path.exists(name_or_path):
        raise HubError(
            f"model {name_or_path} is a file; pass a model directory (config.json, weights, tokenizer) or a Hugging Face Hub id"
        )
    if _looks_like_path(name_or_path):
        raise HubError(
            f"model directory {name_or_path} does not exist; pass an existing directory or a Hugging Face Hub id (org/name)"
        )
    from huggingface_hub import constants
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name_or_path)
    except HFValidationError:
        raise HubError(
            f"model {name_or_path!r} is neither a local directory nor a Hugging Face Hub id (org/name)"
        ) from None
    if constants.is_offline_mode():
        return name_or_path
    lock_dir = Path(constants.HF_HUB_CACHE) / LOCK_SUBDIR
    key = f"model:{name_or_path}@{revision or 'main'}"
    download = download or _download_snapshot
    return fetch_once(lock_dir, key, job_token(env), lambda: download(name_or_path, revision))

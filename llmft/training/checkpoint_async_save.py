"""Periodic checkpoints written while training goes on (`--async_save`).

DeepSpeed writes a checkpoint through its engine's `checkpoint_engine.save(state_dict, path)`, one call per file
(module states, each rank's optimizer shard). `BackgroundWriter` takes that place: it snapshots the state into host
memory and returns; a thread of the rank `torch.save`s the snapshot to `.<name>.partial` beside the final path, fsyncs
and renames it. The snapshot copies each tensor's whole storage once (views keep sharing it, as torch.save writes them)
into host buffers that are kept and reused from save to save; on a GPU they are page-locked, so the device-to-host
copy is a DMA queued on the training stream (it precedes the next step's in-place updates) that the writer thread
waits for. Training waits only for queueing those copies. An earlier version serialised the whole state into a
`BytesIO` on the training thread: on an H100 that held training longer than a synchronous save did (bench/README.md).

Why not DeepSpeed 0.19.8's own writers (bench/README.md, "Saves that do not stall training"): any
`"checkpoint": {"writer": ...}` fails under torchrun (it reads CROSS_RANK/CROSS_SIZE, set only by DeepSpeed's launcher)
and, without a model-parallel unit (HF's Trainer has none), on a missing `dp_rank` unless `data_parallel` is given;
the decoupled engine then refuses to pickle the live tensors to its writer process on CPU and hangs; and by design
it waits for the write before the next optimizer step, so it hides at most one step's forward and backward.

What stays as it was:
- a checkpoint is published complete (llmft_complete.json, llmft.checkpoints) only once every rank's background
  writes have finished: the ranks agree on it at a step end (one all-reduce per step while a write is in flight),
  and the rank reports that list the files are taken then;
- the stop save, the save at the last step and every save after training are written synchronously
  (`synchronous()` says so at save time), so a run that ends has its checkpoint on disk when it exits;
- one checkpoint in flight at a time: a save waits for the previous one's writes first, so host memory holds one
  checkpoint's bytes per rank, kept for reuse from the first background save until the first synchronous one
  (`llmft.memory.host_ram` counts them as `async_save`).
"""

from __future__ import annotations

import copy
import os
import queue
import threading
import time
from pathlib import Path
from typing import Callable

from llmft.planning.world import log

PIN_MIN_BYTES = 1 << 20  # smaller storages are copied synchronously: page-locking each costs more than it saves


def partial_path(path: str | Path) -> Path:
    """Where a file is written before it is renamed into place: hidden, so checkpoint listings skip it."""
    path = Path(path)
    return path.with_name(f".{path.name}.partial")


def write_file(path: str | Path, state, zipfile_serialization: bool = True) -> None:
    """`torch.save` `state` to `path` atomically and durably: a reader sees the whole file or none."""
    import torch

    tmp = partial_path(path)
    with open(tmp, "wb") as f:
        torch.save(state, f, _use_new_zipfile_serialization=zipfile_serialization)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def page_lock(cudart, address: int, nbytes: int) -> str | None:
    """Page-lock `nbytes` of host memory at `address` in place (cudaHostRegister); None when done, else why not.

    A failed cudaHostRegister (too much locked memory for the node or the container's limit, a driver that
    refuses it) leaves CUDA's last error set, and a later, unrelated CUDA call would report it as its own failure:
    the error is read back (cudaGetLastError clears it) here, where it happened. The caller then stops trying for the
    rest of the run (the same request fails the same way, and each failure costs a driver call): its buffers stay
    pageable, so their device-to-host copies are synchronous, slower but correct."""
    try:
        status = int(cudart.cudaHostRegister(address, nbytes, 0))
    except (RuntimeError, AttributeError, TypeError) as e:
        status, why = -1, str(e)
    else:
        why = f"CUDA error {status}"
    if status == 0:
        return None
    try:
        cudart.cudaGetLastError()
    except (RuntimeError, AttributeError):
        pass
    return f"page-locking a {nbytes}-byte snapshot buffer failed ({why})"


class HostSnapshot:
    """A copy of a state dict in host buffers that are reused across saves: `take` starts the copies, `release` returns
    the buffers once the snapshot is written.

    Each distinct storage is copied whole, once, and every tensor becomes the same view of its copy, so the saved file
    holds what torch.save of the original would (tensors read back from CPU). Containers are rebuilt and other values
    deep-copied: the next step may change them in place. On CUDA the buffers are allocated at their exact size and
    page-locked in place (cudaHostRegister; torch's pinned allocator rounds each block up to a power of two)."""

    def __init__(self, cudart=None):
        self._cudart = cudart or (lambda: __import__("torch").cuda.cudart())  # a stand-in in the tests
        self.pin_refused: str | None = None  # why page-locking failed once: no buffer is page-locked after that
        self._free: dict[int, list] = {}  # bytes -> unused (host buffer, page-locked) pairs
        self._lock = threading.Lock()
        self.allocated_bytes = 0  # host memory held for snapshots: one checkpoint's tensors (llmft.memory counts it)

    def _buffer(self, nbytes: int, pin: bool):
        import torch

        with self._lock:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
        host = torch.empty(nbytes, dtype=torch.uint8)
        with self._lock:
            self.allocated_bytes += nbytes
        if pin and self.pin_refused is None:
            try:
                cudart = self._cudart()
            except (RuntimeError, AttributeError) as e:  # a torch built without CUDA's runtime bindings
                self.pin_refused = f"page-locking is not available ({e})"
            else:
                self.pin_refused = page_lock(cudart, host.data_ptr(), nbytes)
            if self.pin_refused is not None:
                log(f"warning: {self.pin_refused}; snapshots stay pageable for the rest of the run (slower copies)")
        return host, pin and self.pin_refused is None

    def take(self, state) -> tuple[object, list, object]:
        """(the snapshot, its buffers, a CUDA event the copies complete at, or None)."""
        import torch

        storages: dict[tuple, object] = {}  # (device, address, bytes) -> host uint8 copy
        buffers: list = []
        memo: dict[int, object] = {}
        cuda = False

        def host_copy(storage):
            nonlocal cuda
            key = (str(storage.device), storage.data_ptr(), storage.nbytes())
            if key not in storages:
                pin = storage.device.type == "cuda" and storage.nbytes() >= PIN_MIN_BYTES
                host, pinned = self._buffer(storage.nbytes(), pin)
                source = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
                host.copy_(source, non_blocking=pinned)
                cuda |= pinned
                buffers.append((host, pinned))
                storages[key] = host
            return storages[key]

        def snap(obj):
            if id(obj) in memo:
                return memo[id(obj)]
            if isinstance(obj, torch.Tensor):
                host = host_copy(obj.untyped_storage())
                view = torch.empty(0, dtype=obj.dtype).set_(
                    host.untyped_storage(), obj.storage_offset(), obj.size(), obj.stride()
                )
                if isinstance(obj, torch.nn.Parameter):
                    view = torch.nn.Parameter(view, requires_grad=obj.requires_grad)
                elif obj.requires_grad:
                    view.requires_grad_(True)
                out = view
            elif isinstance(obj, dict):
                out = type(obj)((k, snap(v)) for k, v in obj.items())
            elif isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
                out = type(obj)(snap(v) for v in obj)
            else:
                out = copy.deepcopy(obj)
            memo[id(obj)] = out
            return out

        snapshot = snap(state)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        return snapshot, buffers, event

    def release(self, buffers: list) -> None:
        with self._lock:
            for host, pinned in buffers:
                self._free.setdefault(host.numel(), []).append((host, pinned))

    def clear(self) -> None:
        """Give the host memory back (unlocked first): before a synchronous save, which needs its own."""
        import torch

        with self._lock:
            for buffers in self._free.values():
                for host, pinned in buffers:
                    if pinned:
                        torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
            self._free.clear()
            self.allocated_bytes = 0


class BackgroundWriter:
    """A DeepSpeed CheckpointEngine (the same methods) whose saves, when `synchronous()` is false, are written by a thread.

    `busy()` / `wait()` / `failure()` tell the trainer's callback when the files are on disk."""

    name = "llmft BackgroundWriter"

    def __init__(
        self,
        synchronous: Callable[[], bool],
        zipfile_serialization: bool = True,
        write: Callable[[Path, object], None] | None = None,
        delay_s: float = 0.0,
    ):
        self.synchronous = synchronous
        self.delay_s = delay_s  # each background checkpoint's first file waits this long (LLMFT_TEST_SAVE_DELAY_S)
        self._delay_next = 0.0
        self.zipfile_serialization = zipfile_serialization
        self._write = write  # None: write_file (looked up when writing)
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        self._error: str | None = None
        self.bytes_in_flight = 0
        self._snapshots = HostSnapshot()
        self._thread = threading.Thread(target=self._run, name="llmft-checkpoint-writer", daemon=True)
        self._thread.start()

    # --- DeepSpeed's CheckpointEngine interface ---------------------------------------------------------------
    def create(self, info) -> None:
        self.wait()  # the previous checkpoint's files first: one checkpoint in flight
        self._delay_next = self.delay_s  # DeepSpeed creates once per checkpoint, then saves each file

    def makedirs(self, path, exist_ok=False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict, path: str) -> None:
        import torch

        if self.synchronous():
            self.wait()
            self._snapshots.clear()  # the stop save and those at the end: the run needs no snapshot after them
            torch.save(state_dict, path, _use_new_zipfile_serialization=self.zipfile_serialization)
            return
        snapshot, buffers, copied = self._snapshots.take(state_dict)
        nbytes = sum(host.numel() for host, _ in buffers)
        with self._lock:
            self._pending += 1
            self.bytes_in_flight += nbytes
        delay, self._delay_next = self._delay_next, 0.0
        self._queue.put((Path(path), snapshot, buffers, copied, nbytes, delay))

    def load(self, path: str, map_location=None):
        import torch

        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info) -> bool:
        return True

    def is_data_parallel_writer(self, dp_rank) -> bool:
        return dp_rank == 0

    def is_decoupled(self) -> bool:
        return False

    def set_commit_info(self, info) -> None:
        pass

    def get_commit_info(self):
        return None

    def cleanup(self) -> None:
        self.wait()

    def preserves_storage_sharing(self) -> bool:
        return True

    # --- what the trainer asks ---------------------------------------------------------------------------------
    def busy(self) -> bool:
        with self._lock:
            return self._pending > 0

    def wait(self) -> None:
        self._queue.join()

    def failure(self) -> str | None:
        """The first write that failed (one line, `write_failure`), if any; the checkpoint it belonged to must not be
        published, and every later background write is skipped."""
        return self._error

    def _run(self) -> None:
        while True:
            path, snapshot, buffers, copied, nbytes, delay = self._queue.get()
            try:
                if copied is not None:
                    copied.synchronize()
                time.sleep(delay)
                if self._error is None:
                    if self._write is not None:
                        self._write(path, snapshot)
                    else:
                        write_file(path, snapshot, self.zipfile_serialization)
            except BaseException as e:  # noqa: BLE001 - any failure fails this save: write_failure says why
                self._error = self._error or write_failure(path, e)
            finally:
                del snapshot
                self._snapshots.release(buffers)
                with self._lock:
                    self._pending -= 1
                    self.bytes_in_flight -= nbytes
                self._queue.task_done()


def write_failure(path: Path, error: BaseException) -> str:
    """What a failed background write reports (one line). Any exception counts, not only the filesystem's: a
    MemoryError, a pickling error or a bug in a stand-in writer would otherwise end the writer thread unseen, leave
    `failure()` empty and `busy()` false, let the checkpoint be published without the file, and hang the next save's
    wait until the collective timeout killed the job. The thread records it and goes on draining its queue (writing
    nothing more), so no save ever waits for a dead thread; the trainer's callback then refuses the checkpoint and
    stops the run with this line (llmft.training.callbacks: a run that cannot write its checkpoints would otherwise
    train on for hours with nothing to resume from, and after a MemoryError the process itself is suspect)."""
    why = getattr(error, "strerror", None) or str(error)
    return f"writing {path} failed: {type(error).__name__}" + (f": {why}" if why else "")


def install(engine, synchronous: Callable[[], bool], delay_s: float = 0.0) -> BackgroundWriter:
    """Put a BackgroundWriter in the DeepSpeed engine's place for its checkpoint engine. Only DeepSpeed's default
    (torch.save) engine is replaced: a DeepSpeed config that chose another (`checkpoint.writer`, datastates) is refused
    by the caller, since both cannot write the same files."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    current = engine.checkpoint_engine
    if type(current) is not TorchCheckpointEngine:
        raise ValueError(
            f"--async_save replaces DeepSpeed's default checkpoint engine, but this DeepSpeed config chose "
            f"{type(current).__name__}: drop its checkpoint writer settings or --async_save"
        )
    writer = BackgroundWriter(
        synchronous, zipfile_serialization=getattr(current, "zipfile_serialization", True), delay_s=delay_s
    )
    engine.checkpoint_engine = writer
    return writer

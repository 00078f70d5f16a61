"""Periodic checkpoints written while training goes on (`--async_save`).

DeepSpeed writes a checkpoint through its engine's `checkpoint_engine.save(state_dict, path)`, one call per file
(module states, each rank's optimizer shard). `BackgroundWriter` takes that place: it serialises the state into host
memory (`torch.save` into a buffer: the same bytes the synchronous save writes, a consistent snapshot of tensors the
next optimizer step changes in place) and returns; a thread of the rank writes the bytes to
`.<name>.partial` beside the final path, fsyncs and renames it. Training waits only for the serialisation (and, on a
GPU, the device-to-host copy it includes).

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
- one checkpoint in flight at a time: a save waits for the previous one's writes first, so host memory holds at most
  one checkpoint's bytes per rank (`llmft.memory.host_ram` counts them as `async_save`).
"""

from __future__ import annotations

import io
import os
import queue
import threading
from pathlib import Path
from typing import Callable


def partial_path(path: str | Path) -> Path:
    """Where a file is written before it is renamed into place: hidden, so checkpoint listings skip it."""
    path = Path(path)
    return path.with_name(f".{path.name}.partial")


def write_file(path: str | Path, data) -> None:
    """Write `data` (bytes-like) to `path` atomically and durably: a reader sees the whole file or none."""
    tmp = partial_path(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class BackgroundWriter:
    """A DeepSpeed CheckpointEngine (the same methods) whose saves, when `synchronous()` is false, are written by a thread.

    `busy()` / `wait()` / `failure()` tell the trainer's callback when the files are on disk."""

    name = "llmft BackgroundWriter"

    def __init__(
        self,
        synchronous: Callable[[], bool],
        zipfile_serialization: bool = True,
        write: Callable[[Path, memoryview], None] | None = None,
    ):
        self.synchronous = synchronous
        self.zipfile_serialization = zipfile_serialization
        self._write = write  # None: write_file (looked up when writing)
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        self._error: str | None = None
        self.bytes_in_flight = 0
        self._thread = threading.Thread(target=self._run, name="llmft-checkpoint-writer", daemon=True)
        self._thread.start()

    # --- DeepSpeed's CheckpointEngine interface ---------------------------------------------------------------
    def create(self, info) -> None:
        self.wait()  # the previous checkpoint's files first: one checkpoint in flight

    def makedirs(self, path, exist_ok=False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict, path: str) -> None:
        import torch

        if self.synchronous():
            self.wait()
            torch.save(state_dict, path, _use_new_zipfile_serialization=self.zipfile_serialization)
            return
        buffer = io.BytesIO()
        torch.save(state_dict, buffer, _use_new_zipfile_serialization=self.zipfile_serialization)
        data = buffer.getbuffer()
        with self._lock:
            self._pending += 1
            self.bytes_in_flight += data.nbytes
        self._queue.put((Path(path), data, buffer))

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
        """The first write that failed (one line), if any; the checkpoint it belonged to must not be published."""
        return self._error

    def _run(self) -> None:
        while True:
            path, data, buffer = self._queue.get()
            try:
                if self._error is None:
                    (self._write or write_file)(path, data)
            except OSError as e:
                self._error = f"writing {path} failed: {e.strerror or e}"
            finally:
                with self._lock:
                    self._pending -= 1
                    self.bytes_in_flight -= data.nbytes
                data.release()
                del buffer
                self._queue.task_done()


def install(engine, synchronous: Callable[[], bool]) -> BackgroundWriter:
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
    writer = BackgroundWriter(synchronous, zipfile_serialization=getattr(current, "zipfile_serialization", True))
    engine.checkpoint_engine = writer
    return writer

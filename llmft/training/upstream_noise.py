"""Waits said and noise removed: a line before DeepSpeed compiles an op, op caches per environment, and the one upstream
warning llmft's settings make meaningless silenced (precisely that message, nothing else).

- DeepSpeed builds an op that is not prebuilt (cpu_adam, fused_adam, ...) with ninja the first time a process needs it:
  one to three minutes in which `deepspeed_init` prints nothing. `say_op_builds` logs which op, why, and the usual time.
- torch keys its op cache (~/.cache/torch_extensions/py311_cu121) by Python and CUDA only: two environments with other
  torch or DeepSpeed versions on one machine rebuild each other's ops. `keyed_extensions_dir` adds the environment.
- accelerate warns "Gradient accumulation steps mismatch: GradientAccumulationPlugin has 1, DeepSpeed config has N"
  whenever the Trainer (which accumulates itself, so it gives accelerate 1) runs DeepSpeed with accumulation N.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from pathlib import Path
from typing import Callable, Mapping

from llmft.training.build_locks import extensions_root

# measured order of magnitude for a first build (8-16 cores); printed as a hint, never used to decide anything
USUAL_BUILD_TIME = {"cpu_adam": "about 1 minute", "fused_adam": "1-3 minutes", "cpu_adagrad": "about 1 minute"}


def keyed_extensions_dir(
    env: Mapping[str, str], prefix: str, torch_version: str, deepspeed_version: str, default_root: Path
) -> Path | None:
    """The TORCH_EXTENSIONS_DIR for this environment (None when the user set one: theirs wins): under
    LLMFT_EXTENSIONS_ROOT (the Slurm script's node-local directory) or torch's default root, one directory per
    (environment prefix, torch, DeepSpeed), so two environments on one node never rebuild each other's ops."""
    if env.get("TORCH_EXTENSIONS_DIR"):
        return None
    default_root = Path(env["LLMFT_EXTENSIONS_ROOT"]) if env.get("LLMFT_EXTENSIONS_ROOT") else default_root
    key = hashlib.sha256(f"{os.path.realpath(prefix)}|{torch_version}|{deepspeed_version}".encode()).hexdigest()[:10]
    return default_root / f"llmft-torch{torch_version.split('+')[0]}-ds{deepspeed_version}-{key}"


def use_keyed_extensions_dir(log: Callable[[str], None]) -> Path | None:
    """Set TORCH_EXTENSIONS_DIR for this process (and the ranks it starts) before DeepSpeed loads an op."""
    import deepspeed
    import torch

    path = keyed_extensions_dir(os.environ, sys.prefix, torch.__version__, deepspeed.__version__, extensions_root())
    if path is not None:
        os.environ["TORCH_EXTENSIONS_DIR"] = str(path)
    return path


def op_build_line(name: str, build_dir: Path, accelerator: str) -> str:
    """The line said before DeepSpeed compiles an op."""
    usual = USUAL_BUILD_TIME.get(name, "1-3 minutes")
    return (
        f"DeepSpeed is compiling its {name} op for {accelerator} (it is not prebuilt in this environment and not yet in "
        f"{build_dir}); usually {usual}, once: later runs load it from there"
        + (
            "; `llmft prebuild` builds it into DeepSpeed once, so no job on any node compiles it"
            if accelerator == "cuda"
            else ""
        )
    )


def op_is_built(build_dir: Path, name: str) -> bool:
    return any(build_dir.glob(f"{name}*.so"))


def say_op_builds(log: Callable[[str], None]) -> None:
    """Wrap DeepSpeed's OpBuilder.jit_load: a line before an op is compiled (not when it loads from the cache)."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    original = OpBuilder.jit_load
    if getattr(original, "_llmft_says_builds", False):
        return

    def jit_load(self, verbose=True):
        try:
            from torch.utils.cpp_extension import _get_build_directory

            build_dir = Path(_get_build_directory(self.name, verbose=False))
            if not op_is_built(build_dir, self.name):
                from deepspeed.accelerator import get_accelerator

                log(op_build_line(self.name, build_dir, get_accelerator()._name))
        except Exception:  # saying it must never stop the build
            pass
        return original(self, verbose)

    jit_load._llmft_says_builds = True
    OpBuilder.jit_load = jit_load


class _AccumulationMismatch(logging.Filter):
    """Drops accelerate's accumulation-mismatch warning for exactly this run's accumulation (the Trainer accumulates
    itself and gives accelerate 1; DeepSpeed's value is llmft's plan)."""

    def __init__(self, grad_accum: int):
        super().__init__()
        self.text = f"Gradient accumulation steps mismatch: GradientAccumulationPlugin has 1, DeepSpeed config has {grad_accum}."

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def quiet_accumulation_mismatch(grad_accum: int) -> logging.Filter:
    """Install the filter on accelerate's logger; returns it (removable)."""
    f = _AccumulationMismatch(grad_accum)
    logging.getLogger("accelerate.accelerator").addFilter(f)
    return f

"""Python's cyclic garbage collector while a training process starts: off, then what start-up loaded is frozen.

A rank's start-up (importing torch, transformers, TRL, PEFT and DeepSpeed; the data; the model; DeepSpeed's engine)
creates millions of objects that live as long as the process, and the collector walks all of them again each time
its allocation counters fill. With it off from the first line of `python -m llmft.train` to the first step, a
2-process CPU run of the demo model reached its first step 11% sooner and used 11% less CPU (bench/README.md,
bench_startup.py). Nothing is lost by waiting: objects are still freed by reference counting as usual; only
reference cycles wait, and they are collected once when start-up ends. What is left then lives as long as the process,
so `gc.freeze()` moves it to the permanent generation, which later collections skip (a frozen cycle that becomes
garbage is never collected; reference counting still frees everything else). Training itself runs with Python's
automatic collection, as before; its collections now walk only what training allocates. DataLoader workers fork
after that, with the collector on.

LLMFT_PYTHON_GC=1 keeps the collector on throughout (bench_startup.py's "before").
"""

from __future__ import annotations

import gc
import os

_paused = False


def pause_for_startup(env: dict | None = None) -> bool:
    """Turn automatic collection off until `resume_after_startup`; True when this call turned it off."""
    global _paused
    if (os.environ if env is None else env).get("LLMFT_PYTHON_GC") == "1" or not gc.isenabled():
        return False
    gc.disable()
    _paused = True
    return True


def resume_after_startup() -> bool:
    """Collect start-up's reference cycles once, freeze what is left, and turn automatic collection back on; True
    when `pause_for_startup` had turned it off (otherwise nothing is done: a process that never paused, such as a
    test calling llmft.train in-process, keeps its collector as it was)."""
    global _paused
    if not _paused:
        return False
    _paused = False
    gc.collect()
    gc.freeze()
    gc.enable()
    return True


def end_pause() -> None:
    """Turn automatic collection back on, without collecting or freezing, if start-up paused it and never resumed:
    a `llmft train` called in a process that goes on (llmft.cli.main from Python) and returned before training
    (a user error, a finished run) leaves that process's collector as it found it."""
    global _paused
    if _paused:
        _paused = False
        gc.enable()

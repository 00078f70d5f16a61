"""Keeps every process group's collective timeout at what the run has measured (the numbers:
llmft.planning.collective_timeout), so a dead or hung rank ends the job in minutes, not transformers' 30.

The process group starts with --ddp_timeout (1800 s unless given). Once MIN_STEPS steps are measured the timeout
drops to max(300 s, 20 x the median step, 2 x the longest save); before each save it rises to cover the save (the
first one by the planner's estimate); after training it returns to the start-up value for the final save and
export. Every rank does this itself, from its own clock: the timeout is per rank. `--ddp_timeout` given by the user
is kept as given, all run long, on every group (torch's new_group, which DeepSpeed calls for its data-parallel groups,
defaults to 30 minutes whatever the default group's timeout). Each change is logged once, as torch reports it back.
"""

from __future__ import annotations

import statistics
import time
from datetime import timedelta

from llmft.planning.collective_timeout import MIN_STEPS, SAVE_FACTOR, STARTUP_S, collective_timeout


def process_groups() -> list:
    """Every process group this rank belongs to (DeepSpeed makes its own besides the default one)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not (dist.is_available() and dist.is_initialized()):
        return []
    world = getattr(c10d, "_world", None)  # torch's registry of groups (private; the default group if it moves)
    groups = list(world.pg_map) if world is not None else [c10d._get_default_group()]
    return [pg for pg in groups if not c10d._rank_not_in_group(pg)]


def set_timeout(seconds: float) -> float | None:
    """Set the timeout of every process group of this rank; the default group's timeout as torch now reports it
    (None: no process group, or torch cannot set or report it)."""
    import torch
    from torch.distributed import distributed_c10d as c10d

    groups = process_groups()
    setter = getattr(c10d, "_set_pg_timeout", None)
    if not groups or setter is None:
        return None
    for pg in groups:
        setter(timedelta(seconds=seconds), pg)
    device = torch.device("cuda" if torch.device("cuda") in groups[0]._device_types else "cpu")
    try:
        return groups[0]._get_backend(device).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return seconds  # set, but this torch does not report it back


def callback(log, *, given_s: float | None, estimated_save_s: float | None, longest_save_s: float | None):
    """A TrainerCallback (added last: it reads every other callback's should_save) that keeps the timeout sized.

    `given_s`: --ddp_timeout when the user gave it (then nothing changes); `longest_save_s`: what an earlier attempt
    of the run measured (llmft.training.job_deadline's record). `save_measured(seconds)` takes each save's time."""
    from transformers import TrainerCallback

    class CollectiveTimeout(TrainerCallback):
        def __init__(self):
            self.steps: list[float] = []
            self.last_end: float | None = None
            self.longest_save_s = longest_save_s
            self.current: float | None = None

        def _set(self, seconds: float, why: str) -> None:
            if given_s is not None or (self.current is not None and abs(seconds - self.current) < 0.1 * self.current):
                return
            now = set_timeout(seconds)
            if now is not None:
                self.current = now
                log(f"collective timeout {now:.0f} s ({why})")

        def _resize(self, saving: bool = False) -> None:
            step = statistics.median(self.steps[-50:]) if len(self.steps) >= MIN_STEPS else None
            self._set(*collective_timeout(step, self.longest_save_s, estimated_save_s, saving=saving))

        def on_train_begin(self, args, state, control, **kwargs):
            if given_s is not None:
                bound = self.longest_save_s or estimated_save_s
                warn = (
                    f"; warning: shorter than {SAVE_FACTOR:g} x a save ({bound:.0f} s), which may then time out"
                    if bound and given_s < SAVE_FACTOR * bound
                    else ""
                )
                set_timeout(given_s)  # DeepSpeed's own groups were made with torch's default, not --ddp_timeout
                log(f"collective timeout {given_s:.0f} s (--ddp_timeout, as given: not sized from the run){warn}")
            else:
                self._resize()
            self.last_end = time.monotonic()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.monotonic()
            if self.last_end is not None:
                self.steps.append(now - self.last_end)
            self.last_end = now
            self._resize(saving=control.should_save)

        def on_evaluate(self, args, state, control, **kwargs):
            self.last_end = time.monotonic()  # the next step's time excludes the evaluation

        def save_measured(self, seconds: float, background: bool = False) -> None:
            """`background`: an --async_save checkpoint, measured as it is published at a step end while the steps
            went on; the step being timed then is a step like any other, and its time stays."""
            self.longest_save_s = max(seconds, self.longest_save_s or 0.0)
            if not background:
                self.last_end = time.monotonic()  # the next step's time excludes the save
            self._resize()

        def on_train_end(self, args, state, control, **kwargs):
            # the final save, its checks and an export are not measured steps
            self._set(max(STARTUP_S, SAVE_FACTOR * (self.longest_save_s or estimated_save_s or 0.0)), "after training")

    return CollectiveTimeout()

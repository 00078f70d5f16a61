"""The elastic conversion (DeepSpeed's ds_to_universal) sized for the node it runs on: workers, memory, time.

Resuming a ZeRO-1/2/3 checkpoint on another number of ranks converts it to a universal checkpoint first
(llmft.elastic). DeepSpeed 0.19's converter (deepspeed/checkpoint/ds_to_universal.py) runs in two parallel phases:
- extract: each worker process loads one rank's optimizer file (fp32 weights and both Adam moments of that rank's
  partition: 12 bytes x trainable parameters / saved ranks) and writes every parameter's fragments;
- merge: each worker loads one parameter's fragments from every rank, state by state, and concatenates them
  (8 bytes x the parameter's size at its peak: the fragments and the whole tensor, fp32).
The main process holds one optimizer file too (reading the checkpoint's layout). Every worker is a Python process
with torch loaded. All of it reads and writes the checkpoint's filesystem: 12 bytes x trainable parameters read and
written in each phase, about 48 in all.

`plan_conversion` picks as many workers of each phase as the node's CPUs, the work and the memory budget allow
(at least one; `fits` says whether even one does), and estimates the peak and the time at the storage bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GIB = 2**30
WORKER_RUNTIME_BYTES = int(0.6 * GIB)  # one Python process with torch imported (measured RSS on CPU: 0.5-0.6 GiB)
SLACK = 1.2  # fragments are cloned before torch.save, and the allocator keeps some
# Beyond these the checkpoint's storage, not the CPUs, sets the pace (every worker reads and writes it); DeepSpeed's
# own help asks for "much fewer" merge than extract workers.
MOST_EXTRACT, MOST_MERGE = 16, 8


@dataclass(frozen=True)
class ConversionPlan:
    extract_workers: int
    merge_workers: int
    peak_bytes: int  # the node's host RAM at the conversion's peak (main process + the workers of one phase)
    seconds: float  # at the storage bandwidth
    budget_bytes: int
    fits: bool  # even one worker of each phase fits the budget

    def describe(self) -> str:
        return (
            f"{self.extract_workers} extract and {self.merge_workers} merge worker(s), about "
            f"{self.peak_bytes / GIB:.1f} GiB host RAM of {self.budget_bytes / GIB:.1f}, about {self.seconds:.0f} s"
        )


def plan_conversion(
    *, trainable: int, largest_tensor: int, saved_world: int, budget_bytes: int, cpus: int, io_mb_s: float
) -> ConversionPlan:
    """Workers for ds_to_universal's two phases within `budget_bytes` of host RAM and `cpus` CPUs."""
    shard = 12 * trainable / max(1, saved_world)
    base = WORKER_RUNTIME_BYTES + shard * SLACK
    per_extract = WORKER_RUNTIME_BYTES + shard * SLACK
    per_merge = WORKER_RUNTIME_BYTES + 8 * min(largest_tensor, trainable) * SLACK
    room = budget_bytes - base

    def workers(per: float, most: int) -> int:
        return max(1, min(most, cpus, int(room // per) if room > 0 else 0))

    extract = workers(per_extract, min(saved_world, MOST_EXTRACT))
    merge = workers(per_merge, max(1, min(cpus // 2, MOST_MERGE)))
    peak = base + max(extract * per_extract, merge * per_merge)
    fits = base + max(per_extract, per_merge) <= budget_bytes
    seconds = 48 * trainable / (io_mb_s * 1e6)
    return ConversionPlan(extract, merge, int(math.ceil(peak)), seconds, int(budget_bytes), fits)

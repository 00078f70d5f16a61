"""What a run really used of its hosts' RAM, printed beside what `llmft plan` predicted.

Rank 0 prints every rank's RSS before the model loads and its peak once the trainer is built (the weights
loaded, the DeepSpeed engine not yet created), then at the end every rank's peak and each node's total
(the sum of its ranks' peaks: an upper bound of the node's peak):

    llmft: host memory: rank 0 0.61 GiB before loading, 0.84 GiB peak after loading, rank 1 ...
    llmft: host memory peak: rank 0 2.10 GiB, rank 1 1.98 GiB; per node (sum of its ranks' peaks): n1 4.08 GiB

On GPUs it also prints each rank's torch.cuda.max_memory_allocated / max_memory_reserved (bench/gpu_memory.py
compares them with the planner's estimate).
"""

from __future__ import annotations

import os
import resource

from llmft.planning.world import rank0


def peak_rss() -> int:
    """This process's peak resident memory in bytes (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss() -> int:
    """This process's resident memory now, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def report_callback(before_loading: int, after_loading: int):
    """A TrainerCallback printing the lines in the module docstring (defined lazily: transformers is heavy)."""
    import torch.distributed as dist
    from transformers import TrainerCallback

    def gather(value):
        if dist.is_available() and dist.is_initialized():
            out = [None] * dist.get_world_size()
            dist.all_gather_object(out, value)
            return out
        return [value]

    class HostMemory(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            ranks = gather((before_loading, after_loading))
            if rank0():
                print(
                    "llmft: host memory: "
                    + ", ".join(
                        f"rank {r} {_gib(b)} before loading, {_gib(p)} peak after loading"
                        for r, (b, p) in enumerate(ranks)
                    ),
                    flush=True,
                )

        def on_train_end(self, args, state, control, **kwargs):
            ranks = gather((os.uname().nodename, peak_rss()))
            nodes: dict[str, int] = {}
            for host, peak in ranks:
                nodes[host] = nodes.get(host, 0) + peak
            gpu = None
            import torch

            if torch.cuda.is_available():
                gpu = gather((torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()))
            if rank0() and gpu:
                print(
                    "llmft: GPU memory peak: "
                    + ", ".join(f"rank {r} {_gib(a)} allocated, {_gib(b)} reserved" for r, (a, b) in enumerate(gpu)),
                    flush=True,
                )
            if rank0():
                print(
                    "llmft: host memory peak: "
                    + ", ".join(f"rank {r} {_gib(p)}" for r, (_, p) in enumerate(ranks))
                    + "; per node (sum of its ranks' peaks): "
                    + ", ".join(f"{h} {_gib(t)}" for h, t in nodes.items()),
                    flush=True,
                )

    return HostMemory()

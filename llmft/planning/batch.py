"""Batch math: keep the global batch the user asked for, whatever the number of GPUs.

    global batch = micro-batch per GPU x gradient accumulation x world size

Given the global batch and the micro-batch, llmft derives the accumulation from the world, so
micro 2 on 1 GPU with accumulation 16 (global 32) becomes accumulation 4 on 4 GPUs. When the
numbers do not divide, it fails before any model is loaded and names valid alternatives.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmft.errors import LlmftError


class BatchError(LlmftError, ValueError):
    """The requested batch sizes cannot be realised on this world."""


@dataclass(frozen=True)
class BatchPlan:
    micro_batch: int
    grad_accum: int
    world_size: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.world_size


def nearest_global_batches(global_batch: int, micro_batch: int, world_size: int) -> list[int]:
    """The valid global batches (multiples of micro x world) just below and above the requested one."""
    step = micro_batch * world_size
    below = (global_batch // step) * step
    above = below + step
    return [b for b in (below, above) if b >= step and b != global_batch]


def valid_micro_batches(global_batch: int, world_size: int) -> list[int]:
    """Every micro-batch that divides the global batch evenly over this world."""
    if global_batch % world_size:
        return []
    per_rank = global_batch // world_size
    return [m for m in range(1, per_rank + 1) if per_rank % m == 0]


def nearest_micro_batches(global_batch: int, micro_batch: int, world_size: int, k: int = 2) -> list[int]:
    candidates = valid_micro_batches(global_batch, world_size)
    return sorted(sorted(candidates, key=lambda m: (abs(m - micro_batch), -m))[:k])


def plan_batch(
    world_size: int, micro_batch: int, global_batch: int | None = None, grad_accum: int | None = None
) -> BatchPlan:
    """Solve for the gradient accumulation (or the global batch when none is asked for).

    - global_batch given: accumulation = global / (micro x world), which must be a whole number >= 1;
      a grad_accum given too must agree with it.
    - global_batch absent: the global batch follows from micro x grad_accum (default 1) x world.
    """
    for name, value in (("world size", world_size), ("micro-batch", micro_batch)):
        if not isinstance(value, int) or value < 1:
            raise BatchError(f"{name} must be a positive integer, got {value!r}")
    if grad_accum is not None and (not isinstance(grad_accum, int) or grad_accum < 1):
        raise BatchError(f"gradient accumulation must be a positive integer, got {grad_accum!r}")

    if global_batch is None:
        return BatchPlan(micro_batch, grad_accum or 1, world_size)
    if not isinstance(global_batch, int) or global_batch < 1:
        raise BatchError(f"global batch must be a positive integer, got {global_batch!r}")

    per_step = micro_batch * world_size
    if global_batch % per_step:
        hints = []
        globals_ = nearest_global_batches(global_batch, micro_batch, world_size)
        if globals_:
            hints.append("global batch " + " or ".join(map(str, globals_)))
        micros = nearest_micro_batches(global_batch, micro_batch, world_size)
        if micros:
            hints.append("micro-batch " + " or ".join(map(str, micros)))
        why = (
            f"global batch {global_batch} is smaller than micro-batch {micro_batch} x world size {world_size} = {per_step}"
            if global_batch < per_step
            else f"global batch {global_batch} is not divisible by micro-batch {micro_batch} x world size {world_size} = {per_step}"
        )
        raise BatchError(f"{why}; use {', or '.join(hints)}")
    accum = global_batch // per_step
    if grad_accum is not None and grad_accum != accum:
        raise BatchError(
            f"gradient accumulation {grad_accum} contradicts global batch {global_batch} = micro-batch {micro_batch} "
            f"x world size {world_size} x accumulation {accum}; give only one of --global_batch_size and --gradient_accumulation_steps"
        )
    return BatchPlan(micro_batch, accum, world_size)

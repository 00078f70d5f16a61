"""Which reference a preference method's run should hold, and the one line that says it, with the numbers.

`llmft plan --method dpo --model M`, `llmft plan --auto` and `llmft train --auto` (ZERO_STAGE=auto) all ask
`plan_with_reference`, so they give the same answer; `llmft plan --check_memory` (the job scripts) says it beside
its check, which counts the reference as llmft train holds it (a copy unless --precompute_ref_log_probs is given):

- LoRA: the policy with its adapter disabled is the reference (TRL's default for a PEFT model): no copy is held,
  its forward runs every micro-batch.
- Full fine-tuning: a full copy when it fits beside the policy under ZeRO-0/1/2 (a stage-0 replica) with no more
  CPU offload than the policy alone needs; else the reference's log-probs precomputed (--precompute_ref_log_probs:
  one pass before training, nothing held while training) when that avoids CPU offload or ZeRO-3, or a copy does not
  fit at all; else a ZeRO-3-sharded copy (the policy needs ZeRO-3 anyway, and a sharded copy is weights / world per
  GPU).

A strategy asked for (--precompute_ref_log_probs) is planned as asked. The accounting of each term is
llmft.planning.memory's (`reference_weight_bytes`, `reference_forward_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from llmft.planning.memory import (
    Estimate,
    Job,
    MemoryPlan,
    gib,
    plan_memory,
    reference_weight_bytes,
)

STRATEGY_WORDS = {
    "adapter": "the policy with its LoRA adapter disabled (no copy of the weights)",
    "copy": "a full copy of the weights",
    "precomputed": "its log-probs precomputed (--precompute_ref_log_probs: one reference pass before training, "
    "kept in the data cache; nothing held while training)",
}


@dataclass(frozen=True)
class ReferenceAdvice:
    strategy: str  # adapter | copy | precomputed ("" for a method without a reference)
    line: str  # `llmft plan: reference ...`, with the numbers ("" for a method without a reference)


def _where(est: Estimate | None, job: Job) -> str:
    if est is None:
        return "nothing fits"
    limit = f" of {job.device_gib:g}" if job.device_gib is not None else ""
    device = "GPU" if job.gpu is not None else "per process"
    return f"{est.setting.describe()}, {device} {gib(est.gpu_total)} GiB{limit}"


def _copy_gib(job: Job, zero_stage: int) -> float:
    return gib(reference_weight_bytes(job.shape, "copy", zero_stage, job.world, job.precision))


def _cost(est: Estimate | None) -> tuple:
    """What a setting costs each step, in llmft's order of preference (llmft.planning.memory.PREFERENCE): CPU offload,
    then ZeRO-3; a plan where nothing fits costs most."""
    if est is None:
        return (2, 2)
    return (int(est.setting.offload != "none"), int(est.setting.zero_stage == 3))


def choose(job: Job, plan_fn: Callable[[Job], MemoryPlan] = plan_memory) -> tuple[str, MemoryPlan, str]:
    """(strategy, the plan made with it, why) for a job whose method has a reference (module docstring's rule)."""
    if job.reference is not None:
        return job.reference, plan_fn(job), "as asked"
    if job.shape.lora:
        return "adapter", plan_fn(replace(job, reference="adapter")), "LoRA: the base model is the reference"
    copy = plan_fn(replace(job, reference="copy"))
    pre = plan_fn(replace(job, reference="precomputed"))
    c, p = copy.recommended, pre.recommended
    if c is not None and _cost(c) <= _cost(p) and c.setting.zero_stage < 3:
        stage = c.setting.zero_stage
        return "copy", copy, f"the copy ({_copy_gib(job, stage)} GiB, a stage-0 replica) fits beside the policy"
    if p is not None and _cost(p) < _cost(c):
        copy_part = (
            f"with a full copy ({_copy_gib(job, 0)} GiB replicated) only {_where(c, job)}"
            if c is not None
            else f"a full copy does not fit beside it ({copy.reason})"
        )
        return "precomputed", pre, f"the policy fits without the copy; {copy_part}"
    if c is not None:
        return (
            "copy",
            copy,
            f"the policy needs ZeRO-3 anyway, which shards the copy to {_copy_gib(job, 3)} GiB per GPU "
            f"(of {_copy_gib(job, 0)} GiB)",
        )
    return "precomputed", pre, "nothing fits, not even with the reference precomputed"


def plan_with_reference(
    job: Job, plan_fn: Callable[[Job], MemoryPlan] = plan_memory
) -> tuple[Job, MemoryPlan, ReferenceAdvice]:
    """The job with its reference strategy decided, its plan (every candidate marked when the reference is
    precomputed by the planner's choice, so --auto and --write pass --precompute_ref_log_probs), and the advice.
    A method without a reference plans as it always has."""
    if not job.method_entry.reference:
        return job, plan_fn(job), ReferenceAdvice("", "")
    asked = job.reference is not None
    strategy, mplan, why = choose(job, plan_fn)
    job = replace(mplan.job, reference=strategy)
    if strategy == "precomputed" and not asked:
        mplan = mark_precomputed(mplan)
    est = mplan.recommended
    numbers = _where(est, job)
    if est is not None:
        numbers += f" (reference {gib(est.reference)} GiB of it)"
    line = (
        f"llmft plan: reference ({job.method}): {STRATEGY_WORDS[strategy]}"
        + (", as asked" if asked else "")
        + f": {numbers}; {why}"
    )
    return job, mplan, ReferenceAdvice(strategy, line)


def mark_precomputed(mplan: MemoryPlan) -> MemoryPlan:
    """The plan's settings carry --precompute_ref_log_probs (Setting.flags), since the run must do what was planned."""

    def mark(est: Estimate | None) -> Estimate | None:
        return None if est is None else replace(est, setting=replace(est.setting, precompute_ref_log_probs=True))

    candidates = [mark(c) for c in mplan.candidates]
    recommended = None
    if mplan.recommended is not None:
        recommended = candidates[mplan.candidates.index(mplan.recommended)]
    return replace(mplan, candidates=candidates, recommended=recommended)

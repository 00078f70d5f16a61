"""How long a rank waits in a collective before the job gives up on a dead or hung peer, as numbers (the run applies
it: llmft.training.process_group_timeout).

transformers' default (`--ddp_timeout`, 1800 s) leaves every other GPU of a job waiting 30 minutes when one node dies.
What a healthy job waits for is bounded by what it measures: a step (the ranks meet in collectives at least once a
step) and a checkpoint save (the ranks meet after writing their own shards, so the fastest waits out the slowest's
whole write). Before the run has measured its steps (data preparation, loading, ZeRO-3 partitioning, a first
compiled step), the start-up value holds.
"""

from __future__ import annotations

STARTUP_S = 1800.0  # transformers' --ddp_timeout default: what nothing measured yet may take
FLOOR_S = 300.0  # a step's collectives may also wait out another rank's data loading or a straggler's hiccup
STEP_FACTOR = 20  # a step may take this many times the median measured step (recompiles, stragglers)
SAVE_FACTOR = 2.0  # a save may take this many times the longest measured (a shared filesystem under contention)
MIN_STEPS = 5  # steps measured before the median counts


def collective_timeout(
    step_s: float | None,
    longest_save_s: float | None,
    estimated_save_s: float | None = None,
    *,
    saving: bool = False,
    startup_s: float = STARTUP_S,
) -> tuple[float, str]:
    """The collective timeout in seconds and why, in words.

    `step_s`: the median optimizer step (None until MIN_STEPS are measured); `longest_save_s`: the longest save this
    run measured, also in an earlier attempt; `estimated_save_s`: the planner's figure for a save not yet measured;
    `saving`: a checkpoint save is starting. Never shorter than SAVE_FACTOR x the longest save; a save gets
    SAVE_FACTOR x the planner's estimate when that is longer (an --async_save save also waits out the previous
    background write; a background save is measured from its start to its publication, so its write counts), and a
    first save at least the start-up value."""
    save, save_is = longest_save_s, "the longest save"
    if saving and longest_save_s is None:
        estimate = SAVE_FACTOR * (estimated_save_s or 0.0)
        if estimate > startup_s:
            return estimate, f"a first save: {SAVE_FACTOR:g} x the planner's estimate {estimated_save_s:.0f} s"
        return startup_s, "a first save, not measured yet: the start-up value"
    if saving and estimated_save_s is not None and estimated_save_s > longest_save_s:
        save, save_is = estimated_save_s, "the planner's estimate of a save"
    save_bound = SAVE_FACTOR * save if save is not None else 0.0
    if step_s is None:
        if save_bound > startup_s:
            return save_bound, f"start-up: {SAVE_FACTOR:g} x {save_is} {save:.1f} s"
        return startup_s, "start-up, nothing measured yet"
    timeout, why = FLOOR_S, f"at least {FLOOR_S:.0f} s"
    if STEP_FACTOR * step_s > timeout:
        timeout, why = STEP_FACTOR * step_s, f"{STEP_FACTOR} x the median step {step_s:.2f} s"
    if save_bound > timeout:
        timeout, why = save_bound, f"{SAVE_FACTOR:g} x {save_is} {save:.1f} s"
    return timeout, why

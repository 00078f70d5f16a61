"""When a Slurm run starts its final save, as numbers: the lead before the job's time limit (llmft plan states it,
llmft.training.job_deadline acts on it at run time, which documents the whole mechanism).

A Llama-3.1-8B ZeRO-3 checkpoint takes 964 s at 100 MB/s, far more than the 120 s USR1 warning of
slurm/run_llm.slurm; so a run stops for its final save `final_save_lead` seconds before the time limit:
FINAL_SAVE_FACTOR x the longest save it measured (before one: the planner's estimate) + the step in flight +
FINAL_SAVE_MARGIN_S for the processes to exit and the job to requeue itself.
"""

from __future__ import annotations

import re

FINAL_SAVE_FACTOR = 1.5
FINAL_SAVE_MARGIN_S = 60.0  # the ranks exit, torchrun and srun return, the batch script requeues
UNMEASURED_SAVE_S = 120.0  # a save nobody could estimate: as long as the USR1 lead itself


def parse_time_left(text: str) -> float | None:
    """Seconds in squeue's %L (TimeLeft): `[days-][hours:]minutes:seconds`; None for UNLIMITED, NOT_SET, INVALID
    or anything else (a job without a limit has no final save to plan)."""
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", text.strip())
    if not m:
        return None
    days, hours, minutes, seconds = (int(g) if g else 0 for g in m.groups())
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


def final_save_lead(
    longest_save_s: float | None, estimate_s: float | None, step_s: float, async_save: bool = False
) -> float:
    """Seconds before the job's end at which the final save must start: the longest save measured (else the
    estimate, else UNMEASURED_SAVE_S) x FINAL_SAVE_FACTOR, plus the step in flight and FINAL_SAVE_MARGIN_S.

    `async_save` (--async_save): the final save is written synchronously, but first waits for the background write in
    flight, which may have just begun; so the lead covers two saves (a background save's measured length runs from
    its start to its publication, llmft.training.job_deadline.time_each_save). Without it, a run whose periodic saves
    held training 0.3 s would start a 964 s final save 61 s before the limit."""
    save = (
        longest_save_s if longest_save_s is not None else estimate_s if estimate_s is not None else UNMEASURED_SAVE_S
    )
    return FINAL_SAVE_FACTOR * save * (2 if async_save else 1) + max(step_s, 0.0) + FINAL_SAVE_MARGIN_S


def final_save_due(time_left_s: float | None, lead_s: float) -> bool:
    """Whether to stop now for the final save: the job has a limit and no more than the lead is left of it."""
    return time_left_s is not None and time_left_s <= lead_s

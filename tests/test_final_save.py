"""When a Slurm run starts its final save (llmft.planning.final_save, llmft.training.job_deadline): the job's time left read from squeue, the save times the
run measures, and the decision that makes the last checkpoint finish before the time limit."""

from __future__ import annotations

import pytest

from llmft.planning.final_save import (
    FINAL_SAVE_MARGIN_S,
    UNMEASURED_SAVE_S,
    final_save_due,
    final_save_lead,
    parse_time_left,
)
from llmft.planning.memory import estimated_save_s
from llmft.training.job_deadline import JOB_END_POLL_S, JobDeadline


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("1-02:03:04\n", 93784.0),  # days-hours:minutes:seconds
        ("2:03:04", 7384.0),
        ("5:00", 300.0),
        ("0:07", 7.0),
        ("UNLIMITED", None),  # no time limit: no final save to plan
        ("NOT_SET", None),
        ("INVALID", None),
        ("", None),  # squeue printed nothing (the job is gone)
    ],
)
def test_squeue_time_left_is_parsed(text, seconds):
    assert parse_time_left(text) == seconds


def test_the_final_save_starts_one_and_a_half_longest_saves_plus_a_step_and_a_margin_before_the_end():
    assert final_save_lead(100.0, 964.0, 10.0) == 1.5 * 100 + 10 + FINAL_SAVE_MARGIN_S  # a measured save wins
    assert final_save_lead(None, 964.0, 10.0) == 1.5 * 964 + 10 + FINAL_SAVE_MARGIN_S  # before one: the estimate
    assert final_save_lead(None, None, 0.0) == 1.5 * UNMEASURED_SAVE_S + FINAL_SAVE_MARGIN_S
    assert final_save_due(100.0, 120.0) and final_save_due(120.0, 120.0) and not final_save_due(121.0, 120.0)
    assert not final_save_due(None, 1e9)  # no limit known: never


def test_the_estimate_before_any_save_is_the_planners():
    """Llama-3.1-8B under ZeRO-3 at the planner's default 100 MB/s: the 964 s `llmft plan` prints."""
    assert round(estimated_save_s(8_030_261_248, 8_030_261_248, 3, "bf16")) == 964
    lora = estimated_save_s(8_030_261_248, 6_815_744, 2, "bf16")
    assert lora < 2  # the adapter and its optimizer state only


class FakeSlurm:
    def __init__(self, left: float | None):
        self.left, self.asked = left, 0

    def __call__(self, job_id: str) -> float | None:
        self.asked += 1
        return self.left


def test_the_deadline_reads_the_end_again_and_uses_the_longest_measured_save(monkeypatch):
    monkeypatch.delenv("LLMFT_TEST_TIME_LEFT_AT_STEP", raising=False)
    now = [1000.0]
    slurm = FakeSlurm(3600.0)
    d = JobDeadline("42", estimate_s=10.0, query=slurm, clock=lambda: now[0], background=False)
    assert d.due(1, 1.0) is None and slurm.asked == 1  # 3600 s left, lead 1.5 x 10 + 1 + 60
    now[0] += 30
    slurm.left = 50.0  # `scontrol update TimeLimit=` moved the end: seen at the next poll, not before
    assert d.due(2, 1.0) is None and slurm.asked == 1
    now[0] += JOB_END_POLL_S
    reason = d.due(3, 1.0)
    assert slurm.asked == 2 and reason == (
        "Slurm job 42 ends in 50 s: starting the final save now, 76 s before the time "
        "limit (no save measured yet, estimated 10 s; x1.5 + a 1.0 s step + 60 s)"
    )
    slurm.left = 200.0
    now[0] += JOB_END_POLL_S
    assert d.due(4, 1.0) is None
    d.record_save(120.0)  # a save took 120 s: the lead is now 1.5 x 120 + 1 + 60 = 241 s > 200 s left
    d.record_save(30.0)  # the longest counts
    assert d.lead(1.0) == 241.0
    assert d.due(5, 1.0).startswith(
        "Slurm job 42 ends in 200 s: starting the final save now, 241 s before the time limit "
        "(the longest save took 120.0 s;"
    )


def test_no_time_limit_means_no_early_stop(monkeypatch):
    monkeypatch.delenv("LLMFT_TEST_TIME_LEFT_AT_STEP", raising=False)
    d = JobDeadline("42", estimate_s=1e6, query=FakeSlurm(None), clock=lambda: 0.0)
    assert d.due(1, 10.0) is None


def test_outside_slurm_and_off_rank_0_there_is_no_deadline(monkeypatch, tmp_path):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert JobDeadline.for_this_job(lambda: pytest.fail("no estimate outside Slurm"), tmp_path) is None
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("RANK", "1")
    assert JobDeadline.for_this_job(lambda: pytest.fail("no estimate off rank 0"), tmp_path) is None
    monkeypatch.setenv("RANK", "0")
    assert JobDeadline.for_this_job(lambda: 3.0, tmp_path).estimate_s == 3.0


def test_the_time_left_test_hook_starts_at_its_step(monkeypatch):
    monkeypatch.setenv("LLMFT_TEST_TIME_LEFT_AT_STEP", "3:30")
    now = [0.0]
    d = JobDeadline("42", estimate_s=0.0, query=FakeSlurm(None), clock=lambda: now[0])
    assert d.due(2, 0.0) is None  # Slurm says: no limit
    assert d.due(3, 0.0).startswith("Slurm job 42 ends in 30 s")  # 30 s <= 60 s lead
    now[0] += 10
    assert d.time_left(4) == 20.0  # and runs down with the clock
    resumed = JobDeadline("42", estimate_s=0.0, query=FakeSlurm(None), clock=lambda: now[0])
    assert resumed.time_left() is None  # resumed at step 3: the hook is for step 3 trained, not resumed from
    assert resumed.due(4, 0.0) is None  # and a run resumed past step 3 never meets it


def test_a_requeued_run_starts_from_the_saves_measured_before(tmp_path, monkeypatch):
    """The longest save is kept in the output directory: the next attempt of the job does not fall back to the
    estimate (which can be far off either way) before its first save."""
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("RANK", "0")
    first = JobDeadline.for_this_job(lambda: 964.0, tmp_path)
    assert first.longest_save_s is None and first.lead(0) == 1.5 * 964 + 60
    first.record_save(300.0)
    first.record_save(200.0)
    again = JobDeadline.for_this_job(lambda: 964.0, tmp_path)
    assert again.longest_save_s == 300.0 and again.lead(0) == 1.5 * 300 + 60
    (tmp_path / "llmft_save_seconds.json").write_text("not json")
    assert JobDeadline.for_this_job(lambda: 964.0, tmp_path).longest_save_s is None


def test_slurm_is_asked_again_in_the_background(monkeypatch):
    """A slow slurmctld must not stall rank 0 (and every rank waiting for it in the next collective)."""
    import threading

    monkeypatch.delenv("LLMFT_TEST_TIME_LEFT_AT_STEP", raising=False)
    now, answered, release = [0.0], threading.Event(), threading.Event()
    calls = []

    def slow_slurm(job_id):
        calls.append(job_id)
        if len(calls) > 1:
            release.wait(10)
            answered.set()
        return 100.0 * len(calls)

    d = JobDeadline("42", estimate_s=0.0, query=slow_slurm, clock=lambda: now[0])
    assert d.time_left(1) == 100.0  # the first answer is waited for
    now[0] += JOB_END_POLL_S
    assert d.time_left(2) == 100.0 - JOB_END_POLL_S  # asked again, not waited for: the old end stands meanwhile
    release.set()
    assert answered.wait(10)
    d.poller.join(10)
    assert d.time_left(3) == 200.0  # the new answer, from when it was asked


def test_a_failed_or_rate_limited_poll_keeps_the_last_good_end(monkeypatch):
    from llmft.training.job_deadline import UNANSWERED

    monkeypatch.delenv("LLMFT_TEST_TIME_LEFT_AT_STEP", raising=False)
    now = [0.0]
    slurm = FakeSlurm(600.0)
    d = JobDeadline("42", estimate_s=100.0, query=slurm, clock=lambda: now[0], background=False)
    assert d.time_left(1) == 600.0
    slurm.left = UNANSWERED  # squeue failed (slurmctld busy, rate-limited)
    now[0] += JOB_END_POLL_S
    assert slurm.asked == 1 and d.time_left(2) == 600.0 - JOB_END_POLL_S and slurm.asked == 2
    now[0] += 400.0  # still unanswered: the end stands, and the final save comes when it is due
    assert d.due(3, 1.0).startswith("Slurm job 42 ends in 140 s: starting the final save now, 211 s before")
    slurm.left = None  # squeue answers: no limit (`scontrol update TimeLimit=UNLIMITED`)
    now[0] += JOB_END_POLL_S
    assert d.time_left(4) is None and d.due(5, 1.0) is None


@pytest.mark.parametrize(
    "text, left",
    [
        ("1000 1:00:00\n", 3500.0),  # asked at Unix time 1000 with an hour left; read at 1100
        ("1000.5 1-00:00:00", 86400.0 + 0.5 - 100.0),
        ("1000 UNLIMITED\n", None),  # no time limit
        ("1000", None),  # squeue printed nothing: the job is gone, no limit is made up
        ("", "unanswered"),  # a file being replaced, or not written yet
        ("garbage 5:00", "unanswered"),
    ],
)
def test_the_batch_shells_job_end_file_is_read_as_of_when_it_was_written(text, left):
    from llmft.training.job_deadline import time_left_from_file

    assert time_left_from_file(text, now_unix=1100.0) == left


def test_without_squeue_rank_0_reads_the_end_from_the_batch_shells_file_and_squeue_wins_when_it_answers(
    tmp_path, monkeypatch
):
    """Inside a container (pyxis) there is usually no squeue: the batch shell, which has one, keeps the job's end in
    a file (slurm/run_llm.slurm); a requeue or `scontrol update TimeLimit=` is in the file by the shell's next poll."""
    from llmft.training.job_deadline import JOB_END_FILE_ENV, UNANSWERED

    monkeypatch.delenv("LLMFT_TEST_TIME_LEFT_AT_STEP", raising=False)
    now, wall = [0.0], [50_000.0]
    end_file = tmp_path / ".llmft-job-end-42"
    end_file.write_text("49990 30:00\n")  # written 10 s ago: 30 minutes left then
    slurm = FakeSlurm(UNANSWERED)  # no Slurm client here
    d = JobDeadline(
        "42",
        estimate_s=10.0,
        query=slurm,
        clock=lambda: now[0],
        background=False,
        end_file=end_file,
        wall_clock=lambda: wall[0],
    )
    assert d.time_left(1) == 1790.0
    end_file.write_text("50050 1:00\n")  # TimeLimit lowered: the shell's next poll says a minute is left
    now[0] += JOB_END_POLL_S
    wall[0] += JOB_END_POLL_S
    assert d.time_left(2) == 50.0 and d.due(2, 0.0).startswith("Slurm job 42 ends in 50 s")
    end_file.unlink()  # no file (and no squeue): the last good answer stands
    now[0] += JOB_END_POLL_S
    wall[0] += JOB_END_POLL_S
    assert d.time_left(3) == 50.0 - JOB_END_POLL_S
    end_file.write_text(f"{wall[0]:.0f} 10:00\n")
    slurm.left = 3000.0  # squeue answers after all: its answer wins over the file's
    now[0] += JOB_END_POLL_S
    wall[0] += JOB_END_POLL_S
    assert d.time_left(4) == 3000.0
    # and the run finds the file where the batch shell says it is
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(JOB_END_FILE_ENV, str(end_file))
    assert JobDeadline.for_this_job(lambda: 1.0, tmp_path).end_file == str(end_file)


def test_with_async_save_the_final_save_starts_early_enough_for_a_write_in_flight_and_its_own():
    """8B ZeRO-3 at 100 MB/s (964 s a checkpoint) with --async_save: the final save waits for the background write in
    flight (up to a whole checkpoint) and then writes its own; a background save counts from its start to its
    publication (llmft.training.job_deadline.time_each_save), not the 0.3 s it held training."""
    d = JobDeadline("42", estimate_s=964.0, query=FakeSlurm(None), async_save=True)
    assert d.lead(0) == 1.5 * 2 * 964 + 60  # 2952 s; synchronous saves: 1,506 s
    d.record_save(970.0)  # the background save, written and published 970 s after it started
    assert d.lead(0) == 1.5 * 2 * 970 + 60
    assert final_save_lead(970.0, None, 1.0) == 1.5 * 970 + 1 + 60  # without --async_save: one save

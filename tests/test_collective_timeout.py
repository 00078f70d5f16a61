"""The collective timeout sized from the run's measured step and save times (llmft.planning.collective_timeout), and
set on every process group (llmft.training.process_group_timeout)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from llmft.planning.collective_timeout import FLOOR_S, SAVE_FACTOR, STARTUP_S, STEP_FACTOR, collective_timeout


def seconds(*args, **kwargs) -> float:
    return collective_timeout(*args, **kwargs)[0]


def test_before_anything_is_measured_the_start_up_value_holds():
    assert collective_timeout(None, None) == (STARTUP_S, "start-up, nothing measured yet")
    assert STARTUP_S == 1800  # transformers' --ddp_timeout default
    # an earlier attempt's save (the requeued job) longer than half the start-up value raises it from the start
    assert collective_timeout(None, 1200.0) == (2400.0, "start-up: 2 x the longest save 1200.0 s")


def test_measured_steps_bring_it_down_to_the_floor_or_a_multiple_of_the_step():
    assert collective_timeout(2.0, None) == (FLOOR_S, "at least 300 s")  # fast steps: the floor, not 40 s
    assert FLOOR_S == 300
    assert collective_timeout(30.0, None) == (STEP_FACTOR * 30.0, "20 x the median step 30.00 s")


def test_never_shorter_than_twice_the_longest_save():
    # the 8B ZeRO-3 checkpoint llmft plan puts at 964 s on 100 MB/s Filestore, after 10 s steps
    assert collective_timeout(10.0, 964.0) == (SAVE_FACTOR * 964.0, "2 x the longest save 964.0 s")
    for step in (None, 0.5, 2.0, 60.0):
        for save in (0.1, 400.0, 30.0, 5000.0):
            for saving in (False, True):
                assert seconds(step, save, saving=saving) >= SAVE_FACTOR * save


def test_a_first_save_gets_the_planner_estimate_or_the_start_up_value():
    assert collective_timeout(2.0, None, 30.0, saving=True) == (
        STARTUP_S,
        "a first save, not measured yet: the start-up value",
    )
    # a save the planner puts at 1,500 s (say 70B on 100 MB/s): 2 x that, beyond the start-up value
    assert collective_timeout(2.0, None, 1500.0, saving=True) == (
        3000.0,
        "a first save: 2 x the planner's estimate 1500 s",
    )
    # once measured, a save gets the longer of the measurement and the estimate (an --async_save save also waits
    # out the previous background write, which its measurement leaves out); between saves only the measurement counts
    assert collective_timeout(2.0, 50.0, 1500.0, saving=True) == (
        3000.0,
        "2 x the planner's estimate of a save 1500.0 s",
    )
    assert collective_timeout(2.0, 400.0, 100.0, saving=True) == (800.0, "2 x the longest save 400.0 s")
    assert seconds(2.0, 50.0, 1500.0) == FLOOR_S


def test_every_process_group_of_the_rank_gets_the_timeout(tmp_path):
    """A real gloo process group and a second group (as DeepSpeed makes): both report the new timeout back."""
    script = tmp_path / "groups.py"
    script.write_text(
        textwrap.dedent(
            """
            from datetime import timedelta
            import torch
            import torch.distributed as dist
            from llmft.training.process_group_timeout import process_groups, set_timeout

            assert set_timeout(300) is None  # no process group yet: nothing set, and it says so
            dist.init_process_group("gloo", rank=0, world_size=1, timeout=timedelta(seconds=1800))
            dist.new_group([0])
            groups = process_groups()
            print(len(groups), set_timeout(300),
                  sorted(g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in groups))
            dist.destroy_process_group()
            """
        )
    )
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(20000 + os.getpid() % 9000))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "2 300.0 [300.0, 300.0]", out.stdout


@pytest.mark.parametrize(
    "argv, given, value",
    [([], False, 1800), (["--ddp_timeout", "7200"], True, 7200), (["--ddp_timeout", "1800"], True, 1800)],
)
def test_ddp_timeout_given_is_kept_and_not_given_is_sized(argv, given, value):
    from llmft.train import make_parser
    from llmft.training.flags import parse_train_flags

    parsed = parse_train_flags(make_parser(), ["--model_name_or_path", "m", "--dataset_name", "d", *argv])
    training, extra = parsed[1], parsed[3]
    assert (extra.ddp_timeout_given, training.ddp_timeout) == (given, value)


class Control:
    should_save = False


def drive(monkeypatch, **kwargs) -> tuple[object, list[str], list[float]]:
    """The callback with torch's setter replaced by a recorder (the real one is tested above and in test_async_save)."""
    from llmft.training import process_group_timeout as ct

    applied: list[float] = []
    monkeypatch.setattr(ct, "set_timeout", lambda s: applied.append(s) or s)
    lines: list[str] = []
    cb = ct.callback(lines.append, **kwargs)
    cb.on_train_begin(None, None, Control())
    return cb, lines, applied


def test_the_callback_lowers_after_five_steps_raises_for_a_save_and_resets_after_training(monkeypatch):
    cb, lines, applied = drive(monkeypatch, given_s=None, estimated_save_s=1500.0, longest_save_s=None)
    for _ in range(5):
        cb.on_step_end(None, None, Control())
    saving = Control()
    saving.should_save = True
    cb.on_step_end(None, None, saving)  # a first save: the planner's 1500 s, twice
    cb.save_measured(200.0)  # measured: back down to 2 x 200 s between saves
    cb.on_train_end(None, None, Control())
    assert lines == [
        "collective timeout 1800 s (start-up, nothing measured yet)",
        "collective timeout 300 s (at least 300 s)",
        "collective timeout 3000 s (a first save: 2 x the planner's estimate 1500 s)",
        "collective timeout 400 s (2 x the longest save 200.0 s)",
        "collective timeout 1800 s (after training)",
    ]
    assert applied == [1800.0, 300.0, 3000.0, 400.0, 1800.0]


def test_a_requeued_run_starts_from_the_save_an_earlier_attempt_measured(monkeypatch):
    _, lines, _ = drive(monkeypatch, given_s=None, estimated_save_s=10.0, longest_save_s=1200.0)
    assert lines == ["collective timeout 2400 s (start-up: 2 x the longest save 1200.0 s)"]


def test_ddp_timeout_given_is_set_on_every_group_never_changed_and_warned_when_shorter_than_a_save(monkeypatch):
    """Set once at the start (DeepSpeed's data-parallel groups were made with torch's 30-minute default, so a given
    --ddp_timeout 30 left a hung rank's peers waiting 30 minutes in ZeRO's all-reduce), then never changed."""
    cb, lines, applied = drive(monkeypatch, given_s=600, estimated_save_s=964.0, longest_save_s=None)
    for _ in range(10):
        cb.on_step_end(None, None, Control())
    cb.on_train_end(None, None, Control())
    assert applied == [600] and lines == [
        "collective timeout 600 s (--ddp_timeout, as given: not sized from the run); "
        "warning: shorter than 2 x a save (964 s), which may then time out"
    ]


def test_a_background_save_published_at_a_step_end_leaves_that_steps_time_as_it_was(monkeypatch):
    """An --async_save checkpoint is measured when it is published, at a step end while training went on: its time
    counts as a save (2 x 30 s is under the floor here), and the step that ended then keeps its own time; after a
    synchronous save the next step's time starts after the save."""
    from llmft.training import process_group_timeout as ct

    now = [0.0]
    monkeypatch.setattr(ct.time, "monotonic", lambda: now[0])
    cb, _, _ = drive(monkeypatch, given_s=None, estimated_save_s=10.0, longest_save_s=None)
    for _ in range(3):
        now[0] += 1.0
        cb.on_step_end(None, None, Control())
    now[0] += 1.0
    cb.save_measured(30.0, background=True)  # the publishing callback runs before this one at the step end
    cb.on_step_end(None, None, Control())
    now[0] += 40.0  # a synchronous save
    cb.save_measured(40.0)
    now[0] += 1.0
    cb.on_step_end(None, None, Control())
    assert cb.steps == [1.0] * 5 and cb.longest_save_s == 40.0

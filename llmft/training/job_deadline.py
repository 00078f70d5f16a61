"""The final save fits the job's time (the numbers: llmft.planning.final_save): a run inside a Slurm job starts its last checkpoint early enough to finish it.

Slurm's USR1 (`--signal=B:USR1@120` in slurm/run_llm.slurm) leaves 120 s; a Llama-3.1-8B ZeRO-3 checkpoint takes
964 s to write on a 100 MB/s Filestore (`llmft plan`). At the time limit Slurm sends SIGTERM and, KillWait later
(30 s by default), SIGKILL: a save still running then is lost, and a TIMEOUT job is not requeued. So the run reads
its job's time left from Slurm (`squeue -o %L`, again every JOB_END_POLL_S: a requeue restarts the run, and
`scontrol update TimeLimit=` moves the end), times each of its own saves (from the Trainer's save through the
callbacks that check and publish it), and stops for its final save once the time left is within
`final_save_lead`: FINAL_SAVE_FACTOR x the longest save measured (kept in SAVE_RECORD for the requeued job; before
any is measured: the planner's estimate, checkpoint bytes at llmft.memory's default write bandwidth) + the step in flight + FINAL_SAVE_MARGIN_S
for the processes to exit and the job to requeue itself. The ranks agree on the step through GracefulStop's
vote. The USR1 stays as a backstop. In a PBS job (PBS_JOBID, no squeue to ask) the job's end comes from the file
llmft.launch.pbs writes from `qstat -f` (PBS sends no warning before the walltime). Outside both nothing of this runs.

Only global rank 0 asks Slurm (one squeue a minute per job, not one per rank).

Test hooks (environment variables; tests only, each read here and nowhere else):
  LLMFT_TEST_TIME_LEFT_AT_STEP=K:S  at global step K the job's time left becomes S seconds (and runs down with the
                                   clock), whatever Slurm says; the ranks vote at step K. A run resumed past step K
                                   (the requeued job) never reaches it: Slurm's figure applies.
  LLMFT_TEST_SAVE_DELAY_S=S        every checkpoint save takes S seconds longer on rank 0, before it is published
                                   (a slow filesystem); with --async_save a background checkpoint's delay is in its
                                   background write.
  LLMFT_TEST_HOLD_AT_STEP=K        at global step K every rank waits (up to 600 s) until a stop is requested
                                   (signal or stop file), so a stop sent from outside lands at step K.
  LLMFT_TEST_SETUP_DELAY_S=S       (read by llmft.launch.pbs, the PBS job's launcher) the job's set-up takes S
                                   seconds longer before the job's end is written (a slow image unpack).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from pathlib import Path

from llmft.planning.final_save import (
    FINAL_SAVE_FACTOR,
    FINAL_SAVE_MARGIN_S,
    UNMEASURED_SAVE_S,
    final_save_due,
    final_save_lead,
    parse_time_left,
)

JOB_END_POLL_S = 60.0  # how often rank 0 asks Slurm again
HOLD_LIMIT_S = 600.0
SAVE_RECORD = "llmft_save_seconds.json"  # in --output_dir: a requeued attempt starts from the saves measured before


UNANSWERED = "unanswered"  # a source of the job's end that gave no answer this time (not: "no time limit")
JOB_END_FILE_ENV = "LLMFT_JOB_END_FILE"  # slurm/run_llm.slurm names the file it keeps the job's end in


def query_time_left(job_id: str, timeout: float = 10.0) -> float | None | str:
    """The Slurm job's time left in seconds, from squeue; None when Slurm says there is no limit (or the job is
    gone); UNANSWERED when squeue did not answer (absent, as in most containers, failed, rate-limited, timed out)."""
    try:
        proc = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%L"], capture_output=True, text=True, timeout=timeout
        )
    except (OSError, subprocess.SubprocessError):
        return UNANSWERED
    return parse_time_left(proc.stdout) if proc.returncode == 0 else UNANSWERED


def time_left_from_file(text: str, now_unix: float) -> float | None | str:
    """Seconds left from the job-end file slurm/run_llm.slurm writes: `<Unix time asked> <squeue %L then>`, so the
    answer is as right as squeue's was when the batch shell asked, however old the file (the end does not move
    unless `scontrol update TimeLimit=` moves it, and the shell asks again every JOB_END_POLL_S). None: no limit;
    UNANSWERED: no readable file."""
    parts = text.split(maxsplit=1)
    try:
        asked = float(parts[0])
    except (IndexError, ValueError):
        return UNANSWERED
    left = parse_time_left(parts[1]) if len(parts) == 2 else None
    return None if left is None else asked + left - now_unix


def read_job_end_file(path: str | Path | None, now_unix: float) -> float | None | str:
    """`time_left_from_file` of the file at `path` (UNANSWERED without one). Its directory is listed first: on NFS,
    opening a name another node just replaced (the shell renames a new file into place) can reach the old file
    through a cached lookup, and listing the directory revalidates it (as stop_file_present does)."""
    if not path:
        return UNANSWERED
    try:
        os.listdir(os.path.dirname(os.path.abspath(path)))
        return time_left_from_file(Path(path).read_text(), now_unix)
    except OSError:
        return UNANSWERED


def job_end(
    at: float, squeue: float | None | str, from_file: float | None | str, previous: float | None
) -> float | None:
    """The job's end on rank 0's clock, from the answers asked at `at`: squeue's when it answers (the freshest: a
    TimeLimit change shows at once), else the batch shell's file (in a container with no Slurm client squeue never
    answers; the file is at most one of the shell's polls old), else the last good answer: one failed or
    rate-limited poll must not turn the early final save off until the next one. None: the job has no limit."""
    for answer in (squeue, from_file):
        if answer != UNANSWERED:
            return None if answer is None else at + answer
    return previous


def _step_hook(name: str) -> tuple[int, float] | None:
    value = os.environ.get(name, "")
    m = re.fullmatch(r"(\d+)(?::(\d+(?:\.\d+)?))?", value)
    return (int(m.group(1)), float(m.group(2) or 0)) if m else None


def hold_step() -> int | None:
    """LLMFT_TEST_HOLD_AT_STEP (module docstring)."""
    hook = _step_hook("LLMFT_TEST_HOLD_AT_STEP")
    return hook[0] if hook else None


def save_delay_s() -> float:
    """LLMFT_TEST_SAVE_DELAY_S (module docstring); 0 without it."""
    try:
        return max(0.0, float(os.environ.get("LLMFT_TEST_SAVE_DELAY_S", "0")))
    except ValueError:
        return 0.0


def forced_vote_steps() -> set[int]:
    """Steps every rank votes at whatever the vote spacing: the test hooks' steps."""
    return {
        hook[0] for hook in (_step_hook("LLMFT_TEST_TIME_LEFT_AT_STEP"), _step_hook("LLMFT_TEST_HOLD_AT_STEP")) if hook
    }


class JobDeadline:
    """Rank 0's view of its Slurm job's end and of its own saves; `due` says when to stop for the final save."""

    def __init__(
        self,
        job_id: str,
        estimate_s: float | None,
        query=query_time_left,
        clock=time.monotonic,
        record: str | Path | None = None,
        background: bool = True,
        end_file: str | Path | None = None,
        wall_clock=time.time,
        async_save: bool = False,
    ):
        self.async_save = async_save  # --async_save: the final save may first wait out a background write
        self.scheduler = "Slurm"  # named in the lines it says; for_this_job sets PBS
        self.job_id, self.estimate_s, self.query, self.clock = job_id, estimate_s, query, clock
        self.end_file, self.wall_clock = end_file, wall_clock  # the batch shell's job-end file (JOB_END_FILE_ENV)
        self.background, self.poller = background, None  # background: re-read Slurm's answer in a thread
        self.record = Path(record) if record else None  # SAVE_RECORD: the longest save, kept across requeues
        self.longest_save_s: float | None = read_longest_save(self.record) if self.record else None
        self.end: float | None = None  # on self.clock; None: no limit known
        self.asked_at: float | None = None
        self.test_hook = _step_hook("LLMFT_TEST_TIME_LEFT_AT_STEP")
        self.hooked_end: float | None = None

    @classmethod
    def for_this_job(cls, estimate, output_dir: str | Path, async_save: bool = False) -> JobDeadline | None:
        """On global rank 0 of a Slurm job; None elsewhere (outside Slurm nothing changes). `estimate()`: the
        planner's save time, asked only here; the saves an earlier attempt of the run measured count too."""
        job = os.environ.get("SLURM_JOB_ID")
        pbs = not job and bool(os.environ.get("PBS_JOBID")) and bool(os.environ.get(JOB_END_FILE_ENV))
        if not (job or pbs) or os.environ.get("RANK", "0") != "0":
            return None
        deadline = cls(
            job or os.environ["PBS_JOBID"],
            estimate(),
            query=query_time_left if job else (lambda _job: UNANSWERED),  # PBS: the file llmft.launch.pbs keeps
            record=Path(output_dir) / SAVE_RECORD,
            end_file=os.environ.get(JOB_END_FILE_ENV),
            async_save=async_save,
        )
        deadline.scheduler = "Slurm" if job else "PBS"
        return deadline

    def time_left(self, step: int | None = None) -> float | None:
        """Seconds left of the job; `step`: the optimizer step just trained (None before training)."""
        now = self.clock()
        if self.test_hook and step == self.test_hook[0] and self.hooked_end is None:
            self.hooked_end = now + self.test_hook[1]
        if self.hooked_end is not None:
            return self.hooked_end - now
        if self.asked_at is None:  # the first answer is waited for (at the start of training)
            self._ask(now)
        elif now - self.asked_at >= JOB_END_POLL_S and (self.poller is None or not self.poller.is_alive()):
            # later ones in the background: a slow slurmctld must not stall rank 0, and with it every rank
            self.asked_at = now
            if self.background:
                self.poller = threading.Thread(target=self._ask, args=(now,), daemon=True)
                self.poller.start()
            else:
                self._ask(now)
        end = self.end
        return None if end is None else end - now

    def _ask(self, at: float) -> None:
        left = self.query(self.job_id)
        from_file = read_job_end_file(self.end_file, self.wall_clock()) if left == UNANSWERED else UNANSWERED
        self.asked_at = at
        self.end = job_end(at, left, from_file, self.end)

    def lead(self, step_s: float) -> float:
        return final_save_lead(self.longest_save_s, self.estimate_s, step_s, self.async_save)

    def due(self, step: int, step_s: float) -> str | None:
        """Why to stop now for the final save (one line), or None to train on."""
        left, lead = self.time_left(step), self.lead(step_s)
        if not final_save_due(left, lead):
            return None
        measured = (
            f"the longest save took {self.longest_save_s:.1f} s"
            if self.longest_save_s is not None
            else f"no save measured yet, estimated {UNMEASURED_SAVE_S if self.estimate_s is None else self.estimate_s:.0f} s"
        )
        return (
            f"{self.scheduler} job {self.job_id} ends in {max(left, 0):.0f} s: starting the final save now, {lead:.0f} s before "
            f"the time limit ({measured}; x{FINAL_SAVE_FACTOR:g}"
            f"{' x 2 (a background write may be in flight)' if self.async_save else ''}"
            f" + a {step_s:.1f} s step + {FINAL_SAVE_MARGIN_S:.0f} s)"
        )

    def record_save(self, seconds: float) -> None:
        self.longest_save_s = max(seconds, self.longest_save_s or 0.0)
        if self.record is not None:
            tmp = self.record.with_name(f".{self.record.name}.tmp{os.getpid()}")
            tmp.write_text(
                json.dumps(
                    {"longest_save_seconds": round(self.longest_save_s, 3), "last_save_seconds": round(seconds, 3)}
                )
                + "\n"
            )
            os.replace(tmp, self.record)


def read_longest_save(path: Path) -> float | None:
    """The longest save an earlier attempt of this run measured (SAVE_RECORD), or None."""
    try:
        value = json.loads(path.read_text()).get("longest_save_seconds")
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) and value >= 0 else None


def parameter_counts(model) -> tuple[int, int]:
    """(all, trainable) parameters of a possibly ZeRO-3-partitioned model (ds_numel is a partition's real size)."""
    total = trainable = 0
    for p in model.parameters():
        n = int(getattr(p, "ds_numel", 0) or p.numel())
        total += n
        trainable += n if p.requires_grad else 0
    return total, trainable


def time_each_save(trainer, deadline: JobDeadline | None, log, timeout=None, publish=None) -> None:
    """Time every checkpoint save, from the Trainer's _save_checkpoint until it is published: the end of the on_save
    callbacks that check, publish and rotate it (rank 0 ends after the barrier every rank reaches once its files are
    written), or, for a checkpoint written in the background (--async_save: `publish.pending` after on_save), the
    step end at which every rank's writes had finished and it was published (`publish.on_written`). The end of on_save
    alone would time only the host snapshot (0.3 s on an H100 for a 15 GB checkpoint), and the deadline would then
    start a 964 s final save a minute before the time limit. Each time is logged and given to the deadline (rank 0 of
    a Slurm job) and to the collective timeout (every rank)."""
    save, on_save = trainer._save_checkpoint, trainer.callback_handler.on_save
    started: list[float] = []
    in_background: dict[str, float] = {}  # checkpoint directory -> when its save started

    def record(seconds: float, name: str, background: bool = False) -> None:
        if timeout is not None:
            timeout.save_measured(seconds, background)
        line = f"{name} written and published in {seconds:.1f} s{' (written in the background)' if background else ''}"
        if deadline is not None:
            deadline.record_save(seconds)
            line += (
                f"; the final save now starts {deadline.lead(0):.0f} s before the job's time limit "
                f"({FINAL_SAVE_FACTOR:g} x the longest save, {deadline.longest_save_s:.1f} s"
                f"{', x 2 for a background write in flight' if deadline.async_save else ''}"
                f", + {FINAL_SAVE_MARGIN_S:.0f} s + a step)"
            )
        log(line)

    def timed_save(*args, **kwargs):
        started[:] = [time.monotonic()]
        return save(*args, **kwargs)

    def timed_on_save(*args, **kwargs):
        out = on_save(*args, **kwargs)
        if started:
            begun = started.pop()
            if publish is not None and publish.pending is not None:
                in_background[str(publish.pending)] = begun  # timed when it is published
            else:
                record(time.monotonic() - begun, f"checkpoint-{trainer.state.global_step}")
        return out

    def written(ckpt) -> None:
        begun = in_background.pop(str(ckpt), None)
        if begun is not None:
            record(time.monotonic() - begun, Path(ckpt).name, background=True)

    trainer._save_checkpoint = timed_save
    trainer.callback_handler.on_save = timed_on_save
    if publish is not None:
        publish.on_written = written


def ask_for_requeue(reason: str) -> None:
    """Tell slurm/run_llm.slurm (its $LLMFT_REQUEUE_FILE) that the run stopped for the time limit and wants the job
    requeued once it has exited; without the script nothing is written (the checkpoint is all a rerun needs)."""
    path = os.environ.get("LLMFT_REQUEUE_FILE")
    if path:
        with open(path, "w") as f:
            f.write(reason + "\n")

"""Trainer callbacks that make a run safe to stop and to resume: complete checkpoints only, and a stop every rank
agrees on (SIGUSR1/SIGTERM from Slurm, or a stop file), plus the check that --torch_compile took effect."""

from __future__ import annotations

import atexit
import functools
import multiprocessing
import os
import signal
import time
from pathlib import Path

from llmft.checkpoint import run_dir
from llmft.errors import TrainError
from llmft.planning.world import log
from llmft.training import checkpoint_checks, job_deadline

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


STOP_VOTE_MAX_DELAY_S = 0.5


def steps_between_stop_votes(seconds: float, steps: int, max_delay_s: float = STOP_VOTE_MAX_DELAY_S) -> int:
    """How many optimizer steps until the ranks next vote on stopping, from the time the last `steps` took.

    Every rank must stop at the same step, so a stop request is voted on with an all-reduce; on every step that is a
    collective and a host sync that costs a fast step 1-2% (bench/README.md, bench_overhead). Voting every k steps,
    with k steps taking at most `max_delay_s`, bounds how much later a stop starts saving (against the 120 s the
    Slurm script leaves before the time limit) and keeps a vote per step wherever a step takes longer."""
    if steps <= 0 or seconds <= 0:
        return 1
    return max(1, min(1000, int(max_delay_s * steps / seconds)))


def stop_file_present(path: str | None) -> bool:
    """Whether the stop file exists, as this node sees it now. Every rank looks (rank 0 may be on another node than the
    batch shell that wrote it) and the vote merges the answers. Listing the directory, rather than a stat of the name:
    an NFS client that cached the name as missing can answer a stat from that cache for up to acdirmax (60 s), while
    opening the directory revalidates it (close-to-open consistency)."""
    if not path:
        return False
    parent, name = os.path.split(os.path.abspath(path))
    try:
        return name in os.listdir(parent)
    except OSError:
        return False


def worker_ignores_stop_signals(init_fn, worker_id: int) -> None:
    """A DataLoader worker leaves SIGTERM/SIGUSR1 to its rank. Slurm signals every process of a step (a requeue,
    preemption, `scancel`), and a worker killed by it ends the rank with "DataLoader worker ... is killed by signal"
    before the stop's checkpoint is written. The rank shuts its workers down itself; they exit when it dies."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if init_fn is not None:
        init_fn(worker_id)


def kill_leftover_workers() -> None:
    """At the rank's exit, SIGKILL the DataLoader workers still alive. They ignore SIGTERM (above), and SIGTERM is what
    multiprocessing sends them at exit before an unbounded join (a run stopped mid-epoch still holds its iterator
    then), and what torch sends a worker that did not stop on request (pytorch#39570): the rank would never exit
    (seen: a 2-node Slurm job held at torchrun's exit barrier after its stop checkpoint). Daemonic children are
    ended at exit anyway; this only makes it certain."""
    workers = [child for child in multiprocessing.active_children() if child.daemon]
    if not workers:
        return
    # torch's SIGCHLD handler would raise "DataLoader worker ... killed" for workers of a live iterator (a run
    # stopped mid-epoch keeps one until exit, when torch no longer shuts workers down itself)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in workers:
        child.kill()
    for child in workers:
        child.join(timeout=5)


def all_ranks_max(*values: int, device) -> list[int]:
    """The element-wise maximum over every rank (the values themselves outside a process group)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return list(values)
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def checkpoint_callbacks():
    """The two callback classes, defined lazily so importing llmft.train stays cheap (no transformers, no torch)."""
    import torch.distributed as dist
    from transformers import TrainerCallback

    return _publish_complete_checkpoint_class(TrainerCallback, dist), _graceful_stop_class(TrainerCallback)


def _publish_complete_checkpoint_class(TrainerCallback, dist):
    class PublishCompleteCheckpoint(TrainerCallback):
        """After every rank has written its shard and the saved weights hold the model, publish checkpoint-N/llmft_complete.json.

        Weights that do not (empty, missing tensors, zeros): no marker, training stops, `refused` says why.
        With --async_save (`make_writer` set: llmft.training.checkpoint_async_save), a checkpoint whose files some rank is still
        writing is published at the first step end at which every rank's writes have finished, or at the end of training.
        """

        def __init__(self, zero_stage: int, batch, keep: int | None = None, make_writer=None):
            self.zero_stage, self.batch, self.keep = zero_stage, batch, keep  # keep: --save_total_limit
            self.make_writer = make_writer
            self.refused: str | None = None
            self.writer = None  # llmft.training.checkpoint_async_save.BackgroundWriter, installed once the DeepSpeed engine exists
            self.pending: Path | None = None  # a checkpoint whose files are being written in the background
            self.on_written = None  # called with a background checkpoint once published (job_deadline.time_each_save)

        def on_train_begin(self, args, state, control, **kwargs):
            if self.make_writer is not None and self.writer is None:
                self.writer = self.make_writer()

        def on_save(self, args, state, control, model=None, **kwargs):
            ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            in_background = self.writer is not None and not self.writer.synchronous()  # its delay is the writer's
            if state.is_world_process_zero and job_deadline.save_delay_s() and not in_background:
                time.sleep(job_deadline.save_delay_s())  # a test hook: a slow filesystem
            if self.pending is not None:  # every rank waited for its writes before this save (BackgroundWriter.create)
                self._publish_written(args, state, control)
            bad = checkpoint_checks.check_save(ckpt, model, state.is_world_process_zero)
            writing = self.writer is not None and self.writer.busy()
            refuse, in_flight = all_ranks_max(int(bool(bad)), int(writing), device=args.device)
            if refuse:
                self.refused = f"{ckpt} not published as complete: {'; '.join(bad) or 'see rank 0'}"
                control.should_training_stop = True
            elif in_flight:
                self.pending = ckpt
            else:
                self._publish(ckpt, args, state)

        def on_step_end(self, args, state, control, **kwargs):
            if self.pending is not None:
                (busy,) = all_ranks_max(int(self.writer.busy()), device=args.device)
                if not busy:
                    self._publish_written(args, state, control)

        def on_train_end(self, args, state, control, **kwargs):
            if self.writer is not None:
                self.writer.synchronous = lambda: (
                    True
                )  # the final save_model (ZeRO-3 shards) is on disk when it returns
                self.writer.wait()
                if self.pending is not None:
                    self._publish_written(args, state, control)

        def _publish_written(self, args, state, control):
            """Publish the pending checkpoint, whose background writes have finished on every rank, unless one failed."""
            ckpt, self.pending = self.pending, None
            (failed,) = all_ranks_max(int(self.writer.failure() is not None), device=args.device)
            if failed:
                self.refused = (
                    f"{ckpt} not published as complete: {self.writer.failure() or 'a write failed on another rank'}"
                )
                control.should_training_stop = True
            else:
                self._publish(ckpt, args, state)
                if self.on_written is not None:
                    self.on_written(ckpt)

        def _publish(self, ckpt: Path, args, state):
            report = run_dir.rank_report(ckpt, args.process_index)  # what this rank wrote, as its node sees it
            reports = [report]
            if dist.is_initialized():
                reports = [None] * dist.get_world_size()
                dist.all_gather_object(reports, report)  # also the barrier: every rank has finished saving
            if state.is_world_process_zero:
                if run_dir.mark_complete(ckpt, args.world_size, self.zero_stage, reports, self.batch):
                    log(f"saved complete checkpoint {ckpt}")
                    # --save_total_limit, applied here (the Trainer gets None): only now is the new one complete
                    for gone in run_dir.rotate(args.output_dir, self.keep, state.best_model_checkpoint):
                        log(f"deleted {gone.name} (--save_total_limit {self.keep} counts complete checkpoints only)")
                else:
                    empty = [r for r, files in enumerate(reports) if not files]
                    why = (
                        f"rank(s) {empty} reported no files"
                        if empty
                        else "; ".join(run_dir.missing_rank_files(reports, self.zero_stage))
                    )
                    log(f"warning: not marking {ckpt} complete: {why}")
            if dist.is_initialized():
                dist.barrier()

    return PublishCompleteCheckpoint


def _graceful_stop_class(TrainerCallback):
    class GracefulStop(TrainerCallback):
        """On SIGUSR1/SIGTERM or when the stop file appears: finish this step, save, stop (for preemption).

        The ranks vote at the first step, then every steps_between_stop_votes steps; the vote carries each rank's
        proposal for the next interval and all take the smallest, so every rank votes (and stops) at the same step."""

        def __init__(self, stop_file: str | None, deadline=None):
            self.stop_file = stop_file
            self.deadline = deadline  # llmft.training.job_deadline.JobDeadline on rank 0 of a Slurm job, else None
            self.requested = False
            self.stopped_at: int | None = None
            self.for_time_limit = False  # stopped for the final save before the job's time limit
            self.forced_votes = job_deadline.forced_vote_steps()  # test hooks' steps
            self.hold_at = job_deadline.hold_step()
            self.next_vote: int | None = None  # the global step of the next vote; None: at the next step
            self.last_vote: tuple[int, float] | None = None  # (global step, time) of the last vote

        def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
            for sig in STOP_SIGNALS:
                signal.signal(sig, self._request)
            atexit.unregister(
                kill_leftover_workers
            )  # once, and after multiprocessing's own exit hook so it runs first
            atexit.register(kill_leftover_workers)
            # accelerate's DataLoaderShard wraps the torch DataLoader that forks the workers (per epoch, after this);
            # under sequence parallelism DeepSpeed's UlyssesSPDataLoaderAdapter wraps that (its `dl`)
            loader = getattr(train_dataloader, "dl", train_dataloader)
            loader = getattr(loader, "base_dataloader", loader)
            if loader is not None and loader.num_workers > 0:
                loader.worker_init_fn = functools.partial(worker_ignores_stop_signals, loader.worker_init_fn)
            if self.deadline is not None:
                left = self.deadline.time_left()
                log(
                    f"{self.deadline.scheduler} job {self.deadline.job_id} "
                    + (
                        "has no time limit llmft can read: no early final save"
                        if left is None
                        else f"ends in {left:.0f} s; the final save starts {self.deadline.lead(0):.0f} s "
                        "before that ("
                        + (
                            f"the longest save so far took {self.deadline.longest_save_s:.1f} s"
                            if self.deadline.longest_save_s is not None
                            else "estimated"
                        )
                        + "; re-measured at each save)"
                    )
                )

        def _hold(self, step: int) -> None:
            """LLMFT_TEST_HOLD_AT_STEP: wait here until a stop is requested (bounded)."""
            until = time.monotonic() + job_deadline.HOLD_LIMIT_S
            while not (self.requested or stop_file_present(self.stop_file)) and time.monotonic() < until:
                time.sleep(0.2)

        def _request(self, signum, frame):
            self.requested = True

        def on_step_end(self, args, state, control, **kwargs):
            step, now = state.global_step, time.monotonic()
            if self.next_vote is not None and step < self.next_vote and step not in self.forced_votes:
                return
            if step == self.hold_at:
                self._hold(step)
            interval, step_s = 1, 0.0
            if self.last_vote is not None and step > self.last_vote[0]:
                interval = steps_between_stop_votes(now - self.last_vote[1], step - self.last_vote[0])
                step_s = (now - self.last_vote[1]) / (step - self.last_vote[0])
            asked = self.requested or stop_file_present(self.stop_file)
            late = self.deadline.due(step, step_s) if self.deadline is not None and not asked else None
            stop, smallest = all_ranks_max(
                int(asked or bool(late)), -interval, device=args.device
            )  # max of -interval: the smallest
            self.next_vote, self.last_vote = step - smallest, (step, now)
            if stop and step < state.max_steps:
                control.should_save = True
                control.should_training_stop = True
                self.stopped_at = state.global_step
                if late:
                    self.for_time_limit = True
                    log(late)
                    job_deadline.ask_for_requeue(late)

    return GracefulStop


def compile_report(trainer):
    """A callback that says, when training starts, whether --torch_compile took effect: accelerate compiles the
    DeepSpeed engine's module (DeepSpeedEngine.compile), and the first steps then pay the compilation (26 s for
    the demo model on 2 CPU cores, bench/bench_compile.py; again when batch shapes change). Requested but not applied: an error."""
    from transformers import TrainerCallback

    class CompileReport(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if not args.torch_compile:
                return
            engine = trainer.model_wrapped
            if not getattr(engine, "is_compiled", False):
                raise TrainError(
                    f"--torch_compile was not applied to the model ({type(engine).__name__}): "
                    "use accelerate and DeepSpeed versions that compile DeepSpeed engines, or drop --torch_compile"
                )
            mode = args.torch_compile_mode or "default"
            log(
                f"torch.compile on (backend {args.torch_compile_backend or 'inductor'}, mode {mode}): "
                "the first steps compile, and steps whose batch shapes are new may compile again"
            )

    return CompileReport()

"""Checkpoint bookkeeping: which checkpoints are complete, which one to resume from, and when a run is done.

HF's Trainer writes `checkpoint-N/` in place, each rank its own ZeRO shard. A job killed while
saving leaves a directory that looks like a checkpoint but lacks shards. llmft therefore publishes
`checkpoint-N/llmft_complete.json` last, after every rank has finished writing, listing each file
and its size; only checkpoints with a matching marker are resumed from.

The list comes from the ranks themselves: each rank reports the files it wrote, as its own node
sees them (`rank_report`), and rank 0 merges the reports. Rank 0's own listing of a network
filesystem (NFS attribute caches, Lustre) can lag behind what other nodes just wrote: a shard it
cannot see yet would be left out of the marker, and its absence later would go unnoticed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

from llmft.errors import LlmftError

COMPLETE_MARKER = "llmft_complete.json"
DONE_MARKER = "llmft_done.json"
RUN_RECORD = "llmft_run.json"  # what defines the run (llmft.training.run_identity): present in every run llmft started
_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")


class CheckpointError(LlmftError, ValueError):
    """A checkpoint that cannot be resumed from; the message says which and why."""


def _write_json_atomic(path: Path, payload: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)


def checkpoint_dirs(output_dir: str | Path) -> list[tuple[int, Path]]:
    """All `checkpoint-N` directories under output_dir, oldest step first."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out.iterdir() if p.is_dir() and (m := _CKPT_RE.match(p.name))]
    return sorted(found)


# Files one rank writes for itself: DeepSpeed's ZeRO shards (named by data-parallel rank, which is the
# global rank without model/pipeline parallelism) and the Trainer's per-process RNG state.
_RANK_FILE_RES = (
    re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_(?:optim|model)_states\.pt$"),
    re.compile(r"^rng_state_(\d+)\.pth$"),
)


def owner_rank(relpath: str) -> int:
    """The rank that writes this checkpoint file: the rank in a per-rank file's name, else rank 0."""
    name = Path(relpath).name
    for pattern in _RANK_FILE_RES:
        m = pattern.match(name)
        if m:
            return int(m.group(1))
    return 0


def _listing(ckpt: Path) -> dict[str, int]:
    files = {}
    for p in sorted(ckpt.rglob("*")):
        if p.name == COMPLETE_MARKER or p.name.startswith("."):
            continue
        try:
            if p.is_file():
                files[str(p.relative_to(ckpt))] = p.stat().st_size
        except FileNotFoundError:  # another rank's temporary file, renamed away while we listed
            continue
    return files


def rank_report(ckpt_dir: str | Path, rank: int) -> dict[str, int]:
    """The files this rank wrote into the checkpoint and their sizes, as this rank's node sees them.

    A writer always sees its own closed files, so the report is exact even where other nodes' files are
    not visible here yet.
    """
    return {rel: size for rel, size in _listing(Path(ckpt_dir)).items() if owner_rank(rel) == rank}


def _rank_template(relpath: str) -> str | None:
    """A per-rank file's path with its rank replaced by `{rank}`; None for a file rank 0 writes for everyone."""
    parent, name = os.path.split(relpath)
    for pattern in _RANK_FILE_RES:
        m = pattern.match(name)
        if m:
            name = name[: m.start(1)] + "{rank}" + name[m.end(1) :]
            return f"{parent}/{name}" if parent else name
    return None


def missing_rank_files(reports: list[dict[str, int]], zero_stage: int | None) -> list[str]:
    """The files some rank should have reported and did not, as `rank R: what` (empty: none missing).

    A rank that reported some files is not thereby complete: a background write that failed (or a rank killed
    between two files) leaves it with, say, its RNG state but not its optimizer shard. What each rank writes is
    derived, not listed per case: (1) DeepSpeed's ZeRO layout: every data-parallel rank writes its own
    `zero_pp_rank_R_mp_rank_*_optim_states.pt` under ZeRO 1-3, and its own `..._model_states.pt` under ZeRO-3
    (below 3, rank 0's mp_rank_00_model_states.pt holds the whole module); (2) symmetry: a per-rank file that one
    rank wrote (its rank in the name), every rank writes with its own rank in that place (the Trainer's
    rng_state_R.pth, the shards in the same tag directory, a bf16_ prefix)."""
    stage = zero_stage or 0
    kinds = [("optim_states", stage >= 1), ("model_states", stage >= 3)]
    templates = sorted({t for report in reports for rel in report if (t := _rank_template(rel)) is not None})
    missing = []
    for rank, report in enumerate(reports):
        names, absent = {Path(rel).name for rel in report}, []
        for kind, needed in kinds:
            shard = re.compile(rf"^(?:bf16_)?zero_pp_rank_{rank}_mp_rank_\d+_{kind}\.pt$")
            if needed and not any(shard.match(name) for name in names):
                absent.append(shard)  # said once, not again as the other ranks' same file
                missing.append(f"rank {rank}: its ZeRO-{stage} {kind} shard (zero_pp_rank_{rank}_*_{kind}.pt)")
        for template in templates:
            rel = template.format(rank=rank)
            if rel not in report and not any(shard.match(Path(rel).name) for shard in absent):
                missing.append(f"rank {rank}: {rel}")
    return missing


def mark_complete(
    ckpt_dir: str | Path,
    world_size: int,
    zero_stage: int | None = None,
    reports: list[dict[str, int]] | None = None,
    batch=None,
) -> Path | None:
    """Publish the completeness marker; call on one rank after all ranks finished saving.

    `reports[r]` is rank r's `rank_report`; the marker lists their union. Without reports (a world of one)
    this process's own listing is the writer's view, published as listed. Returns None, publishing nothing, when
    a report is short of what its rank writes (`missing_rank_files`; a rank of a multi-rank run that reported
    nothing among them): the checkpoint must not pass as complete.
    `batch` (a llmft.planning.batch.BatchPlan) is recorded so a resume on another world keeps the global batch.
    """
    ckpt = Path(ckpt_dir)
    if reports is None:
        reports = [_listing(ckpt)]
    elif (
        len(reports) != world_size or (world_size > 1 and not all(reports)) or missing_rank_files(reports, zero_stage)
    ):
        return None
    files: dict[str, int] = {}
    for report in reports:
        files.update(report)
    marker = ckpt / COMPLETE_MARKER
    payload = {
        "world_size": world_size,
        "zero_stage": zero_stage,
        "saved_at": time.time(),
        "files": dict(sorted(files.items())),
        "reported_by_rank": {str(r): sorted(report) for r, report in enumerate(reports)},
    }
    if batch is not None:
        payload["batch"] = {
            "micro_batch": batch.micro_batch,
            "grad_accum": batch.grad_accum,
            "world_size": batch.world_size,
        }
    _write_json_atomic(marker, payload)
    return marker


def incomplete_reason(ckpt_dir: str | Path) -> str | None:
    """None if the checkpoint is complete, else why not (missing marker, or a listed file missing/truncated)."""
    ckpt = Path(ckpt_dir)
    marker = ckpt / COMPLETE_MARKER
    if not marker.is_file():
        return f"{ckpt} has no {COMPLETE_MARKER}: it was interrupted while saving"
    try:
        files = json.loads(marker.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return f"{marker} is unreadable"
    for rel, size in files.items():
        p = ckpt / rel
        if not p.is_file():
            return f"{ckpt} is missing {rel}"
        if p.stat().st_size != size:
            return f"{ckpt}/{rel} has {p.stat().st_size} bytes, {size} were written"
    return None


def choose_checkpoint(output_dir: str | Path, *, unmarked_ok: bool = False) -> tuple[Path | None, list[str]]:
    """The one answer to "which checkpoint of this run" (training resume, inference, the demo all ask it).

    Returns the newest complete checkpoint-N (None if there is none) and one note per newer checkpoint
    skipped, saying why. unmarked_ok: for a run written without llmft (no run record, no checkpoint with a
    marker, e.g. a plain HF Trainer run), the newest checkpoint-N is taken as it is.
    """
    found = checkpoint_dirs(output_dir)
    foreign = not (Path(output_dir) / RUN_RECORD).exists() and not any(
        (p / COMPLETE_MARKER).exists() for _, p in found
    )
    if unmarked_ok and found and foreign:
        return found[-1][1], []
    notes = []
    for _, path in reversed(found):
        reason = incomplete_reason(path)
        if reason is None:
            return path, notes
        notes.append(f"skipping {reason}")
    return None, notes


def latest_complete(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint, skipping any a crash left half-written."""
    return choose_checkpoint(output_dir)[0]


def tag_dir(ckpt_dir: str | Path) -> Path | None:
    """The DeepSpeed tag directory (global_stepN) inside a checkpoint: the one its `latest` file names, else the
    highest step; None when there is none. A `latest` naming a missing directory is an error."""
    ckpt = Path(ckpt_dir)
    latest = ckpt / "latest"
    if latest.is_file():
        tag = latest.read_text().strip()
        if not (ckpt / tag).is_dir():
            raise CheckpointError(
                f"{latest} names {tag!r}, which is not in {ckpt}: pass the global_stepN directory you want"
            )
        return ckpt / tag
    tags = [
        (int(m.group(1)), p) for p in ckpt.glob("global_step*") if p.is_dir() and (m := re.search(r"(\d+)$", p.name))
    ]
    return max(tags)[1] if tags else None


def resolve_resume(output_dir: str | Path, requested: str | None) -> Path | None:
    """What to resume from.

    - None: the newest complete checkpoint in output_dir, if any (a rerun continues, it never overwrites).
    - "latest": the same, but it is an error when there is none.
    - a path: that checkpoint, which must be complete.
    """
    if requested in (None, "", "latest"):
        found, _ = choose_checkpoint(output_dir)
        if found is None and requested == "latest":
            raise CheckpointError(f"--resume_from_checkpoint latest: no complete checkpoint in {output_dir}")
        return found
    path = Path(requested)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} not found; pass a checkpoint-N directory or 'latest'")
    reason = incomplete_reason(path)
    if reason:
        earlier = latest_complete(path.parent)
        hint = f"resume from {earlier} instead" if earlier else "start without --resume_from_checkpoint"
        raise CheckpointError(f"cannot resume: {reason}; {hint}")
    return path


def nothing_left_to_train(
    output_dir: str | Path, resume: Path | None, max_steps: int, num_train_epochs: float | None = None
) -> str | None:
    """Whether resuming `resume` would train nothing: None to train on; else the one line to print.

    transformers' loop takes one more step before it looks at max_steps, so a run resumed at its last step (a job
    requeued or resubmitted after it had finished, on any number of GPUs) would train step max_steps + 1 and
    overwrite the finished model. A finished run (llmft_done.json at that step) says so and trains nothing; one whose
    final save was cut off raises CheckpointError naming the way to its model.

    An epochs-only run (max_steps <= 0) ends at the step count the Trainer computed and saved in the checkpoint's
    trainer_state.json, as long as --num_train_epochs is the one it was computed for (the run identity keeps the data
    and the global batch). Resumed there, the Trainer trains no step, but the final save and run_summary.json would
    be written again over the finished run's: a finished run says so instead; one whose final save was cut off
    trains on, which writes that save."""
    if resume is None:
        return None
    match = _CKPT_RE.match(Path(resume).name)
    step = int(match.group(1)) if match else None
    if step is None:
        return None
    by_epochs = max_steps is None or max_steps <= 0
    flag, limit = "--max_steps", f"--max_steps {max_steps}"
    if by_epochs:
        try:
            state = json.loads((Path(resume) / "trainer_state.json").read_text())
        except (OSError, ValueError):
            return None
        planned, epochs = state.get("max_steps"), state.get("num_train_epochs")
        if num_train_epochs is None or not isinstance(planned, int) or planned <= 0 or epochs != num_train_epochs:
            return None
        max_steps, flag, limit = (
            planned,
            "--num_train_epochs",
            f"--num_train_epochs {num_train_epochs:g}, {planned} steps",
        )
    if step < max_steps:
        return None
    try:
        done = json.loads((Path(output_dir) / DONE_MARKER).read_text()).get("global_step")
    except (OSError, ValueError, AttributeError):
        done = None
    if isinstance(done, int) and done >= step:
        return f"{output_dir} is already complete at step {done} ({limit}): nothing to train; raise {flag} to train further"
    if by_epochs:
        return None
    raise CheckpointError(
        f"{resume} already reached {limit}, but the run's final save did not finish: "
        f"write its model with `llmft export {resume} --out DIR`, or raise --max_steps to train further"
    )


def mark_done(output_dir: str | Path, global_step: int) -> Path:
    """Record that training ran to its last step (a preempted run has no such file)."""
    path = Path(output_dir) / DONE_MARKER
    _write_json_atomic(path, {"global_step": global_step, "finished_at": time.time()})
    return path


INCOMPLETE_DIR = "incomplete"  # where a rerun moves the checkpoints a killed save left without their marker


def steps_to_delete(complete_steps: list[int], keep: int | None, protected: set[int] = frozenset()) -> list[int]:
    """Which complete checkpoints --save_total_limit `keep` deletes: the oldest beyond the newest `keep`, never a
    protected one (the best model's). Only complete checkpoints are counted: an incomplete one is worth nothing to
    resume, so counting it could delete the last good one (issue 21). None or <= 0: keep all, as transformers does."""
    if not keep or keep <= 0:
        return []
    steps = sorted(complete_steps)
    if not steps:
        return []
    must = {steps[-1]} | (set(protected) & set(steps))  # the newest and the best, as transformers keeps them
    room = max(keep, len(must)) - len(must)
    kept = must | set([s for s in reversed(steps) if s not in must][:room])
    return [s for s in steps if s not in kept]


def rotate(output_dir: str | Path, keep: int | None, protected: str | Path | None = None) -> list[Path]:
    """Apply --save_total_limit after a checkpoint was published complete (rank 0, every rank's files written).

    The marker goes first, so a deletion cut off midway leaves a checkpoint that is plainly incomplete."""
    complete = {step: path for step, path in checkpoint_dirs(output_dir) if incomplete_reason(path) is None}
    protected_steps = {s for s, p in complete.items() if protected and Path(protected).resolve() == p.resolve()}
    deleted = []
    for step in steps_to_delete(list(complete), keep, protected_steps):
        path = complete[step]
        (path / COMPLETE_MARKER).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
        deleted.append(path)
    return deleted


def set_aside_incomplete(output_dir: str | Path) -> list[str]:
    """Move every checkpoint-N without a valid marker to <output_dir>/incomplete/checkpoint-N (replacing an older
    copy there); one line per checkpoint, to print. Run on rank 0 of a run about to train in its own directory: a
    save would otherwise write into the stale directory, and rotation must not see it. Not resumed from either way."""
    lines = []
    if not (Path(output_dir) / RUN_RECORD).is_file():  # checkpoints llmft did not write are not its to move
        return lines
    for _, path in checkpoint_dirs(output_dir):
        reason = incomplete_reason(path)
        if reason is None:
            continue
        target = Path(output_dir) / INCOMPLETE_DIR / path.name
        target.parent.mkdir(exist_ok=True)
        if target.exists():
            shutil.rmtree(target)
        os.replace(path, target)
        lines.append(
            f"moved {path.name} aside to {target}: {reason.replace(str(path), path.name)}; "
            "never resumed from, delete it to free its space"
        )
    return lines

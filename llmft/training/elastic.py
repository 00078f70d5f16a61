"""Elastic resume: continue a ZeRO checkpoint on another number of ranks, through DeepSpeed's universal checkpoint.

DeepSpeed loads ZeRO-1/2/3 shards only onto as many ranks as wrote them. Its universal checkpoint
format (`deepspeed/checkpoint/ds_to_universal.py`) stores every parameter's fp32 weights and Adam
moments whole, and the engine's `"checkpoint": {"load_universal": true}` option partitions them for
whatever world loads them. llmft converts once, caches the result inside the checkpoint, and resumes:

    checkpoint-400/global_step400/      the ZeRO shards as written (say 16 ranks)
    checkpoint-400/universal_step400/   the same state, world-size free; llmft_universal.json is written last
    checkpoint-400/latest_universal     the tag DeepSpeed's engine reads when load_universal is on

Complete or nothing: the conversion is written under a temporary name, checked, given its marker
(every file and its size) and only then renamed into place; `latest_universal` comes last. A
conversion killed half-way, or one whose files no longer match its marker, is removed and redone,
never loaded. The global batch stays what it was: the accumulation is re-derived for the new world
(`llmft.planning.batch`), so global step s trains on the same samples on any world size.

Resuming on the same world and stage does not convert. ZeRO-1 <-> ZeRO-2 goes through the same
conversion (one optimizer format); ZeRO-3 <-> ZeRO-1/2 and anything to or from ZeRO-0 is refused
with the way out: DeepSpeed's conversion does not produce what the other loader reads.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from llmft.checkpoint.run_dir import COMPLETE_MARKER, CheckpointError, tag_dir
from llmft.planning.allocation import this_node_memory
from llmft.planning.batch import BatchError, BatchPlan, nearest_global_batches, nearest_micro_batches, plan_batch
from llmft.planning.conversion import GIB, plan_conversion
from llmft.planning.world import discover_cpus

UNIVERSAL_MARKER = "llmft_universal.json"
LATEST_UNIVERSAL = "latest_universal"  # the file name DeepSpeed's engine reads (engine.load_checkpoint)
_TMP_PREFIX = ".llmft-universal-"
_SAME_FORMAT = ({1, 2},)  # stages whose optimizers read one universal layout


@dataclass(frozen=True)
class Resume:
    """Where a resume comes from and what changes on the way."""

    checkpoint: Path
    saved_world: int | None
    saved_stage: int | None
    saved_batch: BatchPlan | None
    world: int
    stage: int
    batch: BatchPlan

    @property
    def universal(self) -> bool:
        """Shards must be re-partitioned: another world (ZeRO-1/2/3) or another stage (1 <-> 2)."""
        if self.stage == 0:
            return False
        moved = self.saved_world is not None and self.saved_world != self.world
        restaged = self.saved_stage is not None and self.saved_stage != self.stage
        return moved or restaged

    def changes(self) -> list[str]:
        """What differs from the run that wrote the checkpoint, for the log line."""
        out = []
        if self.saved_stage is not None and self.saved_stage != self.stage:
            out.append(f"ZeRO stage {self.saved_stage} -> {self.stage}")
        old = self.saved_batch
        if old and old.grad_accum != self.batch.grad_accum:
            out.append(f"accumulation {old.grad_accum} -> {self.batch.grad_accum}")
        if old and old.micro_batch != self.batch.micro_batch:
            out.append(f"micro-batch {old.micro_batch} -> {self.batch.micro_batch}")
        if old and old.global_batch != self.batch.global_batch:
            out.append(f"global batch {old.global_batch} -> {self.batch.global_batch}")
        elif old:
            out.append(f"global batch {old.global_batch} kept")
        return out

    def describe(self, how: str | None = None) -> str:
        name = self.checkpoint.name
        if not self.universal:
            changed = [c for c in self.changes() if not c.endswith(" kept")]
            return f"resuming from {self.checkpoint}" + (f": {', '.join(self.changes())}" if changed else "")
        who = (
            f"written by {self.saved_world} ranks on {self.world} ranks"
            if self.saved_world != self.world
            else f"written with ZeRO stage {self.saved_stage}"
        )
        parts = [
            f"universal checkpoint {universal_dir(self.checkpoint)}" + (f" ({how})" if how else "")
        ] + self.changes()
        return f"resuming {name} {who}: {', '.join(parts)}"


def _saved(ckpt: Path) -> dict:
    try:
        return json.loads((ckpt / COMPLETE_MARKER).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {ckpt / COMPLETE_MARKER} ({e}); resume from another checkpoint") from None


def _saved_batch(marker: dict) -> BatchPlan | None:
    b = marker.get("batch")
    if not isinstance(b, dict):
        return None  # checkpoints from before llmft recorded it
    try:
        return BatchPlan(int(b["micro_batch"]), int(b["grad_accum"]), int(b["world_size"]))
    except (KeyError, TypeError, ValueError):
        return None


def stage_change_problem(saved_stage: int | None, stage: int) -> str | None:
    """None if a checkpoint written under `saved_stage` can be loaded under `stage`, else why not."""
    if saved_stage is None or saved_stage == stage:
        return None
    if any({saved_stage, stage} <= group for group in _SAME_FORMAT):
        return None
    if 0 in (saved_stage, stage):
        return "DeepSpeed converts and loads universal checkpoints only under ZeRO-1, 2 and 3"
    return "DeepSpeed's ZeRO-3 and ZeRO-1/2 loaders do not read each other's universal checkpoints"


def plan_resume(ckpt: Path, world: int, stage: int, batch: BatchPlan, global_batch_given: bool) -> Resume:
    """Decide how to resume `ckpt` on this world and stage; raise CheckpointError naming the way out.

    Without an explicit --global_batch_size the checkpoint's global batch is kept: the accumulation is
    derived for this world (the micro-batch stays what was asked), and impossible numbers are named.
    """
    marker = _saved(ckpt)
    saved_world, saved_stage, saved_batch = marker.get("world_size"), marker.get("zero_stage"), _saved_batch(marker)
    why = stage_change_problem(saved_stage, stage)
    if why:
        raise CheckpointError(
            f"{ckpt} was written with ZeRO stage {saved_stage}, this run uses stage {stage}: {why}; resume with "
            f"--zero_stage {saved_stage}, or export the weights (llmft export {ckpt} --out DIR --dtype float32) and start a new run from DIR"
        )
    kept = kept_global_batch(ckpt, batch.global_batch, global_batch_given)
    if kept != batch.global_batch:
        try:
            batch = plan_batch(world, batch.micro_batch, kept)
        except BatchError:
            raise CheckpointError(
                f"{ckpt} was trained with global batch {saved_batch.global_batch} (micro-batch {saved_batch.micro_batch} x "
                f"accumulation {saved_batch.grad_accum} x {saved_batch.world_size} ranks), which {world} ranks cannot keep with "
                f"micro-batch {batch.micro_batch}; use {ways_to_keep(saved_batch.global_batch, batch.micro_batch, world)}"
            ) from None
    return Resume(ckpt, saved_world, saved_stage, saved_batch, world, stage, batch)


def kept_global_batch(ckpt: Path | None, global_batch: int, global_batch_given: bool) -> int:
    """The global batch a run trains with: the one asked for (--global_batch_size), else its checkpoint's, if any."""
    if ckpt is None or global_batch_given:
        return global_batch
    saved = _saved_batch(_saved(ckpt))
    return saved.global_batch if saved else global_batch


def ways_to_keep(global_batch: int, micro_batch: int, world: int) -> str:
    """The nearest settings that keep `global_batch` on about this world, and the explicit way to change it."""
    hints = []
    micros = nearest_micro_batches(global_batch, micro_batch, world)
    if micros:
        hints.append("--per_device_train_batch_size " + " or ".join(map(str, micros)))
    worlds = [w for w in range(1, global_batch // micro_batch + 1) if global_batch % (micro_batch * w) == 0]
    near = [
        w
        for w in (
            max((w for w in worlds if w < world), default=None),
            min((w for w in worlds if w > world), default=None),
        )
        if w
    ]
    if near:
        hints.append(" or ".join(map(str, near)) + " ranks")
    others = nearest_global_batches(global_batch, micro_batch, world)
    if others:
        hints.append("--global_batch_size " + " or ".join(map(str, others)) + " to change the global batch")
    return ", or ".join(hints)


# --------------------------------------------------------------------------------------------------
# The conversion, cached inside the checkpoint


def _tag(ckpt: Path) -> str:
    found = tag_dir(ckpt)
    if found is None:
        raise CheckpointError(f"{ckpt} has no global_step* directory: it holds no DeepSpeed shards to convert")
    return found.name


def universal_dir(ckpt: Path) -> Path:
    return ckpt / _tag(ckpt).replace("global_step", "universal_step", 1)


def _files(root: Path) -> dict[str, int]:
    return {
        str(p.relative_to(root)): p.stat().st_size
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != UNIVERSAL_MARKER
    }


def conversion_problem(ckpt: Path) -> str | None:
    """None if checkpoint-N holds a complete universal conversion that latest_universal names, else what is wrong."""
    out = universal_dir(ckpt)
    marker = out / UNIVERSAL_MARKER
    if not out.is_dir():
        return f"{out} does not exist"
    if not marker.is_file():
        return f"{out} has no {UNIVERSAL_MARKER}: its conversion was interrupted"
    try:
        listed = json.loads(marker.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{marker} is unreadable"
    found = _files(out)
    for rel, size in listed.items():
        if rel not in found:
            return f"{out} is missing {rel}"
        if found[rel] != size:
            return f"{out}/{rel} has {found[rel]} bytes, {size} were written"
    latest = ckpt / LATEST_UNIVERSAL
    if not latest.is_file() or latest.read_text().strip() != out.name:
        return f"{latest} does not name {out.name}"
    return None


def _check_output(out: Path) -> None:
    """What DeepSpeed's universal loader needs: optimizer_state.pt, and fp32 + both Adam moments per trained tensor."""
    zero = out / "zero"
    if not (zero / "optimizer_state.pt").is_file():
        raise CheckpointError(f"the conversion wrote no {zero / 'optimizer_state.pt'}")
    params = [p for p in zero.iterdir() if p.is_dir()]
    trained = [p for p in params if (p / "exp_avg.pt").is_file()]
    if not trained:
        raise CheckpointError(f"the conversion wrote no optimizer moments under {zero}")
    for p in params:
        need = ("fp32.pt", "exp_avg.pt", "exp_avg_sq.pt") if p in trained else ("fp32.pt",)
        missing = [n for n in need if not (p / n).is_file()]
        if missing:
            raise CheckpointError(f"the conversion left {p} without {', '.join(missing)}")
    if not any(out.glob("*model_states.pt")):
        raise CheckpointError(f"the conversion copied no *model_states.pt into {out}")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def convert(ckpt: Path, workers: int | None = None, merge_workers: int | None = None) -> float:
    """Convert checkpoint-N's shards with ds_to_universal (HF Trainer layout: --inject_missing_state).

    Runs on one process (with DeepSpeed's worker processes: `workers` extract, `merge_workers` merge; see
    conversion_workers). Stale or half-written attempts are removed first; the result appears under its
    final name only once complete. Returns the seconds it took.
    """
    from deepspeed.checkpoint import ds_to_universal

    t0 = time.time()
    tag, out = _tag(ckpt), universal_dir(ckpt)
    tmp = ckpt / f"{_TMP_PREFIX}{os.getpid()}"
    staged = tmp / out.name
    try:
        for stale in [*ckpt.glob(_TMP_PREFIX + "*"), out]:
            shutil.rmtree(stale, ignore_errors=True)
        (ckpt / LATEST_UNIVERSAL).unlink(missing_ok=True)
        tmp.mkdir()
    except OSError as e:
        raise CheckpointError(
            f"cannot write a universal conversion into {ckpt} ({e.strerror or e}); make it writable, "
            f"or copy {ckpt} into this run's --output_dir and resume from the copy"
        ) from None
    workers = workers or max(1, min(4, (os.cpu_count() or 2) // 2))
    merge_workers = merge_workers or max(1, workers // 2)
    args = argparse.Namespace(
        input_folder=str(ckpt / tag),
        output_folder=str(staged),
        num_extract_workers=workers,
        num_merge_workers=merge_workers,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    log = tmp / "conversion.log"
    try:
        with open(log, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
            ds_to_universal.main(args)
        _check_output(staged)
    except CheckpointError as e:
        raise CheckpointError(f"converting {ckpt} to a universal checkpoint failed: {e} (log: {log})") from None
    except Exception as e:  # DeepSpeed raises assertions and plain exceptions on checkpoints it cannot convert
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"converting {ckpt} to a universal checkpoint failed ({reason}); log: {log}") from None
    shutil.move(str(log), staged / "conversion.log")
    marker = {
        "source": tag,
        "converted_at": time.time(),
        "seconds": round(time.time() - t0, 3),
        "files": _files(staged),
    }
    _write_atomic(staged / UNIVERSAL_MARKER, json.dumps(marker, indent=2) + "\n")
    os.replace(staged, out)
    _write_atomic(ckpt / LATEST_UNIVERSAL, out.name)
    shutil.rmtree(tmp, ignore_errors=True)
    return time.time() - t0


def conversion_workers(
    resume: Resume, trainable: int, largest_tensor: int, procs_per_node: int, env=None, meminfo: str = "/proc/meminfo"
):
    """ds_to_universal's workers for this node (llmft.planning.conversion): within the memory this job may use here
    (llmft.planning.allocation) and the machine has available, less the node's other ranks waiting, on its CPUs.
    Returns the ConversionPlan; CheckpointError, naming the numbers and the ways out, when one worker does not fit."""

    limit = this_node_memory(env, meminfo)
    budget = limit.gib * GIB
    try:
        text = Path(meminfo).read_text()
        available = next(int(line.split()[1]) * 1024 for line in text.splitlines() if line.startswith("MemAvailable:"))
        budget = min(budget, available)
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    budget -= (procs_per_node - 1) * GIB  # the node's other ranks wait with torch loaded
    conv = plan_conversion(
        trainable=trainable,
        largest_tensor=largest_tensor,
        saved_world=resume.saved_world or 1,
        budget_bytes=int(budget),
        cpus=discover_cpus(env)[0],
        io_mb_s=100.0,
    )
    if not conv.fits:
        raise CheckpointError(
            f"converting {resume.checkpoint} to a universal checkpoint needs about {conv.peak_bytes / GIB:.1f} GiB of host "
            f"RAM with one worker, and {budget / GIB:.1f} GiB is free for it on this node (the job may use {limit.gib:g} GiB "
            f"here: {limit.source}): resume on {resume.saved_world} ranks, or on a node with more memory (sbatch --mem=0)"
        )
    return conv


def prepare(resume: Resume, is_first_rank: bool, log=print, poll_s: float = 1.0, sizing=None) -> str | None:
    """Make the universal checkpoint exist: the first rank converts (or reuses a complete one), the others wait.

    Called before any process group exists, so the ranks meet through the file system every node shares.
    `sizing`: (trainable parameters, largest tensor, processes per node) to size the conversion for this node
    (conversion_workers); None keeps the default workers. Returns how the universal checkpoint was obtained
    ('cached' or 'converted in N s'), or None when none is needed.
    """
    if not resume.universal:
        return None
    if is_first_rank:
        problem = conversion_problem(resume.checkpoint)
        if problem is None:
            return "cached"
        workers = merge = None
        sized = ""
        if sizing is not None:
            conv = conversion_workers(resume, *sizing)
            workers, merge = conv.extract_workers, conv.merge_workers
            sized = (
                f" with {conv.extract_workers} extract and {conv.merge_workers} merge worker(s) (about "
                f"{conv.peak_bytes / 2**30:.1f} GiB host RAM of the {conv.budget_bytes / 2**30:.1f} free for it here)"
            )
        log(
            f"converting {resume.checkpoint} ({resume.saved_world} ranks, ZeRO stage {resume.saved_stage}) to a universal checkpoint{sized}"
        )
        seconds = convert(resume.checkpoint, workers, merge)
        return f"converted in {seconds:.0f} s" + ("" if "does not exist" in problem else f"; redone: {problem}")
    while conversion_problem(resume.checkpoint) is not None:  # if the first rank fails, torchrun ends this one
        time.sleep(poll_s)
    return "cached"


def with_universal_load(ds_config: dict) -> dict:
    """The resolved DeepSpeed config, told to load the universal checkpoint (the engine then reads latest_universal)."""
    return {**ds_config, "checkpoint": {**ds_config.get("checkpoint", {}), "load_universal": True}}

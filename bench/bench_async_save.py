"""The training stall per checkpoint, synchronous saves against --async_save, side by side.

    python bench/bench_async_save.py            # GPT-2 124M shape, 1 process, ZeRO-2, fp32 (CPU), 3 checkpoints per run
    python bench/bench_async_save.py --model llama-1b --max_length 1024 --save_steps 20   # on a GPU: 1.24B, bf16

Three `llmft train` runs through bench/timed_train.py, alternated: no checkpoints, synchronous checkpoints, and
--async_save, all with the same steps. The checkpoints (2 GB each here) go to this machine's disk, where one takes
several training steps to write. Stall per checkpoint = (the run's loop time - the no-checkpoint run's loop time) /
checkpoints, the loop time running from the first step's end to the last step's end; it holds everything a save
costs training: the write itself (synchronous), the serialisation into memory (async), and any slowdown of the
steps while a background write goes on. The last step is no save step, so every checkpoint measured is a periodic
one (a stop save and the last save are synchronous in both modes). Also printed: how long Trainer._save_checkpoint
held training each time, and the run's peak host RSS (the async snapshot's memory). Last, the checkpoint's size and
write time against the planner's figures (llmft.planning.memory.checkpoint_bytes, and its write time at the
bandwidth this disk showed and at the planner's 100 MB/s shared-filesystem default).
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
from pathlib import Path

from benchlib import REPO, demo_model, environment, gpt2_124m_model, launcher, run

from llmft.planning.memory import WRITE_MB_S, checkpoint_bytes
from llmft.planning.model_shape import load_model_config, model_shape

SAVE_RE = re.compile(r"bench: checkpoint-(\d+) save ([\d.]+) s")
STEP_END_RE = re.compile(r"bench: step (\d+) end ([\d.]+)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=REPO / "runs" / "bench_async_save")
    p.add_argument("--save_steps", type=int, default=30)
    p.add_argument("--checkpoints", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--model", choices=("gpt2-124m", "llama-1b"), default="gpt2-124m", help="llama-1b needs CUDA")
    p.add_argument("--max_length", type=int, default=64)
    p.add_argument(
        "--save_total_limit",
        type=int,
        default=None,
        help="complete checkpoints kept during a run (the 1B model's are 15 GB each: 1 fits a 64 GB disk)",
    )
    a = p.parse_args()

    if a.model == "llama-1b":
        from gpu import build_model

        model = build_model(a.root)
    else:
        model = gpt2_124m_model(a.root)
    _, data = demo_model(a.root)
    max_steps = a.save_steps * a.checkpoints + a.save_steps // 2
    print(environment())
    print(f"model {model.name}, 1 process, ZeRO-2, {max_steps} steps, a checkpoint every {a.save_steps}")
    print(
        f"{'run':<10} {'loop s':>8} {'median step s':>14} {'stall/ckpt s':>13} {'save call s (each)':>28} {'peak RSS GiB':>13}"
    )
    loops: dict[str, list[float]] = {}
    sync_saves: list[float] = []
    ckpt_bytes = 0
    for i in range(a.repeats):
        for name in ("none", "sync", "async"):
            out = a.root / name
            cmd = (
                launcher(1)
                + [
                    str(REPO / "bench" / "timed_train.py"),
                    "--model_name_or_path",
                    str(model),
                    "--dataset_name",
                    str(data),
                    "--output_dir",
                    str(out),
                    "--zero_stage",
                    "2",
                    "--per_device_train_batch_size",
                    "1",
                    "--global_batch_size",
                    "1",
                    "--max_length",
                    str(a.max_length),
                    "--max_steps",
                    str(max_steps),
                    "--learning_rate",
                    "1e-4",
                    "--report_to",
                    "none",
                    "--disable_tqdm",
                    "true",
                    "--logging_steps",
                    "10",
                ]
                + (["--save_strategy", "no"] if name == "none" else ["--save_steps", str(a.save_steps)])
                + ([] if a.save_total_limit is None else ["--save_total_limit", str(a.save_total_limit)])
            )
            cmd += ["--async_save"] if name == "async" else []
            r = run(name, cmd, out)
            ends = {int(s): float(t) for s, t in STEP_END_RE.findall(r.stdout)}
            loop = ends[max_steps] - ends[1]
            steps = [ends[s] - ends[s - 1] for s in range(2, max_steps + 1) if (s - 1) % a.save_steps]
            saves = [float(s) for _, s in SAVE_RE.findall(r.stdout)]
            loops.setdefault(name, []).append(loop)
            if name == "sync":
                sync_saves += saves
                ckpt_bytes = checkpoint_size(out)
            stall = (loop - loops["none"][-1]) / a.checkpoints if name != "none" else 0.0
            rss = r.summary()["peak_host_rss_gib"]
            for done in out.glob("checkpoint-*"):  # measured: the next run needs the disk space
                shutil.rmtree(done)
            print(
                f"{name + str(i):<10} {loop:>8.1f} {statistics.median(steps):>14.3f} {stall:>13.2f} "
                f"{' '.join(f'{s:.2f}' for s in saves) or '-':>28} {rss:>13.2f}"
            )
    sync = statistics.median(loops["sync"]) - statistics.median(loops["none"])
    asyn = statistics.median(loops["async"]) - statistics.median(loops["none"])
    print(
        f"stall per checkpoint: synchronous {sync / a.checkpoints:.2f} s, async {asyn / a.checkpoints:.2f} s "
        f"({asyn / sync:.3f}x)"
        if sync > 0
        else "no stall measured for synchronous saves"
    )
    print(against_planner(model, ckpt_bytes, sync_saves, a.root))


def checkpoint_size(out: Path) -> int:
    """Bytes of the newest checkpoint directory of a run."""
    newest = max(out.glob("checkpoint-*"), key=lambda d: int(d.name.split("-")[1]))
    return sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())


def disk_write_mb_s(root: Path, size_mb: int = 1024) -> float:
    """This disk's sequential write bandwidth: size_mb written in 64 MB blocks and fsynced, then removed."""
    import os
    import time

    block = os.urandom(64 * 2**20)
    path = root / "bench_disk_write.tmp"
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(size_mb // 64):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return size_mb * 2**20 / seconds / 1e6


def against_planner(model: Path, measured_bytes: int, saves: list[float], root: Path) -> str:
    """The planner's checkpoint size and write time (bytes / bandwidth) against the synchronous saves, with the
    bandwidth this disk showed for a plain sequential write."""
    import torch

    precision = "bf16" if torch.cuda.is_available() else "fp32"  # what llmft train chose (--precision auto)
    planned = checkpoint_bytes(model_shape(load_model_config(str(model))), 2, precision)
    save = statistics.median(saves)
    disk = disk_write_mb_s(root)
    planned_s = planned / (disk * 1e6)
    return (
        f"checkpoint {measured_bytes / 1e6:.0f} MB measured, {planned / 1e6:.0f} MB planned ({measured_bytes / planned:.3f}x); "
        f"median synchronous save {save:.2f} s; this disk writes {disk:.0f} MB/s, at which the planner's figure is "
        f"{planned_s:.2f} s (measured {save / planned_s:.2f}x that), and {planned / (WRITE_MB_S[None] * 1e6):.0f} s at "
        f"its {WRITE_MB_S[None]:g} MB/s shared-filesystem default"
    )


if __name__ == "__main__":
    main()

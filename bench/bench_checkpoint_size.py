"""A ZeRO-0/1/2 checkpoint's size and write time, with HF's model.safetensors beside the shards (before) and without
(llmft now), side by side.

    python bench/bench_checkpoint_size.py                  # GPT-2 124M shape, 1 process, ZeRO-2, 4 checkpoints each

The same `llmft train` run twice through bench/timed_train.py, alternated: `before` restores HF's checkpoint save_model
(model.safetensors written into every checkpoint), `after` is llmft as shipped. Printed per run: the checkpoint
directory's bytes and the median seconds Trainer._save_checkpoint took (every file written; on this machine's local
disk, so mostly page cache: a shared filesystem's bandwidth makes the bytes the cost).
"""

from __future__ import annotations

import argparse
import re
import statistics
from pathlib import Path

from benchlib import REPO, demo_model, environment, gpt2_124m_model, launcher, run

SAVE_RE = re.compile(r"bench: checkpoint-(\d+) save ([\d.]+) s")


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=REPO / "runs" / "bench_checkpoint_size")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--zero_stage", type=int, default=2, choices=[0, 1, 2])
    p.add_argument("--checkpoints", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()

    model = gpt2_124m_model(a.root)
    _, data = demo_model(a.root)
    print(environment())
    print(f"model {model.name}, {a.nproc} process(es), ZeRO-{a.zero_stage}, {a.checkpoints} checkpoints per run")
    print(
        f"{'run':<8} {'checkpoint MB':>14} {'of which model.safetensors MB':>30} {'median save s':>14} {'saves s':>30}"
    )
    results: dict[str, list[tuple[int, float]]] = {"before": [], "after": []}
    for i in range(a.repeats):
        for name in ("before", "after"):
            out = a.root / name
            cmd = launcher(a.nproc) + [
                str(REPO / "bench" / "timed_train.py"),
                "--model_name_or_path",
                str(model),
                "--dataset_name",
                str(data),
                "--output_dir",
                str(out),
                "--zero_stage",
                str(a.zero_stage),
                "--per_device_train_batch_size",
                "1",
                "--global_batch_size",
                str(a.nproc),
                "--max_length",
                "64",
                "--max_steps",
                str(a.checkpoints),
                "--save_steps",
                "1",
                "--report_to",
                "none",
                "--disable_tqdm",
                "true",
                "--logging_steps",
                "1",
            ]
            r = run(name, cmd, out, **({"BENCH_HF_CHECKPOINT_MODEL": "1"} if name == "before" else {}))
            saves = [float(s) for _, s in SAVE_RE.findall(r.stdout)]
            ckpt = out / f"checkpoint-{a.checkpoints}"
            size = dir_bytes(ckpt)
            safetensors = sum(f.stat().st_size for f in ckpt.glob("model*.safetensors"))
            results[name].append((size, statistics.median(saves)))
            print(
                f"{name + str(i):<8} {size / 1e6:>14.1f} {safetensors / 1e6:>30.1f} {statistics.median(saves):>14.3f} "
                f"{' '.join(f'{s:.2f}' for s in saves):>30}"
            )
    before, after = results["before"], results["after"]
    size_ratio = statistics.median(s for s, _ in after) / statistics.median(s for s, _ in before)
    time_ratio = statistics.median(t for _, t in after) / statistics.median(t for _, t in before)
    print(f"after / before: size {size_ratio:.3f}, save time {time_ratio:.3f}")


if __name__ == "__main__":
    main()

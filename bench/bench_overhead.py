"""What llmft costs on top of TRL: `llmft train` against a plain TRL SFTTrainer + DeepSpeed script, same everything.

    python bench/bench_overhead.py                      # demo model, ZeRO-2, 2 processes, 30 steps, A B A B
    python bench/bench_overhead.py --repeats 3 --max_steps 60 --nproc 1

A = `python -m llmft.train` (torchrun for --nproc > 1); B = bench/plain_trl_sft.py with the DeepSpeed config llmft
resolved and wrote in A's first run (so the ZeRO stage, micro-batch, accumulation and optimizer are identical), the
same model, data, steps, learning rate and logging interval. After one uncounted warm-up pair (compiled ops, page
cache), runs alternate A B A B so drift in the machine's load hits both. Printed: each run's steps/s (Trainer's own train_runtime, which both print) and whole-process wall time,
then llmft/plain ratios of the medians. Goals: steps/s ratio >= 0.98, wall ratio (plain/llmft time) >= 0.95.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from benchlib import REPO, demo_model, environment, launcher, run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=REPO / "runs" / "bench_overhead")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--zero_stage", type=int, default=2)
    p.add_argument("--micro_batch", type=int, default=8)
    p.add_argument("--grad_accum", type=int, default=2)
    p.add_argument("--max_steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()

    model, data = demo_model(a.root)
    common = dict(max_steps=a.max_steps, learning_rate="3e-3", logging_steps=10)
    ds_config = a.root / "ds_config.json"
    results: dict[str, list] = {"llmft": [], "plain": []}
    for i in range(-1, a.repeats):  # run -1: warm-up pair (caches, compiled ops, page cache), not counted
        out = a.root / f"llmft{i}"
        cmd = launcher(a.nproc) + [
            "-m",
            "llmft.train",
            "--model_name_or_path",
            str(model),
            "--dataset_name",
            str(data),
            "--output_dir",
            str(out),
            "--zero_stage",
            str(a.zero_stage),
            "--per_device_train_batch_size",
            str(a.micro_batch),
            "--global_batch_size",
            str(a.micro_batch * a.grad_accum * a.nproc),
            "--report_to",
            "none",
            "--disable_tqdm",
            "true",
            *[x for k, v in common.items() for x in (f"--{k}", str(v))],
        ]
        results["llmft"].append(run("llmft", cmd, out))
        if i == -1:
            ds_config.write_text((out / "ds_config.json").read_text())
        out = a.root / f"plain{i}"
        cmd = launcher(a.nproc) + [
            str(REPO / "bench" / "plain_trl_sft.py"),
            str(model),
            str(data),
            str(out),
            str(ds_config),
            "--micro_batch",
            str(a.micro_batch),
            "--grad_accum",
            str(a.grad_accum),
            *[x for k, v in common.items() for x in (f"--{k}", str(v))],
        ]
        results["plain"].append(run("plain", cmd, out))
        if i == -1:
            results = {"llmft": [], "plain": []}
            continue
        for name in ("llmft", "plain"):
            r = results[name][-1]
            print(
                f"run {i + 1} {name:5s}: {a.max_steps / r.train_runtime():7.3f} steps/s, wall {r.wall:6.1f} s",
                flush=True,
            )

    sps = {k: statistics.median(a.max_steps / r.train_runtime() for r in v) for k, v in results.items()}
    wall = {k: statistics.median(r.wall for r in v) for k, v in results.items()}
    print(f"\n{environment()}")
    print(
        f"demo model, ZeRO-{a.zero_stage}, {a.nproc} processes, micro-batch {a.micro_batch} x accumulation {a.grad_accum}, "
        f"{a.max_steps} steps, {a.repeats} runs each (A B A B), medians:"
    )
    print("| | llmft train | plain TRL | ratio | goal |\n|---|---|---|---|---|")
    print(f"| steps/s | {sps['llmft']:.3f} | {sps['plain']:.3f} | {sps['llmft'] / sps['plain']:.3f} | >= 0.98 |")
    print(
        f"| process wall s | {wall['llmft']:.1f} | {wall['plain']:.1f} | {wall['plain'] / wall['llmft']:.3f} | >= 0.95 |"
    )


if __name__ == "__main__":
    main()

"""Where `llmft train` spends its time before the first step, and what llmft cut from it.

    python bench/bench_startup.py                  # demo model and GPT-2-124M, 2 processes, ZeRO-2, 2 steps
    python bench/bench_startup.py --models demo --nproc 1

Each run is a real `llmft train` (torchrun for --nproc > 1) that stops after --max_steps; its run_summary.json
splits the start-up into import, data, model load, DeepSpeed initialisation and the first step.

The slow phase on a CPU machine was DeepSpeed's initialisation: `deepspeed.init_distributed` on the CPU accelerator
JIT-compiles the `deepspeed_shm_comm` C++ op (used only by DeepSpeed's tensor-parallel inference all-reduce, never
by training), a minute or more on a fresh machine and a cached load on every start after that.
llmft now skips it (llmft.training.deepspeed_env.skip_deepspeed_shm_op). The other op DeepSpeed builds there, its fused Adam
(C++ on CPU), is the optimizer training runs, so it stays: once per machine. Loading it, cached, cost 2.2 s a
process: DeepSpeed's CPU builder asks py-cpuinfo twice for the compile flags, and py-cpuinfo answers from a fresh
Python process; llmft answers from /proc/cpuinfo (llmft.training.deepspeed_env.use_proc_cpuinfo_for_deepspeed). Variants, with
a torch extensions cache of their own (TORCH_EXTENSIONS_DIR under --root) so the machine's shared cache cannot
blur them:
- before: DeepSpeed's and Python's defaults (LLMFT_DEEPSPEED_SHM_COMM=1 LLMFT_PY_CPUINFO=1 LLMFT_PYTHON_GC=1
  LLMFT_DEEPSPEED_EAGER_COMPILE=1); after: llmft's defaults;
- cold: an empty cache (a fresh machine's first run); warm: the ops already built (every later run).
Cold runs are made for the first model only: the ops do not depend on the model. Warm runs share one cache.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from benchlib import REPO, demo_model, environment, gpt2_124m_model, launcher, run

PHASES = ("import", "data", "model_load", "deepspeed_init", "first_step")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=REPO / "runs" / "bench_startup")
    p.add_argument("--models", nargs="+", choices=["demo", "gpt2-124m"], default=["demo", "gpt2-124m"])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--max_steps", type=int, default=2)
    a = p.parse_args()

    demo, data = demo_model(a.root)
    models = {"demo": demo, "gpt2-124m": gpt2_124m_model(a.root) if "gpt2-124m" in a.models else None}
    rows = []
    warm, cold = a.root / "extensions-warm", a.root / "extensions-cold"
    shutil.rmtree(warm, ignore_errors=True)  # "before, cold" fills it with both ops for the warm runs
    for i, name in enumerate(a.models):
        variants = [("before, cold", "1", warm), ("after, cold", "0", cold)] if i == 0 else []
        for variant, shm, ext in variants + [("before, warm", "1", warm), ("after, warm", "0", warm)]:
            if ext == cold:
                shutil.rmtree(ext, ignore_errors=True)
            out = a.root / f"{name}-{variant.replace(', ', '-')}"
            cmd = launcher(a.nproc) + [
                "-m",
                "llmft.train",
                "--model_name_or_path",
                str(models[name]),
                "--dataset_name",
                str(data),
                "--output_dir",
                str(out),
                "--zero_stage",
                "2",
                "--per_device_train_batch_size",
                "8",
                "--max_steps",
                str(a.max_steps),
                "--save_strategy",
                "no",
                "--report_to",
                "none",
                "--disable_tqdm",
                "true",
            ]
            r = run(
                f"{name} {variant}",
                cmd,
                out,
                LLMFT_DEEPSPEED_SHM_COMM=shm,
                LLMFT_PY_CPUINFO=shm,
                LLMFT_PYTHON_GC=shm,
                LLMFT_DEEPSPEED_EAGER_COMPILE=shm,
                TORCH_EXTENSIONS_DIR=str(ext),
            )
            s = r.summary()["startup_seconds"]
            rows.append((name, variant, s, r.wall))
            print(
                f"{name:9s} {variant:12s}: " + ", ".join(f"{k} {s[k]:.1f}" for k in PHASES) + f"; wall {r.wall:.1f} s",
                flush=True,
            )

    print(f"\n{environment()}")
    print(
        f"{a.nproc} processes, ZeRO-2, micro-batch 8, {a.max_steps} steps; seconds (rank 0's run_summary.json; wall = "
        f"the whole torchrun process tree)"
    )
    print(
        "| model | variant | import | data | model load | DeepSpeed init | first step | wall |\n|---|---|---|---|---|---|---|---|"
    )
    for name, variant, s, wall in rows:
        print(f"| {name} | {variant} | " + " | ".join(f"{s[k]:.1f}" for k in PHASES) + f" | {wall:.1f} |")
    by = {(n, v): (s, w) for n, v, s, w in rows}
    for name in a.models:
        for cache in ("cold", "warm"):
            if (name, f"before, {cache}") in by and (name, f"after, {cache}") in by:
                (b, bw), (f, fw) = by[(name, f"before, {cache}")], by[(name, f"after, {cache}")]
                print(
                    f"{name}, {cache}: DeepSpeed init {b['deepspeed_init']:.1f} -> {f['deepspeed_init']:.1f} s, "
                    f"whole run {bw:.1f} -> {fw:.1f} s ({fw / bw:.2f}x)"
                )


if __name__ == "__main__":
    main()

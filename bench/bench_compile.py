"""What `--torch_compile` buys and costs: the same run with and without it, side by side.

    python bench/bench_compile.py                        # demo model, 1 process, ZeRO-2, 150 steps, A B A B
    python bench/bench_compile.py --nproc 2 --max_steps 300 --backend inductor

A = `llmft train`, B = the same with `--torch_compile true --torch_compile_backend BACKEND`, runs alternated after no
warm-up: the compile cost is the thing measured, and inductor caches compiled code on disk (here in a cache of the
bench's own, emptied first), so the first compiled run is a fresh machine's and later ones find the cache. The demo
model's dropout is switched off, so both sides must reach the same losses. Printed per run: seconds to the end of
the first step, tokens/s over the second half of the run (every batch shape seen by then) and as run_summary.json
reports it, the whole process's wall time and the last loss; then the ratio of the steady rates and how much longer
the compiled process took in all. On a GPU,
`bench/gpu.py --runs z2-pack-compile` measures it at 1B scale.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

from benchlib import REPO, STEP_RE, demo_model, environment, launcher, run


def steady_tokens_per_second(stdout: str, max_steps: int) -> float:
    """Median of the per-interval tokens/s the step lines report, over the second half of the run."""
    rates = [float(tps) for step, _, tps, _ in STEP_RE.findall(stdout) if int(step) > max_steps // 2]
    return statistics.median(rates)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=REPO / "runs" / "bench_compile")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--max_steps", type=int, default=150)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--backend", default="inductor")
    a = p.parse_args()

    demo, data = demo_model(a.root)
    model = a.root / "demo-model-no-dropout"  # dropout draws its randomness differently compiled: losses would differ
    shutil.rmtree(model, ignore_errors=True)
    shutil.copytree(demo, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(
        json.dumps({**config, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0})
    )
    cache = a.root / "inductor-cache"  # the first compiled run compiles from scratch, later ones find its code here
    shutil.rmtree(cache, ignore_errors=True)
    rows = []
    for i in range(a.repeats):
        for compiled in (False, True):
            name = f"{'compiled' if compiled else 'eager'}{i}"
            out = a.root / name
            cmd = (
                launcher(a.nproc)
                + [
                    "-m",
                    "llmft.train",
                    "--model_name_or_path",
                    str(model),
                    "--dataset_name",
                    str(data),
                    "--output_dir",
                    str(out),
                    "--zero_stage",
                    "2",
                    "--per_device_train_batch_size",
                    "8",
                    "--global_batch_size",
                    str(16 * a.nproc),
                    "--max_steps",
                    str(a.max_steps),
                    "--logging_steps",
                    "10",
                    "--learning_rate",
                    "3e-3",
                    "--save_strategy",
                    "no",
                    "--report_to",
                    "none",
                    "--disable_tqdm",
                    "true",
                ]
                + (["--torch_compile", "true", "--torch_compile_backend", a.backend] if compiled else [])
            )
            r = run(name, cmd, out, TORCHINDUCTOR_CACHE_DIR=str(cache))
            s = r.summary()["startup_seconds"]
            first = sum(s.values())
            steady = steady_tokens_per_second(r.stdout, a.max_steps)
            summary_rate = r.summary()["tokens_per_second"]
            rows.append((compiled, i, first, steady, summary_rate, r.wall, r.losses()[-1][1]))
            print(
                f"run {i + 1} {'compiled' if compiled else 'eager':8s}: first step done at {first:6.1f} s, steady "
                f"{steady:7.0f} tokens/s (run_summary.json {summary_rate:7.0f}), wall {r.wall:6.1f} s, "
                f"last loss {r.losses()[-1][1]:.4f}",
                flush=True,
            )

    print(f"\n{environment()}")
    print(
        f"demo model without dropout, {a.nproc} process(es), ZeRO-2, micro-batch 8 x accumulation 2, {a.max_steps} steps, "
        f"--torch_compile_backend {a.backend}, runs alternated:"
    )
    print(
        "| run | torch.compile | s to the end of step 1 | steady tokens/s | run_summary.json tokens/s | process wall s "
        "| last loss |\n|---|---|---|---|---|---|---|"
    )
    for compiled, i, first, steady, summary_rate, wall, loss in rows:
        print(
            f"| {i + 1} | {'on' if compiled else 'off'} | {first:.1f} | {steady:.0f} | {summary_rate:.0f} | {wall:.1f} "
            f"| {loss:.4f} |"
        )
    eager = statistics.median(r[3] for r in rows if not r[0])
    comp = statistics.median(r[3] for r in rows if r[0])
    extra = statistics.median(r[5] for r in rows if r[0]) - statistics.median(r[5] for r in rows if not r[0])
    print(
        f"steady tokens/s compiled / eager: {comp / eager:.2f}x; the compiled run's process took {extra:+.1f} s longer "
        f"over {a.max_steps} steps"
    )


if __name__ == "__main__":
    main()

"""Packing against padding to the longest sample in the batch, on texts of 16 to 512 tokens.

    python bench/bench_packing.py                   # 2 runs of each, alternated, 40 steps, 1 process
    python bench/bench_packing.py --repeats 1 --max_steps 20

Both runs train the same GPT-2-style model (the demo's 2 x 128 shape, 1024 positions) with `llmft train` on the
same generated texts, whose lengths are spread uniformly over 16-512 tokens, at about the same number of real
tokens per optimizer step:
- padded: micro-batch 8 samples, each batch padded to its longest sample (TRL's default collator);
- packed: `--packing` (TRL's bfd packing, padding-free, attention kept per sample: llmft.training.packing), micro-batch
  2 rows of 1024 tokens.
Printed: non-padding tokens/s and all tokens/s from each run's run_summary.json, the ratio packed/padded of the
medians (goal >= 1.5), and both loss curves side by side with their mean gap (they should agree: same data, same
model, same tokens per step).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from benchlib import REPO, environment, launcher, run, varied_texts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=REPO / "runs" / "bench_packing")
    p.add_argument("--max_steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--nproc", type=int, default=1)
    a = p.parse_args()

    from llmft.data.synthetic import make_model_dir, make_tokenizer

    model = a.root / "model"
    if not (model / "config.json").is_file():
        make_model_dir(model, n_layer=2, n_embd=128, n_head=4, n_positions=1024)
    data = varied_texts(a.root / "texts.jsonl", 4000, 16, 512, make_tokenizer())
    base = [
        "-m",
        "llmft.train",
        "--model_name_or_path",
        str(model),
        "--dataset_name",
        str(data),
        "--zero_stage",
        "2",
        "--max_steps",
        str(a.max_steps),
        "--learning_rate",
        "1e-3",
        "--logging_steps",
        "1",
        "--report_to",
        "none",
        "--disable_tqdm",
        "true",
        "--save_strategy",
        "no",
        "--seed",
        "0",
    ]
    variants = {
        "padded": ["--per_device_train_batch_size", "8", "--max_length", "512"],
        "packed": ["--per_device_train_batch_size", "2", "--max_length", "1024", "--packing"],
    }
    runs: dict[str, list] = {k: [] for k in variants}
    for i in range(a.repeats):
        for name, extra in variants.items():
            out = a.root / f"{name}{i}"
            r = run(name, launcher(a.nproc) + base + ["--output_dir", str(out), *extra], out)
            runs[name].append(r)
            s = r.summary()
            print(
                f"run {i + 1} {name}: {s['tokens_per_second']:8.0f} tokens/s, {s['padded_tokens_per_second']:8.0f} "
                f"all tokens/s, {s['tokens'] / a.max_steps:6.0f} real tokens/step, loss {s['train_loss']:.4f}",
                flush=True,
            )

    med = {
        k: {f: statistics.median(r.summary()[f] for r in v) for f in ("tokens_per_second", "padded_tokens_per_second")}
        for k, v in runs.items()
    }
    per_step = {k: statistics.median(r.summary()["tokens"] / a.max_steps for r in v) for k, v in runs.items()}
    print(f"\n{environment()}")
    print(
        f"texts of 16-512 tokens, demo-shaped model with 1024 positions, ZeRO-2, {a.nproc} process(es), {a.max_steps} steps, "
        f"{a.repeats} runs each (alternated), medians:"
    )
    print("| | padded to longest | packed | packed / padded | goal |\n|---|---|---|---|---|")
    tps = med["packed"]["tokens_per_second"] / med["padded"]["tokens_per_second"]
    print(
        f"| non-padding tokens/s | {med['padded']['tokens_per_second']:.0f} | {med['packed']['tokens_per_second']:.0f} | {tps:.2f} | >= 1.5 |"
    )
    print(
        f"| all tokens/s (padding included) | {med['padded']['padded_tokens_per_second']:.0f} | "
        f"{med['packed']['padded_tokens_per_second']:.0f} | | |"
    )
    print(f"| real tokens per step | {per_step['padded']:.0f} | {per_step['packed']:.0f} | | |")

    curves = {k: dict(v[0].losses()) for k, v in runs.items()}
    steps = sorted(set(curves["padded"]) & set(curves["packed"]))
    print("\nloss curves (first run of each):\n| step | padded | packed |\n|---|---|---|")
    for s in steps:
        if s in (1, 2, 5) or s % 10 == 0:
            print(f"| {s} | {curves['padded'][s]:.3f} | {curves['packed'][s]:.3f} |")
    tail = [s for s in steps if s > len(steps) // 2]
    gap = statistics.mean(abs(curves["padded"][s] - curves["packed"][s]) for s in tail)
    mean = statistics.mean(curves["padded"][s] for s in tail)
    print(f"mean |padded - packed| over steps {tail[0]}-{tail[-1]}: {gap:.3f} ({gap / mean:.1%} of the padded loss)")


if __name__ == "__main__":
    main()

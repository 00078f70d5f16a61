"""Preparing the data once (llmft prepare) vs TRL preparing it on the fly in every run, side by side.

    python bench/bench_prepare.py                    # 100,000 generated prompt/completion records
    python bench/bench_prepare.py --records 20000 --packing

Each measurement runs in a fresh process with its own `datasets` cache, as a new job would:
  - trl-on-the-fly (cold):  what SFTTrainer does at start-up in every rank of every run (TRL's
                            `_prepare_dataset` on the loaded records), with an empty `datasets` cache;
  - trl-on-the-fly (warm):  the same again with the `datasets` cache of the previous run (same machine);
  - llmft prepare (first):  load + TRL's preparation + writing the Arrow files into LLMFT_CACHE;
  - llmft reuse:            a later run (another learning rate, another output_dir): fingerprint + memory-map.
The tokenizer is llmft's tiny offline one, so absolute times understate a real tokenizer's; the ratios
between the rows are the point. Under torchrun, on-the-fly preparation happens in every rank.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from transformers import AutoTokenizer
from trl import SFTConfig
from llmft.data import cache
mode, model, data, out, packing = sys.argv[1:6]
args = SFTConfig(output_dir=out, report_to="none", bf16=False, use_cpu=True, max_length=256, packing=packing == "1")
opts = cache.DataOptions(dataset_name=data)
tok = AutoTokenizer.from_pretrained(model)
t_import = time.perf_counter() - t0
t1 = time.perf_counter()
if mode == "trl":
    train, _, _ = cache.load_records(opts)
    ds = cache.trl_prepare(train, tok, args, packing=args.packing, name="train",
                             completion_only=cache.completion_only_loss(args, train[0]))
    n = len(ds)
else:
    p = cache.prepare(opts, tok, args, log=lambda m: None)
    n = len(p.train)
    assert p.reused == (mode == "reuse"), (mode, p.reused)
print(json.dumps({"seconds": time.perf_counter() - t1, "imports": t_import, "sequences": n}))
"""


def measure(
    mode: str, model: Path, data: Path, work: Path, packing: bool, datasets_cache: Path, llmft_cache: Path
) -> dict:
    env = {
        **os.environ,
        "HF_DATASETS_CACHE": str(datasets_cache),
        "LLMFT_CACHE": str(llmft_cache),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(model), str(data), str(work / "out"), "1" if packing else "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--packing", action="store_true")
    args = parser.parse_args()

    from llmft.data.synthetic import as_format, make_examples, make_model_dir, write_jsonl

    with tempfile.TemporaryDirectory(prefix="bench_prepare-") as tmp:
        work = Path(tmp)
        model = make_model_dir(work / "model")
        data = write_jsonl(as_format(make_examples(args.records), "prompt_completion"), work / "data.jsonl")
        warm = work / "datasets-warm"
        rows = [
            ("trl-on-the-fly (cold)", measure("trl", model, data, work, args.packing, warm, work / "unused")),
            ("trl-on-the-fly (warm)", measure("trl", model, data, work, args.packing, warm, work / "unused")),
            (
                "llmft prepare (first)",
                measure("prepare", model, data, work, args.packing, work / "datasets-2", work / "cache"),
            ),
            ("llmft reuse", measure("reuse", model, data, work, args.packing, work / "datasets-3", work / "cache")),
        ]
    base = rows[0][1]["seconds"]
    print(
        f"{args.records} records, {data.stat().st_size / 2**20:.1f} MiB, packing={args.packing}, python {sys.version.split()[0]}"
    )
    print(f"{'what':<24} {'seconds':>9} {'x cold on-the-fly':>18} {'sequences':>10}")
    for name, r in rows:
        print(f"{name:<24} {r['seconds']:>9.2f} {r['seconds'] / base:>18.3f} {r['sequences']:>10}")


if __name__ == "__main__":
    main()

"""Load time and peak memory: llmft's shard reader vs DeepSpeed's zero_to_fp32, on one real ZeRO checkpoint.

    python bench/bench_infer_load.py                       # ZeRO-2 and ZeRO-3, 2 processes, GPT-2 124M
    python bench/bench_infer_load.py --stages 2 --nproc 1  # lighter

1. Builds a GPT-2-124M-sized model from `GPT2Config()` (random weights, nothing downloaded), trains it
   one step with a bare DeepSpeed engine under torchrun (gloo on CPU) and saves a ZeRO checkpoint.
2. Loads that checkpoint in fresh subprocesses, each reporting its wall time and peak RSS
   (`resource.getrusage(RUSAGE_SELF).ru_maxrss`) and its RSS after imports and a warm-up (the baseline;
   imports are not loading):
   - llmft:          `llmft.checkpoint.loader.model_from_checkpoint` -> a ready fp32 model (weights read into it in place)
   - llmft-sd:       `llmft.checkpoint.zero.load_fp32_state_dict` -> a state dict (like zero_to_fp32)
   - zero_to_fp32:   `deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint` -> a state
                     dict only (a model to load it into would come on top)
Not a test: numbers depend on the machine (and its page cache; each loader runs `--repeat` times).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
KINDS = ["llmft", "llmft-sd", "zero_to_fp32"]


def make_checkpoint(out: Path, stage: int) -> None:
    """Runs under torchrun: one training step of GPT-2 124M with ZeRO-`stage`, then save_checkpoint()."""
    import deepspeed
    import torch  # noqa: F401
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config()
    model = GPT2LMHeadModel(config)
    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    ids = torch.randint(0, config.vocab_size, (1, 32))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(str(out))
    if engine.global_rank == 0:
        config.save_pretrained(out)  # llmft layout: config beside the tag directory
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()  # before exit: see tests/test_zero_checkpoint.py


def child(kind: str, tag_dir: Path) -> None:
    """Runs in a fresh process: load once, print one JSON line with seconds and RSS figures."""
    import torch  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config

    from llmft.checkpoint.loader import model_from_checkpoint
    from llmft.checkpoint.zero import load_fp32_state_dict, open_checkpoint

    if kind == "zero_to_fp32":
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    # warm-up: transformers imports model code lazily on first use; that is not loading
    AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=8, n_head=1, vocab_size=16))
    baseline = _maxrss_mb()
    t0 = time.perf_counter()
    if kind == "llmft":
        model = model_from_checkpoint(open_checkpoint(tag_dir), AutoConfig.from_pretrained(tag_dir.parent))
        n = sum(p.numel() for p in model.parameters())
    elif kind == "llmft-sd":
        sd = load_fp32_state_dict(tag_dir)
    else:
        with contextlib.redirect_stdout(io.StringIO()):
            sd = get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
    seconds = time.perf_counter() - t0
    if kind != "llmft":
        n = sum(t.numel() for t in {id(t): t for t in sd.values()}.values())
    print(
        json.dumps({"kind": kind, "seconds": seconds, "peak_mb": _maxrss_mb(), "baseline_mb": baseline, "params": n})
    )


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    return dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"),
    )


def measure(kind: str, tag_dir: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, str(HERE), "--child", kind, "--tag", str(tag_dir)], capture_output=True, text=True, env=_env()
    )
    if proc.returncode != 0:
        raise SystemExit(f"{kind} loader failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=Path, default=Path("runs/bench_infer_load"))
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3], choices=[1, 2, 3])
    p.add_argument("--nproc", type=int, default=2, help="processes that write the checkpoint (its number of shards)")
    p.add_argument("--repeat", type=int, default=2, help="loads per loader (best time and highest peak are reported)")
    p.add_argument("--make", type=int, default=None, help=argparse.SUPPRESS)  # internal: torchrun worker
    p.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    p.add_argument("--tag", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.make is not None:
        return make_checkpoint(args.workdir / f"zero{args.make}", args.make)
    if args.child:
        return child(args.child, args.tag)

    rows = []
    for stage in args.stages:
        out = args.workdir / f"zero{stage}"
        if not (out / "latest").is_file():
            print(
                f"writing a ZeRO-{stage} checkpoint of GPT-2 124M with {args.nproc} processes in {out} ...", flush=True
            )
            t0 = time.perf_counter()
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nproc_per_node",
                    str(args.nproc),
                    "--master_port",
                    str(_free_port()),
                    str(HERE),
                    "--workdir",
                    str(args.workdir),
                    "--make",
                    str(stage),
                ],
                check=True,
                env=_env(),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            print(f"  done in {time.perf_counter() - t0:.0f}s", flush=True)
        tag_dir = out / (out / "latest").read_text().strip()
        size_mb = sum(f.stat().st_size for f in tag_dir.iterdir()) / 2**20
        results = {}
        for i in range(args.repeat):
            for kind in KINDS:
                r = measure(kind, tag_dir)
                best = results.setdefault(kind, r)
                best["seconds"] = min(best["seconds"], r["seconds"])
                best["peak_mb"] = max(best["peak_mb"], r["peak_mb"])
        rows.append((stage, size_mb, results))

    n = rows[0][2]["llmft"]["params"]
    model_mb = n * 4 / 2**20
    print(
        f"\nGPT-2 124M: {n / 1e6:.1f}M parameters, fp32 weights = {model_mb:.0f} MiB; {args.nproc}-rank checkpoints; "
        f"best time and highest peak of {args.repeat} loads each"
    )
    print("peak = ru_maxrss; base = RSS after imports and warm-up; delta = peak - base (MiB)\n")
    print(
        f"{'ZeRO':>4} {'ckpt MiB':>8}  {'loader':<13} {'seconds':>7} {'peak':>6} {'base':>5} {'delta':>6} {'delta/model':>11}"
    )
    for stage, size_mb, r in rows:
        for kind in KINDS:
            x = r[kind]
            d = x["peak_mb"] - x["baseline_mb"]
            print(
                f"{stage:>4} {size_mb:>8.0f}  {kind:<13} {x['seconds']:>7.2f} {x['peak_mb']:>6.0f} {x['baseline_mb']:>5.0f} {d:>6.0f} {d / model_mb:>11.2f}"
            )
        a, b = r["llmft"], r["zero_to_fp32"]
        da, db = a["peak_mb"] - a["baseline_mb"], b["peak_mb"] - b["baseline_mb"]
        print(
            f"{'':>14}zero_to_fp32 / llmft: time x{b['seconds'] / a['seconds']:.2f}, peak x{b['peak_mb'] / a['peak_mb']:.2f}, "
            f"delta x{db / max(da, 1):.2f}  (above 1: llmft is faster / leaner)"
        )


if __name__ == "__main__":
    main()

"""Host memory of `llmft export`: its peak RSS against the exported model's size (the bound: 1.1x + 1 GiB).

    python bench/bench_export_memory.py                          # a Qwen2.5-0.5B-shaped Llama (494M parameters)
    python bench/bench_export_memory.py --hidden 512 --layers 4  # lighter

1. Builds a Llama-shaped model from a config (random weights, nothing downloaded; tied embeddings, vocabulary
   151,936 as Qwen2.5's), trains it one step with a bare DeepSpeed engine (ZeRO-2, one process under torchrun, gloo
   on CPU, SGD without momentum so no optimizer moments fill the disk) and saves the checkpoint in llmft's layout
   (config and the tiny tokenizer beside global_step1).
2. Runs `llmft export` in a fresh process (bf16, the default) and reports, from that process: its peak RSS
   (`getrusage(RUSAGE_SELF).ru_maxrss`), its RSS when the checks' fresh process starts (what is held beside it),
   and that child's own peak RSS (`RUSAGE_CHILDREN`). The machine's peak is at most the larger of the exporter's
   peak and (RSS at the checks + the child's peak). The exported size is the safetensors files' bytes.
Not a test: numbers depend on the machine. The checks' chat-prompt stop fails on random weights (they never end a
turn); that is reported, not an error here.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
GIB = 1024**3


def make_checkpoint(out: Path, hidden: int, layers: int, intermediate: int, vocab: int) -> None:
    """Runs under torchrun: one step of the Llama-shaped model with ZeRO-2, then save_checkpoint()."""
    import deepspeed
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmft.data.synthetic import make_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 448),
        tie_word_embeddings=True,
        max_position_embeddings=1024,
    )
    model = LlamaForCausalLM(config)
    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,  # torch's SGD: DeepSpeed's ZeRO-2 runs it, it only has not tested it
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    ids = torch.randint(0, 500, (1, 16))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(str(out))
    if engine.global_rank == 0:
        config.save_pretrained(out)  # llmft's layout: config and tokenizer beside the tag directory
        make_tokenizer().save_pretrained(out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def child(checkpoint: Path, out: Path) -> None:
    """Runs in a fresh process: `llmft export` in-process, then one JSON line of RSS figures."""
    from llmft import export
    from llmft.checkpoint import export_checks

    at_checks = {}
    original = export_checks.in_fresh_process

    def measured(*args, **kwargs):
        at_checks["rss_mb"] = _current_rss_mb()
        return original(*args, **kwargs)

    export_checks.in_fresh_process = measured
    code = export.main(export.make_parser().parse_args([str(checkpoint), "--out", str(out)]))
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(
        json.dumps(
            {
                "exit_code": code,
                "exported_bytes": size,
                "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "rss_at_checks_mb": at_checks.get("rss_mb"),
                "checks_child_peak_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
            }
        )
    )


def _current_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    return dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="2")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=Path, default=Path("runs/bench_export_memory"))
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--intermediate", type=int, default=4864)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--make", action="store_true", help=argparse.SUPPRESS)  # internal: the torchrun worker
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    shape = f"h{args.hidden}-l{args.layers}-i{args.intermediate}-v{args.vocab}"
    ckpt = args.workdir / shape / "checkpoint"
    out = args.workdir / shape / "exported"
    if args.make:
        return make_checkpoint(ckpt, args.hidden, args.layers, args.intermediate, args.vocab)
    if args.child:
        return child(ckpt, out)
    if not (ckpt / "latest").is_file():
        print(f"writing a ZeRO-2 checkpoint of the {shape} model in {ckpt} ...", flush=True)
        worker = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1"]
        worker += ["--master_port", str(_free_port()), str(HERE), "--make", "--workdir", str(args.workdir)]
        worker += ["--hidden", str(args.hidden), "--layers", str(args.layers)]
        worker += ["--intermediate", str(args.intermediate), "--vocab", str(args.vocab)]
        subprocess.run(worker, check=True, env=_env())
    if out.exists():
        subprocess.run(["rm", "-rf", "--", str(out)], check=True)
    proc = subprocess.run(
        [sys.executable, str(HERE), "--child", "--workdir", str(args.workdir), "--hidden", str(args.hidden)]
        + ["--layers", str(args.layers), "--intermediate", str(args.intermediate), "--vocab", str(args.vocab)],
        capture_output=True,
        text=True,
        env=_env(),
    )
    if not proc.stdout.strip():
        raise SystemExit(f"the export failed:\n{proc.stderr[-3000:]}")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    size_mb = r["exported_bytes"] / 2**20
    bound_mb = 1.1 * size_mb + 1024
    machine_peak = max(r["peak_mb"], (r["rss_at_checks_mb"] or 0) + r["checks_child_peak_mb"])
    print(f"model {shape}: exported {size_mb:,.0f} MiB of bf16 safetensors; export exit code {r['exit_code']}")
    print(f"  exporter's peak RSS        {r['peak_mb']:8,.0f} MiB  ({r['peak_mb'] / size_mb:.2f}x the export)")
    print(f"  exporter's RSS at checks   {r['rss_at_checks_mb']:8,.0f} MiB")
    print(f"  checks' process peak RSS   {r['checks_child_peak_mb']:8,.0f} MiB")
    print(f"  machine peak (at most)     {machine_peak:8,.0f} MiB  vs bound 1.1x + 1 GiB = {bound_mb:,.0f} MiB")
    print(f"  ratio (peak - 1 GiB) / export: {(machine_peak - 1024) / size_mb:.2f}")
    if r["exit_code"] != 0:
        print("  " + "\n  ".join(line for line in proc.stderr.splitlines() if "check failed" in line))


if __name__ == "__main__":
    main()

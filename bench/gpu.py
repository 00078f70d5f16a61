"""GPU throughput: tokens/s per GPU, MFU and peak memory of `llmft train` on a ~1B Llama-shaped model. CUDA only.

    python bench/gpu.py                                   # the 16 combinations below, all GPUs of this machine
    python bench/gpu.py --zero 3 --packing on --liger on off --compile off --max_steps 20

A Llama-shaped model of 1.1B parameters (TinyLlama's shape: 22 layers x 2048, SwiGLU 5632, 32 heads / 4 KV heads,
vocabulary 32000) is built from a config with random bf16 weights; the data is generated text of 256-2048 tokens
(the locally trained tokenizer's ids are a subset of the vocabulary); sequence length 2048. For every combination of
ZeRO-2/3, packing on/off, Liger on/off and torch.compile on/off it runs `llmft train` under torchrun on all GPUs and
reads <output_dir>/run_summary.json: tokens/s per GPU (non-padding), MFU against the GPU's dense bf16 peak, peak GPU
memory, and `llmft plan --model`'s per-GPU memory estimate for the same setting.
Anchors on an H100: about 41-42% MFU for a 1.3B model (llm-foundry's MPT-1B table), about 41% for DeepSpeed
ZeRO-1 with DeepCompile on an 8B model (DeepSpeed's DeepCompile blog). On a machine without CUDA it says so and
exits 0: nothing here can be measured on a CPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
from pathlib import Path

from benchlib import PYTHON, REPO, environment, run, varied_texts

ON_OFF = {"on": True, "off": False}


def build_model(root: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmft.tiny import make_tokenizer

    model = root / "llama-1b"
    if not (model / "config.json").is_file():
        tokenizer = make_tokenizer()
        config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                             num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=4096,
                             bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id, dtype="bfloat16")
        torch.manual_seed(0)
        with torch.device("cuda"):
            m = LlamaForCausalLM(config).to(torch.bfloat16)
        m.save_pretrained(model)
        tokenizer.save_pretrained(model)
    return model


def plan_estimate(model: Path, zero: int, micro: int, nproc: int, gradient_checkpointing: bool) -> str:
    """llmft plan's per-GPU memory estimate (`plan --model ... --json`) for this setting."""
    cmd = [PYTHON, "-m", "llmft.plan", "--model", str(model), "--nproc_per_node", str(nproc), "--nnodes", "1",
           "--zero_stage", str(zero), "--per_device_train_batch_size", str(micro), "--max_length", "2048",
           "--global_batch_size", str(micro * nproc), "--gradient_checkpointing", str(gradient_checkpointing).lower(), "--json"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    try:
        plan = json.loads(proc.stdout)
        rows = [plan["recommended"], *plan.get("candidates", [])]
        row = next(r for r in rows if r.get("zero_stage") == zero and r.get("micro_batch") == micro
                   and r.get("offload") in (None, "none") and bool(r.get("gradient_checkpointing")) == gradient_checkpointing)
        return f"{row['gpu_total_gib']:.1f}"
    except (ValueError, KeyError, StopIteration, TypeError):
        print(f"gpu.py: no plan estimate for ZeRO-{zero} micro-batch {micro}: {(proc.stderr or proc.stdout).strip()[-300:]}", flush=True)
        return "n/a"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=REPO / "runs" / "bench_gpu")
    p.add_argument("--zero", nargs="+", type=int, default=[2, 3])
    p.add_argument("--packing", nargs="+", choices=ON_OFF, default=["on", "off"])
    p.add_argument("--liger", nargs="+", choices=ON_OFF, default=["on", "off"])
    p.add_argument("--compile", nargs="+", choices=ON_OFF, default=["on", "off"])
    p.add_argument("--micro_batch", type=int, default=4)
    p.add_argument("--max_steps", type=int, default=30)
    p.add_argument("--gradient_checkpointing", action="store_true")
    a = p.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("bench/gpu.py: needs CUDA (run it on a GPU machine); nothing measured on this machine")
        return 0
    nproc = torch.cuda.device_count()
    model = build_model(a.root)
    from llmft.tiny import make_tokenizer

    data = varied_texts(a.root / "texts.jsonl", 20000, 256, 2048, make_tokenizer())
    rows = []
    for zero, packing, liger, compile_ in itertools.product(a.zero, a.packing, a.liger, a.compile):
        name = f"zero{zero}-pack_{packing}-liger_{liger}-compile_{compile_}"
        out = a.root / name
        cmd = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "-m", "llmft.train",
               "--model_name_or_path", str(model), "--dataset_name", str(data), "--output_dir", str(out),
               "--zero_stage", str(zero), "--per_device_train_batch_size", str(a.micro_batch),
               "--global_batch_size", str(a.micro_batch * nproc), "--max_length", "2048", "--max_steps", str(a.max_steps),
               "--logging_steps", "10", "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true",
               "--dtype", "bfloat16"]
        cmd += ["--packing"] if ON_OFF[packing] else []
        cmd += ["--use_liger_kernel", "true"] if ON_OFF[liger] else []
        cmd += ["--torch_compile", "true"] if ON_OFF[compile_] else []
        cmd += ["--gradient_checkpointing"] if a.gradient_checkpointing else []
        r = run(name, cmd, out)
        s = r.summary()
        rows.append((zero, packing, liger, compile_, s["tokens_per_second"] / s["world_size"], s["mfu"],
                     s["peak_gpu_memory_gib"], plan_estimate(model, zero, a.micro_batch, nproc, a.gradient_checkpointing)))
        print(f"{name}: {rows[-1][4]:.0f} tokens/s/GPU, MFU {s['mfu']}, peak {s['peak_gpu_memory_gib']} GiB", flush=True)

    print(f"\n{environment()}")
    print(f"{nproc} GPU(s), 1.1B Llama-shaped model, sequence 2048, micro-batch {a.micro_batch}, {a.max_steps} steps, "
          f"gradient checkpointing {'on' if a.gradient_checkpointing else 'off'}; rates exclude the first step")
    print("| ZeRO | packing | Liger | compile | tokens/s/GPU | MFU | peak GiB | plan GiB |\n|---|---|---|---|---|---|---|---|")
    for zero, packing, liger, compile_, tps, mfu, peak, est in rows:
        mfu_text = f"{mfu:.1%}" if mfu is not None else "n/a (GPU not in llmft.hardware.GPUS)"
        print(f"| {zero} | {packing} | {liger} | {compile_} | {tps:.0f} | {mfu_text} | {peak:.1f} | {est} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""GPU throughput: tokens/s per GPU, MFU and peak memory of `llmft train` on a ~1B Llama-shaped model. CUDA only.

    python bench/gpu.py                                   # every combination of the dimensions below, all GPUs here
    python bench/gpu.py --runs z2-pad z2-pack z3-pack z3-pack-liger z2-pack-compile z2-pack-qlora --budget_s 500

A Llama-shaped model of 1.1B parameters (TinyLlama's shape: 22 layers x 2048, SwiGLU 5632, 32 heads / 4 KV heads,
vocabulary 32000) is built from a config with random bf16 weights; the data is generated text of 256-2048 tokens
(the locally trained tokenizer's ids are a subset of the vocabulary); sequence length 2048. Each run is the real
`llmft train` (torchrun for several GPUs, one process for one) and reads <output_dir>/run_summary.json: tokens/s per
GPU (non-padding), MFU against the GPU's dense bf16 peak, peak GPU memory (max allocated), and `llmft plan --model`'s
estimate for the same setting (its allocated part, and the full per-GPU figure it checks against the GPU).

A run is named by its dimensions: z2|z3 (ZeRO stage), pad|pack, and optionally liger, compile, ckpt (gradient
checkpointing), lora or qlora (LoRA r=16 on all linear layers; qlora: on a 4-bit base). Without --runs, every combination of --zero, --packing,
--liger and --compile runs. A failed run is reported in the table with its error and the bench goes on; --budget_s
stops starting runs past that many seconds, so a time-limited machine still prints its table.

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
import time
from pathlib import Path

from benchlib import PYTHON, REPO, environment, launcher, run, varied_texts

ON_OFF = {"on": True, "off": False}
LLAMA_1B = dict(  # TinyLlama's shape: 1.1B parameters
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
)
DIMENSIONS = ("z2", "z3", "pad", "pack", "liger", "compile", "ckpt", "lora", "qlora")


def parse_run(name: str) -> dict:
    """'z3-pack-liger' -> {"zero": 3, "packing": True, "liger": True, "compile": False, "tuning": "full"}."""
    parts = name.split("-")
    unknown = [p for p in parts if p not in DIMENSIONS]
    if unknown or sum(p in ("z2", "z3") for p in parts) != 1 or sum(p in ("pad", "pack") for p in parts) != 1:
        raise SystemExit(
            f"gpu.py: bad run name {name!r}: one of z2|z3, one of pad|pack, then any of liger, compile, ckpt, lora, qlora"
        )
    return {
        "zero": 3 if "z3" in parts else 2,
        "packing": "pack" in parts,
        "liger": "liger" in parts,
        "compile": "compile" in parts,
        "checkpointing": "ckpt" in parts,
        "tuning": "qlora" if "qlora" in parts else "lora" if "lora" in parts else "full",
    }


def build_model(root: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmft.data.synthetic import make_tokenizer

    model = root / "llama-1b"
    if not (model / "config.json").is_file():
        tokenizer = make_tokenizer()
        config = LlamaConfig(
            **LLAMA_1B,
            max_position_embeddings=4096,
            bos_token_id=tokenizer.eos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            dtype="bfloat16",
        )
        torch.manual_seed(0)
        with torch.device("cuda"):
            m = LlamaForCausalLM(config).to(torch.bfloat16)
        m.save_pretrained(model)
        tokenizer.save_pretrained(model)
    return model


def plan_estimate(model: Path, spec: dict, micro: int, nproc: int) -> tuple[float, float] | None:
    """llmft plan's per-GPU memory estimate (`plan --model ... --json`) for this setting: (allocated part, full)."""
    cmd = [
        PYTHON,
        "-m",
        "llmft.plan",
        "--model",
        str(model),
        "--nproc_per_node",
        str(nproc),
        "--nnodes",
        "1",
        "--zero_stage",
        str(spec["zero"]),
        "--per_device_train_batch_size",
        str(micro),
        "--max_length",
        "2048",
        "--global_batch_size",
        str(micro * nproc),
        "--gradient_checkpointing",
        str(spec["checkpointing"]).lower(),
        "--json",
    ]
    cmd += ["--use_peft", "--lora_target_modules", "all-linear"] if spec["tuning"] != "full" else []
    cmd += ["--load_in_4bit"] if spec["tuning"] == "qlora" else []
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    try:
        plan = json.loads(proc.stdout)
        rows = [plan["recommended"], *plan.get("candidates", [])]
        row = next(
            r
            for r in rows
            if r.get("zero_stage") == spec["zero"]
            and r.get("micro_batch") == micro
            and r.get("offload") in (None, "none")
            and bool(r.get("gradient_checkpointing")) == spec["checkpointing"]
        )
        allocated = row["model_states_gib"] + row["activations_gib"] + row["loss_buffers_gib"] + row["phase_gib"]
        return allocated, row["gpu_total_gib"]
    except (ValueError, KeyError, StopIteration, TypeError):
        print(f"gpu.py: no plan estimate for {spec}: {(proc.stderr or proc.stdout).strip()[-300:]}", flush=True)
        return None


def train_command(model: Path, data: Path, out: Path, spec: dict, a, nproc: int) -> list[str]:
    cmd = launcher(nproc) + [
        "-m",
        "llmft.train",
        "--model_name_or_path",
        str(model),
        "--dataset_name",
        str(data),
        "--output_dir",
        str(out),
        "--zero_stage",
        str(spec["zero"]),
        "--per_device_train_batch_size",
        str(a.micro_batch),
        "--global_batch_size",
        str(a.micro_batch * nproc * a.grad_accum),
        "--max_length",
        "2048",
        "--max_steps",
        str(a.max_steps),
        "--logging_steps",
        "5",
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        "--disable_tqdm",
        "true",
        "--learning_rate",
        "1e-4",
        "--gradient_checkpointing",
        str(spec["checkpointing"]).lower(),
    ]
    cmd += ["--packing", "true"] if spec["packing"] else []
    cmd += ["--use_liger_kernel", "true"] if spec["liger"] else []
    cmd += ["--torch_compile", "true"] if spec["compile"] else []
    cmd += (
        ["--use_peft", "--lora_r", "16", "--lora_alpha", "32", "--lora_target_modules", "all-linear"]
        if spec["tuning"] != "full"
        else []
    )
    cmd += ["--load_in_4bit", "true"] if spec["tuning"] == "qlora" else []
    return cmd


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=REPO / "runs" / "bench_gpu")
    p.add_argument(
        "--runs", nargs="+", help="named runs (z2-pack-liger, ...) instead of the product of the flags below"
    )
    p.add_argument("--zero", nargs="+", type=int, default=[2, 3])
    p.add_argument("--packing", nargs="+", choices=ON_OFF, default=["on", "off"])
    p.add_argument("--liger", nargs="+", choices=ON_OFF, default=["on", "off"])
    p.add_argument("--compile", nargs="+", choices=ON_OFF, default=["on", "off"])
    p.add_argument("--micro_batch", type=int, default=4)
    p.add_argument("--max_steps", type=int, default=30)
    p.add_argument("--texts", type=int, default=3000, help="generated training texts (enough for --max_steps)")
    p.add_argument(
        "--grad_accum", type=int, default=1, help="micro-batches per optimizer step (the global batch follows)"
    )
    p.add_argument("--budget_s", type=float, default=None, help="start no run after this many seconds")
    p.add_argument("--timeout_s", type=float, default=600, help="kill a run after this many seconds")
    p.add_argument("--log", type=Path, default=None, help="append every run's command and output to this file")
    p.add_argument("--table", type=Path, default=None, help="also write the table here, rewritten after each run")
    a = p.parse_args()
    specs = (
        [(n, parse_run(n)) for n in a.runs]
        if a.runs
        else [
            (
                f"z{z}-{'pack' if ON_OFF[pk] else 'pad'}"
                + ("-liger" if ON_OFF[lg] else "")
                + ("-compile" if ON_OFF[cp] else ""),
                {
                    "zero": z,
                    "packing": ON_OFF[pk],
                    "liger": ON_OFF[lg],
                    "compile": ON_OFF[cp],
                    "checkpointing": False,
                    "tuning": "full",
                },
            )
            for z, pk, lg, cp in itertools.product(a.zero, a.packing, a.liger, a.compile)
        ]
    )

    import torch

    if not torch.cuda.is_available():
        print("bench/gpu.py: needs CUDA (run it on a GPU machine); nothing measured on this machine")
        return 0
    start = time.perf_counter()
    nproc = torch.cuda.device_count()
    model = build_model(a.root)
    from llmft.data.synthetic import make_tokenizer

    data = varied_texts(a.root / "texts.jsonl", a.texts, 256, 2048, make_tokenizer())
    head = (
        f"{environment()}\n{nproc} GPU(s), 1.1B Llama-shaped model, sequence 2048, micro-batch {a.micro_batch}, "
        f"accumulation {a.grad_accum}, {a.max_steps} optimizer steps; gradient checkpointing only in runs named ckpt; rates exclude the first step"
    )
    lines = [
        "| run | tokens/s/GPU | padded tokens/s/GPU | TFLOP/s/GPU | MFU | peak GiB (allocated) | plan GiB (allocated / full) | start-up s | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, spec in specs:
        if a.budget_s is not None and time.perf_counter() - start > a.budget_s:
            lines.append(f"| {name} | not run: past --budget_s {a.budget_s:.0f} | | | | | | | |")
            continue
        out = a.root / name
        r = run(
            name, train_command(model, data, out, spec, a, nproc), out, check=False, timeout=a.timeout_s, log=a.log
        )
        est = plan_estimate(model, spec, a.micro_batch, nproc)
        est_text = f"{est[0]:.1f} / {est[1]:.1f}" if est else "n/a"
        failure = r.failure()
        if failure:
            lines.append(f"| {name} | failed ({failure}) | | | | | {est_text} | | {r.wall:.0f} |")
        else:
            s = r.summary()
            world = s["world_size"]
            mfu_text = f"{s['mfu']:.1%}" if s["mfu"] is not None else "n/a (GPU not in llmft.planning.hardware.GPUS)"
            startup = sum((s.get("startup_seconds") or {}).values())
            lines.append(
                f"| {name} | {s['tokens_per_second'] / world:.0f} | {s['padded_tokens_per_second'] / world:.0f} | "
                f"{s['tflops_per_gpu']:.1f} | {mfu_text} | {s['peak_gpu_memory_gib']:.1f} | {est_text} | {startup:.0f} | {r.wall:.0f} |"
            )
        print(lines[-1], flush=True)
        if a.table:
            a.table.write_text(head + "\n\n" + "\n".join(lines) + "\n")
    print(f"\n{head}\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

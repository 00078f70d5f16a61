"""The memory planner's GPU estimate vs torch.cuda.max_memory_allocated, side by side (needs CUDA).

    python bench/gpu_memory.py                         # Llama-shaped ~1.2B model, ZeRO-2 and ZeRO-3, checkpointing off/on
    python bench/gpu_memory.py --nproc 4 --max_length 4096 --micro 2

For each setting it runs the real `llmft train` (torchrun, TRL's SFTTrainer on DeepSpeed, bf16) on a
Llama-3.2-1B-shaped model built from a config with random weights (nothing downloaded; the tokenizer and the
packed data are llmft.tiny's), three steps without checkpoints, and reads the per-rank peak that llmft prints
(`llmft: GPU memory peak: rank 0 X GiB allocated`). Beside it: llmft.planning.memory's estimate of the allocated part
(model states + activations + loss buffers + DeepSpeed buckets; the CUDA context and fragmentation margin are
not allocations) and the full per-GPU figure the planner checks against the GPU. Goal: within 10%.
On a machine without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def build(out: Path, vocab: int) -> tuple[Path, Path]:
    """A Llama-3.2-1B-shaped model (random bf16 weights) with llmft.tiny's tokenizer, and packed-length data."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmft.data.synthetic import as_format, make_examples, make_tokenizer, write_jsonl

    model_dir = out / "model"
    if not (model_dir / "config.json").is_file():
        tok = make_tokenizer()
        config = LlamaConfig(
            hidden_size=2048,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=8192,
            vocab_size=vocab,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
            bos_token_id=tok.eos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        torch.manual_seed(0)
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
    data = write_jsonl(as_format(make_examples(20000), "text"), out / "data.jsonl")
    return model_dir, data


def measure(model_dir: Path, data: Path, out: Path, stage: int, gc: bool, args) -> list[float] | None:
    """Per-rank max_memory_allocated (GiB) of a 3-step run; None (and its error printed) when the run failed."""
    launch = (
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc)]
        if args.nproc > 1
        else [sys.executable]
    )
    cmd = launch + [
        "-m",
        "llmft.train",
        "--model_name_or_path",
        str(model_dir),
        "--dataset_name",
        str(data),
        "--output_dir",
        str(out),
        "--zero_stage",
        str(stage),
        "--gradient_checkpointing",
        str(gc).lower(),
        "--max_length",
        str(args.max_length),
        "--packing",
        "true",
        "--per_device_train_batch_size",
        str(args.micro),
        "--max_steps",
        "3",
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        "--logging_steps",
        "1",
        "--disable_tqdm",
        "true",
        "--attn_implementation",
        args.attention,
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if args.log:
        with open(args.log, "a") as f:
            f.write(
                f"\n===== ZeRO-{stage} checkpointing {gc}: exit {proc.returncode}\n$ {' '.join(cmd)}\n{proc.stdout}\n--- stderr\n{proc.stderr[-20000:]}\n"
            )
    line = next((l for l in proc.stdout.splitlines() if l.startswith("llmft: GPU memory peak:")), None)
    if proc.returncode != 0 or line is None:
        print(
            f"bench/gpu_memory.py: llmft train failed (ZeRO-{stage}, checkpointing {gc}), exit {proc.returncode}: "
            f"{(proc.stderr.strip().splitlines() or ['no output'])[-1][:300]}",
            flush=True,
        )
        return None
    return [float(x) for x in re.findall(r"rank \d+ ([\d.]+) GiB allocated", line)]


def main() -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=max(1, torch.cuda.device_count()))
    parser.add_argument("--max_length", type=int, default=2048)
    parser.add_argument("--micro", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--attention", default="sdpa", choices=["sdpa", "flash_attention_2"])
    parser.add_argument("--log", type=Path, default=None, help="append every run's command and output to this file")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_gpu_memory")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(
            "bench/gpu_memory.py: needs a CUDA GPU and none is visible here; run it on a GPU node (nothing measured)"
        )
        return 0

    from llmft.planning import memory
    from llmft.planning.ds_config import load_config, template_path
    from llmft.planning.hardware import local_gpu
    from llmft.planning.model_shape import load_model_config, model_shape

    model_dir, data = build(args.out, args.vocab)
    shape = model_shape(load_model_config(str(model_dir)))
    gpu = local_gpu()
    print(
        f"{gpu.name}, {torch.cuda.device_count()} visible, {args.nproc} processes; model {shape.params / 1e9:.2f}B "
        f"parameters, bf16, sequence {args.max_length}, micro-batch {args.micro}, attention {args.attention}"
    )
    zero_config = {s: load_config(template_path(s))["zero_optimization"] for s in (2, 3)}
    print("ZeRO  ckpt | measured max_allocated GiB | estimated allocated GiB | ratio | planner's full per-GPU GiB")
    for stage in (2, 3):
        for gc in (False, True):
            peaks = measure(model_dir, data, args.out / f"z{stage}-{gc}", stage, gc, args)
            job = memory.Job(
                shape,
                gpu,
                1e6,
                1,
                args.nproc,
                args.max_length,
                "bf16",
                micro_batch=args.micro,
                attention=args.attention,
                zero_config=zero_config,
            )
            est = memory.estimate(job, memory.Setting(stage, "none", args.micro, 1, gc))
            allocated = (
                est.model_states
                + est.activations
                + est.loss_buffers
                + est.phase
                + memory.zero_buffer_bytes(stage, job.zero_config[stage], shape, "bf16")
            ) / 2**30
            if peaks is None:
                print(
                    f"{stage:>4}  {'on ' if gc else 'off'}  | {'failed':>25} | {allocated:>23.2f} |   n/a | {est.gpu_total / 2**30:.2f}",
                    flush=True,
                )
                continue
            measured = max(peaks)
            print(
                f"{stage:>4}  {'on ' if gc else 'off'}  | {measured:>25.2f} | {allocated:>23.2f} | {allocated / measured:5.2f} | {est.gpu_total / 2**30:.2f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Attention for packed (padding-free) batches on a GPU: the three ways to keep samples apart, side by side. CUDA only.

    python bench/gpu_attention.py                          # Llama-1B-like heads (32 q / 4 kv, head_dim 64), bf16
    python bench/gpu_attention.py --tokens 16384 --lo 16 --hi 512

A packed micro-batch is one row of `--tokens` tokens holding samples of `--lo`..`--hi` tokens (TRL flattens the
micro-batch into one row). Forward + backward of one attention layer, timed with CUDA events (median of `--repeats`
after warm-up), for:
- `dense mask`: transformers' SDPA with the block-diagonal causal mask it builds from position ids (cost ~ row^2);
- `per sample`: llmft's packed SDPA on the CPU path, one SDPA call per sample (cost ~ sum of sample^2, many launches);
- `varlen`: llmft's packed SDPA on a GPU, PyTorch's variable-length flash kernel in one launch.
Outputs and input gradients of each are compared with `per sample` (relative error; bf16 is ~1e-3..1e-2).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class _Attention:
    """What transformers' attention functions read from the module."""

    def __init__(self, heads: int, kv_heads: int):
        self.num_key_value_groups = heads // kv_heads
        self.is_causal = True
        self.training = True
        self.layer_idx = 0


def sample_lengths(tokens: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    rng, lengths = random.Random(seed), []
    while sum(lengths) < tokens:
        lengths.append(min(rng.randint(lo, hi), tokens - sum(lengths)))
    return lengths


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--lo", type=int, default=256)
    p.add_argument("--hi", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv_heads", type=int, default=4)
    p.add_argument("--head_dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args()

    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from llmft.training import packing

    if not torch.cuda.is_available():
        print("bench/gpu_attention.py: needs CUDA (run it on a GPU machine); nothing measured on this machine")
        return 0
    torch.manual_seed(0)
    lengths = sample_lengths(a.tokens, a.lo, a.hi)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    sample_of = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).cuda()
    index = torch.arange(a.tokens, device="cuda")
    mask = ((sample_of[:, None] == sample_of[None, :]) & (index[:, None] >= index[None, :]))[None, None]
    module = _Attention(a.heads, a.kv_heads)
    scaling = a.head_dim**-0.5
    shapes = (
        (1, a.heads, a.tokens, a.head_dim),
        (1, a.kv_heads, a.tokens, a.head_dim),
        (1, a.kv_heads, a.tokens, a.head_dim),
    )

    def fresh(cu_tensor):
        cu_new = cu_tensor.clone()  # a new tensor per step, as the collator makes (no cached host bounds)
        return [torch.randn(s, device="cuda", dtype=torch.bfloat16, requires_grad=True) for s in shapes], cu_new

    def dense(q, k, v, cu_):
        return sdpa_attention_forward(module, q, k, v, mask, scaling=scaling)[0]

    def per_sample(q, k, v, cu_):
        bounds = cu_.tolist()
        pieces = [
            sdpa_attention_forward(module, q[:, :, x:y], k[:, :, x:y], v[:, :, x:y], None, scaling=scaling)[0]
            for x, y in zip(bounds, bounds[1:])
        ]
        return torch.cat(pieces, dim=1)

    def varlen(q, k, v, cu_):
        kernel = packing.packed_kernel(
            device_type="cuda",
            dtype="bfloat16",
            dropout=0.0,
            head_dim=a.head_dim,
            varlen_available=packing._varlen() is not None,
        )
        assert kernel == "varlen", f"llmft would not use varlen here ({kernel}): PyTorch {torch.__version__}"
        return packing.packed_sdpa_forward(
            module,
            q,
            k,
            v,
            None,
            cu_seq_lens_q=cu_,
            cu_seq_lens_k=cu_,
            max_length_q=max(lengths),
            max_length_k=max(lengths),
            scaling=scaling,
        )[0]

    ways = {"dense mask": dense, "per sample": per_sample, "varlen": varlen}
    # correctness: the same inputs through each way, against per sample
    (q, k, v), cu_ = fresh(cu)
    grad_out = torch.randn(1, a.tokens, a.heads, a.head_dim, device="cuda", dtype=torch.bfloat16)
    results = {}
    for name, fn in ways.items():
        for t in (q, k, v):
            t.grad = None
        out = fn(q, k, v, cu_.clone())
        out.backward(grad_out)
        results[name] = [out.detach().float()] + [t.grad.detach().float() for t in (q, k, v)]

    def rel(x, y):
        return ((x - y).norm() / y.norm()).item()

    errors = {name: max(rel(x, y) for x, y in zip(results[name], results["per sample"])) for name in ways}
    # timing: forward + backward, fresh inputs each time
    times = {}
    for name, fn in ways.items():
        samples = []
        for i in range(a.repeats + 3):
            (q, k, v), cu_ = fresh(cu)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn(q, k, v, cu_).backward(grad_out)
            end.record()
            torch.cuda.synchronize()
            if i >= 3:
                samples.append(start.elapsed_time(end))
        times[name] = statistics.median(samples)
    print(
        f"{torch.cuda.get_device_name(0)}; torch {torch.__version__}; one packed row of {a.tokens} tokens, "
        f"{len(lengths)} samples of {a.lo}-{a.hi} tokens; {a.heads} heads / {a.kv_heads} KV heads x {a.head_dim}, bf16"
    )
    print("| attention | fwd+bwd ms (median) | vs per sample | max rel. error vs per sample |\n|---|---|---|---|")
    for name in ways:
        print(f"| {name} | {times[name]:.3f} | {times['per sample'] / times[name]:.2f}x | {errors[name]:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

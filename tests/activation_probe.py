"""What one rank keeps for the backward pass, measured: the bytes of every tensor autograd saves in a training-mode
forward (decoder layers, final norm and LM head), parameters excluded, each storage counted once.

    python tests/activation_probe.py --lengths 512 2048 [--tiled_mlp]
    python -m torch.distributed.run --nproc_per_node 2 tests/activation_probe.py --lengths 512 2048

Under torchrun the ranks form one Ulysses group through DeepSpeed's own integration (UlyssesSPAttentionHF over
SDPA), and each rank runs its 1/N of the sequence, as a --sequence_parallel run's rank does. Rank 0 prints one JSON
line: {"world": N, "bytes": {length: bytes}}. The model is a small Llama (4 layers, hidden 64, grouped KV heads)
in fp32, llmft's CPU precision.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

CONFIG = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=8192,
)


def config() -> LlamaConfig:
    return LlamaConfig(**CONFIG, attn_implementation="sdpa")


def saved_bytes(model, input_ids, position_ids) -> int:
    """Bytes of the tensors autograd saves in one forward, parameters left out, a storage counted once."""
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hidden = model.model(input_ids=input_ids, position_ids=position_ids).last_hidden_state
        model.lm_head(hidden)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(size for ptr, size in seen.items() if ptr not in params)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", required=True)
    parser.add_argument("--tiled_mlp", action="store_true")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = 0
    torch.manual_seed(0)
    model = LlamaForCausalLM(config())
    if world > 1:
        import deepspeed
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        from llmft.training.deepspeed_env import skip_deepspeed_shm_op

        # as llmft train starts it: no JIT build of DeepSpeed's CPU shared-memory op, which training never uses (a
        # build killed mid-way leaves torch's lock file, and every later start would wait on it)
        skip_deepspeed_shm_op()
        deepspeed.init_distributed(dist_backend="gloo")  # DeepSpeed's comm layer, which its Ulysses groups use
        rank = dist.get_rank()

        UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", world, 1)
    if args.tiled_mlp:
        from llmft.training import tiled_mlp

        tiled_mlp.install(model, "llama")
    model.train()
    out = {}
    for length in args.lengths:
        ids = torch.randint(0, CONFIG["vocab_size"], (1, length), generator=torch.Generator().manual_seed(length))
        part = length // world  # this rank's chunk, as DeepSpeed's UlyssesSPDataLoaderAdapter splits a batch
        chunk = slice(rank * part, (rank + 1) * part)
        positions = torch.arange(length).unsqueeze(0)
        out[length] = saved_bytes(model, ids[:, chunk], positions[:, chunk])
    if rank == 0:
        print(json.dumps({"world": world, "bytes": out}), flush=True)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""--tiled_mlp: DeepSpeed's TiledMLP (the MLP part of ALST) on every gated MLP of the model.

A decoder layer's MLP keeps its widest tensors for the backward (gate, up, their activation and product: 4 x the
intermediate width per token, the largest share of a layer's activations at long sequences). DeepSpeed's
`TiledMLP` runs the MLP in shards of the sequence without autograd, keeps only its input, and in the backward
recomputes one shard at a time (llmft.planning.memory counts both). transformers does not apply it; ALST's recipe
(DeepSpeed's TiledMLP docstring) replaces the MLP's forward, which is what `install` does, per module instance.

Shards: one per `hidden` tokens of the sequence on this rank (DeepSpeed's recipe; the planner counts with the same
function, llmft.planning.memory.tiled_mlp_shards), the largest count over all ranks: under ZeRO-3 each shard
gathers the MLP's weights, a collective every rank must join the same number of times.
"""

from __future__ import annotations

from llmft.errors import LlmftError
from llmft.planning.memory import tiled_mlp_shards

GATED = ("gate_proj", "up_proj", "down_proj", "act_fn")


class TiledMlpError(LlmftError, ValueError):
    """--tiled_mlp cannot apply to this model; the message names the fix."""


def gated_mlps(model) -> list:
    """The modules whose forward is down(act(gate(x)) * up(x)): Llama, Qwen, Mistral, Gemma."""
    return [m for m in model.modules() if all(hasattr(m, name) for name in GATED) and type(m).__name__.endswith("MLP")]


def install(model, model_type: str) -> int:
    """Every gated MLP of `model` runs through DeepSpeed's TiledMLP; returns how many. Refused, in one line, when the
    installed DeepSpeed has no TiledMLP or the model has no gated MLP."""
    try:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
    except ImportError:
        raise TiledMlpError(
            "--tiled_mlp needs DeepSpeed's TiledMLP (deepspeed.runtime.sequence_parallel.ulysses_sp, DeepSpeed "
            "0.17.2+): upgrade deepspeed, or drop --tiled_mlp"
        ) from None
    import torch
    import torch.distributed as dist

    mlps = gated_mlps(model)
    if not mlps:
        raise TiledMlpError(
            f"--tiled_mlp tiles gated MLPs (gate_proj, up_proj, down_proj: Llama, Qwen, Mistral, Gemma); a {model_type} "
            "model has none: drop --tiled_mlp"
        )

    def mlp_forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def tiled_forward(self, x):
        count = tiled_mlp_shards(x.shape[-1], x.shape[-2])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            agreed = torch.tensor(count, device=x.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            count = int(agreed.item())
        params = [p for p in self.parameters() if p.requires_grad]
        return TiledMLP.apply(mlp_forward, self, x, count, params)

    for mlp in mlps:
        mlp.forward = tiled_forward.__get__(mlp)
    return len(mlps)

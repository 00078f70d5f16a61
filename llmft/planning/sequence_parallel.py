"""Ulysses sequence parallelism (`--sequence_parallel N`): the layout, what a model and run need for it, and the
gradient correction the HF path needs.

DeepSpeed's Ulysses (the sequence part of ALST) splits every sample's sequence over N ranks and exchanges attention
heads with an all-to-all, so each rank holds 1/N of the activations. llmft runs it through the HF stack's own
integration (accelerate's `ParallelismConfig(sp_backend="deepspeed")`, which the Trainer passes to DeepSpeed); this
module holds the decisions, as pure functions:

- the layout: world = data-parallel x N, and the global batch counts data-parallel ranks only (the N ranks of a
  group train the same samples);
- the model: attention heads divisible by N, KV heads divisible by N or N by them (DeepSpeed's rule), and a config
  that names its KV heads (DeepSpeed reads `num_key_value_heads`: GPT-2's config has none);
- the attention: not eager (it needs a 4D mask Ulysses drops), and no packed or padding-free batches unless the
  kernel reads sample boundaries from position_ids (flash-attention): SDPA would attend across packed samples;
- the gradients: under ZeRO stages 0-2 the HF path's gradients come out N times too large (each rank backpropagates
  the gathered loss of the whole sequence, and DeepSpeed then sums, not averages, over the sequence group).
  Measured on CPU with plain SGD (2 ranks, N=2, one data-parallel group, against 1 rank on the same samples): the
  grad norm was 2.0x and the second step's loss differed; ZeRO-3 matched (tests/test_sequence_parallel.py).
  DeepSpeed issue #5248 reports the same factor. `gradient_scale` says what llmft multiplies the loss's gradient by,
  and refuses ZeRO-3 with `reduce_scatter: false`, whose buckets mix both behaviours.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmft.errors import LlmftError

# attention implementations that take sample boundaries from position_ids, so packed samples stay apart under SP
BOUNDARY_AWARE = ("flash_attention_2", "flash_attention_3")


class SequenceParallelError(LlmftError, ValueError):
    """A sequence-parallel run that cannot work as asked; the message names the fix."""


@dataclass(frozen=True)
class Layout:
    world_size: int
    sequence_parallel: int

    @property
    def data_parallel(self) -> int:
        return self.world_size // self.sequence_parallel

    def line(self) -> str:
        """What the start lines say, e.g. '8 ranks = 2 data-parallel x 4 sequence-parallel'."""
        ranks = f"{self.world_size} rank{'s' if self.world_size != 1 else ''}"
        return f"{ranks} = {self.data_parallel} data-parallel x {self.sequence_parallel} sequence-parallel"


def plan_layout(world_size: int, sequence_parallel: int) -> Layout:
    """The layout of `world_size` ranks in groups of `sequence_parallel`; refused when they do not divide."""
    n = sequence_parallel
    if not isinstance(n, int) or n < 1:
        raise SequenceParallelError(f"--sequence_parallel must be a positive integer, got {n!r}")
    if world_size % n:
        fits = [d for d in range(1, world_size + 1) if world_size % d == 0 and d > 1]
        hint = f"--sequence_parallel {' or '.join(map(str, fits))}" if fits else "1 (no sequence parallelism)"
        raise SequenceParallelError(
            f"--sequence_parallel {n} does not divide the world size {world_size}: the ranks form groups of N; "
            f"use {hint}, or a job with a multiple of {n} processes"
        )
    return Layout(world_size, n)


def check_model(sequence_parallel: int, model_type: str, heads: int | None, kv_heads: int | None) -> None:
    """DeepSpeed's Ulysses splits attention heads over the N ranks: heads divisible by N, and KV heads divisible by N
    or N by them (KV heads are then replicated)."""
    n = sequence_parallel
    if n == 1:
        return
    if heads is None or kv_heads is None:
        raise SequenceParallelError(
            f"--sequence_parallel needs a model whose config names its attention and KV heads (num_attention_heads, "
            f"num_key_value_heads: Llama, Qwen, Mistral, Gemma); a {model_type} model has none: drop "
            "--sequence_parallel"
        )
    if heads % n:
        fits = [d for d in range(2, heads + 1) if heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0)]
        raise SequenceParallelError(
            f"--sequence_parallel {n} does not divide the model's {heads} attention heads: use "
            + (f"--sequence_parallel {' or '.join(map(str, fits))}" if fits else "no sequence parallelism")
        )
    if kv_heads % n and n % kv_heads:
        raise SequenceParallelError(
            f"--sequence_parallel {n} and the model's {kv_heads} KV heads divide neither way (DeepSpeed's Ulysses "
            f"splits or replicates them): use a --sequence_parallel that divides {kv_heads} or is a multiple of it"
        )


def check_attention(sequence_parallel: int, attention: str, packing: bool, padding_free: bool) -> None:
    """Ulysses drops the attention mask: eager attention cannot run without it, and packed or padding-free rows
    stay apart only with a kernel that reads sample boundaries from position_ids."""
    if sequence_parallel == 1:
        return
    if attention in ("eager", "paged|eager"):
        raise SequenceParallelError(
            f"--sequence_parallel needs an attention that works without a 4D mask; {attention} does not: use "
            "--attn_implementation sdpa (or flash_attention_2 on GPUs)"
        )
    if (packing or padding_free) and attention not in BOUNDARY_AWARE:
        what = "--packing" if packing else "--padding_free"
        raise SequenceParallelError(
            f"{what} with --sequence_parallel and {attention} attention would let samples attend to each other "
            f"(Ulysses drops the mask that keeps them apart): use --attn_implementation flash_attention_2 (GPUs), "
            f"or drop {what}"
        )


def pad_to_multiple_of(sequence_parallel: int, given: int | None, cuda: bool, max_length: int | None) -> int | None:
    """The collator's padding under Ulysses: every row's length divisible by N (DeepSpeed splits it in N equal
    chunks). On GPUs (NCCL) the ranks of a group may gather rows of different lengths; gloo's all-gather needs the
    same shape on every rank, so CPU runs pad every row to max_length (rounded up to a multiple of N).
    A --pad_to_multiple_of the user gave must be a multiple of N; it is kept on GPUs."""
    n = sequence_parallel
    if n == 1:
        return given
    if given is not None and given % n:
        raise SequenceParallelError(
            f"--pad_to_multiple_of {given} is not a multiple of --sequence_parallel {n} (Ulysses splits each row in "
            f"{n} equal parts): use --pad_to_multiple_of {given * n // math.gcd(given, n)}, or leave it out"
        )
    if cuda:
        return given or n
    if max_length is None:
        raise SequenceParallelError(
            "--sequence_parallel on CPU pads every row to --max_length (gloo gathers equal shapes only): give --max_length"
        )
    return -(-max_length // n) * n


def gradient_scale(zero_stage: int, sequence_parallel: int, reduce_scatter: bool = True) -> float:
    """What the loss's gradient is multiplied by so a sequence-parallel step equals the same step without it: 1/N
    under ZeRO 0-2 (DeepSpeed sums their gradients over the sequence group), 1 under ZeRO-3 (it averages). Measured,
    see the module docstring. ZeRO-3 with `reduce_scatter: false` is refused: DeepSpeed 0.19.8 (stage3.py) then
    all-reduces each bucket that fits `reduce_bucket_size` in its contiguous buffer divided by world / N, as ZeRO-1/2
    do (summed over the sequence group), but still reduce-scatters, averaged, a parameter larger than the bucket, so
    no one scale is right: on CPU (2 ranks, N=2, the tiny Llama) its grad norm was 1.49x the 1-rank run's."""
    if sequence_parallel == 1:
        return 1.0
    if zero_stage == 3 and not reduce_scatter:
        raise SequenceParallelError(
            "--sequence_parallel under ZeRO-3 with reduce_scatter: false in the DeepSpeed config would scale some "
            "gradients N times too large (DeepSpeed sums small buckets over the sequence group and averages large "
            "parameters): remove reduce_scatter: false from the config, or use --zero_stage 2"
        )
    if zero_stage == 3:
        return 1.0
    return 1.0 / sequence_parallel

"""Ulysses sequence parallelism in the Trainer: accelerate's ParallelismConfig for it, the loss whose gradient
llmft.planning.sequence_parallel.gradient_scale corrects (the value logged stays the loss itself), and a resume.

A resume mid-epoch skips the batches already trained with accelerate's `skip_first_batches`, which the Trainer hands
DeepSpeed's UlyssesSPDataLoaderAdapter: it has no `dataset` and the resume fails (AttributeError). `skip_trained`
skips inside the adapter instead: the adapter yields N micro-batches (one gathered from each rank of the group) per
batch of the loader it wraps, so n of its micro-batches are n // N of the loader's batches and n % N of its own.
"""

from __future__ import annotations


def parallelism_config(sequence_parallel: int, data_parallel: int, attention: str):
    """accelerate's config for DeepSpeed's Ulysses (None without sequence parallelism): N ranks a group,
    `data_parallel` groups, the model's own attention inside (DeepSpeed checks they match), and sequences whose
    length changes from batch to batch (llmft's batches are padded to their longest sample, not to max_length)."""
    if sequence_parallel == 1:
        return None
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    return ParallelismConfig(
        sp_backend="deepspeed",
        sp_size=sequence_parallel,
        dp_replicate_size=data_parallel,
        sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation=attention),
    )


def scale_gradient(loss, scale: float):
    """`loss` with its gradient multiplied by `scale` and its value unchanged (what the Trainer logs)."""
    if scale == 1.0:
        return loss
    return loss * scale + (loss * (1.0 - scale)).detach()


def mixin_class(base, scale: float):
    """`base` whose training loss gradient is multiplied by `scale` (1: `base` itself)."""
    if scale == 1.0:
        return base

    class UlyssesGradientTrainer(base):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if not model.training:
                return out
            if return_outputs:
                return scale_gradient(out[0], scale), out[1]
            return scale_gradient(out, scale)

    return UlyssesGradientTrainer


def skip_trained(adapter, num_batches: int):
    """DeepSpeed's UlyssesSPDataLoaderAdapter over the same loader, past its first `num_batches` micro-batches."""
    from accelerate import skip_first_batches

    n = adapter.sp_world_size
    inner = skip_first_batches(adapter.dl, num_batches // n) if num_batches >= n else adapter.dl
    skipped = type(adapter)(
        inner, sp_rank=adapter.sp_rank, sp_group=adapter.sp_group, sp_world_size=n, device=adapter.device
    )
    for _ in range(num_batches % n):  # every rank of the group draws the same micro-batches: no rank waits alone
        next(skipped)
    return skipped


def install_resume_skip() -> None:
    """The Trainer's skip_first_batches, for a loader wrapped by DeepSpeed's Ulysses adapter, skips inside it; any other
    loader goes to accelerate's as before."""
    import transformers.trainer as hf_trainer

    original = hf_trainer.skip_first_batches
    if getattr(original, "llmft_ulysses", False):
        return

    def skip_first_batches(dataloader, num_batches: int = 0):
        if type(dataloader).__name__ == "UlyssesSPDataLoaderAdapter":
            return skip_trained(dataloader, num_batches)
        return original(dataloader, num_batches)

    skip_first_batches.llmft_ulysses = True
    hf_trainer.skip_first_batches = skip_first_batches

"""Ulysses sequence parallelism in the Trainer: accelerate's ParallelismConfig for it, the loss whose gradient
llmft.planning.sequence_parallel.gradient_scale corrects (the value logged stays the loss itself), and a resume.

A resume mid-epoch skips the batches already trained with accelerate's `skip_first_batches`, which the Trainer hands
DeepSpeed's UlyssesSPDataLoaderAdapter: it has no `dataset` and the resume fails (AttributeError). `skip_trained`
skips inside the adapter instead: the adapter yields N micro-batches (one gathered from each rank of the group) per
batch of the loader it wraps, so n of its micro-batches are n // N of the loader's batches and n % N of its own.

Epochs (DeepSpeed 0.19.8's adapter, read in its source and measured in tests/test_sequence_parallel.py): the adapter
has no `set_epoch`, so the Trainer's per-epoch reseed never reaches the loader it wraps, and a run resumed in epoch
2 or later drew epoch 1's order; and it starts its next pass only when the old one raises StopIteration, which the
Trainer (it stops after the epoch's last batch) meets as the first batch of the next epoch: every epoch after the first
lost its first optimizer step's batches (2 epochs of 6 steps trained 11). `epoch_adapter` is the adapter with both
fixed: `set_epoch` reseeds the wrapped loader as the Trainer reseeds one without sequence parallelism, `iter()`
starts a new pass, and a resume's skip inside a gathered batch happens at the pass's first batch, after the reseed.
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


def reseed(loader, epoch: int) -> None:
    """What the Trainer does to its train loader at each epoch (transformers' _run_epoch), done to `loader`."""
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    underlying = getattr(getattr(loader, "batch_sampler", None), "batch_sampler", None)
    if hasattr(underlying, "set_epoch"):
        underlying.set_epoch(epoch)


def epoch_adapter(dl, sp_rank: int, sp_group, sp_world_size: int, device, skip: int = 0):
    """DeepSpeed's UlyssesSPDataLoaderAdapter over `dl` with epochs (the module docstring), its first pass `skip`
    micro-batches in."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    class EpochAdapter(UlyssesSPDataLoaderAdapter):
        def set_epoch(self, epoch: int) -> None:
            reseed(self.dl, epoch)

        def __iter__(self):
            self.iter = iter(self.dl)  # a new pass; the reseed before it reaches the loader when it starts
            self.micro_batches.clear()
            return self

        def __next__(self):
            while self.skip:  # every rank of the group draws the same micro-batches: no rank waits alone
                self.skip -= 1
                super().__next__()
            return super().__next__()

    adapter = EpochAdapter(dl, sp_rank=sp_rank, sp_group=sp_group, sp_world_size=sp_world_size, device=device)
    adapter.skip = skip
    return adapter


def skip_trained(adapter, num_batches: int):
    """The Ulysses adapter over the same loader, past its first `num_batches` micro-batches."""
    from accelerate import skip_first_batches

    n = adapter.sp_world_size
    inner = skip_first_batches(adapter.dl, num_batches // n) if num_batches >= n else adapter.dl
    return epoch_adapter(inner, adapter.sp_rank, adapter.sp_group, n, adapter.device, skip=num_batches % n)


def install_epoch_adapter(trainer) -> None:
    """The Trainer's Ulysses adapter (accelerate's deepspeed_ulysses_dl_adapter, applied when training starts) with
    epochs; nothing without sequence parallelism."""
    accelerator = trainer.accelerator
    config = getattr(accelerator, "parallelism_config", None)
    if config is None or not config.sp_enabled:
        return
    original = accelerator.deepspeed_ulysses_dl_adapter

    def with_epochs(dl, model):
        plain = original(dl, model)
        return epoch_adapter(plain.dl, plain.sp_rank, plain.sp_group, plain.sp_world_size, plain.device)

    accelerator.deepspeed_ulysses_dl_adapter = with_epochs


def install_resume_skip() -> None:
    """The Trainer's skip_first_batches, for a loader wrapped by DeepSpeed's Ulysses adapter, skips inside it; any other
    loader goes to accelerate's as before."""
    import transformers.trainer as hf_trainer

    original = hf_trainer.skip_first_batches
    if getattr(original, "llmft_ulysses", False):
        return

    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    def skip_first_batches(dataloader, num_batches: int = 0):
        if isinstance(dataloader, UlyssesSPDataLoaderAdapter):
            return skip_trained(dataloader, num_batches)
        return original(dataloader, num_batches)

    skip_first_batches.llmft_ulysses = True
    hf_trainer.skip_first_batches = skip_first_batches

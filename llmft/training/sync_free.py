"""The trainer's per-micro-batch work without device-to-host syncs.

A GPU runs ahead of Python: the host queues kernels and only waits when it reads a value back (`.item()`,
`.tolist()`, `bool(tensor)`). One such read per micro-batch stalls the queue every micro-batch, and small fast
micro-batches pay it most. Three of them sat in every default (padded) training step, and llmft takes them out
here, keeping what each computes:

- TRL's SFTTrainer.compute_loss all-gathers entropy, token accuracy and the token count over ranks and reads them
  back (`.item()`) at every micro-batch. Here each micro-batch's sums stay on the device; at a logging step one
  all-reduce and one `.tolist()` give the same per-micro-batch values TRL would have averaged (the mean, over the
  interval's micro-batches, of each one's all-rank ratio), and the same cumulative `num_tokens`.
- HF's `logging_nan_inf_filter` (on by default) asks `torch.isnan(loss) or torch.isinf(loss)` after every
  micro-batch. Here the same replacement (a non-finite loss is logged as the interval's mean so far) is a
  `torch.where` on the device; the Trainer's own check is turned off (its args say False once built).
- llmft's packed attention read the sample boundaries back once per forward (llmft.packing: the varlen kernel now
  takes the longest sample from the collator's host-side `max_length_q`).

Evaluation keeps TRL's own path (it is not the per-micro-batch training loop), and so do TRL's other loss paths
(a `compute_loss_func`, label smoothing, MoE auxiliary loss, sequence parallelism), which this does not replicate.
tests/test_sync_free.py checks the logged values against TRL's and counts the syncs of a real run.
"""

from __future__ import annotations

METRICS = ("entropy", "mean_token_accuracy")


def plain_loss_path(trainer) -> bool:
    """Whether TRL's compute_loss would take its plain path (the model's fused log-probs, nll or dft) for training:
    the only path mixin_class replicates."""
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    sequence_parallel = (
        pc is not None and getattr(pc, "sp_backend", None) == "deepspeed" and getattr(pc, "sp_enabled", False)
    )
    return not (
        sequence_parallel
        or trainer.compute_loss_func is not None
        or (trainer.label_smoother is not None and trainer.args.loss_type == "nll")
        or trainer.aux_loss_enabled
    )


def reduce_metrics(
    rows, total_tokens_before: int, tp_size: int, all_reduce=None
) -> tuple[dict[str, list[float]], int]:
    """TRL's logged values from the interval's per-micro-batch sums: `rows` is a (micro-batches, 4) tensor of
    [label tokens, entropy sum, top-1 hits, input tokens] on this rank; `all_reduce` sums it over ranks in place.
    Returns ({"entropy": [...], "mean_token_accuracy": [...]} per micro-batch, the new cumulative token count)."""
    if all_reduce is not None:
        all_reduce(rows)
    valid, entropy, correct, tokens = rows.double().cpu().T.tolist()  # the one host copy of the interval

    def ratio(num: float, n: float) -> float:
        return num / n if n > 0 else 0.0

    total = total_tokens_before
    for t in tokens:
        total += int(t) // tp_size
    return {
        "entropy": [ratio(e, n) for e, n in zip(entropy, valid)],
        "mean_token_accuracy": [ratio(c, n) for c, n in zip(correct, valid)],
    }, total


def mixin_class(base):
    """`base` (TRL's SFTTrainer or a subclass) with the syncs above taken out of training."""
    import torch

    class SyncFreeTrainer(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._llmft_rows: list = []  # per training micro-batch: a (4,) tensor on the device
            # logging_nan_inf_filter: applied on the device here, so the Trainer's loop must not check it too
            self._llmft_nan_inf_filter, self.args.logging_nan_inf_filter = self.args.logging_nan_inf_filter, False

        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            if self._llmft_nan_inf_filter:
                # HF's filter: a non-finite loss is logged as the mean of the interval's logged losses so far
                fallback = self._tr_loss / (1 + self.state.global_step - self._globalstep_last_logged)
                loss = torch.where(torch.isfinite(loss), loss, fallback.to(loss.dtype))
            return loss

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if return_outputs or not self.model.training or not plain_loss_path(self):
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            # TRL 1.16's plain path (trl/trainer/sft_trainer.py SFTTrainer.compute_loss), metrics kept on the device
            inputs["use_cache"] = False
            outputs = model(**inputs, fused_lm_head=True)
            per_token_loss = -outputs.log_probs  # zero on ignored positions
            if self.args.loss_type == "dft":
                per_token_loss = per_token_loss * outputs.log_probs.exp().detach()
            num_tokens = outputs.label_mask.sum() if num_items_in_batch is None else num_items_in_batch
            loss = per_token_loss.sum() / torch.as_tensor(num_tokens).clamp(min=1)
            if self.args.average_tokens_across_devices and num_items_in_batch is not None:
                loss = loss * (self.accelerator.num_processes // self.get_tp_size())
            device = loss.device
            if "attention_mask" in inputs:
                fed = inputs["attention_mask"].sum()
            elif "position_ids" in inputs:  # torch.full: a fill kernel, no copy from the host
                fed = torch.full((), float(inputs["position_ids"].size(1)), dtype=torch.float64, device=device)
            else:
                raise ValueError("Expected 'attention_mask' or 'position_ids' in inputs.")
            self._llmft_rows.append(
                torch.stack(
                    [
                        outputs.label_mask.sum().to(device, torch.float64),
                        outputs.entropy.detach().sum().to(device, torch.float64),
                        outputs.is_top1.sum().to(device, torch.float64),
                        fed.to(device, torch.float64),
                    ]
                )
            )
            return loss

        def log(self, logs, start_time=None):
            if self.model.training and self._llmft_rows:  # every rank logs at the same step: the collective is safe
                import torch.distributed as dist

                rows, self._llmft_rows = torch.stack(self._llmft_rows), []
                reduce = dist.all_reduce if dist.is_available() and dist.is_initialized() else None
                values, self._total_train_tokens = reduce_metrics(
                    rows, self._total_train_tokens, self._tp_size, reduce
                )
                for name in METRICS:
                    self._metrics["train"][name].extend(values[name])
                self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
            return super().log(logs, start_time)

    return SyncFreeTrainer

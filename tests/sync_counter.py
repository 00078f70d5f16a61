"""Counting device-to-host syncs on a CPU: every host read of a tensor (item, tolist, bool, float, int, cpu, numpy),
by call site, made from the first micro-batch of each optimizer step to just before its optimizer step (forward,
backward, loss, metrics and the training loop's per-micro-batch code). On a GPU each of them waits for the GPU."""

from __future__ import annotations

import contextlib
import traceback

import torch
import transformers
from transformers import TrainerCallback

SYNC_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")
# The model's own forward, which llmft does not change: transformers' SDPA mask checks a padded batch's mask
# (`padding_mask.all()`), looks for packed sequences in a padding-free batch's position ids, and GPT-2 checks for
# pad tokens without a mask: one or two reads per forward.
MODEL_CODE = ("transformers/masking_utils.py", "transformers/modeling_utils.py", "transformers/models/")


class SyncCounter:
    def __init__(self):
        self.on = False
        self.micro_batches = 0
        self.sites: dict[str, int] = {}

    @contextlib.contextmanager
    def installed(self):
        """Count while installed: torch.Tensor's host reads, and the Trainer's micro-batches inside the window."""
        originals = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}
        training_step = transformers.Trainer.training_step
        counter = self

        def counted(name, original):
            def read(tensor, *args, **kwargs):
                if counter.on:
                    frames = traceback.extract_stack(limit=12)[:-1]
                    frame = next((f for f in reversed(frames) if "/torch/" not in f.filename), frames[-1])
                    path = frame.filename.split("site-packages/")[-1]
                    path = "llmft/" + path.split("/llmft/")[-1] if "/llmft/" in path else path
                    site = f"{name} {path}:{frame.lineno}"
                    counter.sites[site] = counter.sites.get(site, 0) + 1
                return original(tensor, *args, **kwargs)

            return read

        def counted_step(trainer, *args, **kwargs):
            counter.micro_batches += counter.on
            return training_step(trainer, *args, **kwargs)

        for name, original in originals.items():
            setattr(torch.Tensor, name, counted(name, original))
        transformers.Trainer.training_step = counted_step
        try:
            yield self
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)
            transformers.Trainer.training_step = training_step

    def callback(self) -> TrainerCallback:
        counter = self

        class Window(TrainerCallback):
            def on_step_begin(self, *args, **kwargs):
                counter.on = True

            def on_pre_optimizer_step(self, *args, **kwargs):
                counter.on = False

        return Window()

    def outside_model_code(self) -> dict[str, int]:
        return {site: n for site, n in self.sites.items() if not any(part in site for part in MODEL_CODE)}

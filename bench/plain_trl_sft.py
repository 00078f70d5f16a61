"""The baseline for bench_overhead.py and gpu_suite.py: TRL's SFTTrainer on DeepSpeed with nothing of llmft, as a
user would write it.

    torchrun --nproc_per_node 2 bench/plain_trl_sft.py MODEL DATA.jsonl OUT DS_CONFIG.json \
        --micro_batch 8 --grad_accum 2 --max_steps 30 --learning_rate 3e-3 --logging_steps 10
    python bench/plain_trl_sft.py ... --max_length 2048 --packing --summary OUT/plain_summary.json

Only what TRL + DeepSpeed need to run at all on a CPU machine is added (use_cpu, fp32, a gloo process group),
the same three settings llmft makes; everything else is TRL's default (max_length and packing only when given).

--summary measures the run the way `llmft train`'s run_summary.json does, for a side-by-side table: real (non-padding)
tokens counted per micro-batch with llmft's own counter (llmft.training.metrics.batch_counts, on the device, no host
sync), timed from the end of the first optimizer step (warm-up) to the end of the last one, with one synchronisation
at each end of that window; TFLOP/s and MFU from llmft's FLOP count; the peak allocated GPU memory. A measured run
saves nothing (a 1.24B model's end-of-run checkpoint is 17 GB: it filled a lent H100 machine's disk on 2026-11-27).
"""

import argparse
import json
import os
import time

import deepspeed
import torch
from datasets import load_dataset
from transformers import AutoTokenizer, TrainerCallback
from trl import SFTConfig, SFTTrainer

p = argparse.ArgumentParser()
for name in ("model", "data", "out", "ds_config"):
    p.add_argument(name)
p.add_argument("--micro_batch", type=int, required=True)
p.add_argument("--grad_accum", type=int, required=True)
p.add_argument("--max_steps", type=int, required=True)
p.add_argument("--learning_rate", type=float, required=True)
p.add_argument("--logging_steps", type=int, required=True)
p.add_argument("--max_length", type=int, default=None, help="SFTConfig.max_length (TRL's default when not given)")
p.add_argument("--packing", action="store_true", help="SFTConfig(packing=True)")
p.add_argument("--summary", default=None, help="write the measured rates here (JSON)")
a = p.parse_args()

cuda = torch.cuda.is_available()
extra = {"max_length": a.max_length} if a.max_length else {}
if a.summary:
    extra["save_strategy"] = "no"
args = SFTConfig(
    output_dir=a.out,
    deepspeed=a.ds_config,
    per_device_train_batch_size=a.micro_batch,
    gradient_accumulation_steps=a.grad_accum,
    max_steps=a.max_steps,
    learning_rate=a.learning_rate,
    logging_steps=a.logging_steps,
    report_to="none",
    disable_tqdm=True,
    bf16=cuda,
    use_cpu=not cuda,
    dataloader_pin_memory=cuda,
    packing=a.packing,
    **extra,
)
_ = args.device
deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")


class Measured(SFTTrainer):
    """SFTTrainer that adds each micro-batch's token counts to a device tensor (the measurement only)."""

    counts = None

    def training_step(self, model, inputs, *rest, **kwargs):
        from llmft.training.metrics import batch_counts

        c = batch_counts(inputs)
        self.counts = c if self.counts is None else self.counts + c
        return super().training_step(model, inputs, *rest, **kwargs)


class Window(TrainerCallback):
    """The clock and the counts at the end of the first optimizer step and of the last."""

    marks: list = []

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in (1, args.max_steps):
            if cuda:
                torch.cuda.synchronize()
            self.marks.append((state.global_step, time.perf_counter(), trainer.counts.tolist()))


trainer_class = Measured if a.summary else SFTTrainer
trainer = trainer_class(
    model=a.model,
    args=args,
    train_dataset=load_dataset("json", data_files=a.data, split="train"),
    processing_class=AutoTokenizer.from_pretrained(a.model),
    callbacks=[Window()] if a.summary else None,
)
trainer.train()
if a.summary and trainer.is_world_process_zero():
    from llmft.planning.hardware import local_gpu
    from llmft.training.metrics import flop_shape, mfu, training_flops

    (s0, t0, c0), (s1, t1, c1) = Window.marks[0], Window.marks[-1]
    seconds, world = t1 - t0, trainer.args.world_size
    real, padded, sum_sq = (x1 - x0 for x0, x1 in zip(c0, c1))  # this rank's; the ranks see equal shares
    tflops = training_flops(flop_shape(trainer.model), real, sum_sq) / seconds / 1e12
    gpu = local_gpu() if cuda else None
    summary = {
        "window_steps": s1 - s0,
        "window_seconds": round(seconds, 3),
        "tokens_per_second": real * world / seconds,
        "padded_tokens_per_second": padded * world / seconds,
        "tflops_per_gpu": tflops,
        "mfu": mfu(tflops, gpu),
        "peak_gpu_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "world_size": world,
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.summary)), exist_ok=True)
    with open(a.summary, "w") as f:
        json.dump(summary, f, indent=1)
if not a.summary:
    trainer.save_model(a.out)
trainer.end()  # destroys the process group before exit (see tests/test_zero_checkpoint.py)

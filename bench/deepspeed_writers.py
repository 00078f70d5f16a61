"""Does DeepSpeed 0.19.8's own checkpoint writing work where llmft runs (torchrun, gloo on CPU, no model-parallel unit)?

    python -m torch.distributed.run --nproc_per_node 2 bench/deepspeed_writers.py MODE OUT_DIR
    MODE: torch (the default engine) | python | fast | decoupled    (`"checkpoint": {"writer": {...}}`)

A 4-layer GPT-2 under ZeRO-2 trains 4 steps and saves after step 2; rank 0 prints how long save_checkpoint took and
which files existed when it returned. Results (2026-11-25) are in bench/README.md ("Saves that do not stall training").
"""

import os
import sys
import time

import deepspeed
import torch
from transformers import GPT2Config, GPT2LMHeadModel

WRITERS = {
    "torch": None,
    "python": {"type": "python", "data_parallel": "replica"},
    "fast": {"type": "fast", "data_parallel": "replica"},
    "decoupled": {"decoupled": True, "type": "python", "data_parallel": "replica"},
}

mode, out = sys.argv[1], sys.argv[2]
deepspeed.init_distributed(dist_backend="gloo")
cfg = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
}
if WRITERS[mode] is not None:
    cfg["checkpoint"] = {"writer": WRITERS[mode]}
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4))
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
ids = torch.randint(0, 1000, (1, 32))
for step in range(1, 5):
    t = time.perf_counter()
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    t1 = time.perf_counter()
    if step == 2:
        engine.save_checkpoint(out)
    t2 = time.perf_counter()
    tag = os.path.join(out, "global_step2")
    files = sorted(os.listdir(tag)) if os.path.isdir(tag) else []
    if engine.global_rank == 0:
        print(
            f"RESULT {mode} step {step} train {t1 - t:.3f}s save_checkpoint {t2 - t1:.3f}s files {files}", flush=True
        )
torch.distributed.destroy_process_group()  # before exit: see tests/test_zero_checkpoint.py

"""How long DeepSpeed's save_checkpoint holds training: its default engine (torch.save to the files) against
llmft's BackgroundWriter (--async_save: serialise into memory, a thread writes), alternated, in one process.

    python bench/async_save_stall.py [--layers 6] [--repeats 3]

A GPT-2-shaped model (768 wide, 50257 vocabulary, random weights) under ZeRO-2 on one CPU process (gloo) takes one
step, then saves repeatedly into a fresh directory on this machine's disk. Printed per save: the seconds
save_checkpoint blocked, and for the background writer also the seconds until its files were on disk (fsynced).
The full training-loop bench is bench/bench_async_save.py.
"""

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

p = argparse.ArgumentParser()
p.add_argument("--layers", type=int, default=6)
p.add_argument("--repeats", type=int, default=3)
p.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1] / "runs" / "async_save_stall")
a = p.parse_args()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")

import deepspeed  # noqa: E402
import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from llmft.training.async_save import BackgroundWriter  # noqa: E402

deepspeed.init_distributed(dist_backend="gloo")
model = GPT2LMHeadModel(GPT2Config(n_layer=a.layers))
cfg = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
ids = torch.randint(0, 1000, (1, 64))
engine.backward(engine(input_ids=ids, labels=ids).loss)
engine.step()
torch_engine, writer = engine.checkpoint_engine, BackgroundWriter(lambda: False)
params = sum(p.numel() for p in model.parameters())
print(f"GPT-2 {a.layers} x 768, {params / 1e6:.0f}M parameters, ZeRO-2, fp32, 1 process; torch {torch.__version__}")
print(f"{'engine':<12} {'blocked s':>10} {'on disk s':>10} {'MB':>8}")
for i in range(a.repeats):
    for name, ce in (("torch.save", torch_engine), ("background", writer)):
        out = a.root / f"{name}-{i}"
        shutil.rmtree(out, ignore_errors=True)
        engine.checkpoint_engine = ce
        t = time.perf_counter()
        engine.save_checkpoint(str(out))
        blocked = time.perf_counter() - t
        if ce is writer:
            writer.wait()
        else:
            os.sync()  # the synchronous save's bytes are in the page cache: count their flush like the writer's fsync
        on_disk = time.perf_counter() - t
        size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 1e6
        print(f"{name:<12} {blocked:>10.2f} {on_disk:>10.2f} {size:>8.0f}", flush=True)
        shutil.rmtree(out, ignore_errors=True)

"""How long DeepSpeed's save_checkpoint holds training: its default engine (torch.save to the files) against
llmft's BackgroundWriter (--async_save: a host snapshot, then a thread writes), alternated, in one process.

    python bench/async_save_stall.py [--layers 6] [--repeats 3]        # GPT-2-shaped, fp32, CPU (gloo)
    python bench/async_save_stall.py --model llama-1b --repeats 1      # on a GPU: 1.1B Llama shape, bf16, NCCL

One ZeRO-2 process takes one optimizer step, then saves repeatedly into a fresh directory on this machine's disk.
Printed per save: the seconds save_checkpoint blocked and, for the background writers, the seconds until their files
were on disk (fsynced; a synchronous save's are flushed with os.sync). `bytesio` is the earlier --async_save, which
serialised the whole state into a BytesIO on the training thread, kept here to measure the change side by side. The
full training-loop bench is bench/bench_async_save.py.
"""

import argparse
import io
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

p = argparse.ArgumentParser()
p.add_argument("--model", choices=("gpt2", "llama-1b"), default="gpt2")
p.add_argument("--layers", type=int, default=6, help="gpt2 only")
p.add_argument("--repeats", type=int, default=3)
p.add_argument(
    "--engines", nargs="+", choices=("snapshot", "torch.save", "bytesio"), default=None, help="default: all"
)
p.add_argument(
    "--steps_during_write",
    type=int,
    default=0,
    help="then time N steps without a write, and N steps right after a background save, while its write runs",
)
p.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1] / "runs" / "async_save_stall")
a = p.parse_args()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")

import deepspeed  # noqa: E402
import torch  # noqa: E402

from llmft.training.checkpoint_async_save import BackgroundWriter, partial_path  # noqa: E402


def write_bytes(path, data) -> None:
    tmp = partial_path(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class BytesIOWriter(BackgroundWriter):
    """The earlier --async_save: torch.save into a BytesIO on the training thread, a thread writes the bytes."""

    def __init__(self):
        super().__init__(lambda: False, write=write_bytes)

    def save(self, state_dict, path):
        buffer = io.BytesIO()
        torch.save(state_dict, buffer)
        data = buffer.getbuffer()
        with self._lock:
            self._pending += 1
            self.bytes_in_flight += data.nbytes
        self._queue.put((Path(path), data, [], None, data.nbytes))


def build_model():
    if a.model == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(n_layer=a.layers)), "gloo", {}
    from gpu import LLAMA_1B
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**LLAMA_1B)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    return model, "nccl", {"bf16": {"enabled": True}}


model, backend, precision = build_model()
deepspeed.init_distributed(dist_backend=backend)
cfg = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
    **precision,
}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
ids = torch.randint(0, 1000, (1, 64), device=engine.device)
engine.backward(engine(input_ids=ids, labels=ids).loss)
engine.step()
torch_engine, writer, bytesio = engine.checkpoint_engine, BackgroundWriter(lambda: False), BytesIOWriter()
params = sum(p.numel() for p in model.parameters())
device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
print(
    f"{a.model}, {params / 1e6:.0f}M parameters, ZeRO-2, {'bf16' if precision else 'fp32'}, 1 process on {device}; "
    f"torch {torch.__version__}, deepspeed {deepspeed.__version__}; {time.strftime('%Y-%m-%d %H:%M %Z')}"
)
print(f"{'engine':<12} {'blocked s':>10} {'on disk s':>10} {'MB':>8}")
engines = [("snapshot", writer), ("torch.save", torch_engine), ("bytesio", bytesio)]
engines = [(name, ce) for name, ce in engines if a.engines is None or name in a.engines]
for i in range(a.repeats):
    for name, ce in engines + (
        [("snapshot", writer)] if i == a.repeats - 1 and ("snapshot", writer) in engines else []
    ):
        out = a.root / f"{name}-{i}"
        shutil.rmtree(out, ignore_errors=True)
        engine.checkpoint_engine = ce
        t = time.perf_counter()
        engine.save_checkpoint(str(out))
        blocked = time.perf_counter() - t
        if ce is torch_engine:
            os.sync()  # the synchronous save's bytes are in the page cache: count their flush like the writer's fsync
        else:
            ce.wait()
        on_disk = time.perf_counter() - t
        size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 1e6
        print(f"{name:<12} {blocked:>10.2f} {on_disk:>10.2f} {size:>8.0f}", flush=True)
        shutil.rmtree(out, ignore_errors=True)
pinned = sum(h.numel() for pairs in writer._snapshots._free.values() for h, pin in pairs if pin)
print(f"snapshot buffers: {writer._snapshots.allocated_bytes / 1e9:.2f} GB held, {pinned / 1e9:.2f} GB page-locked")


def step_times(n: int) -> list[float]:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times


if a.steps_during_write:
    import statistics

    engine.checkpoint_engine = writer
    quiet = step_times(a.steps_during_write)
    out = a.root / "during-write"
    shutil.rmtree(out, ignore_errors=True)
    engine.save_checkpoint(str(out))
    during = step_times(a.steps_during_write)
    still_writing = writer.busy()
    writer.wait()
    shutil.rmtree(out, ignore_errors=True)
    print(
        f"median step: {statistics.median(quiet):.3f} s without a write, {statistics.median(during):.3f} s while the "
        f"background write runs ({statistics.median(during) / statistics.median(quiet):.2f}x; the write "
        f"{'outlasted' if still_writing else 'ended within'} those {a.steps_during_write} steps)"
    )
torch.distributed.destroy_process_group()  # before exit: see tests/test_zero_checkpoint.py

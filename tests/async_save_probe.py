"""`llmft train` whose background checkpoint writes (llmft.training.checkpoint_async_save) wait for a known step, to test publishing.

Run it like `python -m llmft.train` (under torchrun too). Each rank holds the writes of checkpoint-$LLMFT_PROBE_HOLD_CKPT
until the end of step $LLMFT_PROBE_RELEASE_STEP; at that step end, before releasing them, rank 0 records in
$LLMFT_PROBE_DIR/held.json whether the checkpoint's marker and shard files existed then; the other ranks release
theirs only after that record exists.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import trl
from transformers import TrainerCallback

from llmft.training import checkpoint_async_save

HOLD, RELEASE = f"checkpoint-{os.environ['LLMFT_PROBE_HOLD_CKPT']}", int(os.environ["LLMFT_PROBE_RELEASE_STEP"])
released = threading.Event()


def held_write(path, state, *args, **kwargs):
    if HOLD in Path(path).parts:
        released.wait(timeout=600)
    return original_write(path, state, *args, **kwargs)


class Release(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != RELEASE:
            return
        record = Path(os.environ["LLMFT_PROBE_DIR"]) / "held.json"
        if state.is_world_process_zero:
            ckpt = Path(args.output_dir) / HOLD
            seen = {
                "marker": (ckpt / "llmft_complete.json").exists(),
                "shards": sorted(p.name for p in ckpt.glob("global_step*/*.pt")),
            }
            record.parent.mkdir(parents=True, exist_ok=True)
            (record.parent / "held.json.tmp").write_text(json.dumps(seen))
            (record.parent / "held.json.tmp").replace(record)
        else:  # the other ranks release their writes only once rank 0 has looked: a rank that reached this step end
            # first wrote its shard before rank 0's look (a CI run of 2026-11-27 saw rank 1's optimizer shard there)
            deadline = time.monotonic() + 600
            while not record.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        released.set()


class ProbedTrainer(trl.SFTTrainer):
    def __init__(self, *args, callbacks=None, **kwargs):
        super().__init__(*args, callbacks=[*(callbacks or []), Release()], **kwargs)


if __name__ == "__main__":
    from llmft.train import cli, make_parser

    original_write = checkpoint_async_save.write_file
    checkpoint_async_save.write_file = held_write
    trl.SFTTrainer = ProbedTrainer  # llmft.training.checkpoint_save.trainer_class subclasses trl.SFTTrainer when train builds the trainer
    sys.exit(cli(make_parser()))

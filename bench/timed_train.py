"""`python -m llmft.train` with each checkpoint save timed, for the checkpoint benches. Run it like llmft.train.

Rank 0 prints `bench: checkpoint-N save S s` (Trainer._save_checkpoint: every file of the checkpoint, written) and
`bench: step N end T` (a monotonic clock, at each optimizer step's end), for the bench to compute stalls from.
$BENCH_HF_CHECKPOINT_MODEL=1: checkpoints also get HF's model.safetensors (what llmft wrote before it stopped
duplicating the weights, llmft.training.checkpoint_save), so before and after run side by side in one bench.
"""

from __future__ import annotations

import os
import sys
import time

import transformers
import trl
from transformers import TrainerCallback


class StepClock(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            print(f"bench: step {state.global_step} end {time.monotonic():.4f}", flush=True)


def timed_save(original):
    def save(self, model, trial):
        start = time.perf_counter()
        original(self, model, trial)
        if self.args.process_index == 0:
            print(f"bench: checkpoint-{self.state.global_step} save {time.perf_counter() - start:.3f} s", flush=True)

    return save


class BenchTrainer(trl.SFTTrainer):
    def __init__(self, *args, callbacks=None, **kwargs):
        super().__init__(*args, callbacks=[*(callbacks or []), StepClock()], **kwargs)


if __name__ == "__main__":
    from llmft.train import cli, make_parser
    from llmft.training import checkpoint_save

    transformers.Trainer._save_checkpoint = timed_save(transformers.Trainer._save_checkpoint)
    trl.SFTTrainer = BenchTrainer  # llmft.training.checkpoint_save.trainer_class subclasses trl.SFTTrainer when train builds the trainer
    if os.environ.get("BENCH_HF_CHECKPOINT_MODEL") == "1":
        llmft_class = checkpoint_save.trainer_class

        def hf_checkpoints(save_consolidated: bool = False):
            cls = llmft_class(save_consolidated)

            class HFCheckpointModel(cls):
                def save_model(self, output_dir=None, _internal_call=False):
                    if _internal_call and not checkpoint_save.is_zero3(self):
                        return trl.SFTTrainer.save_model(
                            self, output_dir, _internal_call
                        )  # HF's: model.safetensors too
                    return super().save_model(output_dir, _internal_call)

            return HFCheckpointModel

        checkpoint_save.trainer_class = hf_checkpoints
    sys.exit(cli(make_parser()))

"""`llmft train` with a probe: what the optimizer held when it saved and right after a resume, and the final logits.

Run it exactly like `python -m llmft.train` (under torchrun too). Rank 0 writes to $LLMFT_PROBE_DIR:
  moments-saved-N.pt    every trainable tensor's full Adam exp_avg / exp_avg_sq when checkpoint-N was saved
  moments-resumed-N.pt  the same, read from the engine right after it resumed from checkpoint-N
  logits-N.pt           the trained model's logits for PROBE_IDS at the end of training (step N)
The tensors are gathered with DeepSpeed's own accessors (collective: every rank runs the callback).
$LLMFT_PROBE_SABOTAGE=zero_lora_b breaks every checkpoint's adapter file, to test the save-time check.
$LLMFT_PROBE_SLOW_SAVE=S / $LLMFT_PROBE_SLOW_EVAL=S make every checkpoint save / evaluation take S seconds longer,
to test that the rates leave them out.
$LLMFT_PROBE_MOMENTS=0: none of the files above (only what the variables below ask for).
$LLMFT_PROBE_LISTING=1: listing-at-save-N.json, what --output_dir held when checkpoint-N's files were written and
  before it was published complete: {"checkpoint-K": true if complete else false}.
$LLMFT_PROBE_SYNCS=1 counts the host reads of tensors inside each optimizer step's micro-batches, by call site
(tests/sync_counter.py), and writes syncs.json: {"micro_batches": n, "sites": {site: count}}.
$LLMFT_PROBE_TRAINED=1: trained.jsonl, one line per micro-batch rank 0 trains: {"step": global step before it,
  "rows": the first 8 token ids of each row rank 0 holds} (under --sequence_parallel, rank 0's shard is each row's
  first part: the sample's identity); a resumed run appends to the same file.
$LLMFT_PROBE_COMMS=1 (with a DeepSpeed config whose comms_logger is enabled): comms.json, the collectives DeepSpeed
logged in optimizer steps 2 and 3: {op: {message bytes: count}}.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import trl
from transformers import TrainerCallback

PROBE_IDS = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 64, 120, 33]])


def full_moments(model) -> dict[str, dict[str, torch.Tensor]]:
    from deepspeed.utils import safe_get_full_optimizer_state

    return {
        name: {key: safe_get_full_optimizer_state(p, key).detach().cpu().clone() for key in ("exp_avg", "exp_avg_sq")}
        for name, p in model.named_parameters()
        if p.requires_grad
    }


class Probe(TrainerCallback):
    def __init__(self, out: Path):
        self.out = out

    def _write(self, state, name: str, value) -> None:
        if state.is_world_process_zero:
            self.out.mkdir(parents=True, exist_ok=True)
            torch.save(value, self.out / f"{name}.pt")

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step > 0:
            self._write(state, f"moments-resumed-{state.global_step}", full_moments(model))

    def on_save(self, args, state, control, model=None, **kwargs):
        self._write(state, f"moments-saved-{state.global_step}", full_moments(model))

    def on_train_end(self, args, state, control, model=None, **kwargs):
        was_training = model.training
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=PROBE_IDS.to(args.device)).logits.float().cpu()
        model.train(was_training)
        self._write(state, f"logits-{state.global_step}", logits)


class ProbedTrainer(trl.SFTTrainer):
    def __init__(self, *args, callbacks=None, **kwargs):
        probe = [] if os.environ.get("LLMFT_PROBE_MOMENTS") == "0" else [Probe(Path(os.environ["LLMFT_PROBE_DIR"]))]
        super().__init__(*args, callbacks=[*(callbacks or []), *probe], **kwargs)

    def training_step(self, model, inputs, num_items_in_batch=None):
        if os.environ.get("LLMFT_PROBE_TRAINED") and self.args.process_index == 0:
            import json

            out = Path(os.environ["LLMFT_PROBE_DIR"])
            out.mkdir(parents=True, exist_ok=True)
            rows = [row[:8].tolist() for row in inputs["input_ids"]]
            with open(out / "trained.jsonl", "a") as f:
                f.write(json.dumps({"step": self.state.global_step, "rows": rows}) + "\n")
        return super().training_step(model, inputs, num_items_in_batch)


def _zero_lora_b_after_save(original):
    """$LLMFT_PROBE_SABOTAGE=zero_lora_b: after each checkpoint save, rank 0 overwrites the adapter's lora_B with zeros
    (what an ungathered ZeRO-3 save looks like), before llmft's on_save callback checks the files."""

    def save(self, model, trial):
        original(self, model, trial)
        if self.args.process_index == 0:
            from safetensors.torch import load_file, save_file

            path = Path(self.args.output_dir) / f"checkpoint-{self.state.global_step}" / "adapter_model.safetensors"
            tensors = load_file(path)
            save_file(
                {k: torch.zeros_like(v) if "lora_B" in k else v for k, v in tensors.items()},
                path,
                metadata={"format": "pt"},
            )

    return save


def _slower(original, seconds: float):
    """`original` (a Trainer method) taking `seconds` longer."""
    import time

    def slow(self, *args, **kwargs):
        time.sleep(seconds)
        return original(self, *args, **kwargs)

    return slow


def _list_after_save(original):
    """$LLMFT_PROBE_LISTING=1: rank 0 records which checkpoints exist, and which are complete, after the Trainer wrote
    checkpoint-N (and did whatever it does inside the save) and before llmft's on_save callback publishes it."""

    def save(self, model, trial):
        original(self, model, trial)
        if self.args.process_index == 0:
            import json

            from llmft.checkpoint.run_dir import checkpoint_dirs, incomplete_reason

            out = Path(os.environ["LLMFT_PROBE_DIR"])
            out.mkdir(parents=True, exist_ok=True)
            listing = {p.name: incomplete_reason(p) is None for _, p in checkpoint_dirs(self.args.output_dir)}
            (out / f"listing-at-save-{self.state.global_step}.json").write_text(json.dumps(listing))

    return save


def count_syncs(out: Path) -> None:
    """$LLMFT_PROBE_SYNCS: count host reads inside each step's micro-batches (tests/sync_counter.py) into syncs.json."""
    import json

    from sync_counter import SyncCounter

    counter = SyncCounter()
    installed = counter.installed()  # kept referenced: a collected generator would uninstall the counter
    installed.__enter__()  # for the whole process

    class Written(TrainerCallback):
        def on_train_end(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                out.mkdir(parents=True, exist_ok=True)
                (out / "syncs.json").write_text(
                    json.dumps({"micro_batches": counter.micro_batches, "sites": counter.sites})
                )

    init = ProbedTrainer.__init__

    def with_window(self, *args, callbacks=None, **kwargs):
        init(self, *args, callbacks=[*(callbacks or []), counter.callback(), Written()], **kwargs)

    ProbedTrainer.__init__ = with_window
    ProbedTrainer._llmft_sync_counter = installed


def record_comms(out: Path) -> None:
    """$LLMFT_PROBE_COMMS: DeepSpeed's comms logger, emptied when step 2 begins and written when step 3 ends."""
    import json

    class Comms(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:
                from deepspeed.comm import comm

                comm.comms_logger.comms_dict.clear()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3 and state.is_world_process_zero:
                from deepspeed.comm import comm

                logged = {
                    op: {str(size): v[0] for size, v in sizes.items()}
                    for op, sizes in comm.comms_logger.comms_dict.items()
                }
                out.mkdir(parents=True, exist_ok=True)
                (out / "comms.json").write_text(json.dumps(logged))

    init = ProbedTrainer.__init__

    def with_comms(self, *args, callbacks=None, **kwargs):
        init(self, *args, callbacks=[*(callbacks or []), Comms()], **kwargs)

    ProbedTrainer.__init__ = with_comms


if __name__ == "__main__":  # patched only in the probe's own processes, never in a test that imports PROBE_IDS
    from llmft.train import cli, make_parser

    trl.SFTTrainer = ProbedTrainer  # llmft.training.checkpoint_save.trainer_class subclasses trl.SFTTrainer when train builds the trainer
    if os.environ.get("LLMFT_PROBE_SABOTAGE") == "zero_lora_b":
        import transformers

        transformers.Trainer._save_checkpoint = _zero_lora_b_after_save(transformers.Trainer._save_checkpoint)
    if os.environ.get("LLMFT_PROBE_SYNCS"):
        count_syncs(Path(os.environ["LLMFT_PROBE_DIR"]))
    if os.environ.get("LLMFT_PROBE_COMMS"):
        record_comms(Path(os.environ["LLMFT_PROBE_DIR"]))
    for name, variable in (("_save_checkpoint", "LLMFT_PROBE_SLOW_SAVE"), ("evaluate", "LLMFT_PROBE_SLOW_EVAL")):
        if os.environ.get(variable):
            import transformers

            setattr(
                transformers.Trainer, name, _slower(getattr(transformers.Trainer, name), float(os.environ[variable]))
            )

    if os.environ.get("LLMFT_PROBE_LISTING") == "1":
        import transformers

        transformers.Trainer._save_checkpoint = _list_after_save(transformers.Trainer._save_checkpoint)

    sys.exit(cli(make_parser()))

"""What a ZeRO-3 checkpoint and the final model hold: the ranks' shards, never the whole model gathered on one rank.

llmft's ZeRO-3 templates set `stage3_gather_16bit_weights_on_model_save: false`. With it off, HF's
`Trainer.save_model` falls back to `engine.save_checkpoint(dir)` (the shards) and `_save_checkpoint` then writes
the same shards again through `_save_optimizer_and_scheduler`: every checkpoint twice. And for a PEFT model HF
gathers every layer of the frozen base model (`_zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)`)
just to keep the adapter. `trainer_class()` is TRL's SFTTrainer with `save_model` doing, under ZeRO-3:

- a checkpoint: config, tokenizer and training arguments only; the shards come once, from `save_checkpoint`;
- LoRA: gathers only the trainable (adapter) parameters and writes the adapter, checkpoint or final;
- the final model: the 16-bit model gathered on rank 0 when `save_consolidated` is set (`--save_consolidated`;
  `llmft plan` states the host RAM it needs), else config and tokenizer beside the last checkpoint's shards
  (`llmft infer RUN` reads them; `llmft export RUN --out DIR` writes a model to serve); a run that saved no
  checkpoint at its last step gets the shards in the output directory, as HF's fallback does.

ZeRO-0/1/2: a checkpoint holds the weights once. HF's `_save_checkpoint` writes `model.safetensors` (save_model)
beside the engine's `mp_rank_00_model_states.pt`, which holds the same 16-bit module weights (and the optimizer
shards the fp32 masters): resume (DeepSpeed's load_checkpoint), `llmft infer` and `llmft export` (llmft.checkpoint.zero)
read only the engine's files, so a checkpoint gets config, tokenizer and training arguments without the safetensors
copy (GPT-2 124M, ZeRO-2, fp32 on CPU: 2,643 -> 1,991 MB per checkpoint, bench/bench_checkpoint_size.py). A LoRA run keeps its small
`adapter_model.safetensors`; the final model in --output_dir is written whole, as HF does.
"""

from __future__ import annotations

import os
from pathlib import Path

from llmft.training import sync_free


def is_zero3(trainer) -> bool:
    return (
        bool(trainer.is_deepspeed_enabled)
        and trainer.accelerator.deepspeed_config["zero_optimization"].get("stage") == 3
    )


def trainable_state_dict(trainer) -> dict | None:
    """The trainable parameters (a LoRA adapter, plus any modules_to_save), gathered from their ZeRO-3 partitions
    onto rank 0; the frozen base model is never gathered. None on other ranks."""
    import deepspeed
    import torch.distributed as dist

    named = [(name, p) for name, p in trainer.model.named_parameters() if p.requires_grad]
    state = {} if dist.get_rank() == 0 else None
    with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
        if state is not None:
            for name, p in named:
                state[name] = p.detach().cpu().clone()
    return state


def trainer_class(save_consolidated: bool = False, base=None, mixins: tuple[str, ...] = ("sync_free",)):
    """`base` (TRL's SFTTrainer by default; any TRL trainer: DPOTrainer, KTOTrainer, RewardTrainer) whose save_model
    writes ZeRO-3 runs as described in the module docstring; with "sync_free" in `mixins` (the method table's,
    llmft.planning.methods: SFT's alone), training steps that do not sync the GPU with the host (llmft.training.sync_free)."""
    from transformers.trainer_pt_utils import remove_dummy_checkpoint
    from transformers.utils import SAFE_WEIGHTS_NAME, WEIGHTS_NAME

    if base is None:
        from trl import SFTTrainer as base
    if "sync_free" in mixins:
        base = sync_free.mixin_class(base)

    class LlmftTrainer(base):
        def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
            if not is_zero3(self):
                if _internal_call and self.is_deepspeed_enabled and not _is_peft(self.model):
                    self._save(output_dir, state_dict={})  # a checkpoint: config, tokenizer, training arguments;
                    remove_dummy_checkpoint(self.args.should_save, output_dir, [WEIGHTS_NAME, SAFE_WEIGHTS_NAME])
                    return  # the weights come once, in the engine's mp_rank_00_model_states.pt
                return super().save_model(output_dir, _internal_call)
            output_dir = output_dir or self.args.output_dir
            if _is_peft(self.model):
                self._save(output_dir, state_dict=trainable_state_dict(self))
                return
            if not _internal_call and save_consolidated:
                self._save(output_dir, state_dict=self.model_wrapped._zero3_consolidated_16bit_state_dict())
                return
            self._save(output_dir, state_dict={})  # config, tokenizer, training arguments
            remove_dummy_checkpoint(self.args.should_save, output_dir, [WEIGHTS_NAME, SAFE_WEIGHTS_NAME])
            if _internal_call and not self.args.save_only_model:
                return  # _save_checkpoint writes the shards next, once
            step_dir = Path(self.args.output_dir) / f"checkpoint-{self.state.global_step}"
            if _internal_call or not (step_dir / "llmft_complete.json").is_file():
                self.model_wrapped.save_checkpoint(output_dir)

    LlmftTrainer.__name__ = LlmftTrainer.__qualname__ = f"Llmft{base.__name__}"
    return LlmftTrainer


def _is_peft(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)


def final_model_note(output_dir: str, step: int, zero_stage: int, lora: bool, save_consolidated: bool) -> str:
    """Where the trained weights are, for the last log line."""
    if zero_stage != 3 or lora or save_consolidated:
        return f"model saved to {output_dir}"
    ckpt = os.path.join(output_dir, f"checkpoint-{step}")
    return (
        f"weights are the ZeRO-3 shards in {ckpt if os.path.isdir(ckpt) else output_dir} "
        f"(llmft infer {output_dir}; llmft export {output_dir} --out DIR writes a model to serve; --save_consolidated gathers one at the end)"
    )

"""Packing that keeps samples apart: when `--packing` (or `--padding_free`) is safe, and a refusal when it is not.

TRL 1.16's `--packing` (strategy `bfd`, the default) fits whole samples into rows of `--max_length` and turns on
padding-free batches: each micro-batch is one flattened row, `position_ids` restart at 0 for every sample, and
there is no attention mask. Samples stay apart only if the attention reads those position ids:

- `flash_attention_2`: the varlen kernels take the sample boundaries (`cu_seq_lens`, from the position ids);
- `sdpa` and `eager`: transformers 5's `masking_utils.create_causal_mask` finds the restarts in `position_ids`
  (`find_packed_sequence_indices`) and builds a block-diagonal causal mask. Every model whose modeling code
  builds its mask there gets this: Llama, Qwen2/3, Mistral, Gemma, Phi-3, GPT-2 and nearly all decoders in 5.x.
  (Only without a KV cache: SFTTrainer.compute_loss passes use_cache=False, so training never has one.)

Not safe, so refused: `--packing_strategy wrapped` (it cuts samples and concatenates them into one sequence),
models whose own code builds the mask (remote code, a few old architectures), and attention implementations
llmft has not checked. tests/test_packing.py trains the same samples packed and unpacked and compares per-token
losses and gradients; bench/bench_packing.py measures the speed.
"""

from __future__ import annotations

# Attention implementations that keep packed samples apart, given a model that builds its masks with masking_utils.
PACKED_ATTENTIONS = ("flash_attention_2", "sdpa", "eager")
SAFE_STRATEGIES = ("bfd", "bfd_split")


class PackingError(ValueError):
    """Packing would let samples attend to each other; the message says what to change."""


def check_packing(*, packing: bool, padding_free: bool, strategy: str, attention: str, masks_from_positions: bool) -> None:
    """The one place llmft decides whether packed / padding-free batches are correct for this run."""
    if not (packing or padding_free):
        return
    what = "--packing" if packing else "--padding_free"
    if packing and strategy not in SAFE_STRATEGIES:
        raise PackingError(
            f"--packing_strategy {strategy} concatenates samples so that they attend to each other; "
            f"use --packing_strategy bfd (the default) or bfd_split"
        )
    if attention not in PACKED_ATTENTIONS:
        raise PackingError(
            f"{what} with --attn_implementation {attention} is not known to keep packed samples apart; "
            f"use {', '.join(PACKED_ATTENTIONS)} (or auto)"
        )
    if not masks_from_positions:
        raise PackingError(
            f"{what}: this model's code does not build its attention mask with transformers' masking_utils, so packed "
            f"samples would attend to each other; train without {what}"
        )


def _model_class(model_config, trust_remote_code: bool):
    """The transformers class a causal-LM config loads into; None for remote code or an unknown model type."""
    import importlib

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if trust_remote_code and "AutoModelForCausalLM" in (getattr(model_config, "auto_map", None) or {}):
        return None
    class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(model_config, "model_type", None))
    try:
        return getattr(importlib.import_module("transformers"), class_name) if class_name else None
    except (AttributeError, ImportError):
        return None


def model_attentions(model_config, trust_remote_code: bool = False) -> frozenset[str] | None:
    """The attention implementations the model's code has (eager always), or None when llmft cannot tell."""
    cls = _model_class(model_config, trust_remote_code)
    if cls is None:
        return None
    has = {"eager"} | ({"sdpa"} if cls._supports_sdpa else set())
    return frozenset(has | ({"flash_attention_2"} if cls._supports_flash_attn else set()))


def masks_from_position_ids(model_config, trust_remote_code: bool = False) -> bool:
    """Whether the model's modeling code builds its causal mask with transformers' masking_utils (which reads
    packed position ids). Remote code is not inspected: False. Imports only the model's modeling module."""
    import sys

    from transformers import masking_utils

    cls = _model_class(model_config, trust_remote_code)
    if cls is None:
        return False
    module = sys.modules[cls.__module__]
    builders = ("create_causal_mask", "create_sliding_window_causal_mask", "create_masks_for_generate")
    return any(getattr(module, name, None) is getattr(masking_utils, name, object()) for name in builders)

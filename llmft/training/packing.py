"""Packing that keeps samples apart: when `--packing` (or `--padding_free`) is safe, and a refusal when it is not.

TRL 1.16's `--packing` (strategy `bfd`, the default) fits whole samples into rows of `--max_length` and turns on
padding-free batches: each micro-batch is one flattened row, `position_ids` restart at 0 for every sample, and
there is no attention mask. Samples stay apart only if the attention reads those position ids:

- `flash_attention_2`: the varlen kernels take the sample boundaries (`cu_seq_lens`, from the position ids);
- `sdpa` and `eager`: transformers 5's `masking_utils.create_causal_mask` finds the restarts in `position_ids`
  (`find_packed_sequence_indices`) and builds a block-diagonal causal mask. Every model whose modeling code
  builds its mask there gets this: Llama, Qwen2/3, Mistral, Gemma, Phi-3, GPT-2 and nearly all decoders in 5.x.
  (Only without a KV cache: SFTTrainer.compute_loss passes use_cache=False, so training never has one.)

Correct is not yet fast: SDPA (and eager) attend over the whole packed row with a dense block-diagonal mask, so a
row of L tokens costs L^2 whatever the samples' lengths (and TRL flattens the whole micro-batch into one row). On a
CPU that made packing 2.4x slower than padding (bench/README.md). So when packing meets SDPA, llmft registers
`llmft_sdpa_packed` with transformers' AttentionInterface: for a padding-free batch it runs SDPA causally on each
sample (the boundaries TRL's collator passes as cu_seq_lens_q), costing sum(s_i^2) like flash-attention's varlen
kernels; any other batch goes to transformers' own SDPA with its usual mask. On a GPU (CUDA, bf16/fp16, PyTorch
2.9+) the same batch goes to PyTorch's own variable-length flash kernel (`varlen_attn`) in one launch instead of
one SDPA call per sample and layer: no flash-attn install needed (bench/gpu_attention.py compares the three).

Not safe, so refused: `--packing_strategy wrapped` (it cuts samples and concatenates them into one sequence),
models whose own code builds the mask (remote code, a few old architectures), and attention implementations
llmft has not checked. tests/test_packing.py trains the same samples packed and unpacked and compares per-token
losses and gradients; bench/bench_packing.py measures the speed.
"""

from __future__ import annotations

import functools
import inspect

from llmft.errors import LlmftError

# Attention implementations that keep packed samples apart, given a model that builds its masks with masking_utils.
PACKED_ATTENTIONS = ("flash_attention_2", "sdpa", "eager")
SAFE_STRATEGIES = ("bfd", "bfd_split")
PACKED_SDPA = "llmft_sdpa_packed"  # SDPA per packed sample (registered by register_packed_sdpa)
_SEQUENCE_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


class PackingError(LlmftError, ValueError):
    """Packing would let samples attend to each other; the message says what to change."""


def check_packing(
    *,
    packing: bool,
    padding_free: bool,
    strategy: str,
    attention: str,
    masks_from_positions: bool,
    sliding_window: bool = False,
) -> str:
    """The one place llmft decides whether packed / padding-free batches are correct for this run, and the attention
    implementation to load for them: SDPA becomes llmft's per-sample SDPA, unless the model has sliding-window
    layers (which the per-sample causal SDPA would not honour: those keep transformers' SDPA and its mask)."""
    if not (packing or padding_free):
        return attention
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
    return PACKED_SDPA if attention == "sdpa" and not sliding_window else attention


def uses_sliding_window(model_config) -> bool:
    """Whether any attention layer of the model is windowed (Mistral v0.1, Gemma 2/3, Qwen with use_sliding_window)."""
    config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return True
    return (
        getattr(config, "sliding_window", None) is not None
        and getattr(config, "use_sliding_window", True) is not False
    )


def packed_kernel(
    *,
    device_type: str,
    dtype: str,
    dropout: float,
    head_dim: int,
    varlen_available: bool,
    capability: tuple[int, int] | None = None,
) -> str:
    """Which kernel runs a padding-free batch's attention: "varlen" (PyTorch's own variable-length flash kernel,
    `torch.nn.attention.varlen.varlen_attn`: one launch for all samples) where it can (CUDA on compute capability
    8.0+: it is aten's flash-attention 2, which a T4 or V100 lacks; 16-bit, no dropout, head_dim <= 256, PyTorch
    2.9+), else "per_sample" (one SDPA call per sample and layer: any device and dtype)."""
    if (
        varlen_available
        and device_type == "cuda"
        and (capability is None or tuple(capability) >= (8, 0))
        and dtype in ("bfloat16", "float16")
        and dropout == 0.0
        and head_dim <= 256
    ):
        return "varlen"
    return "per_sample"


@functools.lru_cache(maxsize=16)
def _capability(device_index: int) -> tuple[int, int]:
    import torch

    return tuple(torch.cuda.get_device_capability(device_index))


@functools.lru_cache(maxsize=1)
def _varlen():
    """(varlen_attn, its keyword arguments for causal attention, whether it takes enable_gqa, whether it takes scale),
    or None before PyTorch 2.9. Older versions say causal with is_causal=True, newer with window_size=(-1, 0)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    return varlen_attn, causal, "enable_gqa" in params, "scale" in params


def packed_kernel_for(model_config, *, cuda: bool, precision: str, capability: tuple[int, int] | None = None) -> str:
    """packed_kernel for this run's model and machine (what `llmft train` logs; the forward decides per call)."""
    config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return packed_kernel(
        device_type="cuda" if cuda else "cpu",
        dtype={"bf16": "bfloat16", "fp16": "float16"}.get(precision, "float32"),
        dropout=float(getattr(config, "attention_dropout", None) or getattr(config, "attn_pdrop", 0.0) or 0.0),
        head_dim=head_dim,
        varlen_available=_varlen() is not None,
        capability=capability,
    )


def _varlen_forward(module, query, key, value, longest: int, cu, scaling):
    """All samples in one varlen_attn call. query/key/value: (1, heads, tokens, head_dim) -> (1, tokens, heads, head_dim)."""
    import torch

    varlen_attn, causal, takes_gqa, takes_scale = _varlen()
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (tokens, heads, head_dim)
    extra = dict(causal)
    if scaling is not None and takes_scale:
        extra["scale"] = scaling
    elif scaling is not None:  # its fixed 1/sqrt(head_dim) scale, with the model's folded into the queries
        q = q * (scaling * q.shape[-1] ** 0.5)
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and takes_gqa:
        extra["enable_gqa"] = True
    elif groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    cu32 = cu.to(device=q.device, dtype=torch.int32)  # TRL's collator already gives int32 on the device: no copy
    out = varlen_attn(q, k, v, cu32, cu32, longest, longest, **extra)
    return out.unsqueeze(0)


def packed_sdpa_forward(module, query, key, value, attention_mask, **kwargs):
    """transformers attention function: a padding-free batch's samples attend only within themselves (PyTorch's
    varlen flash kernel on a GPU, SDPA per sample elsewhere: `packed_kernel`); every other batch goes to
    transformers' SDPA. query/key/value: (batch, heads, tokens, head_dim); returns (batch, tokens, heads, head_dim)."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    dropout = kwargs.get("dropout", 0.0) if module.training else 0.0
    kernel = packed_kernel(
        device_type=query.device.type,
        dtype=str(query.dtype).removeprefix("torch."),
        dropout=dropout,
        head_dim=query.shape[-1],
        varlen_available=_varlen() is not None,
        capability=_capability(query.device.index or 0) if query.device.type == "cuda" else None,
    )
    if kernel == "varlen" and kwargs.get("position_bias") is None and kwargs.get("softcap") is None:
        longest = kwargs.get("max_length_q")  # TRL's collator computes it on the host: no device-to-host copy
        if not isinstance(longest, int):
            longest = int(cu.diff().max())
        return _varlen_forward(module, query, key, value, longest, cu, kwargs.get("scaling")), None
    bounds = getattr(cu, "_llmft_bounds", None)
    if bounds is None:  # one host copy per forward (none on a CPU), shared by the layers
        bounds = cu.tolist()
        cu._llmft_bounds = bounds
    rest = {k: v for k, v in kwargs.items() if k not in _SEQUENCE_KWARGS}
    pieces = [
        sdpa_attention_forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None, **rest)[0]
        for a, b in zip(bounds, bounds[1:])
        if b > a
    ]
    return torch.cat(pieces, dim=1), None


def choose_padding_free(
    *,
    requested: bool | None,
    packing: bool,
    cuda: bool,
    micro_batch: int,
    attention: str,
    kernel: str,
    masks_from_positions: bool,
    sliding_window: bool,
) -> tuple[bool, str]:
    """Whether a run's padded batches go padding-free, and why (a line for the log; empty when nothing changes).

    Padding-free: each micro-batch's samples (the same ones, in the same order) flattened into one row with
    position ids restarting per sample and no pad tokens; TRL's collator masks each sample's first label, which a
    padded batch never trains on either (the shift), so the loss and its token count are the same (test_packing).
    It pays where the attention runs the samples as variable-length sequences: flash-attention 2, or PyTorch's
    varlen flash kernel (`kernel` "varlen", packed_kernel). Elsewhere (a CPU, a T4, fp32) the per-sample SDPA
    fallback is slower than padding, so batches stay padded. `requested` is --padding_free as given (None: not
    given); --packing already trains padding-free."""
    if requested is not None or packing:
        return bool(requested), ""
    if not cuda:
        return False, ""
    keep = "padded batches: "
    if micro_batch == 1:
        return False, ""  # one sample per micro-batch: no padding to remove
    if not masks_from_positions:
        return (
            False,
            keep + "this model's code does not build its masks from position ids (padding-free would mix samples)",
        )
    if attention == "flash_attention_2":
        return True, (
            "padding-free batches (auto): the same samples per micro-batch without pad tokens, through "
            "flash-attention's varlen kernel; --padding_free false keeps padding"
        )
    if attention == "sdpa" and not sliding_window and kernel == "varlen":
        return True, (
            "padding-free batches (auto): the same samples per micro-batch without pad tokens, through "
            "PyTorch's varlen flash kernel; --padding_free false keeps padding"
        )
    why = {
        "sdpa": "sliding-window layers need transformers' own SDPA mask"
        if sliding_window
        else "no varlen flash kernel here (it needs compute capability 8.0+, bf16/fp16 and PyTorch 2.9+)"
    }
    return False, keep + why.get(attention, f"attention {attention} has no varlen kernel")


def register_packed_sdpa() -> None:
    """Make `attn_implementation="llmft_sdpa_packed"` loadable in this process (masks as for SDPA)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED_SDPA, packed_sdpa_forward)
    AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)


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

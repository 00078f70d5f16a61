"""A QLoRA run's merge: the adapter folded into the base as training saw it, dequant(quant(W)), not into W.

A QLoRA run trains its adapter against the 4-bit base: the model it trained computes with dequant(quant(W)) + the
LoRA delta. `llmft export --lora merged` repeats the run's quantization on the original weights (bitsandbytes'
quantize_4bit with the type, double quantization and block size llmft_run.json records, on the weights cast to the
run's dtype first and Conv1D weights transposed first, as transformers' 4-bit loading does; the same modules it
converts), dequantizes, and merges the adapter into that. bitsandbytes quantizes and dequantizes on CPU.
"""

from __future__ import annotations

from llmft.checkpoint.run_dir import CheckpointError

QUANT_TYPES = ("nf4", "fp4")
ADAPTER_ONLY = "export the adapter with --lora adapter (vLLM serves it on the base with --enable-lora)"


def well_formed(settings) -> bool:
    """Settings the merge can repeat: a 4-bit type, double quantization on or off, a block size, a float dtype."""
    return (
        isinstance(settings, dict)
        and settings.get("quant_type") in QUANT_TYPES
        and isinstance(settings.get("double_quant"), bool)
        and settings.get("blocksize") in (32, 64, 128, 256, 512, 1024, 2048, 4096)
        and settings.get("dtype") in ("bfloat16", "float16", "float32")
    )


def merge_settings_problem(run_record: dict, lora: str) -> str | None:
    """Why a QLoRA run's merge is refused, or None (not QLoRA, the adapter alone, or a 4-bit run whose settings
    llmft_run.json records, which the merge repeats)."""
    quant = run_record.get("quantization")
    if not quant or lora not in ("merged", "both"):
        return None
    what = f"the run trained its adapter against a {quant} base (QLoRA), so the merge dequantizes that base first"
    if quant != "4bit":
        return f"{what}, and llmft dequantizes 4-bit bases only; {ADAPTER_ONLY}"
    if not well_formed(run_record.get("quantization_settings")):
        return (
            f"{what}, and its llmft_run.json does not record how (the 4-bit type, double quantization, block size: "
            f"recorded by runs since llmft export merges QLoRA); {ADAPTER_ONLY}"
        )
    return None


def quantized_modules(base) -> list[str]:
    """The modules transformers' 4-bit loading replaces in this model: nn.Linear (exactly) and Conv1D, but for the
    output embedding, tied weights, the last parameter's module and _keep_in_fp32_modules (its own functions, on a
    fresh copy of the model without the adapter's layers)."""
    import torch
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    with torch.device("meta"):
        fresh = type(base)(base.config)
    skip = get_keys_to_not_convert(fresh) + list(getattr(fresh, "_keep_in_fp32_modules", None) or [])
    return [
        name
        for name, module in fresh.named_modules()
        if (isinstance(module, Conv1D) or type(module) is torch.nn.Linear) and should_convert_module(name, skip)
    ]


def quantize_round_trip(weight, settings: dict, transposed: bool):
    """dequant(quant(weight)) as the run's 4-bit base held it, in weight's dtype."""
    import torch

    try:
        from bitsandbytes import functional as bnb_functional
    except ImportError:
        raise CheckpointError(
            f"merging a QLoRA adapter quantizes the base as training did, which needs bitsandbytes: pip install "
            f"bitsandbytes (its CPU build works), or {ADAPTER_ONLY}"
        ) from None
    value = weight.detach().to(getattr(torch, settings["dtype"]))
    value = value.T.contiguous() if transposed else value
    packed, state = bnb_functional.quantize_4bit(
        value,
        blocksize=settings["blocksize"],
        quant_type=settings["quant_type"],
        compress_statistics=settings["double_quant"],
    )
    restored = bnb_functional.dequantize_4bit(packed, state)
    return (restored.T if transposed else restored).to(weight.dtype)


def dequantize_base(peft_model, settings: dict) -> int:
    """Replace the base weights of `peft_model` (a PeftModel) that the run held in 4 bits by dequant(quant(W)), in
    place, before merge_and_unload; returns how many."""
    import torch
    from transformers.pytorch_utils import Conv1D

    base = peft_model.get_base_model()
    names = quantized_modules(base)
    with torch.no_grad():
        for name in names:
            module = base.get_submodule(name)
            layer = getattr(module, "base_layer", module)  # a LoRA target wraps the original layer
            layer.weight.copy_(quantize_round_trip(layer.weight, settings, transposed=isinstance(layer, Conv1D)))
    return len(names)

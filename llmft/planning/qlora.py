"""QLoRA: whether and how the base model is loaded quantized (bitsandbytes 4-bit or 8-bit) under DeepSpeed ZeRO.

`--load_in_4bit` / `--load_in_8bit` (TRL's ModelConfig flags) with `--use_peft`. One pure function decides
from hardware facts, so the decision is tested without a GPU:

    choose_quantization(request, gpu=GPUS["A100-80GB"], zero_stage=3, offload=False, use_peft=True,
                        precision="bf16", bitsandbytes="0.50.2")
    # {'load_in_4bit': True, 'bnb_4bit_compute_dtype': 'bfloat16', ..., 'bnb_4bit_quant_storage': 'bfloat16'}

What works with which ZeRO stage (PEFT's DeepSpeed guide, "Compatibility with bitsandbytes quantization +
LoRA", and its ZeRO-3 QLoRA section; transformers 5 loads quantized models outside zero.Init and lets the
engine partition them):
  - ZeRO 0/1/2: 4-bit and 8-bit. Each rank holds the whole quantized base model on its GPU; ZeRO only
    partitions the (small) LoRA weights' optimizer state and gradients.
  - ZeRO-3: 4-bit only, with the 4-bit weights packed in the training dtype (bnb_4bit_quant_storage = bf16/fp16)
    and the model loaded in that dtype, so DeepSpeed can partition them like any other parameter. 8-bit
    weights (Int8Params with their scales) cannot be partitioned: refused.
  - CPU offload: refused. The trainable LoRA weights are small, so offloading saves nothing, and PEFT's guide
    notes ZeRO-3 offload with QLoRA uses more GPU memory, not less.
bitsandbytes' kernels need CUDA and compute capability 7.5+ (T4 and newer; llmft.planning.hardware.GPU.bitsandbytes_4bit).
The CUDA path itself has not been run by llmft's tests (no GPU there): only this decision is tested.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmft.errors import LlmftError
from llmft.planning.hardware import GPU

MIN_BITSANDBYTES = (0, 43, 3)  # ZeRO-3 QLoRA (bnb_4bit_quant_storage) per PEFT's guide
_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


class QuantizationError(LlmftError, ValueError):
    """QLoRA cannot run as asked here; the message says why and what to change."""


@dataclass(frozen=True)
class QuantRequest:
    """The quantization flags as the user gave them (TRL's ModelConfig names)."""

    load_in_4bit: bool = False
    load_in_8bit: bool = False
    quant_type: str = "nf4"  # bnb_4bit_quant_type
    nested: bool = False  # use_bnb_nested_quant
    quant_storage: str | None = None  # bnb_4bit_quant_storage
    dtype: str | None = None  # ModelConfig.dtype (the non-quantized weights)

    @classmethod
    def from_model_args(cls, model_args) -> "QuantRequest":
        return cls(
            model_args.load_in_4bit,
            model_args.load_in_8bit,
            model_args.bnb_4bit_quant_type,
            model_args.use_bnb_nested_quant,
            model_args.bnb_4bit_quant_storage,
            model_args.dtype,
        )


def bitsandbytes_version() -> str | None:
    """The installed bitsandbytes version, or None when it is not installed (importing it would touch CUDA)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("bitsandbytes")
    except PackageNotFoundError:
        return None


def _version_tuple(v: str) -> tuple[int, ...]:
    parts = []
    for piece in v.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def choose_quantization(
    req: QuantRequest,
    *,
    gpu: GPU | None,
    zero_stage: int,
    offload: bool,
    use_peft: bool,
    precision: str,
    bitsandbytes: str | None,
) -> dict | None:
    """BitsAndBytesConfig keyword arguments for this run, None without --load_in_4bit/8bit, or QuantizationError.

    precision is llmft's decided precision (bf16/fp16/fp32): the 4-bit compute dtype and, under ZeRO-3, the
    storage dtype of the packed weights. The returned dict also holds "model_dtype", the dtype to load the
    rest of the model in (it is not a BitsAndBytesConfig argument; pop it first).
    """
    if not (req.load_in_4bit or req.load_in_8bit):
        if req.quant_type != "nf4" or req.nested or req.quant_storage:
            raise QuantizationError(
                "--bnb_4bit_quant_type/--use_bnb_nested_quant/--bnb_4bit_quant_storage set without "
                "--load_in_4bit: add --load_in_4bit, or drop them"
            )
        return None
    flag = "--load_in_4bit" if req.load_in_4bit else "--load_in_8bit"
    if req.load_in_4bit and req.load_in_8bit:
        raise QuantizationError("--load_in_4bit and --load_in_8bit contradict each other: give one")
    if req.load_in_8bit and (req.quant_type != "nf4" or req.nested or req.quant_storage):
        raise QuantizationError("--bnb_4bit_* and --use_bnb_nested_quant apply to --load_in_4bit, not --load_in_8bit")
    if not use_peft:
        raise QuantizationError(f"{flag} trains LoRA adapters on a frozen quantized model (QLoRA): add --use_peft")
    if gpu is None:
        raise QuantizationError(
            f"{flag} (QLoRA) needs a CUDA GPU for bitsandbytes' kernels and none is visible here: "
            "drop it to train LoRA in full precision, or run on a GPU node"
        )
    if not gpu.bitsandbytes_4bit:
        cc = f"{gpu.compute_capability[0]}.{gpu.compute_capability[1]}"
        raise QuantizationError(
            f"{flag} needs compute capability 7.5+ (T4 or newer) for bitsandbytes; this {gpu.name} has {cc}"
        )
    if offload:
        raise QuantizationError(
            f"{flag} with --offload saves no GPU memory (the trainable LoRA weights are small; "
            "ZeRO-3 offload with QLoRA uses more): drop --offload"
        )
    if req.load_in_8bit and zero_stage == 3:
        raise QuantizationError(
            "--load_in_8bit cannot run under ZeRO-3 (8-bit weights cannot be partitioned): "
            "use --zero_stage 2, or --load_in_4bit with ZeRO-3"
        )
    if bitsandbytes is None:
        raise QuantizationError(
            f"{flag} needs bitsandbytes: pip install -e '.[qlora]' in llmft's checkout (or pip install bitsandbytes)"
        )
    if _version_tuple(bitsandbytes) < MIN_BITSANDBYTES:
        raise QuantizationError(
            f"bitsandbytes {bitsandbytes} is too old for QLoRA under DeepSpeed: "
            f"pip install 'bitsandbytes>={'.'.join(map(str, MIN_BITSANDBYTES))}'"
        )
    compute = _DTYPE_NAMES[precision]
    if req.dtype not in (None, "auto", "float32", compute):
        raise QuantizationError(
            f"--dtype {req.dtype} contradicts the {precision} this run trains in: drop --dtype "
            "(QLoRA loads the rest of the model in the training precision)"
        )
    if req.load_in_8bit:
        return {"load_in_8bit": True, "model_dtype": compute}
    storage = req.quant_storage
    if zero_stage == 3:
        if storage not in (None, compute):
            raise QuantizationError(
                f"--bnb_4bit_quant_storage {storage} under ZeRO-3 must match the training precision "
                f"({compute}) so DeepSpeed can partition the 4-bit weights: drop it"
            )
        storage = compute
    out = {
        "load_in_4bit": True,
        "bnb_4bit_compute_dtype": compute,
        "bnb_4bit_quant_type": req.quant_type,
        "bnb_4bit_use_double_quant": req.nested,
        "model_dtype": compute,
    }
    if storage:
        out["bnb_4bit_quant_storage"] = storage
    return out


BNB_4BIT_BLOCKSIZE = 64  # bitsandbytes' Params4bit default, which transformers' 4-bit loading leaves as it is


def recorded_settings(quantization: dict | None) -> dict | None:
    """How the base was quantized, for llmft_run.json (`llmft export` quantizes the base the same way and dequantizes
    it before merging): the 4-bit type, double quantization, block size, and the dtype the weights were cast to
    before quantizing (transformers casts them to the model dtype first). None without 4-bit."""
    if not quantization or not quantization.get("load_in_4bit"):
        return None
    return {
        "quant_type": quantization["bnb_4bit_quant_type"],
        "double_quant": bool(quantization["bnb_4bit_use_double_quant"]),
        "blocksize": BNB_4BIT_BLOCKSIZE,
        "dtype": quantization["model_dtype"],
    }

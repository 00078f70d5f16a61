"""Hardware facts and the decisions made from them: which GPU this is, which precision and attention it gets.

CPU machines cannot show GPU behaviour, so every GPU decision is a pure function of a `GPU` record
(compute capability, memory, peak throughput). The tests drive those functions with the facts of an
L4, an A100 and a T4; on a real node `local_gpu()` reads the same facts from CUDA.

    from llmft.planning.hardware import GPUS, choose_precision, local_gpu
    choose_precision("auto", GPUS["T4"])        # 'fp16': no bf16 tensor cores before compute capability 8.0
    choose_precision("auto", local_gpu())       # what this machine trains in ('fp32' without CUDA)

Peak throughputs are NVIDIA's dense (no sparsity) 16-bit tensor-core numbers from the data sheets:
L4 121 TFLOP/s (L4 datasheet, "BF16 242 TFLOPS with sparsity"), A100 312 (A100 datasheet), H100 SXM
and H200 989 (H100/H200 datasheets, SXM), H100 PCIe 756, T4 65 fp16 (T4 datasheet), V100 SXM2 125,
V100 PCIe 112 fp16 (V100 datasheet). A GPU not in the table has no peak: MFU is then reported as
unknown rather than computed against a guess.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from llmft.errors import LlmftError
from llmft.planning.allocation import this_node_memory

PRECISIONS = ("auto", "bf16", "fp16", "fp32")


class HardwareError(LlmftError, ValueError):
    """A hardware name or setting llmft does not know; the message lists the known ones."""


@dataclass(frozen=True)
class GPU:
    """What llmft needs to know about one GPU model."""

    name: str  # llmft's short name: L4, A100-40GB, H100-80GB ...
    memory_gib: float  # total device memory as CUDA reports it
    compute_capability: tuple[int, int]
    peak_tflops: float | None  # dense 16-bit tensor-core peak (bf16 where supported, else fp16); None = unknown

    @property
    def has_bf16(self) -> bool:
        """Native bf16 tensor cores: Ampere (8.0) and newer. Older GPUs only emulate bf16 (slowly)."""
        return self.compute_capability >= (8, 0)

    @property
    def supports_flash_attention(self) -> bool:
        """flash-attn 2 needs Ampere (8.0) or newer."""
        return self.compute_capability >= (8, 0)

    @property
    def bitsandbytes_4bit(self) -> bool:
        """bitsandbytes' 4-bit kernels run on compute capability 7.5 (Turing) and newer."""
        return self.compute_capability >= (7, 5)


# The GPUs llmft's clusters use (L4 on g2/g6, A100 on a2/p4d, H100/H200 on a3/p5) and the older ones users
# still meet (T4, V100). Memory: what `torch.cuda.get_device_properties(0).total_memory` reports.
GPUS: dict[str, GPU] = {
    g.name: g
    for g in (
        GPU("T4", 15.0, (7, 5), 65.0),
        GPU("V100-16GB", 15.8, (7, 0), 125.0),
        GPU("V100-32GB", 31.7, (7, 0), 125.0),
        GPU("L4", 22.0, (8, 9), 121.0),
        GPU("A100-40GB", 39.4, (8, 0), 312.0),
        GPU("A100-80GB", 79.1, (8, 0), 312.0),
        GPU("H100-80GB", 79.1, (9, 0), 989.0),
        GPU("H100-PCIe", 79.1, (9, 0), 756.0),
        GPU("H200", 139.8, (9, 0), 989.0),
    )
}

# CUDA device names (torch.cuda.get_device_name) -> llmft's short names. Order matters: first match wins.
_NAME_PATTERNS = [
    (r"\bT4\b", "T4"),
    (r"V100.*32GB", "V100-32GB"),
    (r"V100", "V100-16GB"),
    (r"\bL4\b", "L4"),
    (r"A100.*80GB", "A100-80GB"),
    (r"A100", "A100-40GB"),
    (r"H100.*PCIe", "H100-PCIe"),
    (r"H100.*(HBM3|SXM)", "H100-80GB"),
    (r"H200", "H200"),
]


def gpu_by_name(name: str) -> GPU:
    """A catalogue GPU by llmft's short name (case-insensitive), e.g. 'a100-40gb'."""
    for key, gpu in GPUS.items():
        if key.lower() == name.strip().lower():
            return gpu
    raise HardwareError(f"unknown GPU {name!r}; known: {', '.join(GPUS)} (or give its memory with --gpu_memory_gb)")


def gpu_from_device(device_name: str, memory_gib: float, compute_capability: tuple[int, int]) -> GPU:
    """The facts for a CUDA device: the catalogue entry its name matches, else what CUDA said (no peak)."""
    for pattern, short in _NAME_PATTERNS:
        if re.search(pattern, device_name, re.IGNORECASE):
            known = GPUS[short]
            return GPU(known.name, round(memory_gib, 1), tuple(compute_capability), known.peak_tflops)
    return GPU(device_name, round(memory_gib, 1), tuple(compute_capability), None)


def local_gpu(index: int = 0) -> GPU | None:
    """This process's GPU, or None on a machine without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(index)
    return gpu_from_device(props.name, props.total_memory / 2**30, (props.major, props.minor))


# What "auto" means, in words (printed by `llmft plan` on a login node, where the GPU is not known yet).
AUTO_PRECISION = (
    "bf16 on GPUs with compute capability 8.0+ (A100, L4, H100), fp16 on older GPUs (T4, V100), fp32 on CPU"
)


def choose_precision(
    requested: str, gpu: GPU | None, *, bf16: bool | None = None, fp16: bool | None = None, inference: bool = False
) -> str:
    """The one place llmft decides the training/inference precision: 'bf16', 'fp16' or 'fp32'.

    requested is llmft's --precision; bf16/fp16 are TRL/HF's --bf16/--fp16 as the user gave them (None: not
    given), mapped onto the same decision: --bf16 / --fp16 ask for that precision, --bf16 false asks for
    full precision (HF's meaning), --fp16 false rules fp16 out; flags that contradict each other or an
    explicit --precision are refused.

    auto: bf16 on GPUs with native bf16 (compute capability >= 8.0: A100, L4, H100), fp16 on older GPUs
    (T4, V100: PyTorch reports bf16 "supported" there through emulation, which is slow), fp32 on CPU.
    An explicit bf16 on a GPU without native bf16, or fp16 training on CPU, is refused with the fix (explicit
    bf16 on CPU is allowed: PyTorch and DeepSpeed run it there, slowly, which is how the bf16 path is tested;
    inference=True also allows fp16 on CPU, where generation needs no loss scaling).
    """
    if requested not in PRECISIONS:
        raise HardwareError(f"unknown precision {requested!r}; use one of {', '.join(PRECISIONS)}")
    if bf16 and fp16:
        raise HardwareError(
            "--bf16 and --fp16 contradict each other: give one of them, or --precision auto|bf16|fp16|fp32"
        )
    asked, flags = None, None
    if bf16 or fp16:
        asked, flags = ("bf16", "--bf16") if bf16 else ("fp16", "--fp16")
    elif bf16 is False and requested in ("auto", "bf16"):
        asked, flags = "fp32", "--bf16 false"  # no mixed precision unless --fp16 (HF's meaning)
    no_fp16 = fp16 is False and asked is None
    if asked and requested not in ("auto", asked) or no_fp16 and requested == "fp16":
        shown = flags or "--fp16 false"
        raise HardwareError(f"{shown} contradicts --precision {requested}: give only one of them")
    requested = asked or requested
    if requested == "auto":
        if gpu is None:
            return "fp32"
        if gpu.has_bf16:
            return "bf16"
        return "fp32" if no_fp16 else "fp16"
    if requested == "bf16" and gpu is not None and not gpu.has_bf16:
        raise HardwareError(
            f"bf16 needs a GPU with compute capability 8.0 or newer; this {gpu.name} has "
            f"{gpu.compute_capability[0]}.{gpu.compute_capability[1]}: use --precision fp16 (or auto)"
        )
    if requested == "fp16" and gpu is None and not inference:
        raise HardwareError(
            "fp16 mixed precision needs a GPU and none is visible here: use --precision fp32 (or auto)"
        )
    return requested


def torch_dtype(precision: str):
    """The torch dtype for a resolved precision (bf16, fp16, fp32)."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]


# --- Attention and GPU kernels (issue 10) -------------------------------------------------------------------------
# Which attention implementation a run gets, and whether Liger's kernels can run. Pure functions of the GPU facts
# and of what is installed, so the tests can ask them about an L4, an A100 and a T4 on a CPU machine.

ATTENTIONS = ("auto", "flash_attention_2", "sdpa", "eager")


def flash_attn_installed() -> bool:
    """flash-attn 2 is importable (`pip install 'llmft[gpu]'` on a CUDA machine)."""
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def choose_attention(
    requested: str | None, gpu: GPU | None, flash_installed: bool, model_supports: frozenset[str] | None = None
) -> str:
    """The one place llmft decides the attention implementation.

    auto (or unset): flash_attention_2 when flash-attn is installed and the GPU can run it (compute capability
    8.0+: A100, L4, H100), else PyTorch's SDPA, which runs everywhere (eager for the few models without SDPA
    support). All three keep packed samples apart (see llmft.training.packing). `model_supports`: the implementations the
    model's code has (llmft.training.packing.model_attentions; None: not known, all assumed). An explicit choice that
    cannot run here is refused with the fix.
    """
    requested = requested or "auto"
    if requested not in ATTENTIONS:
        raise HardwareError(f"unknown --attn_implementation {requested!r}; use one of {', '.join(ATTENTIONS)}")
    supports = model_supports if model_supports is not None else frozenset(ATTENTIONS)
    flash_ok = gpu is not None and gpu.supports_flash_attention
    if requested == "auto":
        if flash_ok and flash_installed and "flash_attention_2" in supports:
            return "flash_attention_2"
        return "sdpa" if "sdpa" in supports else "eager"
    if requested not in supports:
        raise HardwareError(
            f"this model has no {requested} attention; use one of {', '.join(sorted(supports))} (or auto)"
        )
    if requested == "flash_attention_2":
        if gpu is None:
            raise HardwareError(
                "--attn_implementation flash_attention_2 needs a CUDA GPU and none is visible here; use sdpa (or auto)"
            )
        if not gpu.supports_flash_attention:
            cc = ".".join(map(str, gpu.compute_capability))
            raise HardwareError(
                f"flash-attention 2 needs compute capability 8.0 or newer; this {gpu.name} has {cc}: use sdpa (or auto)"
            )
        if not flash_installed:
            raise HardwareError(
                "--attn_implementation flash_attention_2 needs flash-attn: pip install 'llmft[gpu]' (or use sdpa)"
            )
    return requested


def liger_model_types() -> frozenset[str] | None:
    """Model types Liger has kernels for, or None when liger-kernel is not installed."""
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError:
        return None
    return frozenset(MODEL_TYPE_TO_APPLY_LIGER_FN)


def check_liger(
    gpu: GPU | None, model_type: str, supported: frozenset[str] | None, kernel_config: dict | None = None
) -> None:
    """Refuse --use_liger_kernel where it cannot work, instead of letting it do nothing or crash mid-run.

    Liger's kernels are Triton GPU kernels: no CUDA, no Liger. For a model type Liger has no kernels for,
    transformers logs one info line and trains without them: llmft refuses instead. Any ZeRO stage is allowed:
    TRL 1.16's SFTTrainer applies only Liger's layer kernels (RMSNorm, RoPE, SwiGLU), which run inside each
    module's forward where ZeRO-3 has gathered the weights, and keeps its own ZeRO-3-aware fused LM head. The
    ZeRO-3 failures reported upstream (Liger-Kernel#1048, TRL#3368, #5891, #6372) come from Liger's fused linear
    cross-entropy reading lm_head.weight outside the module's forward; that option is refused here (TRL refuses it
    too, with a traceback).
    """
    if gpu is None:
        raise HardwareError(
            "--use_liger_kernel needs a CUDA GPU (Liger's kernels are Triton GPU kernels) and none is visible here; drop the flag"
        )
    if supported is None:
        raise HardwareError("--use_liger_kernel needs liger-kernel: pip install 'llmft[gpu]'")
    if model_type not in supported:
        known = ", ".join(
            sorted(t for t in supported if t in {"llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3"})
        )
        raise HardwareError(
            f"Liger has no kernels for model type {model_type!r} (it has them for {known}, ...); drop --use_liger_kernel"
        )
    if (kernel_config or {}).get("fused_linear_cross_entropy"):
        raise HardwareError(
            "--liger_kernel_config fused_linear_cross_entropy is not supported: TRL's SFTTrainer uses its own fused LM head "
            "(it also works under ZeRO-3); remove that key"
        )


def choose_liger(
    requested: bool | None,
    gpu: GPU | None,
    model_type: str,
    supported: frozenset[str] | None,
    kernel_config: dict | None = None,
) -> tuple[bool, str]:
    """Whether a run uses Liger's layer kernels (RMSNorm, RoPE, SwiGLU), and why (a log line; empty: nothing to say).

    Given (--use_liger_kernel true/false, or a --liger_kernel_config, which asks for them): that, with check_liger's
    refusals. Not given: on wherever they run in bf16 and pay: a CUDA GPU of compute capability 8.0 or newer (A100,
    L4, H100, H200), liger-kernel installed and a model type it has kernels for. On an H200 they trained the
    1.24B Llama-3.2 shape 1.26x faster at the same peak memory (packed: 33.5 -> 42.1% MFU); on an
    H100, 1.03x and 4.4 GiB less under ZeRO-2, 1.10x under ZeRO-3 (bench/README.md). A T4 or V100 (no bf16) and a
    CPU keep PyTorch's layers: nothing measured there says Liger wins.
    """
    if requested is None and kernel_config:
        requested = True
    if requested is not None:
        if requested:
            check_liger(gpu, model_type, supported, kernel_config)
        return bool(requested), ""
    if gpu is None or not gpu.has_bf16:
        return False, ""
    if supported is None:
        return False, (
            "Liger's kernels are off: liger-kernel is not installed (pip install 'llmft[gpu]': 1.26x on an H200 "
            "for a Llama); --use_liger_kernel false silences this"
        )
    if model_type not in supported:
        return False, ""
    return True, (
        "Liger's kernels on (auto: RMSNorm, RoPE and SwiGLU fused on this GPU; 1.26x on an H200 at the same memory); "
        "--use_liger_kernel false turns them off"
    )


# ---- node types: the cloud machines llmft's blueprints use, and their neighbours ---------------------------------
# One row per machine type: its GPUs and host. Checked (2026-11) against the providers' pages:
#   GCP: https://cloud.google.com/compute/docs/gpus (GPU machine types: G2, A2 Standard/Ultra, A3 High) and
#        https://cloud.google.com/compute/docs/accelerator-optimized-machines
#   AWS: https://docs.aws.amazon.com/ec2/latest/instancetypes/ac.html (accelerated computing specifications) and
#        https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa.html#efa-instance-types (EFA-capable types)
# Host RAM is the provider's number: GB on GCP, GiB on AWS (llmft treats both as GiB, so GCP nodes are read ~7%
# generous; the plan's host numbers carry more margin than that). GCP machines have no EFA (their fast fabrics,
# GPUDirect-TCPX on A3, are not EFA), so `efa` is False there.
GCP_GPU_PAGE = "https://cloud.google.com/compute/docs/gpus"
AWS_AC_PAGE = "https://docs.aws.amazon.com/ec2/latest/instancetypes/ac.html"


@dataclass(frozen=True)
class NodeType:
    """One cloud machine type: what a Slurm node of that type gives a job."""

    name: str  # the provider's machine type name, e.g. g2-standard-4, p4d.24xlarge
    provider: str  # gcp | aws
    gpu: GPU
    gpus: int  # GPUs per node
    vcpus: int
    host_ram_gib: float
    efa: bool  # Elastic Fabric Adapter (AWS)
    source: str  # the provider page the row was checked against


def _nodes(provider: str, gpu: str, source: str, rows) -> list[NodeType]:
    return [
        NodeType(name, provider, GPUS[gpu], gpus, vcpus, float(ram), efa, source)
        for name, gpus, vcpus, ram, efa in rows
    ]


NODE_TYPES: dict[str, NodeType] = {
    n.name: n
    for n in (
        # name, GPUs, vCPUs, host RAM, EFA
        *_nodes(
            "gcp",
            "L4",
            GCP_GPU_PAGE,
            [
                ("g2-standard-4", 1, 4, 16, False),
                ("g2-standard-8", 1, 8, 32, False),
                ("g2-standard-12", 1, 12, 48, False),
                ("g2-standard-16", 1, 16, 64, False),
                ("g2-standard-24", 2, 24, 96, False),
                ("g2-standard-32", 1, 32, 128, False),
                ("g2-standard-48", 4, 48, 192, False),
                ("g2-standard-96", 8, 96, 384, False),
            ],
        ),
        *_nodes(
            "gcp",
            "A100-40GB",
            GCP_GPU_PAGE,
            [
                ("a2-highgpu-1g", 1, 12, 85, False),
                ("a2-highgpu-2g", 2, 24, 170, False),
                ("a2-highgpu-4g", 4, 48, 340, False),
                ("a2-highgpu-8g", 8, 96, 680, False),
            ],
        ),
        *_nodes(
            "gcp",
            "A100-80GB",
            GCP_GPU_PAGE,
            [
                ("a2-ultragpu-1g", 1, 12, 170, False),
                ("a2-ultragpu-2g", 2, 24, 340, False),
                ("a2-ultragpu-4g", 4, 48, 680, False),
                ("a2-ultragpu-8g", 8, 96, 1360, False),
            ],
        ),
        *_nodes(
            "gcp",
            "H100-80GB",
            GCP_GPU_PAGE,
            [
                ("a3-highgpu-8g", 8, 208, 1872, False),
            ],
        ),
        *_nodes(
            "aws",
            "L4",
            AWS_AC_PAGE,
            [
                ("g6.xlarge", 1, 4, 16, False),
                ("g6.2xlarge", 1, 8, 32, False),
                ("g6.4xlarge", 1, 16, 64, False),
                ("g6.8xlarge", 1, 32, 128, True),
                ("g6.12xlarge", 4, 48, 192, True),
                ("g6.16xlarge", 1, 64, 256, True),
                ("g6.24xlarge", 4, 96, 384, True),
                ("g6.48xlarge", 8, 192, 768, True),
            ],
        ),
        *_nodes(
            "aws",
            "A100-40GB",
            AWS_AC_PAGE,
            [
                ("p4d.24xlarge", 8, 96, 1152, True),
            ],
        ),
        *_nodes(
            "aws",
            "H100-80GB",
            AWS_AC_PAGE,
            [
                ("p5.48xlarge", 8, 192, 2048, True),
            ],
        ),
    )
}


def node_type_by_name(name: str) -> NodeType:
    """A catalogue node type by its provider name (case-insensitive), e.g. 'g2-standard-4' or 'p4d.24xlarge'."""
    for key, node in NODE_TYPES.items():
        if key.lower() == name.strip().lower():
            return node
    raise HardwareError(
        f"unknown node type {name!r}; known: {', '.join(NODE_TYPES)} (or give --gpu and --host_ram_gb)"
    )


def local_host_ram_gib(env=None, meminfo: str = "/proc/meminfo") -> float:
    """The RAM a job may use on this node (llmft.planning.allocation.job_memory): the smallest of MemTotal, the
    memory cgroup's limit, Slurm's --mem / --mem-per-cpu / --mem-per-gpu and LLMFT_HOST_RAM_GB (run_llm.slurm sets
    it to the smallest node's, so every node of a job plans alike)."""
    return local_host_memory(env, meminfo).gib


def local_host_memory(env=None, meminfo: str = "/proc/meminfo"):
    """local_host_ram_gib with what sets it (a MemoryLimit: GiB and source)."""

    try:
        return this_node_memory(env, meminfo)
    except ValueError as e:
        if "LLMFT_HOST_RAM_GB" in str(e):
            raise HardwareError(str(e)) from None
        raise HardwareError(f"cannot read this node's memory from {meminfo}; give --host_ram_gb") from None

"""DeepSpeed configs: pick a ZeRO template from ds_configs/, fill every run-dependent field, write it beside the run.

Templates hold production defaults and leave run-dependent fields as "auto". HF's own "auto"
handling mis-computes the global batch in multi-process CPU runs, so llmft replaces every "auto"
with a concrete value: the file in the output directory is exactly what DeepSpeed ran with.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

from llmft.errors import LlmftError
from llmft.planning.batch import BatchPlan

ZERO_STAGES = (0, 1, 2, 3)
RESOLVED_NAME = "ds_config.json"


class DSConfigError(LlmftError, ValueError):
    """A DeepSpeed config that cannot be found, read or resolved."""


def templates_dir() -> Path:
    """ds_configs/ from a source checkout, or the copy installed under <prefix>/share/llmft."""
    for candidate in (Path(__file__).resolve().parents[2] / "ds_configs", Path(sys.prefix) / "share/llmft/ds_configs"):
        if (candidate / "zero2.json").is_file():
            return candidate
    raise DSConfigError("cannot find llmft's ds_configs/ templates; reinstall llmft or pass --deepspeed PATH")


def template_path(zero_stage: int | None, offload: bool | str = False, deepspeed: str | Path | None = None) -> Path:
    """The config file to start from: the user's --deepspeed file, or the template for a ZeRO stage.

    offload: False/"none"; True (--offload: the optimizer, and on ZeRO-3 the parameters too); or the planner's
    "optimizer" / "optimizer+params" (ZeRO-3 with only the optimizer offloaded: zero3_offload_optimizer.json).
    """
    if deepspeed is not None:
        if zero_stage is not None:
            raise DSConfigError("give either --zero_stage or --deepspeed, not both")
        path = Path(deepspeed)
        if not path.is_file():
            raise DSConfigError(
                f"DeepSpeed config {path} not found; pass an existing JSON file or --zero_stage {{0,1,2,3}}"
            )
        return path
    stage = 2 if zero_stage is None else zero_stage
    if stage not in ZERO_STAGES:
        raise DSConfigError(f"unknown ZeRO stage {stage!r}; use --zero_stage 0, 1, 2 or 3")
    if offload not in (False, None, "none") and stage < 2:
        raise DSConfigError(f"--offload needs ZeRO stage 2 or 3 (got {stage}); use --zero_stage 2 --offload")
    if offload == "optimizer+params" and stage != 3:
        raise DSConfigError(f"offloading the parameters needs ZeRO stage 3 (got {stage})")
    if offload in (False, None, "none"):
        name = f"zero{stage}.json"
    elif offload == "optimizer" and stage == 3:
        name = "zero3_offload_optimizer.json"
    elif offload in (True, "optimizer", "optimizer+params"):
        name = f"zero{stage}_offload.json"
    else:
        raise DSConfigError(f"unknown offload {offload!r}; use none, optimizer or optimizer+params")
    return templates_dir() / name


def load_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise DSConfigError(
            f"DeepSpeed config {path} is not valid JSON (line {e.lineno}: {e.msg}); fix the file"
        ) from None
    if not isinstance(config, dict):
        raise DSConfigError(f"DeepSpeed config {path} must hold a JSON object")
    if not isinstance(config.get("zero_optimization"), dict):  # HF's Trainer refuses such a config, without naming it
        raise DSConfigError(
            f'DeepSpeed config {path} has no "zero_optimization" section; add e.g. "zero_optimization": {{"stage": 2}}'
        )
    stage = config["zero_optimization"].get("stage", 0)
    if stage not in ZERO_STAGES:
        raise DSConfigError(f"DeepSpeed config {path} has unknown ZeRO stage {stage!r}; use 0, 1, 2 or 3")
    return config


def zero_stage_of(config: dict[str, Any]) -> int:
    return int(config.get("zero_optimization", {}).get("stage", 0))


def reduce_scatter(config: dict[str, Any]) -> bool:
    """Whether ZeRO reduces gradients with a reduce-scatter (DeepSpeed's default, true)."""
    return config.get("zero_optimization", {}).get("reduce_scatter", True) is not False


def offloads(config: dict[str, Any]) -> bool:
    zero = config.get("zero_optimization", {})
    return any(
        zero.get(k, {}).get("device", "none") not in ("none", None) for k in ("offload_optimizer", "offload_param")
    )


def offload_mode(config: dict[str, Any]) -> str:
    """none, optimizer or optimizer+params: what a config offloads to the CPU."""
    zero = config.get("zero_optimization", {})
    on = [
        k
        for k in ("offload_optimizer", "offload_param")
        if zero.get(k, {}).get("device", "none") not in ("none", None)
    ]
    return {(): "none", ("offload_optimizer",): "optimizer"}.get(tuple(on), "optimizer+params")


def _fill(section: dict[str, Any], key: str, value: Any, where: str) -> None:
    """Set an "auto" (or absent) field; an explicit different value is a contradiction the user must fix."""
    current = section.get(key, "auto")
    if current == "auto":
        section[key] = value
    elif current != value and not (isinstance(current, list) and list(value) == current):
        raise DSConfigError(
            f"DeepSpeed config sets {where}{key}={current!r} but this run needs {value!r}; "
            f'set it to "auto" in the config and let llmft compute it'
        )


def resolve(
    config: dict[str, Any],
    batch: BatchPlan,
    precision: str,
    *,
    gradient_clipping: float,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    hidden_size: int | None = None,
) -> dict[str, Any]:
    """Return a copy of `config` with every run-dependent field concrete and no "auto" left."""
    if precision not in ("bf16", "fp16", "fp32"):
        raise DSConfigError(f"unknown precision {precision!r}; use bf16, fp16 or fp32")
    cfg = copy.deepcopy(config)
    _fill(cfg, "train_micro_batch_size_per_gpu", batch.micro_batch, "")
    _fill(cfg, "gradient_accumulation_steps", batch.grad_accum, "")
    _fill(cfg, "train_batch_size", batch.global_batch, "")
    _fill(cfg, "gradient_clipping", gradient_clipping, "")
    for kind in ("bf16", "fp16"):
        cfg.setdefault(kind, {})
        _fill(cfg[kind], "enabled", precision == kind, f"{kind}.")

    optimizer = cfg.get("optimizer")
    if optimizer is not None:
        params = optimizer.setdefault("params", {})
        for key, value in (("lr", lr), ("betas", list(betas)), ("eps", eps), ("weight_decay", weight_decay)):
            _fill(params, key, value, "optimizer.params.")

    zero = cfg.get("zero_optimization", {})
    if any(
        zero.get(k) == "auto"
        for k in ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
    ):
        if hidden_size is None:
            raise DSConfigError('ZeRO-3 bucket sizes are "auto" but the model\'s hidden size is unknown')
        # The sizes HF's integration derives from the hidden size, made explicit.
        for key, value in (
            ("reduce_bucket_size", hidden_size * hidden_size),
            ("stage3_prefetch_bucket_size", int(0.9 * hidden_size * hidden_size)),
            ("stage3_param_persistence_threshold", 10 * hidden_size),
        ):
            if zero.get(key) == "auto":
                zero[key] = value

    leftover = list(_auto_fields(cfg))
    if leftover:
        raise DSConfigError(
            f"DeepSpeed config fields llmft cannot fill: {', '.join(leftover)}; give them explicit values"
        )
    return cfg


# --optim values and who runs them under DeepSpeed. AdamW variants are the same algorithm: DeepSpeed's own
# AdamW (fused on GPUs, DeepSpeedCPUAdam with offload) runs them, with the Trainer's hyper-parameters. Plain
# PyTorch/transformers optimizers need no extra package and run as the Trainer's optimizer, which ZeRO 0-3
# partitions (HF sets zero_allow_untested_optimizer); CPU offload needs DeepSpeed's own optimizer. Everything
# else (bitsandbytes 8-bit/paged, GaLore, APOLLO, LOMO, schedule-free, ...) is refused: not run under
# DeepSpeed by llmft's tests.
DEEPSPEED_ADAMW = ("adamw_torch", "adamw_torch_fused", "adamw_apex_fused")
TRAINER_OPTIMIZERS = ("sgd", "adagrad", "rmsprop", "adafactor")
DEFAULT_OPTIM = "adamw_torch_fused"  # TRL's SFTConfig default


def choose_optimizer(
    config: dict[str, Any], optim: str, *, optim_args: str | None = None, user_config: bool = False
) -> dict[str, Any]:
    """The one decision about who runs --optim: returns `config` with its optimizer block kept, added or removed.

    user_config: the config is the user's own --deepspeed file (its optimizer block is theirs, not a template's).
    """
    optim = str(getattr(optim, "value", optim))
    cfg = copy.deepcopy(config)
    block = cfg.get("optimizer")
    block_type = str(block.get("type", "")) if isinstance(block, dict) else None
    offload = offloads(cfg)
    supported = f"use one of {', '.join(DEEPSPEED_ADAMW)} (DeepSpeed's AdamW) or {', '.join(TRAINER_OPTIMIZERS)}"
    if optim in DEEPSPEED_ADAMW:
        if optim_args:
            raise DSConfigError(
                f"--optim_args {optim_args!r} is not used by DeepSpeed's AdamW: drop it (set betas, eps and weight decay with --adam_beta1/--adam_beta2/--adam_epsilon/--weight_decay)"
            )
        if block is None:
            if offload:  # DeepSpeed refuses a client optimizer with offload: give it its own AdamW
                cfg["optimizer"] = {
                    "type": "AdamW",
                    "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
                }
            return cfg  # no block: the Trainer's torch AdamW runs, as the user's config asks
        if block_type.lower() not in ("adamw", "adam") and optim != DEFAULT_OPTIM:
            raise DSConfigError(
                f"--optim {optim} contradicts the optimizer block ({block_type}) of your DeepSpeed config: drop --optim, or the block"
            )
        return cfg
    if optim in TRAINER_OPTIMIZERS:
        if optim_args and optim == "adafactor":
            raise DSConfigError("--optim_args is not used by adafactor: drop it")
        if offload:
            raise DSConfigError(
                f"--optim {optim} runs as the Trainer's optimizer, and DeepSpeed's CPU offload needs its own optimizer: drop --offload, or {supported}"
            )
        if block is not None and user_config:
            raise DSConfigError(
                f"--optim {optim} contradicts the optimizer block ({block_type}) of your DeepSpeed config: remove the block to use {optim}"
            )
        cfg.pop("optimizer", None)  # HF then creates the Trainer's optimizer and hands it to DeepSpeed
        return cfg
    raise DSConfigError(f"--optim {optim} is not supported with DeepSpeed in llmft: {supported}")


def adam_kernel(
    *, cuda: bool, offload: bool, fused_adam_prebuilt: bool, cuda_compiler: bool, cxx_compiler: bool = True
) -> str:
    """Which implementation runs the config's Adam/AdamW on the GPU: "fused" (DeepSpeed's FusedAdam: one kernel per
    step, prebuilt or JIT-compiled with nvcc on the first step, about 40 s on an H100 machine), "torch"
    (torch.optim.AdamW through DeepSpeed's torch_adam) where FusedAdam is not prebuilt and no CUDA compiler is there
    to build it (a pip-installed torch brings the CUDA runtime, not nvcc: DeepSpeed would fail at the first step),
    or "deepspeed" where DeepSpeed chooses itself (CPU runs, CPU offload's DeepSpeedCPUAdam). On CPU, DeepSpeed's
    choice is its CPU FusedAdam, a C++ op that loads through ninja and c++ even when already built (ninja checks the
    build's headers): where no C++ compiler is there (a container image without one), "torch" instead."""
    if offload:
        return "deepspeed"
    if not cuda:
        return "deepspeed" if cxx_compiler or fused_adam_prebuilt else "torch"
    return "fused" if fused_adam_prebuilt or cuda_compiler else "torch"


def local_adam_facts() -> dict[str, bool]:
    """This machine's facts for adam_kernel: is FusedAdam prebuilt into the installed DeepSpeed, is nvcc there, is a
    C++ compiler there (CXX, else c++: what torch's extension builds run)."""
    import os
    import shutil

    try:
        from deepspeed.git_version_info import installed_ops
    except ImportError:
        installed_ops = {}
    from torch.utils.cpp_extension import CUDA_HOME

    nvcc = (bool(CUDA_HOME) and os.access(os.path.join(CUDA_HOME, "bin", "nvcc"), os.X_OK)) or shutil.which(
        "nvcc"
    ) is not None
    return {
        "fused_adam_prebuilt": bool(installed_ops.get("fused_adam")),
        "cuda_compiler": nvcc,
        "cxx_compiler": shutil.which(os.environ.get("CXX") or "c++") is not None,
    }


def with_adam_kernel(config: dict[str, Any], kernel: str) -> dict[str, Any]:
    """The resolved config with DeepSpeed's torch_adam set when adam_kernel said "torch" (and an Adam block is there)."""
    block = config.get("optimizer")
    if kernel != "torch" or not isinstance(block, dict) or str(block.get("type", "")).lower() not in ("adam", "adamw"):
        return config
    cfg = copy.deepcopy(config)
    cfg["optimizer"].setdefault("params", {})["torch_adam"] = True
    return cfg


def _auto_fields(node: Any, prefix: str = ""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _auto_fields(v, f"{prefix}{k}.")
    elif node == "auto":
        yield prefix.rstrip(".")


def write_resolved(config: dict[str, Any], output_dir: Path) -> Path:
    """Write the resolved config as <output_dir>/ds_config.json (atomically: a crash leaves the old one)."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / RESOLVED_NAME
    tmp = path.with_suffix(f".tmp{id(config)}")
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    tmp.replace(path)
    return path

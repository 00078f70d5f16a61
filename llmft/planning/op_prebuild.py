"""Which DeepSpeed ops llmft's install step compiles into DeepSpeed, for which GPUs, or why it cannot.

DeepSpeed compiles an op that is not prebuilt the first time a job needs it: FusedAdam, llmft's optimizer on a GPU,
took 40 of a first job's 67 s on an H100 node (2026-11-24), and every fresh node of a 64-rank job pays it again.
`llmft prebuild` (run by `make venv`) reinstalls DeepSpeed from source with those ops built in (DeepSpeed's own
DS_BUILD_* switches), so jobs load them with no compiler and no per-node op cache. The decision is one pure function
of the machine's facts (`op_prebuild`), so the tests ask it about an L4, an A100, an H100 and a T4 on a CPU machine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from llmft.planning.hardware import GPU, GPUS

# llmft's defaults use FusedAdam on a GPU, and DeepSpeedCPUAdam where the planner offloads the optimizer (8B on an L4).
OPS = ("fused_adam", "cpu_adam")
# CUDA 13 dropped the architectures before Turing (compute capability 7.5): its nvcc refuses sm_70.
OLDEST_ARCH = {13: (7, 5)}


@dataclass(frozen=True)
class OpPrebuild:
    """What the install step does: compile `build` (DeepSpeed op names) with `env` set, or nothing; and its line."""

    build: tuple[str, ...]
    line: str
    env: dict[str, str] = field(default_factory=dict)


def deepspeed_arch_list(value: str | None) -> str | None:
    """TORCH_CUDA_ARCH_LIST as DeepSpeed's op builder can read it, or None when it can already (or is unset).

    PyTorch accepts arch-specific and family targets such as `9.0a` (Hopper's wgmma) or `10.0f`, and CUDA images
    for H100/B200 set them; DeepSpeed 0.19's builder sorts the list with int() on each part and fails on the
    first op it builds (FusedAdam, at the first step: `invalid literal for int() with base 10: '0a'`, seen on an
    H100 machine with TORCH_CUDA_ARCH_LIST=9.0a). Its ops use no arch-specific instructions, so the plain
    compute capability builds the same kernels: `9.0a` -> `9.0`, `8.0;9.0a+PTX` -> `8.0;9.0+PTX`."""
    if not value or not value.strip():
        return None
    entries = [e for e in re.split(r"[;\s]+", value.strip()) if e]
    fixed = [re.sub(r"^(\d+\.\d+)[a-z](\+PTX)?$", r"\1\2", e) for e in entries]
    return ";".join(dict.fromkeys(fixed)) if fixed != entries else None


def build_arch_list(gpus: Sequence[GPU], torch_cuda: str, user_list: str | None) -> str:
    """TORCH_CUDA_ARCH_LIST for the build. Prebuilt ops run only on the architectures they were built for, and a venv
    on a shared filesystem serves every node of the cluster, so: the user's own list (made readable to DeepSpeed)
    when set; else every bf16 architecture in llmft's catalogue (A100 8.0, L4 8.9, H100/H200 9.0) with this machine's
    GPUs, the newest also as PTX for GPUs newer than the catalogue. A GPU before 8.0 (T4, V100) is built alone: one
    such architecture in the list makes DeepSpeed build FusedAdam without bf16 for all of them. (op_prebuild asks
    only with GPUs visible or a user's list: a CUDA torch on a machine with neither is a CPU machine or a login
    node that did not say which GPUs it serves.)"""
    if user_list and user_list.strip():
        return deepspeed_arch_list(user_list) or user_list.strip()
    oldest = OLDEST_ARCH.get(int(torch_cuda.split(".")[0]), (0, 0))
    visible = {g.compute_capability for g in gpus if g.compute_capability >= oldest}
    if gpus and not visible:
        return ""  # this CUDA compiles for none of them (V100 under CUDA 13)
    if any(c < (8, 0) for c in visible):
        capabilities = visible
    else:
        capabilities = visible | {g.compute_capability for g in GPUS.values() if g.has_bf16}
    archs = [f"{major}.{minor}" for major, minor in sorted(capabilities)]
    return ";".join(archs[:-1] + [archs[-1] + "+PTX"]) if archs else ""


def op_prebuild(
    *,
    torch_cuda: str | None,
    nvcc: bool,
    gpus: Sequence[GPU],
    user_arch_list: str | None,
    installed: Mapping[str, bool],
    build_vars: Mapping[str, str],
    ops: Sequence[str] = OPS,
) -> OpPrebuild:
    """The install step's decision from the facts: torch's CUDA version (None: a CPU build), whether nvcc is here,
    the visible GPUs, the user's TORCH_CUDA_ARCH_LIST, DeepSpeed's installed ops and each op's DS_BUILD_* switch.
    A reinstall keeps the ops already prebuilt (the Dockerfile's utils and async_io among them)."""
    if torch_cuda is None:
        return OpPrebuild((), "this torch is a CPU build: no DeepSpeed GPU op to prebuild")
    missing = [op for op in ops if not installed.get(op)]
    if not missing:
        return OpPrebuild((), f"DeepSpeed's {', '.join(ops)} ops are already prebuilt: jobs compile nothing")
    if not gpus and not (user_arch_list and user_arch_list.strip()):
        return OpPrebuild(
            (),
            "no GPU visible here to build DeepSpeed's ops for: run `llmft prebuild` on a GPU node, or here with "
            "TORCH_CUDA_ARCH_LIST set to your GPUs' compute capabilities (A100 8.0, L4 8.9, H100 9.0)",
        )
    if not nvcc:
        return OpPrebuild(
            (),
            f"no CUDA compiler (nvcc) here to prebuild DeepSpeed's {', '.join(missing)}: jobs run torch.optim.AdamW in "
            f"place of FusedAdam; install the CUDA {torch_cuda} toolkit (nvcc) and run `llmft prebuild`, or use the "
            "Dockerfile's image",
        )
    build = tuple(dict.fromkeys([*(op for op, built in installed.items() if built and op in build_vars), *ops]))
    unknown = [op for op in build if op not in build_vars]
    if unknown:
        return OpPrebuild((), f"this DeepSpeed has no {', '.join(unknown)} op to prebuild: jobs build what they need")
    archs = build_arch_list(gpus, torch_cuda, user_arch_list)
    env = {"DS_BUILD_OPS": "0", "DS_ACCELERATOR": "cuda", "TORCH_CUDA_ARCH_LIST": archs}
    env.update({build_vars[op]: "1" for op in build})
    if not archs:
        return OpPrebuild((), f"CUDA {torch_cuda} compiles for none of this machine's GPUs: nothing to prebuild")
    return OpPrebuild(
        build,
        f"compiling DeepSpeed's {', '.join(build)} into DeepSpeed for compute capability {archs} "
        "(TORCH_CUDA_ARCH_LIST chooses others); a few minutes, once: jobs then compile nothing",
        env,
    )


def pip_command(python: str, deepspeed_version: str) -> list[str]:
    """DeepSpeed reinstalled from its source with the switches set: no wheel from pip's cache (one built without the
    ops would come back), no dependency touched."""
    return [
        python,
        "-m",
        "pip",
        "install",
        "--no-build-isolation",
        "--no-deps",
        "--force-reinstall",
        "--no-cache-dir",
        "--no-binary",
        "deepspeed",
        f"deepspeed=={deepspeed_version}",
    ]

"""What a training process sets up before DeepSpeed starts: a world of one outside torchrun, and the fixes to
DeepSpeed's op builds (an op training never uses, a slow CPU probe); CUDA arch lists it cannot parse are made
readable by llmft.planning.op_prebuild.deepspeed_arch_list."""

from __future__ import annotations

import os

from llmft.planning.world import free_port


def single_process_defaults(env: dict | None = None) -> bool:
    """Outside torchrun, give this process the variables of a world of one (else DeepSpeed tries MPI).

    Returns True when it set them.
    """
    env = os.environ if env is None else env
    if "RANK" in env or "WORLD_SIZE" in env:
        return False
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(free_port()))
    return True


def skip_deepspeed_shm_op(env: dict | None = None) -> bool:
    """Keep DeepSpeed from building its CPU shared-memory all-reduce op when its comm layer starts.

    On the CPU accelerator `deepspeed.init_distributed` JIT-compiles `deepspeed_shm_comm` (C++ with OpenMP, about
    a minute on 2 cores, then a cached load on every start; a cache written by another environment is rebuilt).
    Only `inference_all_reduce` (DeepSpeed's tensor-parallel inference) uses it; training's collectives go through
    torch.distributed, so llmft never needs it (bench/bench_startup.py measures the difference).
    LLMFT_DEEPSPEED_SHM_COMM=1 keeps DeepSpeed's default. Returns True when it was skipped.
    """
    env = os.environ if env is None else env
    if env.get("LLMFT_DEEPSPEED_SHM_COMM") == "1":
        return False
    import deepspeed.ops

    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if not isinstance(compatible, dict) or "deepspeed_shm_comm" not in compatible:
        return False
    compatible["deepspeed_shm_comm"] = False  # deepspeed.comm.torch.build_shm_op then returns None
    return True


# py-cpuinfo's names for the machines /proc/cpuinfo answers for as it would (its _parse_arch)
_CPUINFO_ARCH = {"x86_64": "X86_64", "amd64": "X86_64", "aarch64": "ARM_8", "arm64": "ARM_8"}


def cpu_info_from_proc(cpuinfo_text: str, machine: str) -> dict | None:
    """What DeepSpeed reads of py-cpuinfo's `get_cpu_info()` (arch, flags, vendor_id_raw), from /proc/cpuinfo.

    py-cpuinfo answers from a fresh Python process that also times the clock and runs system tools: 1.1 s a call on
    the 2-core machine, and DeepSpeed's CPU op builders call it twice each time they load an op (FusedAdam on CPU,
    CPU Adam under ZeRO-Offload on GPU nodes), on every rank at every start. The compile flags DeepSpeed derives from
    it (-march, the SIMD width) must not change, or the cached op is rebuilt: None wherever the answer could differ
    (another architecture, no flags line)."""
    arch = _CPUINFO_ARCH.get(machine.lower())
    fields: dict[str, str] = {}
    for line in cpuinfo_text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() and key.strip() not in fields:
            fields[key.strip()] = value.strip()
        if not line.strip() and fields:  # the first processor's block is enough
            break
    flags = fields.get("flags") if arch == "X86_64" else fields.get("Features")
    if arch is None or not flags:
        return None
    info = {"arch": arch, "flags": sorted(set(flags.lower().split()))}
    if fields.get("vendor_id"):
        info["vendor_id_raw"] = fields["vendor_id"]
    return info


def use_proc_cpuinfo_for_deepspeed(path: str = "/proc/cpuinfo", env: dict | None = None) -> bool:
    """Answer py-cpuinfo's `get_cpu_info()` from /proc/cpuinfo in this process (cpu_info_from_proc); True when it
    does. Saves DeepSpeed's CPU op loads about 2 s per process (bench/README.md, bench_startup.py).
    LLMFT_PY_CPUINFO=1 keeps py-cpuinfo."""
    import platform

    if (os.environ if env is None else env).get("LLMFT_PY_CPUINFO") == "1":
        return False
    try:
        with open(path) as f:
            info = cpu_info_from_proc(f.read(), platform.machine())
        import cpuinfo
    except (OSError, ImportError):
        return False
    if info is None:
        return False
    cpuinfo.get_cpu_info = lambda: {**info, "flags": list(info["flags"])}
    return True


def defer_deepspeed_compile_decorators(env: dict | None = None) -> bool:
    """Make DeepSpeed's `@compiler.compile()` decorators call torch.compile at a function's first call, not at import.

    DeepSpeed's Muon optimizer module decorates three functions with torch.compile at import, and DeepSpeed imports
    that module on every ZeRO run (to ask whether the optimizer is Muon: the engine's optimizer check, ZeRO-1/2's
    gradient reduction, ZeRO-3's and the bf16 optimizer's set-up). torch.compile imports torch._inductor's compiler
    when called: 1.45 s of a rank's 9.4 s of imports on the 2-core machine (python -X importtime), for functions
    llmft never calls. torch.compile compiles at the first call anyway, so deferring the call itself changes nothing
    a decorated function does. Must run before DeepSpeed's engine starts (llmft.train's prepare_process);
    LLMFT_DEEPSPEED_EAGER_COMPILE=1 keeps DeepSpeed's. Returns True when the decorator is the deferred one."""
    if (os.environ if env is None else env).get("LLMFT_DEEPSPEED_EAGER_COMPILE") == "1":
        return False
    import functools
    import sys

    import torch
    from deepspeed.runtime import compiler

    if getattr(compiler.compile, "llmft_deferred", False):
        return True
    if "deepspeed.runtime.zero.muon.original_muon" in sys.modules or not hasattr(torch, "compile"):
        return False  # already decorated eagerly, or DeepSpeed's no-op decorator applies

    def compile():
        def decorator(fn):
            compiled = None

            @functools.wraps(fn)
            def compiled_at_first_call(*args, **kwargs):
                nonlocal compiled
                if compiled is None:
                    compiled = torch.compile(fn)
                return compiled(*args, **kwargs)

            return compiled_at_first_call

        return decorator

    compile.llmft_deferred = True
    compiler.compile = compile
    return True

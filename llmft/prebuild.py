"""Compile DeepSpeed's GPU ops into the installed DeepSpeed once, so no job compiles them (`make venv` runs this).

    llmft prebuild              # on a GPU node with the CUDA toolkit (nvcc): FusedAdam and CPUAdam
    TORCH_CUDA_ARCH_LIST="8.0;8.9;9.0" llmft prebuild    # on a login node: for the GPUs named
    llmft prebuild --dry_run    # what it would do, and the pip command, without doing it

Without it the first job on each fresh node compiles FusedAdam (40 of 67 s of start-up on an H100) and CPUAdam when
the optimizer is offloaded. The decision (which ops, which GPU architectures, or why not) is
llmft.planning.op_prebuild.op_prebuild; this command reads the facts, runs pip, and checks that DeepSpeed now
reports the ops as installed. TORCH_CUDA_ARCH_LIST, when set, says which GPUs to build for (else the visible ones
with the catalogue's bf16 GPUs; with neither, nothing is built); pip's own PIP_* variables (an index, --target)
apply as usual.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from llmft.command import command_parser, report_error
from llmft.errors import LlmftError
from llmft.planning import ds_config
from llmft.planning.hardware import gpu_from_device
from llmft.planning.op_prebuild import OPS, op_prebuild, pip_command


class PrebuildError(LlmftError, RuntimeError):
    """DeepSpeed could not be rebuilt with its ops; the message has pip's last lines and the fix."""


def make_parser(subparsers=None):
    parser = command_parser(subparsers, "prebuild", __doc__.splitlines()[0])
    parser.add_argument(
        "--dry_run", action="store_true", help="say what would be built and the pip command; build nothing"
    )
    parser.set_defaults(func=main)
    return parser


def machine_facts() -> dict:
    """The facts op_prebuild decides from, read off this machine and its DeepSpeed (not imported for a CPU torch)."""
    import torch

    facts = {"torch_cuda": torch.version.cuda, "gpus": [], "installed": {}, "build_vars": {}, "nvcc": False}
    facts["user_arch_list"] = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if not torch.version.cuda:
        return facts
    os.environ.setdefault("DS_ACCELERATOR", "cuda")  # DeepSpeed lists its CUDA ops under its CUDA accelerator only
    from deepspeed.git_version_info import installed_ops
    from deepspeed.ops.op_builder.all_ops import ALL_OPS

    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        facts["gpus"].append(gpu_from_device(props.name, props.total_memory / 2**30, (props.major, props.minor)))
    if facts["gpus"] or facts["user_arch_list"]:  # torch warns where it finds no CUDA runtime: asked only if needed
        facts["nvcc"] = ds_config.local_adam_facts()["cuda_compiler"]
    facts["installed"] = dict(installed_ops)
    facts["build_vars"] = {name: builder.BUILD_VAR for name, builder in ALL_OPS.items()}
    return facts


def installed_ops_now() -> dict:
    """DeepSpeed's installed ops as a fresh interpreter sees them after the reinstall."""
    code = "import json, deepspeed.git_version_info as g; print(json.dumps(g.installed_ops))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    return json.loads(lines[-1]) if proc.returncode == 0 and lines else {}


def build_error(pip_output: str) -> str:
    """The line of pip's output that says why the build failed: the compiler's first fatal error or error, else
    pip's last line (pip's own summary lines name no cause)."""
    lines = [line.strip() for line in pip_output.splitlines() if line.strip()]
    for pattern in (r"fatal error", r"\berror\b(?!: subprocess-exited)(?!: failed-wheel)"):
        found = [line for line in lines if re.search(pattern, line, re.IGNORECASE) and "Command '[" not in line]
        found = [line for line in found if not line.startswith(("ERROR: Failed building", "error: failed-wheel"))]
        if found:
            return found[0][:300]
    return (lines or ["no output"])[-1][:300]


def main(args) -> int:
    try:
        return prebuild(dry_run=args.dry_run)
    except LlmftError as e:
        return report_error("prebuild", e, all_ranks=True)


def prebuild(*, dry_run: bool) -> int:
    from importlib.metadata import version

    decision = op_prebuild(**machine_facts(), ops=OPS)
    print(f"llmft prebuild: {decision.line}", flush=True)
    if not decision.build:
        return 0
    cmd = pip_command(sys.executable, version("deepspeed"))
    shown = " ".join(f"{k}={v}" for k, v in decision.env.items()) + " " + " ".join(cmd)
    if dry_run:
        print(f"llmft prebuild: would run: {shown}")
        return 0
    print(f"llmft prebuild: {shown}", flush=True)
    log_path = Path(tempfile.gettempdir()) / f"llmft-prebuild-{os.getpid()}.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.run(cmd, env={**os.environ, **decision.env}, stdout=log_file, stderr=subprocess.STDOUT)
    built = installed_ops_now()
    missing = [op for op in decision.build if not built.get(op)]
    if proc.returncode != 0 or missing:
        raise PrebuildError(
            f"DeepSpeed's {', '.join(missing or decision.build)} did not build (pip exit {proc.returncode}: "
            f"{build_error(log_path.read_text(errors='replace'))}; whole log: {log_path}); jobs will compile them at "
            "their first step instead; rerun `llmft prebuild` after fixing the cause"
        )
    log_path.unlink()
    print(f"llmft prebuild: DeepSpeed {version('deepspeed')} now has {', '.join(decision.build)} built in")
    return 0


if __name__ == "__main__":
    sys.exit(main(make_parser().parse_args()))

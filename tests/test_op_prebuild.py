"""llmft's install step prebuilds DeepSpeed's GPU ops (issue 31 item 4): which ops, for which GPUs, or the one line
saying why not. The decision is driven with an L4, an A100, an H100 and a T4; DeepSpeed's own builder reads the
arch list it chooses; the command runs for real on this CPU machine and, with an H100's facts, names its pip command."""

from __future__ import annotations

import subprocess
import sys

import pytest

from llmft.planning.hardware import GPUS
from llmft.planning.op_prebuild import OPS, build_arch_list, op_prebuild, pip_command

BUILD_VARS = {"fused_adam": "DS_BUILD_FUSED_ADAM", "cpu_adam": "DS_BUILD_CPU_ADAM", "async_io": "DS_BUILD_AIO"}


def decide(gpus=(), *, cuda="12.8", nvcc=True, installed=None, arch=None):
    return op_prebuild(
        torch_cuda=cuda,
        nvcc=nvcc,
        gpus=list(gpus),
        user_arch_list=arch,
        installed=installed or {},
        build_vars=BUILD_VARS,
    )


@pytest.mark.parametrize(
    "gpu, archs",
    [
        # a venv on a shared filesystem serves every node: the catalogue's bf16 GPUs are built with the local one
        ("L4", "8.0;8.9;9.0+PTX"),
        ("A100-80GB", "8.0;8.9;9.0+PTX"),
        ("H100-80GB", "8.0;8.9;9.0+PTX"),
        # one pre-Ampere architecture makes DeepSpeed build FusedAdam without bf16 for all: a T4 is built alone
        ("T4", "7.5+PTX"),
    ],
)
def test_a_gpu_node_with_nvcc_builds_fused_and_cpu_adam_for_its_gpu(gpu, archs):
    d = decide([GPUS[gpu]])
    assert d.build == OPS == ("fused_adam", "cpu_adam")
    assert d.env == {
        "DS_BUILD_OPS": "0",
        "DS_ACCELERATOR": "cuda",  # a login node has no GPU: DeepSpeed would fall back to its CPU accelerator
        "TORCH_CUDA_ARCH_LIST": archs,
        "DS_BUILD_FUSED_ADAM": "1",
        "DS_BUILD_CPU_ADAM": "1",
    }
    assert archs in d.line


def test_arch_lists_for_login_nodes_user_lists_and_cuda_13():
    assert build_arch_list([], "12.8", None) == "8.0;8.9;9.0+PTX"  # no GPU visible
    assert build_arch_list([], "12.8", "8.0;9.0a") == "8.0;9.0"  # the H100 image's 9.0a, made readable to DeepSpeed
    assert build_arch_list([], "12.8", "8.6") == "8.6"  # the user's own list wins
    assert build_arch_list([GPUS["V100-16GB"]], "12.8", None) == "7.0+PTX"
    assert build_arch_list([GPUS["V100-16GB"]], "13.0", None) == ""  # CUDA 13's nvcc refuses sm_70
    assert "for none of this machine's GPUs" in decide([GPUS["V100-16GB"]], cuda="13.0").line


def test_deepspeeds_builder_compiles_for_exactly_the_chosen_architectures(monkeypatch):
    """DeepSpeed's own install-time builder reads the list: one -gencode per architecture, bf16 kept on Ampere+."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    for gpu, expected, bf16 in (
        ("L4", ["sm_80", "sm_89", "sm_90", "compute_90"], True),  # machine code for each, PTX for what comes after
        ("T4", ["sm_75", "compute_75"], False),
    ):
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", decide([GPUS[gpu]]).env["TORCH_CUDA_ARCH_LIST"])
        builder = FusedAdamBuilder()
        assert [a.rsplit("code=", 1)[1] for a in builder.compute_capability_args()] == expected
        assert builder.enable_bf16 is bf16


def test_no_build_where_nothing_is_to_be_gained_or_nothing_can_compile():
    cpu = decide(cuda=None)
    assert cpu.build == () and cpu.line == "this torch is a CPU build: no DeepSpeed GPU op to prebuild"
    done = decide([GPUS["H100-80GB"]], installed={"fused_adam": True, "cpu_adam": True})
    assert done.build == () and "already prebuilt" in done.line
    # a CUDA torch with no GPU and no arch list: a CPU machine (CI's other-Python venvs) or a login node
    login = decide(cuda="13.0")
    assert login.build == () and login.line.startswith("no GPU visible here to build DeepSpeed's ops for")
    assert decide(cuda="13.0", arch="8.0;9.0").env["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0"  # unless it says which
    no_nvcc = decide([GPUS["L4"]], nvcc=False)
    assert no_nvcc.build == ()
    assert no_nvcc.line == (
        "no CUDA compiler (nvcc) here to prebuild DeepSpeed's fused_adam, cpu_adam: jobs run torch.optim.AdamW in place "
        "of FusedAdam; install the CUDA 12.8 toolkit (nvcc) and run `llmft prebuild`, or use the Dockerfile's image"
    )


def test_a_rebuild_keeps_the_ops_already_built_in():
    d = decide([GPUS["A100-40GB"]], installed={"async_io": True, "fused_adam": True, "cpu_adam": False})
    assert d.build == ("async_io", "fused_adam", "cpu_adam")
    assert d.env["DS_BUILD_AIO"] == "1"


def test_pip_reinstalls_deepspeed_from_source_never_from_a_cached_wheel():
    assert pip_command("/venv/bin/python", "0.19.8") == [
        "/venv/bin/python",
        "-m",
        "pip",
        "install",
        "--no-build-isolation",
        "--no-deps",
        "--force-reinstall",
        "--no-cache-dir",
        "--no-binary",
        "deepspeed",
        "deepspeed==0.19.8",
    ]


def test_the_command_on_this_cpu_machine_says_one_line_and_succeeds():
    """What `make venv` runs here: one line, exit 0, DeepSpeed not even imported (no accelerator warning)."""
    proc = subprocess.run([sys.executable, "-m", "llmft.prebuild"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "llmft prebuild: this torch is a CPU build: no DeepSpeed GPU op to prebuild\n"
    assert proc.stderr == ""


def test_the_command_on_an_h100_node_names_its_pip_command(monkeypatch, capsys):
    """The H100 facts through the command's own path (--dry_run: nothing installed here)."""
    from llmft import prebuild

    facts = {
        "torch_cuda": "13.0",
        "nvcc": True,
        "gpus": [GPUS["H100-80GB"]],
        "user_arch_list": "9.0a",  # what the lent H100 machine's image sets
        "installed": {"fused_adam": False, "cpu_adam": False},
        "build_vars": BUILD_VARS,
    }
    monkeypatch.setattr(prebuild, "machine_facts", lambda: facts)
    assert prebuild.main(prebuild.make_parser().parse_args(["--dry_run"])) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("llmft prebuild: compiling DeepSpeed's fused_adam, cpu_adam into DeepSpeed for compute")
    from importlib.metadata import version

    assert out[1] == (
        "llmft prebuild: would run: DS_BUILD_OPS=0 DS_ACCELERATOR=cuda TORCH_CUDA_ARCH_LIST=9.0 DS_BUILD_FUSED_ADAM=1 "
        f"DS_BUILD_CPU_ADAM=1 {sys.executable} -m pip install --no-build-isolation --no-deps --force-reinstall "
        f"--no-cache-dir --no-binary deepspeed deepspeed=={version('deepspeed')}"
    )


def test_a_failed_build_is_one_line_naming_the_ops_and_the_fix(monkeypatch, capsys):
    """pip fails (here: no such DeepSpeed version to reinstall offline): one error line, exit 2, no traceback."""
    from llmft import prebuild

    facts = {
        "torch_cuda": "12.8",
        "nvcc": True,
        "gpus": [GPUS["L4"]],
        "user_arch_list": None,
        "installed": {},
        "build_vars": BUILD_VARS,
    }
    monkeypatch.setattr(prebuild, "machine_facts", lambda: facts)
    monkeypatch.setattr(prebuild, "pip_command", lambda python, v: [python, "-c", "import sys; sys.exit('no sdist')"])
    assert prebuild.main(prebuild.make_parser().parse_args([])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith(
        "llmft prebuild: error: DeepSpeed's fused_adam, cpu_adam did not build (pip exit 1: no sdist; whole log: "
    )
    assert "rerun `llmft prebuild`" in err[0]
    log = err[0].split("whole log: ")[1].split(")")[0]
    assert open(log).read() == "no sdist\n"


def test_the_failure_names_the_compilers_error_not_pips_summary():
    """What a machine with nvcc but not the whole CUDA toolkit printed (this CPU machine's /usr/local/bin/nvcc)."""
    from llmft.prebuild import build_error

    pip_output = """  Building wheel for deepspeed (pyproject.toml): finished with status 'error'
  error: subprocess-exited-with-error
      /usr/local/bin/nvcc -I/tmp/pip-install/csrc/includes -c csrc/adam/multi_tensor_adam.cu -o multi_tensor_adam.o
      torch/include/ATen/cuda/CUDAContextLight.h:10:10: fatal error: cusparse.h: No such file or directory
      error: Command '['/usr/local/bin/nvcc', '-c', 'csrc/adam/multi_tensor_adam.cu']' returned non-zero exit status 1.
  ERROR: Failed building wheel for deepspeed
error: failed-wheel-build-for-install
"""
    assert build_error(pip_output) == (
        "torch/include/ATen/cuda/CUDAContextLight.h:10:10: fatal error: cusparse.h: No such file or directory"
    )
    assert build_error("ERROR: No matching distribution found for deepspeed==0.19.8\n") == (
        "ERROR: No matching distribution found for deepspeed==0.19.8"
    )

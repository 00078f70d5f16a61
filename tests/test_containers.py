"""Containers on PBS: enroot as its source defines it. GPUs reach a container through NVIDIA_VISIBLE_DEVICES (enroot's
nvidia hook), never an option `enroot start` does not have, and the stand-in the PBS tests run rejects what the real
enroot rejects: its `start` options are held here to enroot 4.1.2's own parser (../shared/vendor)."""

from __future__ import annotations

import re
import subprocess
import tarfile
from pathlib import Path

from conftest import REPO

from llmft.launch import pbs

ENROOT_SOURCE = REPO.parent / "shared" / "vendor" / "enroot-4.1.2-8ea147d.tar.gz"
STANDIN = REPO / "tests" / "enroot_standin"


def real_start_options() -> dict[str, int]:
    """Every option enroot::start parses in enroot.in, and how many arguments it consumes (1: a flag, 2: a value)."""
    assert ENROOT_SOURCE.is_file(), f"{ENROOT_SOURCE}: enroot's source is missing (the workplace's shared/vendor)"
    with tarfile.open(ENROOT_SOURCE) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("/enroot.in"))
        source = tar.extractfile(member).read().decode()
    body = source[source.index("enroot::start() {") :]
    body = body[: body.index("    done\n")]
    options = {}
    for patterns, block in re.findall(r"\n\s+([-\w|=*?]+)\)\n(.*?);;", body, flags=re.S):
        if patterns in ("--", "-?*", "*", "-h|--help"):
            continue
        for option in patterns.split("|"):
            options[option.rstrip("*")] = 2 if "shift 2" in block else 1
    return options


def standin(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {
        "ENROOT_STANDIN_LOG": str(tmp_path / "log"),
        "ENROOT_STANDIN_STATE": str(tmp_path / "state"),
        "PATH": "/usr/bin:/bin",
    }
    return subprocess.run(["bash", str(STANDIN), *args], capture_output=True, text=True, env=env)


def test_the_standin_takes_exactly_the_options_enroot_start_takes(tmp_path):
    real = real_start_options()
    assert {"--rw", "--mount", "--env", "--conf", "--rc", "--root", "--net", "--pid", "--ipc", "--uts"} <= set(real)
    assert "--nv" not in real and "--gpus" not in real  # GPUs come through the environment
    image = tmp_path / "image.sqsh"
    image.write_bytes(b"")
    assert standin(tmp_path, "create", "--name", "c", str(image)).returncode == 0
    for option, consumed in real.items():
        args = [f"{option}x"] if option.endswith("=") else [option, "x"][:consumed]
        proc = standin(tmp_path, "start", *args, "c", "true")
        assert proc.returncode == 0, (option, proc.stderr)
    for option in ("--nv", "--gpus", "--bogus"):  # the real one prints its usage and exits 1
        proc = standin(tmp_path, "start", option, "c", "true")
        assert proc.returncode == 1 and proc.stderr.startswith("Usage: enroot start"), option


def test_gpu_jobs_pass_their_gpus_through_the_containers_environment():
    """A GPU job's `enroot start` has no --nv; it passes NVIDIA_VISIBLE_DEVICES (the node's GPUs of the job: PBS's
    CUDA_VISIBLE_DEVICES, else all the node lets it open) and NVIDIA_DRIVER_CAPABILITIES=compute,utility, each node
    its own; a site's own values win; a CPU job passes neither."""
    gpu = pbs.enroot_start("enroot", "llmft-1", ["/d:/d"], True, ["LLMFT_STOP_FILE"])
    assert "--nv" not in gpu
    assert gpu == [
        "enroot", "start", "--rw", "--mount", "/d:/d", "--env", "LLMFT_STOP_FILE",
        "--env", "NVIDIA_VISIBLE_DEVICES", "--env", "NVIDIA_DRIVER_CAPABILITIES", "llmft-1",
    ]  # fmt: skip
    cpu = pbs.enroot_start("enroot", "llmft-1", ["/d:/d"], False, ["LLMFT_STOP_FILE"])
    assert "NVIDIA_VISIBLE_DEVICES" not in cpu and pbs.container_gpu_env([*cpu, "python"], {}) == {}
    command = [*gpu, "python", "-m", "torch.distributed.run"]
    assert pbs.container_gpu_env(command, {"CUDA_VISIBLE_DEVICES": "GPU-1a,GPU-2b"}) == {
        "NVIDIA_VISIBLE_DEVICES": "GPU-1a,GPU-2b",
        "NVIDIA_DRIVER_CAPABILITIES": "compute,utility",
    }
    assert pbs.container_gpu_env(command, {})["NVIDIA_VISIBLE_DEVICES"] == "all"
    site = {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility,video"}
    assert pbs.container_gpu_env(command, site) == site


def test_a_slurm_gpu_jobs_pyxis_steps_carry_the_variables_enroots_hook_reads(tmp_path, monkeypatch, capsys):
    """pyxis hands each step's environment to enroot, whose nvidia hook mounts GPUs only when NVIDIA_VISIBLE_DEVICES is
    set (its capabilities default to utility: no CUDA): a GPU job sets all and compute,utility unless already set
    (an image that sets neither still gets its GPUs); a CPU job sets neither (the hook would need nvidia-container-cli).
    """
    from llmft.launch import knobs, slurm

    for name in ("NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "SLURM_GPUS_ON_NODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("LLMFT_CACHE", str(tmp_path / "cache"))
    image = tmp_path / "image.sqsh"
    image.write_bytes(b"")
    k = knobs.resolve({"CONTAINER_IMAGE": str(image), "CHECKPOINT_DIR": str(tmp_path / "ckpt")}, cwd=tmp_path)

    args = slurm.container_arguments(k, tmp_path, tmp_path / "ckpt", "7")
    assert f"--container-image={image}" in args and "NVIDIA_VISIBLE_DEVICES" not in slurm.os.environ
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "4")
    slurm.container_arguments(k, tmp_path, tmp_path / "ckpt", "7")
    assert slurm.os.environ["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert slurm.os.environ["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    assert (
        "container GPUs: NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility"
        in capsys.readouterr().out
    )
    monkeypatch.setenv("NVIDIA_DRIVER_CAPABILITIES", "compute,utility,video")  # the user's own wins
    slurm.container_arguments(k, tmp_path, tmp_path / "ckpt", "7")
    assert slurm.os.environ["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility,video"

"""Containers: the command lines llmft gives enroot (PBS) and pyxis (Slurm). GPUs reach a container through
NVIDIA_VISIBLE_DEVICES (enroot's nvidia hook), never an option `enroot start` does not have. The same command lines
run through the real enroot and pyxis in tests/test_container_jobs.py."""

from __future__ import annotations

import os
import subprocess

import pytest

from llmft.launch import node, pbs


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
    assert "NVIDIA_VISIBLE_DEVICES" not in cpu and node.container_gpu_env([*cpu, "python"], {}) == {}
    command = [*gpu, "python", "-m", "torch.distributed.run"]
    assert node.container_gpu_env(command, {"CUDA_VISIBLE_DEVICES": "GPU-1a,GPU-2b"}) == {
        "NVIDIA_VISIBLE_DEVICES": "GPU-1a,GPU-2b",
        "NVIDIA_DRIVER_CAPABILITIES": "compute,utility",
    }
    assert node.container_gpu_env(command, {})["NVIDIA_VISIBLE_DEVICES"] == "all"
    site = {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility,video"}
    assert node.container_gpu_env(command, site) == site


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

    args, env = slurm.container_arguments(k, tmp_path, tmp_path / "ckpt", "7", os.environ)
    assert f"--container-image={image}" in args and "NVIDIA_VISIBLE_DEVICES" not in env
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "4")
    _, env = slurm.container_arguments(k, tmp_path, tmp_path / "ckpt", "7", os.environ)
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    assert (
        "container GPUs: NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility"
        in capsys.readouterr().out
    )
    monkeypatch.setenv("NVIDIA_DRIVER_CAPABILITIES", "compute,utility,video")  # the user's own wins
    _, env = slurm.container_arguments(k, tmp_path, tmp_path / "ckpt", "7", os.environ)
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility,video"


def test_a_container_image_on_a_cluster_without_pyxis_is_refused_in_one_line(monkeypatch):
    """CONTAINER_IMAGE where srun has no --container-image (no pyxis SPANK plugin loaded): one line, before any srun;
    with pyxis's option in srun's help, the check passes."""
    from llmft.launch import knobs, slurm

    k = knobs.resolve({"CONTAINER_IMAGE": "image.sqsh"}, cwd=None)
    help_without = subprocess.CompletedProcess(
        ["srun", "--help"], 0, "Usage: srun [OPTIONS...]\n  -N, --nodes=N\n", ""
    )
    monkeypatch.setattr(slurm, "run", lambda *a, **kw: help_without)
    with pytest.raises(slurm.SlurmJobError, match=r"^CONTAINER_IMAGE=image.sqsh needs the pyxis SPANK plugin, and"):
        slurm.host_checks(k, {})
    with_pyxis = subprocess.CompletedProcess(
        ["srun", "--help"], 0, "      --container-image=[USER@][REGISTRY#]IMAGE", ""
    )
    monkeypatch.setattr(slurm, "run", lambda *a, **kw: with_pyxis)
    slurm.host_checks(k, {})


def test_a_venv_beside_an_image_runs_inside_it_with_its_bin_first_on_path(tmp_path, monkeypatch):
    """VENV with CONTAINER_IMAGE: the venv (built by the image's Python) is mounted at its real path and its python
    runs inside; PATH there starts at its bin (PBS: `env PATH=...` inside, after enroot's login shell; Slurm: the job's PATH kept over the
    image's by pyxis's --container-env=PATH). Without VENV the image's own python and PATH."""
    import sys
    from pathlib import Path

    from llmft.launch import job, knobs, slurm

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("LLMFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", "/site/bin:/usr/bin:/bin")
    image = tmp_path / "image.sqsh"
    image.write_bytes(b"")
    venv = Path(sys.prefix).resolve()
    k = knobs.resolve({"CONTAINER_IMAGE": str(image), "VENV": sys.prefix}, cwd=tmp_path)
    assert job.choose_python(k, {}, "/usr/bin/python3") == str(venv / "bin" / "python")  # both schedulers' Python
    node_env = {"HF_HOME": str(tmp_path / "hf"), "LLMFT_CACHE": str(tmp_path / "cache"), "LLMFT_STOP_FILE": "s"}
    paths = job.run_paths(k, tmp_path, tmp_path / "run", node_env)
    assert venv in paths
    inside, create = pbs.container_prefix(k, {}, "5.pbs-head", paths, node_env, 0)
    assert inside[-3:] == [create[3], "env", f"PATH={venv}/bin:{job.IMAGE_PATH}"] and create[3] == "llmft-5-{node}"
    assert f"--mount {venv}:{venv}" in " ".join(inside)
    args, env = slurm.container_arguments(k, tmp_path, tmp_path / "run", "7", os.environ)
    assert "--container-env=PATH" in args and f"{venv}:{venv}" in next(a for a in args if "mounts" in a)
    assert env["PATH"] == f"{venv}/bin:/site/bin:/usr/bin:/bin"
    plain = knobs.resolve({"CONTAINER_IMAGE": str(image)}, cwd=tmp_path)
    assert job.choose_python(plain, {}, "/usr/bin/python3") == "python" and job.container_path(plain) is None
    assert (
        "--container-env=PATH" not in slurm.container_arguments(plain, tmp_path, tmp_path / "run", "7", os.environ)[0]
    )

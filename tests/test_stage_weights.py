"""Model weights staged once per node from shared storage to node-local disk (ZeRO-0/1/2)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from llmft.training.stage_weights import MARKER, mount_of, restore_source_name, shared_fs, stage_weights

MOUNTS = """\
/dev/sda1 / ext4 rw,relatime 0 0
tmpfs /tmp tmpfs rw 0 0
filestore:/home /home nfs4 rw,vers=4.1 0 0
fs-0abc.fsx.us-east-1.amazonaws.com@tcp:/fsx /fsx lustre rw 0 0
bucket /mnt/gcs fuse.gcsfuse rw 0 0
/dev/nvme1n1 /home/scratch xfs rw 0 0
server:/a\\040b /data\\040set nfs rw 0 0
"""


def test_shared_storage_is_told_by_the_mount_holding_the_path():
    assert shared_fs("/home/u/.cache/huggingface/hub/x", MOUNTS) == "nfs4"  # HF_HOME on a Filestore
    assert shared_fs("/fsx/models/llama", MOUNTS) == "lustre"
    assert shared_fs("/mnt/gcs/models", MOUNTS) == "fuse.gcsfuse"
    assert shared_fs("/home/scratch/m", MOUNTS) is None  # a local disk mounted inside the shared /home
    assert shared_fs("/homework/m", MOUNTS) is None  # /home is not a prefix of /homework
    assert shared_fs("/tmp/m", MOUNTS) is None and shared_fs("/opt/m", MOUNTS) is None
    assert mount_of("/data set/x", MOUNTS) == ("/data set", "nfs")


def model_dir(root: Path) -> Path:
    d = root / "shared" / "model"
    (d / "checkpoint-5").mkdir(parents=True)  # a run directory's checkpoints are not what from_pretrained reads
    (d / "config.json").write_text('{"model_type": "gpt2"}')
    (d / "model.safetensors").write_bytes(os.urandom(3_000_000))
    (d / "checkpoint-5" / "big.pt").write_bytes(b"x" * 1000)
    return d


def test_the_first_process_of_a_node_copies_once_and_the_others_load_its_copy(tmp_path):
    """Three processes of a node start together: one copies, the others wait and get the same local copy; a later
    job on the node reuses it; a changed model is staged anew."""
    model = model_dir(tmp_path)
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/sda1 / ext4 rw 0 0\nserver:/export {tmp_path / 'shared'} nfs rw 0 0\n")
    env = {
        **os.environ,
        "LLMFT_PROC_MOUNTS": str(mounts),
        "LLMFT_STAGE_DIR": str(tmp_path / "local"),
        "SLURMD_NODENAME": "n1",
    }
    code = "import sys; from llmft.training.stage_weights import stage_weights; print('->', stage_weights(sys.argv[1], 3))"
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(model)], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    text = "".join(outs)
    targets = {line.split()[1] for line in text.splitlines() if line.startswith("-> ")}
    assert len(targets) == 1
    [target] = targets
    target = Path(target)
    assert target.parent == tmp_path / "local" and target.name.startswith("model-")
    assert sorted(p.name for p in target.iterdir()) == [MARKER, "config.json", "model.safetensors"]
    assert (target / "model.safetensors").read_bytes() == (model / "model.safetensors").read_bytes()
    staged = [line for line in text.splitlines() if "staged the weights" in line]
    assert len(staged) == 1, text
    assert staged[0].startswith(
        f"llmft: node n1: staged the weights of {model} (0.00 GB, 2 files) from nfs to node-local {target} in "
    )
    assert (
        staged[0].endswith("s at that rate")
        and "the node's 3 process(es) load the local copy: 2 full read(s) of shared storage saved, about" in staged[0]
    )
    said = []
    assert stage_weights(str(model), 3, env=env, log=said.append) == str(target) and said == []  # a later job: reused
    (model / "config.json").write_text('{"model_type": "gpt2", "n_layer": 2}')
    again = stage_weights(str(model), 3, env=env, log=said.append)
    assert again != str(target) and len(said) == 1  # changed files: a new copy
    local = {"LLMFT_PROC_MOUNTS": str(mounts), "LLMFT_STAGE_DIR": str(tmp_path / "local")}
    mounts.write_text("/dev/sda1 / ext4 rw 0 0\n")
    assert stage_weights(str(model), 3, env=local, log=said.append) == str(model)  # already on local disk


def test_what_the_run_saves_names_the_source_not_the_local_copy(tiny_model):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(tiny_model)), LoraConfig(r=2, target_modules=["c_attn"])
    )
    source = "/home/u/.cache/huggingface/hub/models--org--m/snapshots/abc"
    restore_source_name(model, str(tiny_model), source)
    assert model.peft_config["default"].base_model_name_or_path == source
    assert model.get_base_model().config._name_or_path == source


def test_a_two_process_zero2_run_loads_weights_staged_once(run_with_eval, tiny_model):
    """The shared run (tests/conftest.py) sees its model directory on NFS: one process copied it, both loaded it."""
    out, stdout, _ = run_with_eval
    staged = [line for line in stdout.splitlines() if "staged the weights" in line]
    assert len(staged) == 1, stdout
    assert f"staged the weights of {tiny_model} (" in staged[0] and str(out.parent / "node-local") in staged[0]
    assert "the node's 2 process(es) load the local copy: 1 full read(s) of shared storage saved" in staged[0]
    assert (out / "model.safetensors").is_file()

"""The planner's communication model (llmft.comm): bytes per optimizer step by ZeRO stage, checked against
DeepSpeed's own comms logger on real 2-process gloo runs, and the step time it gives on the catalogue's nodes."""

from __future__ import annotations

import json

import pytest
from conftest import PYTHON, REPO, run

from llmft.planning.comm import NETWORKS, messages, step_time, wire_bytes
from llmft.planning.hardware import NODE_TYPES

PROBE = str(REPO / "tests" / "train_probe.py")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bytes_per_step_match_deepspeeds_comms_logger(tiny_model, tiny_data, tmp_path, stage):
    """2 ranks, 2 micro-batches per step, fp32 on CPU (4-byte gradients and parameters): what DeepSpeed's comms
    logger records in steps 2-3 (per step) against llmft.comm.messages, within 10% (ZeRO-3 keeps parameters under
    stage3_param_persistence_threshold on every rank, ungathered: a fraction of a percent here)."""
    from transformers import AutoModelForCausalLM

    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model).parameters())
    config = json.loads((REPO / "ds_configs" / f"zero{stage}.json").read_text())
    config["comms_logger"] = {"enabled": True, "verbose": False, "prof_all": True, "debug": False}
    (tmp_path / "ds.json").write_text(json.dumps(config))
    flags = [
        "--model_name_or_path",
        tiny_model,
        "--dataset_name",
        tiny_data,
        "--output_dir",
        tmp_path / "run",
        "--report_to",
        "none",
        "--disable_tqdm",
        "true",
        "--max_steps",
        3,
        "--save_strategy",
        "no",
        "--deepspeed",
        tmp_path / "ds.json",
        "--global_batch_size",
        8,
        "--per_device_train_batch_size",
        2,
    ]
    run(
        [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2", PROBE, *map(str, flags)],
        check=True,
        LLMFT_PROBE_DIR=str(tmp_path / "probe"),
        LLMFT_PROBE_COMMS="1",
        LLMFT_PROBE_MOMENTS="0",
    )
    logged = json.loads((tmp_path / "probe" / "comms.json").read_text())

    def total(*ops, least=64):  # flags and overflow checks (a few bytes) are not gradients
        return sum(int(size) * n for op in ops for size, n in logged.get(op, {}).items() if int(size) >= least) / 2

    expected = messages(
        stage, accumulation=2, world=2, gradient_bytes=4 * params, param_bytes=4 * params, params=params
    )
    assert total("all_reduce", "reduce_scatter_tensor", "reduce_scatter") == pytest.approx(
        expected["gradients"], rel=0.1
    )
    assert total("all_gather_into_tensor", "all_gather") == pytest.approx(expected["parameters"], rel=0.1)


def test_bytes_by_stage_accumulation_and_lora():
    g, w, p = 2e9, 2e9, 10**9  # a 1B model in bf16
    z1, z2, z3 = (messages(s, accumulation=4, world=8, gradient_bytes=g, param_bytes=w, params=p) for s in (1, 2, 3))
    assert z1 == {"gradients": g, "parameters": w / 8}  # gradients once per step
    assert z2 == {"gradients": 4 * g, "parameters": w / 8}  # every micro-batch
    assert z3 == {"gradients": 4 * g, "parameters": 4 * w / 8}  # the whole model stays live (1e9 parameters)
    big = messages(3, accumulation=4, world=8, gradient_bytes=16e9, param_bytes=16e9, params=8 * 10**9)
    assert big["parameters"] == 2 * 4 * 16e9 / 8  # gathered for forward and again for backward
    lora = messages(2, accumulation=4, world=8, gradient_bytes=40e6, param_bytes=40e6, frozen_bytes=w, params=p)
    assert lora == {"gradients": 4 * 40e6, "parameters": 40e6 / 8}  # the adapters' gradients and partitions only
    lora3 = messages(3, accumulation=4, world=8, gradient_bytes=40e6, param_bytes=40e6, frozen_bytes=w, params=p)
    assert lora3["parameters"] == 4 * (40e6 + w) / 8  # ZeRO-3 gathers the frozen weights too
    assert messages(2, accumulation=4, world=1, gradient_bytes=g, param_bytes=w, params=p) == {
        "gradients": 0,
        "parameters": 0,
    }
    assert wire_bytes(2, z2, 8) == pytest.approx(7 / 8 * 4 * g + 7 / 8 * w)
    assert wire_bytes(
        0, messages(0, accumulation=4, world=8, gradient_bytes=g, param_bytes=w, params=p), 8
    ) == pytest.approx(2 * 7 / 8 * g)


def test_every_catalogue_node_has_its_network_and_the_network_decides_on_small_nodes():
    assert set(NETWORKS) == set(NODE_TYPES)
    assert NETWORKS["g2-standard-4"].network_gbps == 10 and NETWORKS["a2-highgpu-8g"].network_gbps == 100
    assert NETWORKS["g2-standard-4"].intra_link == "PCIe" and NETWORKS["a3-highgpu-8g"].intra_link == "NVLink"
    # The case: a 1.24B full fine-tune, bf16, 8 x g2-standard-4, micro-batch 2 x accumulation 4
    g = w = 2 * 1.24e9
    z2 = messages(2, accumulation=4, world=8, gradient_bytes=g, param_bytes=w, params=int(1.24e9))
    z1 = messages(1, accumulation=4, world=8, gradient_bytes=g, param_bytes=w, params=int(1.24e9))
    compute = 2.0
    t2 = step_time(2, z2, world=8, nnodes=8, compute_s=compute, network=NETWORKS["g2-standard-4"])
    t1 = step_time(1, z1, world=8, nnodes=8, compute_s=compute, network=NETWORKS["g2-standard-4"])
    assert t2.network_bound and t1.step_s < t2.step_s  # ZeRO-1 reduces once per step
    assert "10 Gbps network" in t2.link
    one_node = step_time(2, z2, world=8, nnodes=1, compute_s=compute, network=NETWORKS["a2-highgpu-8g"])
    assert one_node.link == "NVLink inside the node" and not one_node.network_bound

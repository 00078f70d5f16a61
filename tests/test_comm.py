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


def test_a_micro_batchs_reduction_hides_only_behind_its_own_backward_and_its_last_bucket_is_exposed():
    from llmft.planning.comm import Overlap, exposed_reduction_s

    # A fast link: every bucket is sent before the next fills; only the last, full as the backward ends, waits.
    assert exposed_reduction_s(1.0, backward_s=10.0, bucket_s=0.1) == pytest.approx(0.1)
    # A slow link: busy from the first bucket on, it ends the whole reduction after the first bucket filled.
    assert exposed_reduction_s(4.0, backward_s=1.0, bucket_s=0.5) == pytest.approx(4.0 - 1.0 * (1 - 0.5 / 4.0))
    # One bucket (or none configured): nothing starts before the backward ends.
    assert exposed_reduction_s(1.0, backward_s=10.0, bucket_s=5.0) == exposed_reduction_s(1.0, 10.0, 0) == 1.0
    # A larger bucket exposes more; a longer backward hides more.
    assert exposed_reduction_s(2.0, 1.0, 0.2) < exposed_reduction_s(2.0, 1.0, 0.4)
    assert exposed_reduction_s(2.0, 1.5, 0.2) < exposed_reduction_s(2.0, 1.0, 0.2)

    # ZeRO-2, 4 micro-batches, 2 ranks on a 10 Gbps network: the step's reduction (A x G) is shorter than the step's
    # compute, which the old whole-step model took as fully hidden; per micro-batch it outlasts the backward.
    g = 1e9
    z2 = messages(2, accumulation=4, world=2, gradient_bytes=g, param_bytes=g, params=5 * 10**8)
    net = NETWORKS["g2-standard-4"]
    grads_s = z2["gradients"] / 2 / (net.network_gbps * 1e9 / 8 * 0.8)  # 2 s on the wire
    compute = 1.5 * grads_s
    ov = Overlap(accumulation=4, backward_share=2 / 3, bucket_bytes=2e8, overlap_comm=True)
    t = step_time(2, z2, world=2, nnodes=2, compute_s=compute, network=net, overlap=ov)
    params_s = z2["parameters"] / (net.network_gbps * 1e9 / 8 * 0.8)
    assert t.exposed_comm_s - params_s > 0  # the old model: max(0, 2 s - 3 s) = 0
    # However long the backward, each micro-batch's last bucket is exposed: 4 of them per step.
    long = step_time(2, z2, world=2, nnodes=2, compute_s=100 * compute, network=net, overlap=ov)
    bucket_s = 2e8 / 2 / (net.network_gbps * 1e9 / 8 * 0.8)
    assert long.exposed_comm_s == pytest.approx(4 * bucket_s + params_s)
    # Without overlap_comm the reduction runs on the compute stream: all of it exposed.
    off = step_time(
        2, z2, world=2, nnodes=2, compute_s=100 * compute, network=net, overlap=Overlap(4, overlap_comm=False)
    )
    assert off.exposed_comm_s == pytest.approx(t.comm_s)


def test_zero1_reduces_once_per_step_after_the_last_backward():
    from llmft.planning.comm import Overlap

    g, net = 2e9, NETWORKS["g2-standard-4"]
    z1 = {a: messages(1, accumulation=a, world=8, gradient_bytes=g, param_bytes=g, params=10**9) for a in (1, 4)}
    assert z1[1] == z1[4]  # once per step, whatever the accumulation
    # llmft's template has no overlap_comm: the reduction waits for the last backward, exposed whole.
    t = step_time(1, z1[4], world=8, nnodes=8, compute_s=4.0, network=net, overlap=Overlap(4, overlap_comm=False))
    assert t.exposed_comm_s == pytest.approx(t.comm_s)
    # With overlap_comm it runs from the last micro-batch's backward hooks: only that backward hides it.
    on = step_time(1, z1[4], world=8, nnodes=8, compute_s=4.0, network=net, overlap=Overlap(4, 2 / 3, 2e8, True))
    one = step_time(1, z1[4], world=8, nnodes=8, compute_s=4.0, network=net, overlap=Overlap(1, 2 / 3, 2e8, True))
    assert 0 < one.exposed_comm_s < on.exposed_comm_s < t.exposed_comm_s  # more micro-batches: a shorter last backward


def test_offload_counts_its_pcie_copies_and_a_faster_link_shortens_them():
    from llmft.planning.comm import host_link_gbytes_s, offload_host_bytes

    T, N, w = 8 * 10**9, 8, 2
    g = T / N
    kw = dict(world=N, trainable=T, w=w)
    assert offload_host_bytes(2, "none", accumulation=8, **kw) == 0
    assert offload_host_bytes(1, "optimizer", accumulation=8, **kw) == 0  # ZeRO-1 has no offload in llmft
    # One micro-batch: the fp32 gradient partition out, the updated 16-bit parameters back.
    assert offload_host_bytes(2, "optimizer", accumulation=1, **kw) == pytest.approx(4 * g + w * g)
    # Accumulating on the host costs a round trip per extra micro-batch, under ZeRO-2 and ZeRO-3 alike.
    z2 = [offload_host_bytes(2, "optimizer", accumulation=a, **kw) for a in (1, 2, 8)]
    z3 = [offload_host_bytes(3, "optimizer", accumulation=a, **kw) for a in (1, 2, 8)]
    assert z2 == sorted(z2) and z3 == sorted(z3) and z2[0] < z2[-1]
    # Offloaded parameters are fetched for every gather (twice a micro-batch when the model outgrows the live limit).
    params = [offload_host_bytes(3, "optimizer+params", accumulation=4, gathers=k, **kw) for k in (1, 2)]
    assert params[1] - params[0] == pytest.approx(4 * w * T / N)
    assert params[0] > offload_host_bytes(3, "optimizer", accumulation=4, **kw) - w * g
    # PCIe Gen5 (H100) moves them faster than Gen4 (A100, L4), at the same share of the link as NCCL.
    assert host_link_gbytes_s("H100-80GB") > host_link_gbytes_s("A100-40GB") == host_link_gbytes_s("L4") > 20


def test_small_aws_types_are_planned_at_their_baseline_and_a3_at_the_network_its_nccl_profile_reaches():
    from llmft.planning.comm import BURST_GBPS, node_network

    small = [n for n in NODE_TYPES.values() if n.provider == "aws" and n.vcpus <= 16]
    assert small  # AWS lists these "up to" a burst they keep for minutes; a fine-tune sustains the baseline
    for n in small:
        assert NETWORKS[n.name].network_gbps < BURST_GBPS[n.name]
    tcpx, plain = node_network("a3-highgpu-8g", "gcp-tcpx"), node_network("a3-highgpu-8g")
    assert tcpx.network_gbps > plain.network_gbps and "GPUDirect-TCPX" in tcpx.network
    assert node_network("a3-highgpu-8g", "gcp-g2") == plain  # another profile loads no TCPX plugin
    assert node_network("p4d.24xlarge", "gcp-tcpx") == NETWORKS["p4d.24xlarge"]
    # Two a3 nodes, ZeRO-2: the same step is slower over the host NIC than over GPUDirect-TCPX.
    z2 = messages(2, accumulation=4, world=16, gradient_bytes=16e9, param_bytes=16e9, params=8 * 10**9)
    slow, fast = (step_time(2, z2, world=16, nnodes=2, compute_s=5.0, network=n) for n in (plain, tcpx))
    assert slow.step_s > fast.step_s and "host gVNIC" in slow.link and "TCPX" in fast.link

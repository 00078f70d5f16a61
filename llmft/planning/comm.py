"""What a ZeRO stage moves over the network per optimizer step, and how long that takes on a node type.

Pure functions of numbers (no torch). Per rank and optimizer step, with A micro-batches per step (accumulation),
N ranks, G the gradient bytes of the trainable parameters (DeepSpeed reduces them in the training precision),
W the 16-bit bytes of the trainable parameters and F those of the frozen ones (LoRA), the collectives DeepSpeed
runs (its comms logger names them):

    ZeRO-0/1  gradients reduced once per step, at the accumulation boundary            G
    ZeRO-1/2  updated parameter partitions all-gathered after the optimizer step        W / N from each rank
    ZeRO-2    gradients reduce-scattered at every micro-batch (overlapped with backward) A x G
    ZeRO-3    gradients reduce-scattered at every micro-batch                           A x G
              parameters all-gathered for the forward of every micro-batch              A x (W + F) / N from each rank
              and again for its backward, unless the whole model stays live between them (DeepSpeed keeps
              gathered parameters up to stage3_max_live_parameters; llmft's template: 1e9)
    LoRA      G and W count the adapters only; ZeRO-3 also gathers the frozen weights (F)

`messages` gives these volumes as DeepSpeed hands them to its collectives (tests/test_comm.py checks them against
DeepSpeed's comms logger on 2-process gloo runs of ZeRO-1, 2 and 3). On the wire, a ring collective over N ranks
moves (N-1)/N of the full tensor per rank for a reduce-scatter or an all-gather (NCCL's bus bandwidth model; an
all-reduce is both, 2(N-1)/N); `wire_bytes` applies that.

Time: the bytes over the slowest link the ring crosses: the node's network when the job spans nodes (the
providers' published bandwidth, NodeNetwork below), else NVLink or PCIe between the GPUs of one node. Overlap, as
DeepSpeed achieves it: ZeRO-2's per-micro-batch gradient reduce-scatter (overlap_comm) and ZeRO-3's prefetched
gathers run during backward and forward, so compute hides them up to the compute time; ZeRO-0/1's reduction
waits for the last micro-batch's backward and the all-gather after the optimizer step waits for the step: both
add to the step. This is a model, not a measurement: NCCL reaches 70-90% of a link's bandwidth in practice, and
the overlap is best case (bench/README.md lists the GPU runs that would check it).
"""

from __future__ import annotations

from dataclasses import dataclass

LINK_EFFICIENCY = 0.8  # share of a link's nominal bandwidth NCCL reaches for large messages
MAX_LIVE_PARAMETERS = 1_000_000_000  # ds_configs/zero3.json stage3_max_live_parameters


@dataclass(frozen=True)
class NodeNetwork:
    """A node type's links: between nodes (the provider's published network bandwidth) and between its GPUs."""

    network_gbps: float  # per node, between nodes
    intra_gbytes_s: float  # per GPU, one direction, between the GPUs of one node (NVLink, else PCIe)
    intra_link: str  # "NVLink" | "PCIe"


# GCP: https://cloud.google.com/compute/docs/gpus (the "network bandwidth" column of the G2/A2/A3 tables);
# AWS: https://docs.aws.amazon.com/ec2/latest/instancetypes/ac.html ("network bandwidth (Gbps)"; "up to" values
# are burst: taken as given). Between GPUs: L4 has no NVLink, PCIe Gen4 x16 (32 GB/s a direction); A100 SXM NVLink 3
# (300 GB/s a direction), H100 SXM NVLink 4 (450 GB/s a direction).
PCIE4, NVLINK_A100, NVLINK_H100 = 32.0, 300.0, 450.0
NETWORKS: dict[str, NodeNetwork] = {
    **{
        name: NodeNetwork(gbps, PCIE4, "PCIe")
        for name, gbps in (
            ("g2-standard-4", 10),
            ("g2-standard-8", 16),
            ("g2-standard-12", 16),
            ("g2-standard-16", 32),
            ("g2-standard-24", 32),
            ("g2-standard-32", 32),
            ("g2-standard-48", 50),
            ("g2-standard-96", 100),
            ("g6.xlarge", 10),
            ("g6.2xlarge", 10),
            ("g6.4xlarge", 25),
            ("g6.8xlarge", 25),
            ("g6.12xlarge", 40),
            ("g6.16xlarge", 25),
            ("g6.24xlarge", 50),
            ("g6.48xlarge", 100),
        )
    },
    **{
        name: NodeNetwork(gbps, NVLINK_A100, "NVLink")
        for name, gbps in (
            ("a2-highgpu-1g", 24),
            ("a2-highgpu-2g", 32),
            ("a2-highgpu-4g", 50),
            ("a2-highgpu-8g", 100),
            ("a2-ultragpu-1g", 24),
            ("a2-ultragpu-2g", 32),
            ("a2-ultragpu-4g", 50),
            ("a2-ultragpu-8g", 100),
            ("p4d.24xlarge", 400),
        )
    },
    "a3-highgpu-8g": NodeNetwork(1000, NVLINK_H100, "NVLink"),
    "p5.48xlarge": NodeNetwork(3200, NVLINK_H100, "NVLink"),
}


def messages(
    zero_stage: int,
    *,
    accumulation: int,
    world: int,
    gradient_bytes: float,
    param_bytes: float,
    params: int,
    frozen_bytes: float = 0.0,
    max_live_parameters: int = MAX_LIVE_PARAMETERS,
) -> dict[str, float]:
    """Bytes per optimizer step each rank hands to DeepSpeed's collectives: {"gradients": ..., "parameters": ...}
    (gradients: the full tensors reduced; parameters: this rank's partitions sent to the all-gathers)."""
    if world <= 1:
        return {"gradients": 0.0, "parameters": 0.0}
    partition = param_bytes / world
    if zero_stage == 3:
        partition += frozen_bytes / world
    if zero_stage in (0, 1):
        grads = gradient_bytes
    else:
        grads = accumulation * gradient_bytes
    if zero_stage in (1, 2):
        gathers = partition
    elif zero_stage == 3:
        gathers = accumulation * partition * (1 if params <= max_live_parameters else 2)
    else:
        gathers = 0.0
    return {"gradients": float(grads), "parameters": float(gathers)}


def wire_bytes(zero_stage: int, msgs: dict[str, float], world: int) -> float:
    """Bytes each rank sends over the ring for these collectives (a reduce-scatter or all-gather: (N-1)/N of the
    full tensor; ZeRO-0's gradient all-reduce: twice that)."""
    if world <= 1:
        return 0.0
    share = (world - 1) / world
    grads = msgs["gradients"] * share * (2 if zero_stage == 0 else 1)
    return grads + msgs["parameters"] * world * share


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    comm_s: float
    exposed_comm_s: float  # the part compute does not hide
    link: str  # what the ring's slowest link is

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_comm_s

    @property
    def network_bound(self) -> bool:
        return self.exposed_comm_s > self.compute_s


def step_time(
    zero_stage: int, msgs: dict[str, float], *, world: int, nnodes: int, compute_s: float, network: NodeNetwork | None
) -> StepTime:
    """Compute plus the communication compute does not hide (module docstring); no network known: compute only."""
    if world <= 1 or network is None:
        return StepTime(compute_s, 0.0, 0.0, "none" if world <= 1 else "unknown")
    if nnodes > 1:
        bytes_s, link = network.network_gbps * 1e9 / 8, f"{network.network_gbps:g} Gbps network"
    else:
        bytes_s, link = network.intra_gbytes_s * 1e9, f"{network.intra_link} inside the node"
    bytes_s *= LINK_EFFICIENCY
    share = (world - 1) / world
    grads_s = msgs["gradients"] * share * (2 if zero_stage == 0 else 1) / bytes_s
    params_s = msgs["parameters"] * world * share / bytes_s
    if zero_stage == 2:
        exposed = max(0.0, grads_s - compute_s) + params_s
    elif zero_stage == 3:
        exposed = max(0.0, grads_s + params_s - compute_s)
    else:
        exposed = grads_s + params_s
    return StepTime(compute_s, grads_s + params_s, exposed, link)

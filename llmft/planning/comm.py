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
providers' published bandwidth, NodeNetwork below; a fabric's figure only with the NCCL profile that loads its
plugin, `node_network`), else NVLink or PCIe between the GPUs of one node.

Overlap, as DeepSpeed 0.19 runs it (`exposed_comm_s`). Every backward ends with a synchronisation: ZeRO-2's
independent_gradient_partition_epilogue reduces the last IPG bucket and, with overlap_comm, synchronises the
device before the next micro-batch (deepspeed/runtime/zero/stage_1_and_2.py); ZeRO-3's reduces its last bucket and
synchronises its reduce-and-partition stream (stage3.py). So a micro-batch's gradient reduction hides only behind
that micro-batch's backward, and the last bucket (reduce_bucket_size elements), filled as the backward ends, is
always exposed (`exposed_reduction_s`); without overlap_comm the reduction runs on the compute stream and nothing is
hidden. ZeRO-3's forward gathers are prefetched behind that micro-batch's forward (best case: the first layer's
gather is not counted). ZeRO-1 reduces once per step: the engine calls reduce_gradients only at the accumulation
boundary (engine.allreduce_gradients), after the last backward when overlap_comm is off (llmft's template), from the
backward hooks of the last micro-batch when it is on; ZeRO-0's all-reduce (buffered_allreduce_fallback) runs after
the last backward. The all-gather after the optimizer step (ZeRO-1/2) waits for the step: exposed.

CPU offload moves states over each GPU's PCIe link to the host (`offload_host_bytes`, from the same sources), at
`host_link_gbytes_s` (the node catalogue gives no PCIe figure, so the GPU generation's: Gen3/4/5 x16), counted as
not hidden: an upper bound, since DeepSpeed issues the gradient copies during backward. On 8-GPU HGX boards two
GPUs share a PCIe switch's link to the host (DGX A100's layout), which is not modelled. The CPU optimizer step
itself is not modelled: offload rows are still faster here than they run.

This is a model, not a measurement: NCCL reaches 70-90% of a link's bandwidth in practice
(bench/README.md lists the GPU runs that would check it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

LINK_EFFICIENCY = 0.8  # share of a link's nominal bandwidth NCCL reaches for large messages (and a DMA copy)
MAX_LIVE_PARAMETERS = 1_000_000_000  # ds_configs/zero3.json stage3_max_live_parameters


@dataclass(frozen=True)
class NodeNetwork:
    """A node type's links: between nodes (the provider's published network bandwidth) and between its GPUs."""

    network_gbps: float  # per node, between nodes, as NCCL reaches it without a fabric profile
    intra_gbytes_s: float  # per GPU, one direction, between the GPUs of one node (NVLink, else PCIe)
    intra_link: str  # "NVLink" | "PCIe"
    fabrics: tuple[tuple[str, float, str], ...] = ()  # (NCCL_PROFILE, Gbps, name): a faster fabric and what loads it
    network: str = ""  # what network_gbps is, when a fabric could be faster (shown in the plan)


# GCP: https://cloud.google.com/compute/docs/gpus (the "network bandwidth" column of the G2/A2/A3 tables) and
# https://cloud.google.com/compute/docs/gpus/gpu-network-bandwidth: A3 High (a3-highgpu-8g) has 1,000 Gbps in all,
# one 200 Gbps gVNIC for the host and four 200 Gbps NICs that only GPUDirect-TCPX uses. NCCL reaches those four only
# through Google's TCPX plugin (slurm/run_llm.slurm's NCCL_PROFILE=gcp-tcpx); without it NCCL's plain sockets run over
# the host gVNIC: 200 Gbps. AWS: https://docs.aws.amazon.com/ec2/latest/instancetypes/ac.html ("network bandwidth
# (Gbps)"). Types with 16 or fewer vCPUs are listed "up to" a burst they keep for 5 to 60 minutes on network I/O
# credits, above a baseline they sustain (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/ec2-instance-network-bandwidth.html):
# a fine-tune runs for hours, so those take the baseline AWS publishes per type (g6.xlarge 2.5, g6.2xlarge 5,
# g6.4xlarge 10 Gbps baseline, bursting to 10/10/25; figures from AWS's instance-type network specifications, not
# re-checked against the page in this change). Between GPUs: L4 has no NVLink, PCIe Gen4 x16 (32 GB/s a direction);
# A100 SXM NVLink 3 (300 GB/s a direction), H100 SXM NVLink 4 (450 GB/s a direction).
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
            ("g6.xlarge", 2.5),
            ("g6.2xlarge", 5),
            ("g6.4xlarge", 10),
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
    "a3-highgpu-8g": NodeNetwork(
        200,
        NVLINK_H100,
        "NVLink",
        fabrics=(("gcp-tcpx", 800, "GPUDirect-TCPX"),),
        network="the host gVNIC, NCCL's plain sockets",
    ),
    "p5.48xlarge": NodeNetwork(3200, NVLINK_H100, "NVLink"),
}
BURST_GBPS = {"g6.xlarge": 10, "g6.2xlarge": 10, "g6.4xlarge": 25}  # the "up to" figures, for the record: not used
NCCL_PROFILES = ("gcp-g2", "aws-efa", "gcp-tcpx", "ib")  # slurm/run_llm.slurm's NCCL_PROFILE values


def node_network(node_type: str, nccl_profile: str | None = None) -> NodeNetwork | None:
    """The node type's links as NCCL uses them: a fabric's bandwidth only under the NCCL profile that loads its
    plugin (a3-highgpu-8g: 800 Gbps over GPUDirect-TCPX with gcp-tcpx, else its 200 Gbps host NIC); None when the
    node type's network is not known."""
    net = NETWORKS.get(node_type)
    if net is None:
        return None
    for profile, gbps, name in net.fabrics:
        if profile == nccl_profile:
            return replace(net, network_gbps=gbps, network=f"{name}, NCCL_PROFILE={profile}", fabrics=())
    return net


# Each GPU's PCIe link to the host, GB/s a direction (x16 lanes: Gen3 16, Gen4 32, Gen5 64; NVIDIA's data sheets give
# the generation: T4 and V100 Gen3, L4 and A100 Gen4, H100 and H200 Gen5). The node catalogue has no PCIe figure.
HOST_PCIE_GBYTES_S = {
    "T4": 16.0,
    "V100-16GB": 16.0,
    "V100-32GB": 16.0,
    "L4": 32.0,
    "A100-40GB": 32.0,
    "A100-80GB": 32.0,
    "H100-80GB": 64.0,
    "H100-PCIe": 64.0,
    "H200": 64.0,
}
HOST_PCIE_DEFAULT = 32.0  # a GPU not listed: Gen4 x16


def host_link_gbytes_s(gpu_name: str) -> float:
    """The bandwidth CPU offload's copies get, GB/s: the GPU's PCIe link at LINK_EFFICIENCY (Gen4 x16: ~25 GB/s,
    what pinned host-device copies reach on an A100; Gen5 x16: ~51)."""
    return HOST_PCIE_GBYTES_S.get(gpu_name, HOST_PCIE_DEFAULT) * LINK_EFFICIENCY


def gathers_per_micro_batch(params: int, max_live_parameters: int = MAX_LIVE_PARAMETERS) -> int:
    """ZeRO-3 gathers each parameter for the forward, and again for the backward unless the whole model stays live
    between them (DeepSpeed keeps gathered parameters up to stage3_max_live_parameters)."""
    return 1 if params <= max_live_parameters else 2


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
        gathers = accumulation * partition * gathers_per_micro_batch(params, max_live_parameters)
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


def offload_host_bytes(
    zero_stage: int,
    offload: str,
    *,
    accumulation: int,
    world: int,
    trainable: int,
    w: int,
    frozen_bytes: float = 0.0,
    gathers: int = 1,
) -> float:
    """Bytes each rank copies over its PCIe link to and from the host per optimizer step under CPU offload, g = T/N
    of the trainable elements its partition holds, A micro-batches (DeepSpeed 0.19's copies):

        ZeRO-2, optimizer  accumulating: each micro-batch but the last copies its w-byte gradient partition to the
                           host, each but the first copies the running sum back (stage_1_and_2.py
                           async_accumulate_grad_in_cpu_via_gpu): 2 (A-1) w g; the boundary copies the fp32
                           gradient (async_inplace_copy_grad_to_fp32_buffer_from_gpu): 4 g; the updated w-byte
                           parameters come back after the CPU step: w g
        ZeRO-3, optimizer  the fp32 gradient partition to the host every micro-batch, and back to the GPU to be added
                           to for every one after the first (stage3.py partition_grads): (2A-1) 4 g; the updated
                           parameters back: w g
        ZeRO-3, +params    the same gradients; the parameters live on the host (nothing comes back after the step),
                           and each gather fetches this rank's partition first: A x gathers x (w T + frozen) / N
    """
    if offload == "none" or zero_stage < 2:
        return 0.0
    A, g = max(1, accumulation), trainable / world
    if zero_stage == 2:
        return 2 * (A - 1) * w * g + 4 * g + w * g
    grads = (2 * A - 1) * 4 * g
    if offload == "optimizer+params":
        return grads + A * gathers * (w * trainable + frozen_bytes) / world
    return grads + w * g


@dataclass(frozen=True)
class Overlap:
    """What DeepSpeed can hide communication behind in one configuration (module docstring)."""

    accumulation: int = 1
    backward_share: float = 2 / 3  # of a micro-batch's compute, the backward's (recomputation included)
    bucket_bytes: float = 0.0  # reduce_bucket_size x the gradient's element bytes; 0: one bucket
    overlap_comm: bool = True  # DeepSpeed's zero_optimization.overlap_comm
    gathers: int = 1  # ZeRO-3: parameter gathers per micro-batch (gathers_per_micro_batch)


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    comm_s: float
    exposed_comm_s: float  # the part compute does not hide
    link: str  # what the ring's slowest link is
    host_s: float = 0.0  # CPU offload's copies over PCIe (offload_host_bytes), not hidden
    sequence_s: float = 0.0  # Ulysses' all-to-alls (sequence parallelism), inside each layer: not hidden

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_comm_s + self.host_s + self.sequence_s

    @property
    def network_bound(self) -> bool:
        return self.exposed_comm_s > self.compute_s


def exposed_reduction_s(reduce_s: float, backward_s: float, bucket_s: float) -> float:
    """The part of one backward's gradient reduction its backward does not hide. The gradients fill k = reduce_s /
    bucket_s buckets evenly through the backward and the link sends them one after another: when a bucket is sent
    faster than the next fills, only the last (full as the backward ends) is left; otherwise the link, busy from the
    first bucket on, ends reduce_s after it. bucket_s <= 0 or >= reduce_s: one bucket, all exposed."""
    if reduce_s <= 0:
        return 0.0
    bucket_s = reduce_s if bucket_s <= 0 else min(bucket_s, reduce_s)
    return max(bucket_s, reduce_s - backward_s * (1 - bucket_s / reduce_s))


def exposed_comm_s(zero_stage: int, grads_s: float, params_s: float, bucket_s: float, compute_s: float, ov: Overlap):
    """Per optimizer step, the communication compute does not hide, by stage (module docstring): grads_s and params_s
    are the step's gradient reduction and parameter gathers on the link, bucket_s one reduce bucket's."""
    A = max(1, ov.accumulation)
    backward_s = compute_s / A * ov.backward_share
    forward_s = compute_s / A - backward_s
    if zero_stage == 0:
        return grads_s + params_s
    if zero_stage == 1:  # once per step, after (or, with overlap_comm, during) the last micro-batch's backward
        return (exposed_reduction_s(grads_s, backward_s, bucket_s) if ov.overlap_comm else grads_s) + params_s
    per_grads = grads_s / A
    if zero_stage == 2:
        per = exposed_reduction_s(per_grads, backward_s, bucket_s) if ov.overlap_comm else per_grads
        return A * per + params_s
    gather = params_s / A / max(1, ov.gathers)  # one gather of the model, prefetched behind the pass that needs it
    forward = max(0.0, gather - forward_s)
    regather = gather * (max(1, ov.gathers) - 1)
    if ov.overlap_comm:
        backward = exposed_reduction_s(per_grads + regather, backward_s, bucket_s)  # the last reduce bucket
    else:
        backward = per_grads + max(0.0, regather - backward_s)
    return A * (forward + backward)


def link_bytes_s(network: NodeNetwork, nnodes: int) -> tuple[float, str]:
    """The ring's slowest link, bytes/s at LINK_EFFICIENCY, and its name: the network across nodes, else NVLink or
    PCIe inside the node."""
    if nnodes > 1:
        name = f"{network.network_gbps:g} Gbps network" + (f" ({network.network})" if network.network else "")
        return network.network_gbps * 1e9 / 8 * LINK_EFFICIENCY, name
    return network.intra_gbytes_s * 1e9 * LINK_EFFICIENCY, f"{network.intra_link} inside the node"


def ulysses_link(network: NodeNetwork, group: int, nproc_per_node: int) -> tuple[float, str]:
    """The bytes/s one rank's Ulysses all-to-all gets, and the link's name. A group of N ranks inside one node
    (N <= GPUs per node: accelerate puts the sequence dimension innermost, so a group is consecutive ranks) moves
    over NVLink or PCIe; a larger group crosses the network, which the node's GPUs share, all sending at once."""
    if group <= nproc_per_node:
        return network.intra_gbytes_s * 1e9 * LINK_EFFICIENCY, f"{network.intra_link} inside the node"
    return (
        network.network_gbps * 1e9 / 8 * LINK_EFFICIENCY / nproc_per_node,
        f"{network.network_gbps:g} Gbps network shared by {nproc_per_node} GPUs",
    )


def step_time(
    zero_stage: int,
    msgs: dict[str, float],
    *,
    world: int,
    nnodes: int,
    compute_s: float,
    network: NodeNetwork | None,
    overlap: Overlap = Overlap(),
    host_s: float = 0.0,
) -> StepTime:
    """Compute, plus the communication compute does not hide (module docstring), plus CPU offload's PCIe copies;
    no network known: compute and those copies only."""
    if world <= 1 or network is None:
        return StepTime(compute_s, 0.0, 0.0, "none" if world <= 1 else "unknown", host_s)
    bytes_s, link = link_bytes_s(network, nnodes)
    share = (world - 1) / world
    grads_s = msgs["gradients"] * share * (2 if zero_stage == 0 else 1) / bytes_s
    params_s = msgs["parameters"] * world * share / bytes_s
    bucket_s = overlap.bucket_bytes * share * (2 if zero_stage == 0 else 1) / bytes_s
    exposed = exposed_comm_s(zero_stage, grads_s, params_s, bucket_s, compute_s, overlap)
    return StepTime(compute_s, grads_s + params_s, exposed, link, host_s)

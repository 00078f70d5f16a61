"""What the job was given, not what the node has: memory from cgroups and Slurm, GPUs per node, fabric plugins."""

from __future__ import annotations

import pytest

from llmft.planning.allocation import (
    AllocationError,
    MemoryLimit,
    NodeFacts,
    cgroup_memory_limit,
    cpulist,
    gpus_on_node,
    job_gpu_numa,
    job_memory,
    job_nodes,
    numa_binding,
    numa_node_cpus,
    numa_uncovered,
    parse_cpulist,
    parse_node_lines,
)
from llmft.planning.fabric import fabric_problem

GIB = 2**30
MEMINFO_192 = "MemTotal:       201326592 kB\nMemFree:  1 kB\n"  # 192 GiB
V1_UNLIMITED = "9223372036854771712"


def files(mapping: dict[str, str]):
    return mapping.get


def test_cgroup_v2_the_smallest_limit_of_the_steps_cgroup_and_its_ancestors():
    cgroup = "0::/system.slice/slurmstepd.scope/job_42/step_0/user/task_0\n"
    base = "/sys/fs/cgroup/system.slice/slurmstepd.scope/job_42"
    read = files(
        {
            f"{base}/memory.max": str(24 * GIB),
            f"{base}/step_0/memory.max": "max",
            f"{base}/step_0/user/task_0/memory.max": "max",
        }
    )
    assert cgroup_memory_limit(cgroup, read) == (24 * GIB, f"{base}/memory.max")
    assert cgroup_memory_limit(cgroup, files({})) is None  # no file readable: no limit known
    assert cgroup_memory_limit("0::/\n", files({"/sys/fs/cgroup/memory.max": "max"})) is None  # a container, unlimited


def test_cgroup_v1_and_hybrid_read_the_memory_controller():
    cgroup = "12:pids:/slurm/uid_1000/job_7\n4:memory:/slurm/uid_1000/job_7/step_batch\n0::/\n"
    base = "/sys/fs/cgroup/memory/slurm/uid_1000/job_7"
    read = files(
        {
            f"{base}/step_batch/memory.limit_in_bytes": str(30 * GIB),
            f"{base}/memory.limit_in_bytes": str(31 * GIB),
            "/sys/fs/cgroup/memory/memory.limit_in_bytes": V1_UNLIMITED,
        }
    )
    assert cgroup_memory_limit(cgroup, read) == (30 * GIB, f"{base}/step_batch/memory.limit_in_bytes")
    # v1 with no limit anywhere (this machine's layout): none
    assert (
        cgroup_memory_limit(
            "4:memory:/process_api/x\n", files({"/sys/fs/cgroup/memory/memory.limit_in_bytes": V1_UNLIMITED})
        )
        is None
    )


@pytest.mark.parametrize(
    "env, gib, source",
    [
        ({}, 192, "MemTotal"),
        ({"SLURM_MEM_PER_NODE": "65536"}, 64, "SLURM_MEM_PER_NODE=65536 MB"),
        # slurm-gcp's DefMemPerCPU on an a2-highgpu-1g: 4 CPUs per GPU get about a third of the node
        ({"SLURM_MEM_PER_CPU": "7168", "SLURM_CPUS_ON_NODE": "4"}, 28, "SLURM_MEM_PER_CPU=7168 MB x 4 CPUs"),
        (
            {"SLURM_MEM_PER_CPU": "7168", "SLURM_JOB_CPUS_PER_NODE": "4,12", "SLURM_NODEID": "1"},
            84,
            "SLURM_MEM_PER_CPU=7168 MB x 12 CPUs",
        ),
        ({"SLURM_MEM_PER_GPU": "20480", "SLURM_GPUS_ON_NODE": "2"}, 40, "SLURM_MEM_PER_GPU=20480 MB x 2 GPUs"),
        ({"SLURM_MEM_PER_NODE": "999999"}, 192, "MemTotal"),  # larger than the node: the node
        ({"LLMFT_HOST_RAM_GB": "32", "LLMFT_HOST_RAM_SOURCE": "node n2: MemTotal"}, 32, "node n2: MemTotal"),
    ],
)
def test_job_memory_is_the_smallest_of_the_node_and_slurms_numbers(env, gib, source):
    assert job_memory(env, MEMINFO_192, "", files({})) == MemoryLimit(gib, source, 192)


def test_a_cgroup_limit_below_memtotal_and_slurm_wins_and_is_named():
    cgroup = "0::/job_1/step_0\n"
    limit = job_memory(
        {"SLURM_MEM_PER_NODE": "65536"}, MEMINFO_192, cgroup, files({"/sys/fs/cgroup/job_1/memory.max": str(12 * GIB)})
    )
    assert (
        limit == MemoryLimit(12, "cgroup memory.max (/sys/fs/cgroup/job_1/memory.max)", 192) and limit.from_allocation
    )
    assert not job_memory({}, MEMINFO_192, cgroup, files({})).from_allocation
    with pytest.raises(ValueError, match="LLMFT_HOST_RAM_GB='lots' is not a positive number"):
        job_memory({"LLMFT_HOST_RAM_GB": "lots"}, MEMINFO_192, "", files({}))


def test_gpus_on_node_are_this_nodes_not_the_jobs_total():
    assert gpus_on_node({"SLURM_GPUS_ON_NODE": "3", "SLURM_GPUS": "5"}) == 3
    assert gpus_on_node({"SLURM_JOB_GPUS": "0,1", "SLURM_GPUS": "5"}) == 2
    assert gpus_on_node({"SLURM_GPUS_PER_NODE": "a100:4"}) == 4
    assert gpus_on_node({"SLURM_GPUS": "5"}) == 0  # the job's total says nothing about this node


def node(host, gpus=1, gib=192.0, source="MemTotal", numa=1, numactl=False, missing="", numa_problem=""):
    return NodeFacts(host, gpus, MemoryLimit(gib, source, 192.0), numa, numactl, missing, numa_problem)


def test_the_job_plans_for_its_smallest_node_and_refuses_uneven_gpus():
    """The AWS g6 queue mixes 32 and 192 GiB nodes in one partition: the job plans with the smallest."""
    lines = "\n".join(
        n.line() for n in (node("g6-a", gib=192), node("g6-b", gib=28.0, source="SLURM_MEM_PER_CPU=7168 MB x 4 CPUs"))
    )
    assert lines.splitlines()[1] == "llmft node:\tg6-b\t1\t28\t192\t1\t0\tSLURM_MEM_PER_CPU=7168 MB x 4 CPUs\t\t"
    nodes = parse_node_lines("srun: some noise\n" + lines)
    assert [n.host for n in nodes] == ["g6-a", "g6-b"]
    assert job_nodes(nodes) == MemoryLimit(28, "node g6-b: SLURM_MEM_PER_CPU=7168 MB x 4 CPUs", 192)
    assert job_nodes([node("a", gib=192), node("b", gib=30.5)]) == MemoryLimit(
        30.5, "MemTotal", 192
    )  # the node's size
    with pytest.raises(
        AllocationError, match=r"GPUs are spread unevenly over its nodes \(n1 3, n2 2\).*--gpus-per-node=N"
    ):
        job_nodes([node("n1", gpus=3), node("n2", gpus=2)])
    with pytest.raises(AllocationError, match="^node n2: NCCL_PROFILE=aws-efa: the aws-ofi-nccl plugin"):
        job_nodes([node("n1"), node("n2", missing="NCCL_PROFILE=aws-efa: the aws-ofi-nccl plugin ...")])


def test_numa_binding_where_torchrun_can_bind():
    two_sockets = [node("n1", gpus=8, numa=2, numactl=True), node("n2", gpus=8, numa=2, numactl=True)]
    assert numa_binding("auto", two_sockets) == ("node", "node: each process on the CPUs of its GPU's NUMA node")
    assert numa_binding("auto", [node("n1", numa=1, numactl=True)]) == (None, "off: one NUMA node on n1")
    assert numa_binding("auto", [node("n1", gpus=0, numa=2)]) == (None, "off: no GPU on n1")
    assert numa_binding("auto", [node("n1", numa=2)]) == (None, "off: numactl is missing on n1 (install it to bind)")
    assert numa_binding("off", two_sockets)[0] is None and numa_binding("socket", two_sockets)[0] == "socket"
    with pytest.raises(AllocationError, match="NUMA_BINDING=node needs numactl .* missing on n1"):
        numa_binding("node", [node("n1", numa=2)])
    with pytest.raises(AllocationError, match="NUMA_BINDING=near is unknown"):
        numa_binding("near", two_sockets)


TWO_SOCKETS = {0: set(range(0, 48)), 1: set(range(48, 96))}  # a2-highgpu-8g-like: GPUs 0-3 on node 0, 4-7 on 1


@pytest.mark.parametrize(
    "gpu_numa, numa_cpus, allowed, problem",
    [
        # The job holds the whole node: every GPU's NUMA node is covered.
        ([0, 0, 0, 0, 1, 1, 1, 1], TWO_SOCKETS, set(range(96)), ""),
        # Two GPUs of a shared node, both near socket 0, and 48 CPUs there: covered.
        ([0, 0], TWO_SOCKETS, set(range(0, 48)), ""),
        # A shared node: the job's GPU sits on NUMA node 1, its CPUs on node 0 (torch: "Must bind to a non-empty set").
        (
            [1],
            TWO_SOCKETS,
            set(range(0, 12)),
            "GPU 0's NUMA node 1 has CPUs 48-95, of which the job holds none (the job's CPUs there: 0-11; a node "
            "shared with other jobs)",
        ),
        # Part of the NUMA node: torch would cram the process onto 12 of its 48 CPUs.
        (
            [0, 1],
            TWO_SOCKETS,
            set(range(0, 48)) | set(range(48, 60)),
            "GPU 1's NUMA node 1 has CPUs 48-95, of which the job holds 48-59",
        ),
        # numa_node -1 (no NUMA information): torch would bind to node 0 wherever the GPU sits.
        ([0, -1], TWO_SOCKETS, set(range(96)), "GPU 1 has no NUMA node (numa_node -1), and torch would bind"),
        ([], TWO_SOCKETS, set(range(96)), "its GPUs' NUMA nodes are not known"),
        (None, TWO_SOCKETS, set(range(96)), "its GPUs' NUMA nodes are not known"),
        # A single NUMA node the job holds whole: safe (numa_binding still leaves it off: nothing to gain).
        ([0, 0], {0: set(range(16))}, set(range(16)), ""),
        ([2], TWO_SOCKETS, set(range(96)), "GPU 0's NUMA node 2 lists no CPUs"),
    ],
)
def test_numa_binding_only_where_the_jobs_cpus_cover_each_gpus_numa_node(gpu_numa, numa_cpus, allowed, problem):
    found = numa_uncovered(gpu_numa, numa_cpus, allowed)
    assert found.startswith(problem) and bool(found) == bool(problem), found


def test_a_node_whose_cpus_do_not_cover_its_gpus_is_not_bound_and_named():
    problem = numa_uncovered([1], TWO_SOCKETS, set(range(12)))
    nodes = [node("n1", gpus=1, numa=2, numactl=True), node("n2", gpus=1, numa=2, numactl=True, numa_problem=problem)]
    assert numa_binding("auto", nodes) == (None, f"off: on n2, {problem}")
    assert parse_node_lines("\n".join(n.line() for n in nodes)) == nodes  # the probe's line carries it
    # one NUMA node: off for that reason first, whatever the coverage
    assert numa_binding("auto", [node("n1", numa=1, numactl=True, numa_problem="x")]) == (
        None,
        "off: one NUMA node on n1",
    )


def test_cpulists_and_the_gpus_numa_nodes_are_read_from_sysfs(tmp_path):
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11} and parse_cpulist("") == set()
    assert cpulist({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11" and cpulist(set()) == "none"
    for n, cpus in ((0, "0-47"), (1, "48-95")):
        (tmp_path / f"devices/system/node/node{n}").mkdir(parents=True)
        (tmp_path / f"devices/system/node/node{n}/cpulist").write_text(cpus + "\n")
    assert numa_node_cpus(str(tmp_path)) == TWO_SOCKETS
    assert job_gpu_numa({}, str(tmp_path)) is None  # no NVIDIA driver: not known
    for address, numa in (("0000:17:00.0", "0"), ("0000:b1:00.0", "1"), ("0000:ca:00.0", "-1")):
        (tmp_path / "bus/pci/drivers/nvidia" / address).mkdir(parents=True)
        (tmp_path / "bus/pci/drivers/nvidia" / address / "numa_node").write_text(numa + "\n")
    (tmp_path / "bus/pci/drivers/nvidia/bind").write_text("")  # the driver's own files are not GPUs
    assert job_gpu_numa({}, str(tmp_path)) == [0, 1, -1]  # no Slurm GPU list: every GPU counts
    assert job_gpu_numa({"SLURM_JOB_GPUS": "1"}, str(tmp_path)) == [1]
    assert job_gpu_numa({"SLURM_STEP_GPUS": "0,2", "SLURM_JOB_GPUS": "1"}, str(tmp_path)) == [0, -1]
    assert job_gpu_numa({"SLURM_JOB_GPUS": "7"}, str(tmp_path)) == [0, 1, -1]  # not in the list: every GPU


def exists_in(paths):
    return lambda p: p in paths


def test_efa_profile_needs_the_ofi_plugin_and_libfabric_findable_by_the_loader():
    ok = exists_in({"/opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so", "/opt/amazon/efa/lib/libfabric.so.1"})
    env = {"LD_LIBRARY_PATH": "/opt/amazon/ofi-nccl/lib:/opt/amazon/efa/lib"}
    assert fabric_problem("aws-efa", env, "", ok) is None
    ldconfig = "\tlibnccl-net-aws-ofi.so (libc6,x86-64) => /usr/lib/libnccl-net-aws-ofi.so\n\tlibfabric.so.1 (libc6,x86-64) => /usr/lib/libfabric.so.1\n"
    # In the ld.so cache, under the name NCCL_NET_PLUGIN gives NCCL (newer releases: aws-ofi)
    assert fabric_problem("aws-efa", {"NCCL_NET_PLUGIN": "aws-ofi"}, ldconfig, exists_in(set())) is None
    assert "NCCL_NET_PLUGIN=ofi loads (libnccl-net-ofi.so) is not on" in fabric_problem(
        "aws-efa", {}, ldconfig, exists_in(set())
    )
    # Installed, but a venv's job does not have it on the path: NCCL would fall back to sockets.
    problem = fabric_problem("aws-efa", {"LD_LIBRARY_PATH": "/usr/local/cuda/lib64"}, "", ok)
    assert problem == (
        "the aws-ofi-nccl plugin NCCL_NET_PLUGIN=ofi loads (libnccl-net-ofi.so) is not on the library path; "
        "it is installed in /opt/amazon/ofi-nccl/lib: add it to LD_LIBRARY_PATH; libfabric (libfabric.so) is not "
        "on the library path; it is installed in /opt/amazon/efa/lib: add it to LD_LIBRARY_PATH"
    )
    assert "install aws-ofi-nccl" in fabric_problem("aws-efa", {}, "", exists_in(set()))


def test_tcpx_profile_names_the_plugin_and_the_rxdm_it_lacks():
    ok = exists_in({"/var/lib/tcpx/lib64/libnccl-net.so", "/run/tcpx"})
    assert fabric_problem("gcp-tcpx", {"LD_LIBRARY_PATH": "/var/lib/tcpx/lib64"}, "", ok) is None
    problem = fabric_problem("gcp-tcpx", {}, "", exists_in(set()))
    assert "GPUDirect-TCPX NCCL plugin (libnccl-net.so) is not on the library path" in problem
    assert "no receive-datapath-manager (RxDM) socket directory /run/tcpx" in problem


@pytest.fixture(scope="module")
def llama_8b():
    """Llama-3.1-8B's published shape (a config, nothing downloaded)."""
    from published_shapes import llama_3_1_8b

    return llama_3_1_8b()


@pytest.mark.parametrize(
    "gpu, lora, cgroup_gib",
    [
        ("L4", True, 2),  # LoRA on an L4 fits in any node, but not in a 2 GiB step
        ("A100-40GB", False, 64),  # full fine-tuning offloads: a2's DefMemPerCPU share is too small
        ("H100-80GB", False, 64),
        ("T4", True, 8),  # LoRA on a T4 offloads the frozen weights to the host
    ],
)
def test_a_cgroup_limit_below_memtotal_changes_the_plan_and_names_the_flag(llama_8b, gpu, lora, cgroup_gib):
    """The same node (192 GiB) planned for the whole node and for a job whose memory cgroup allows less: the plan
    that fitted no longer does, and the error names the limit and the sbatch --mem that makes it fit (the least)."""
    import re

    from llmft.planning.hardware import GPUS, choose_precision
    from llmft.planning.memory import plan_memory
    from llmft.planning.model_shape import model_shape
    from llmft.planning.run_plan import Hardware, memory_job
    from llmft.planning.world import World

    shape = model_shape(llama_8b, use_peft=lora, lora_r=16, lora_target_modules=None)
    cgroup = "0::/job_9/step_0\n"

    def plan_with(limit_gib):
        read = files({} if limit_gib is None else {"/sys/fs/cgroup/job_9/memory.max": str(int(limit_gib * GIB))})
        memory = job_memory({}, MEMINFO_192, cgroup, read)
        hardware = Hardware(
            GPUS[gpu],
            GPUS[gpu].memory_gib,
            memory.gib,
            1,
            None,
            None,
            memory.source if memory.from_allocation else "",
            memory.node_gib,
        )
        job = memory_job(
            shape,
            hardware,
            World(1, 1),
            max_length=1024,
            precision=choose_precision("auto", GPUS[gpu]),
            global_batch=8,
            max_micro_batch=4,
        )
        return plan_memory(job), hardware

    whole, node = plan_with(None)
    assert whole.recommended is not None and not node.allocation_hint(whole)
    limited, job_hw = plan_with(cgroup_gib)
    assert limited.recommended is None
    hint = job_hw.allocation_hint(limited)
    assert f"{cgroup_gib:g} GiB host RAM per node (the job's limit: cgroup memory.max" in job_hw.describe(1, 1)
    m = re.fullmatch(
        r"; the job's allocation is the limit \(cgroup memory.max \(/sys/fs/cgroup/job_9/memory.max\)\): "
        r"ask Slurm for (\d+) GiB per node with sbatch --mem=(\d+)G \(or --mem=0 for the whole node\)",
        hint,
    )
    assert m and m.group(1) == m.group(2), hint
    need = int(m.group(1))
    assert cgroup_gib < need <= 192
    assert plan_with(need)[0].recommended is not None and plan_with(need - 1)[0].recommended is None


def test_check_memory_checks_the_given_setting_against_the_jobs_memory(capsys, monkeypatch, tiny_model):
    """`llmft plan --model M --check_memory` (what run_llm.slurm runs for ZERO_STAGE=0-3): the run plan, then whether
    its own setting fits; Slurm's --mem below what it needs stops it with one line naming the limit and the flag."""
    from llmft import plan

    for name in (
        "SLURM_MEM_PER_NODE",
        "SLURM_MEM_PER_CPU",
        "SLURM_MEM_PER_GPU",
        "LLMFT_HOST_RAM_GB",
        "SLURM_JOB_NUM_NODES",
        "SLURM_NNODES",
        "WORLD_SIZE",
    ):
        monkeypatch.delenv(name, raising=False)
    argv = [
        "--model",
        str(tiny_model),
        "--check_memory",
        "--global_batch_size",
        "4",
        "--per_device_train_batch_size",
        "2",
        "--zero_stage",
        "2",
        "--print_launch",
    ]

    def run(*extra):
        rc = plan.main(plan.make_parser().parse_args(argv + list(extra)))
        return rc, *capsys.readouterr()

    rc, out, err = run()
    assert rc == 0, err
    assert "llmft plan: ZeRO stage 2" in out and "llmft launch: nnodes=1" in out
    # not given: what llmft train runs on CPU processes (TRL's default, on: llmft.planning.speed_defaults)
    assert "llmft plan: memory: ZeRO-2, micro-batch 2 x accumulation 2, gradient checkpointing on fits" in out
    monkeypatch.setenv("SLURM_MEM_PER_NODE", "512")
    rc, out, err = run()
    assert rc == 2 and "llmft launch:" not in out
    assert err.count("\n") == 1 and err.startswith(
        "llmft plan: error: memory: ZeRO-2, micro-batch 2 x accumulation 2"
    ), err
    assert "0.5 GiB host RAM per node (the job's limit: SLURM_MEM_PER_NODE=512 MB): host RAM: needs" in err
    assert "ask Slurm for" in err and "with sbatch --mem=" in err
    rc, out, err = run("--gradient_checkpointing", "false")  # the setting checked is the one given
    assert "gradient checkpointing off" in err
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("SLURM_MEM_PER_NODE")
    argv[1] = "nobody/not-a-cached-model"
    rc, out, err = run()
    assert rc == 0, err
    assert "llmft plan: memory not checked: --model nobody/not-a-cached-model: cannot read its config" in out

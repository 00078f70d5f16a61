"""llmft.planning.world without a cluster: hostlists and the world (nodes x processes) from Slurm/torchrun variables."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmft.planning.world import (
    LaunchEnvError,
    World,
    cpu_split,
    discover_world,
    expand_hostlist,
    parse_gpu_count,
    slurm_cpus_per_node,
)


@pytest.mark.parametrize(
    "hostlist, hosts",
    [
        ("n[1-3,7]", ["n1", "n2", "n3", "n7"]),
        ("n1", ["n1"]),
        ("n1,n2", ["n1", "n2"]),
        ("gpu-[01-03]", ["gpu-01", "gpu-02", "gpu-03"]),
        ("gpu-[08-11]", ["gpu-08", "gpu-09", "gpu-10", "gpu-11"]),
        ("a3-[1-2],login", ["a3-1", "a3-2", "login"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("slurm-g2-nodeset-[0-1],slurm-a2-[5]", ["slurm-g2-nodeset-0", "slurm-g2-nodeset-1", "slurm-a2-5"]),
    ],
)
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("bad", ["n[1-3", "n1-3]", "n[3-1]", "n[a-b]", "n[1,x]"])
def test_expand_hostlist_rejects_malformed_lists_with_a_message(bad):
    with pytest.raises(LaunchEnvError, match="hostlist"):
        expand_hostlist(bad)


@given(st.lists(st.integers(0, 999), min_size=1, max_size=20, unique=True))
def test_expand_hostlist_round_trips_any_set_of_numbered_nodes(numbers):
    numbers = sorted(numbers)
    assert expand_hostlist(f"node[{','.join(map(str, numbers))}]") == [f"node{n}" for n in numbers]


@pytest.mark.parametrize(
    "spec, count",
    [
        ("2", 2),
        ("a100:2", 2),
        ("gpu:a100:2", 2),
        ("gpu:4", 4),
        ("a100:2,l4:1", 3),
        ("gpu:a100", 1),
        ("(null)", 0),
        ("", 0),
    ],
)
def test_gpu_count_from_slurm_gpu_specs(spec, count):
    assert parse_gpu_count(spec) == count


@pytest.mark.parametrize(
    "env, world",
    [
        # Inside a Slurm allocation: GPUs Slurm gave the node, from the most specific variable.
        ({"SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "4"}, (2, 4)),
        ({"SLURM_NNODES": "2", "SLURM_GPUS_PER_NODE": "a100:8"}, (2, 8)),
        ({"SLURM_NNODES": "3", "SLURM_GPUS_PER_NODE": "gpu:l4:4"}, (3, 4)),
        ({"SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "1", "SLURM_GPUS_PER_NODE": "8"}, (2, 1)),
        ({"SLURM_NNODES": "4", "SLURM_JOB_NUM_NODES": "4", "SLURM_GPUS": "16"}, (4, 4)),  # --gpus=16 over the job
        ({"SLURM_JOB_NUM_NODES": "4", "SLURM_GPUS": "16"}, (4, 4)),  # only the older node-count name
        # One task per process launch style, no GPUs: processes from tasks.
        ({"SLURM_NNODES": "2", "SLURM_NTASKS": "8"}, (2, 4)),
        # A CPU node (the local test cluster without --gpus): one process per node.
        ({"SLURM_NNODES": "2", "SLURM_NTASKS": "2"}, (2, 1)),
        ({"SLURM_NNODES": "2"}, (2, 1)),
        # Inside a one-node step of a two-node job (llmft plan run by srun in a container): the job's nodes.
        ({"SLURM_NNODES": "1", "SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "4"}, (2, 4)),
        # Inside torchrun its variables win over Slurm's.
        ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "1"}, (2, 4)),
        ({"WORLD_SIZE": "2"}, (1, 2)),
    ],
)
def test_discover_world_from_slurm_and_torchrun_variables(env, world):
    w = discover_world(env, cuda_device_count=0)
    assert (w.nnodes, w.procs_per_node) == world
    assert w.world_size == world[0] * world[1]


def test_outside_slurm_the_world_is_the_local_gpus_or_one_cpu_process():
    assert discover_world({}, cuda_device_count=8) == World(1, 8, "cuda")
    assert discover_world({}, cuda_device_count=0).world_size == 1


@pytest.mark.parametrize(
    "env, name",
    [
        ({"SLURM_NNODES": "two"}, "SLURM_NNODES"),
        ({"SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "-1"}, "SLURM_GPUS_ON_NODE"),
        ({"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"}, "WORLD_SIZE"),
        ({"SLURM_NNODES": "2", "SLURM_GPUS_PER_NODE": "a100:x?"}, "a100:x?"),
    ],
)
def test_unreadable_variables_fail_naming_the_variable(env, name):
    with pytest.raises(LaunchEnvError, match=name.replace("?", r"\?")):
        discover_world(env, cuda_device_count=0)


def test_deepspeed_start_up_builds_no_shm_op():
    """DeepSpeed's CPU shared-memory all-reduce op (inference only) is not compiled when llmft starts DeepSpeed;
    LLMFT_DEEPSPEED_SHM_COMM=1 keeps DeepSpeed's default."""
    import deepspeed.ops
    from deepspeed.comm.torch import build_shm_op

    from llmft.training.deepspeed_env import skip_deepspeed_shm_op

    before = dict(deepspeed.ops.__compatible_ops__)
    assert before["deepspeed_shm_comm"] is True  # DeepSpeed would build it on this (Linux) machine
    try:
        assert skip_deepspeed_shm_op({"LLMFT_DEEPSPEED_SHM_COMM": "1"}) is False
        assert deepspeed.ops.__compatible_ops__ == before
        assert skip_deepspeed_shm_op({}) is True
        assert build_shm_op() is None  # returns before any compiler runs
    finally:
        deepspeed.ops.__compatible_ops__.clear()
        deepspeed.ops.__compatible_ops__.update(before)


@pytest.mark.parametrize(
    "env, cpus",
    [
        ({"SLURM_JOB_CPUS_PER_NODE": "16(x2)", "SLURM_CPUS_ON_NODE": "16"}, 16),
        ({"SLURM_JOB_CPUS_PER_NODE": "48,12(x3)"}, 12),  # nodes differ: every node runs as many processes
        ({"SLURM_JOB_CPUS_PER_NODE": "8(x2)", "SLURM_CPUS_ON_NODE": "1"}, 8),  # a 1-CPU step inside an 8-CPU job
        ({"SLURM_CPUS_ON_NODE": "6"}, 6),
        ({}, None),
    ],
)
def test_cpus_per_node_from_the_jobs_allocation(env, cpus):
    assert slurm_cpus_per_node(env) == cpus


def test_unreadable_cpu_count_names_the_variable():
    with pytest.raises(LaunchEnvError, match="SLURM_JOB_CPUS_PER_NODE"):
        slurm_cpus_per_node({"SLURM_JOB_CPUS_PER_NODE": "lots"})


@pytest.mark.parametrize(
    "cpus, procs, threads, workers, tokenisers",
    [
        (4, 1, 4, 2, 4),  # g2-standard-4: one L4, 4 vCPUs (--cpus-per-gpu=4)
        (16, 4, 4, 2, 16),  # 4 GPUs x 4 CPUs
        (96, 8, 12, 2, 96),  # p4d.24xlarge: 8 A100s, 96 vCPUs
        (2, 1, 2, 0, 2),  # too few CPUs for workers beside the process
        (3, 1, 3, 1, 3),
        (2, 4, 1, 0, 2),  # fewer CPUs than processes: one thread each, and a warning
    ],
)
def test_a_nodes_cpus_are_split_between_its_processes(cpus, procs, threads, workers, tokenisers):
    split = cpu_split(cpus, procs)
    assert (split.threads_per_process, split.dataloader_workers, split.dataset_num_proc) == (
        threads,
        workers,
        tokenisers,
    )
    # Never more busy threads per process than its share (the process itself plus its workers count too).
    assert split.threads_per_process * procs <= max(cpus, procs)
    assert (split.warning() is not None) == (cpus < procs)


def test_llmft_plan_prints_the_launch_line_the_slurm_script_reads(monkeypatch, capsys):
    from llmft import plan

    for name in (
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "SLURM_NNODES",
        "SLURM_GPUS_PER_NODE",
        "SLURM_NTASKS",
        "SLURM_GPUS",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "4")
    monkeypatch.setenv("SLURM_JOB_CPUS_PER_NODE", "48(x2)")
    args = plan.make_parser().parse_args(
        ["--global_batch_size", "64", "--per_device_train_batch_size", "2", "--print_launch"]
    )
    assert plan.main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert "llmft plan: world size 8 (2 nodes x 4 processes, from slurm)" in out
    assert out[-1] == (
        "llmft launch: nnodes=2 nproc_per_node=4 cpus_per_node=48 omp_num_threads=12 "
        "dataloader_num_workers=2 dataset_num_proc=48"
    )


@pytest.mark.parametrize(
    "value, fixed",
    [
        ("9.0a", "9.0"),  # what an H100 image set (seen 2026-11-24): FusedAdam's build failed at the first step
        ("8.0;9.0a+PTX", "8.0;9.0+PTX"),
        ("8.0 8.9 9.0a 10.0f", "8.0;8.9;9.0;10.0"),
        ("9.0a;9.0", "9.0"),
        ("8.0;8.9", None),  # the Dockerfile's: DeepSpeed reads it as it is
        ("", None),
        (None, None),
    ],
)
def test_arch_specific_targets_are_rewritten_for_deepspeeds_op_builder(monkeypatch, value, fixed):
    """DeepSpeed's own JIT builder (the code that failed on the H100) reads what llmft sets, and fails on the raw value."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    from llmft.planning.op_prebuild import deepspeed_arch_list

    assert deepspeed_arch_list(value) == fixed
    builder = FusedAdamBuilder()
    builder.jit_mode = True
    if fixed:
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", value)
        with pytest.raises(ValueError, match="invalid literal for int"):
            builder.compute_capability_args()
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", fixed)
        builder.compute_capability_args()  # parses (on this CPU machine it then keeps no CUDA target)


X86_AVX2 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse sse2 avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu\n"
X86_AVX512 = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu avx2 avx512f avx512bw avx512_bf16\n"
ARM_SVE = "processor\t: 0\nBogoMIPS\t: 2000.00\nFeatures\t: fp asimd evtstrm sve sve2\nCPU implementer\t: 0x41\n"
ARM_NEON = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes crc32\n"


@pytest.mark.parametrize(
    "text, machine, simd, vendor",
    [
        (X86_AVX2, "x86_64", "-D__AVX256__", "AuthenticAMD"),
        (X86_AVX512, "x86_64", "-D__AVX512__", "GenuineIntel"),
        (ARM_SVE, "aarch64", "-D__SVE__", None),
        (ARM_NEON, "aarch64", "-D__NEON__", None),
        (X86_AVX2, "ppc64le", None, None),  # py-cpuinfo's own answer is kept elsewhere
        ("processor\t: 0\nvendor_id\t: GenuineIntel\n", "x86_64", None, None),  # no flags line
    ],
)
def test_deepspeed_reads_the_same_cpu_from_proc_cpuinfo(monkeypatch, text, machine, simd, vendor):
    """DeepSpeed's CPU op builders derive -march and the SIMD width from py-cpuinfo (1 s a call, two calls per op load,
    every rank): llmft answers from /proc/cpuinfo, and DeepSpeed's own code must reach the same compile flags."""
    import cpuinfo
    from deepspeed.ops.op_builder.cpu import CPUAdamBuilder

    from llmft.training.deepspeed_env import cpu_info_from_proc

    info = cpu_info_from_proc(text, machine)
    if simd is None:
        assert info is None
        return
    assert info.get("vendor_id_raw") == vendor  # DeepSpeedCPUAdam reads the vendor (its AMD fp16 warning)
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: info)
    builder = CPUAdamBuilder()
    assert (builder.cpu_arch(), builder.simd_width()) == ("-march=native", simd)


def test_this_machines_deepspeed_op_flags_are_unchanged_by_reading_proc_cpuinfo(monkeypatch):
    """On this machine, py-cpuinfo's real answer and llmft's give DeepSpeed identical op compile flags (so the op
    already built and cached is loaded, not rebuilt), and the answer no longer starts a Python process."""
    import subprocess

    import cpuinfo
    from deepspeed.accelerator import get_accelerator

    from llmft.training.deepspeed_env import use_proc_cpuinfo_for_deepspeed

    builders = [get_accelerator().create_op_builder(name) for name in ("FusedAdamBuilder", "CPUAdamBuilder")]
    real = cpuinfo.get_cpu_info()
    before = [b.cxx_args() for b in builders]
    monkeypatch.setattr(cpuinfo, "get_cpu_info", cpuinfo.get_cpu_info)  # restored after the test
    assert use_proc_cpuinfo_for_deepspeed(env={}) is True
    spawned = []
    monkeypatch.setattr(
        subprocess.Popen, "__init__", lambda self, *a, **k: spawned.append(a) or (_ for _ in ()).throw(OSError)
    )
    assert [b.cxx_args() for b in builders] == before
    assert spawned == []
    ours = cpuinfo.get_cpu_info()
    assert ours["arch"] == real["arch"] and ours["vendor_id_raw"] == real["vendor_id_raw"]
    assert {"avx2", "avx512f"} & set(real["flags"]) == {"avx2", "avx512f"} & set(ours["flags"])
    assert use_proc_cpuinfo_for_deepspeed("/nonexistent/cpuinfo") is False
    assert use_proc_cpuinfo_for_deepspeed(env={"LLMFT_PY_CPUINFO": "1"}) is False


def test_a_training_process_ends_with_its_code_after_its_exit_work_and_without_finalization(tmp_path):
    """llmft.train's ranks end through llmft.command.exit_process: the gloo threads DeepSpeed's groups leave behind
    (still running after destroy_process_group; a bare torch group's end with it) are never met by interpreter
    finalization, where one can abort the rank; what finalization would have done for the run (non-daemon threads,
    exit handlers, flushed output) is done first."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        f"""
        import atexit, os, sys, threading, time
        import torch.distributed as dist
        from llmft.command import exit_process
        from llmft.planning.world import free_port

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
        dist.all_reduce(__import__("torch").ones(4))
        dist.destroy_process_group()

        class Finalized:
            def __del__(self):
                print("finalized")  # interpreter finalization would print this

        keep = Finalized()
        atexit.register(lambda: open({str(tmp_path / "atexit")!r}, "w").write("ran"))
        writer = threading.Thread(target=lambda: (time.sleep(0.5), open({str(tmp_path / "thread")!r}, "w").write("done")))
        writer.start()
        import concurrent.futures  # an idle pool's non-daemon workers (torch.compile keeps one): stopped, not waited on
        pool = concurrent.futures.ThreadPoolExecutor(1)
        pool.submit(lambda: None).result()
        sys.stdout.write("unflushed line")
        exit_process(3)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)  # never hangs
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "unflushed line"  # flushed, and no finalization (it would print "finalized")
    assert (tmp_path / "atexit").read_text() == "ran" and (tmp_path / "thread").read_text() == "done"


GC_PROBE = """
import gc, json
from llmft.training import garbage_collection as g
seen = {"paused": g.pause_for_startup(), "on_while_paused": gc.isenabled(), "paused_twice": g.pause_for_startup()}
garbage = [[]]
garbage[0].append(garbage)  # a reference cycle made during start-up
del garbage
seen.update(resumed=g.resume_after_startup(), on_after=gc.isenabled(), frozen=gc.get_freeze_count())
seen.update(resumed_twice=g.resume_after_startup(), left_over=gc.collect())
gc.unfreeze()
seen["paused_again"] = g.pause_for_startup()  # a `llmft train` that returns before training, in a process that goes on
g.end_pause()
seen.update(on_after_end=gc.isenabled(), frozen_after_end=gc.get_freeze_count(), resumed_after_end=g.resume_after_startup())
print(json.dumps(seen))
"""


@pytest.mark.parametrize("keep", [None, "1"])
def test_a_rank_starts_without_cyclic_collection_then_collects_once_freezes_and_trains_with_it(keep):
    """llmft.training.garbage_collection in a fresh interpreter, as `python -m llmft.train` runs it: off from the
    start, start-up's cycles collected when it ends (nothing left for the first collection of training), what is left
    frozen, the collector on again for training; LLMFT_PYTHON_GC=1 leaves Python's collector alone throughout."""
    import json
    import subprocess
    import sys

    from conftest import subprocess_env

    env = subprocess_env(**({"LLMFT_PYTHON_GC": keep} if keep else {}))
    if not keep:
        env.pop("LLMFT_PYTHON_GC", None)
    seen = json.loads(
        subprocess.run([sys.executable, "-c", GC_PROBE], env=env, capture_output=True, text=True, check=True).stdout
    )
    if keep:
        assert seen == {
            "paused": False, "on_while_paused": True, "paused_twice": False,
            "resumed": False, "on_after": True, "frozen": 0, "resumed_twice": False, "left_over": 2,
            "paused_again": False, "on_after_end": True, "frozen_after_end": 0, "resumed_after_end": False,
        }  # fmt: skip
    else:
        assert seen["paused"] and not seen["on_while_paused"] and not seen["paused_twice"]
        assert seen["resumed"] and seen["on_after"] and seen["frozen"] > 1000 and not seen["resumed_twice"]
        assert seen["left_over"] == 0  # the cycle was collected at the end of start-up, not frozen
        assert seen["paused_again"] and seen["on_after_end"] and seen["frozen_after_end"] == 0
        assert not seen["resumed_after_end"]  # ended: nothing left to resume


def test_llmft_train_pauses_the_collector_from_its_first_line_and_resumes_it_before_training():
    """Where the two calls sit: a rank (`python -m llmft.train`) and `llmft train` pause before the parser imports
    torch and TRL; the training path resumes after the trainer is built, before trainer.train; the in-process
    torchrun agent of `llmft train --nproc_per_node` resumes before it launches (it runs for the whole job)."""
    import inspect

    from llmft import cli, train

    main_block = inspect.getsource(train).split('if __name__ == "__main__":')[1]
    assert main_block.index("pause_for_startup()") < main_block.index("make_parser()")
    body = inspect.getsource(train.train)
    assert body.index("build_trainer(") < body.index("resume_after_startup()") < body.index("trainer.train(")
    launch = inspect.getsource(train.cli)
    assert launch.index("resume_after_startup()") < launch.index("launcher.launch(")
    entry = inspect.getsource(cli.main)  # and `llmft train` called from Python gives its process the collector back
    assert entry.index("pause_for_startup()") < entry.index("run_command(argv)") < entry.index("end_pause()")
    assert "import_module(" in inspect.getsource(cli.run_command)


COMPILE_PROBE = """
import json, sys
import torch
from llmft.training.deepspeed_env import defer_deepspeed_compile_decorators
calls = []
real = torch.compile
torch.compile = lambda fn, *a, **k: calls.append(fn.__name__) or fn  # a recorder: which function, and when
deferred = defer_deepspeed_compile_decorators()
from deepspeed.runtime.zero.muon import muon_optimizer, original_muon  # what DeepSpeed imports on every ZeRO run
seen = {"deferred": deferred, "at_import": list(calls), "inductor": "torch._inductor.compile_fx" in sys.modules}
from deepspeed.runtime import compiler
@compiler.compile()
def double(x):
    return 2 * x
seen["at_decoration"] = list(calls)
seen["results"] = [double(1), double(2)]
seen["after_calls"] = list(calls)
seen["muon_class"] = muon_optimizer.MuonWithAuxAdam.__name__
print(json.dumps(seen))
"""


@pytest.mark.parametrize("keep", [None, "1"])
def test_deepspeeds_muon_module_imports_without_calling_torch_compile_until_a_function_runs(keep):
    """DeepSpeed imports its Muon optimizer module on every ZeRO run, and that module's torch.compile decorators
    imported torch._inductor's compiler at import (1.45 s a rank). Deferred: nothing is compiled at import or at
    decoration, a decorated function compiles once at its first call and returns what it did;
    LLMFT_DEEPSPEED_EAGER_COMPILE=1 keeps DeepSpeed's decorator."""
    import json
    import subprocess
    import sys

    from conftest import subprocess_env

    env = subprocess_env(**({"LLMFT_DEEPSPEED_EAGER_COMPILE": keep} if keep else {}))
    if not keep:
        env.pop("LLMFT_DEEPSPEED_EAGER_COMPILE", None)
    proc = subprocess.run([sys.executable, "-c", COMPILE_PROBE], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.splitlines()[-1])
    assert seen["muon_class"] == "MuonWithAuxAdam" and seen["results"] == [2, 4]
    if keep:
        assert not seen["deferred"]
        assert len(seen["at_import"]) == 3 and seen["at_decoration"][-1] == "double"  # DeepSpeed's: at decoration
    else:
        assert seen["deferred"] and seen["at_import"] == [] and not seen["inductor"]
        assert seen["at_decoration"] == [] and seen["after_calls"] == ["double"]  # once, at the first call


def process_state(pid: int) -> str:
    """A process's state letter ('' when it is gone; 'Z' when it has ended but is not reaped yet)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def test_a_rank_torchrun_started_ends_with_its_torchrun_and_no_other_process_does(tmp_path):
    """torchrun starts each rank in a session of its own, so a scheduler that kills the job's sessions (PBS's mom
    without the cgroups hook) kills torchrun and misses its ranks. A rank under torchrun (TORCHELASTIC_RUN_ID) asks to
    be killed when its parent dies (llmft.training.launcher.end_with_the_agent); any other process is left alone."""
    repo = str(Path(__file__).resolve().parents[1])
    for under_torchrun in (True, False):
        ready = tmp_path / f"ready-{under_torchrun}"
        rank = (
            f"import os, sys, time; sys.path.insert(0, {repo!r}); from llmft.training import launcher; "
            f"asked = launcher.end_with_the_agent(); open({str(ready)!r}, 'w').write(f'{{os.getpid()}} {{asked}}'); "
            "time.sleep(300)"
        )
        agent = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {rank!r}], start_new_session=True); time.sleep(300)"
        env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}
        if under_torchrun:
            env["TORCHELASTIC_RUN_ID"] = "test"
        parent = subprocess.Popen([sys.executable, "-c", agent], env=env)
        for _ in range(1200):  # a hang guard: the rank writes the file once it has asked
            if ready.exists() and ready.read_text() or parent.poll() is not None:
                break
            time.sleep(0.1)
        pid_text, asked = ready.read_text().split()
        pid = int(pid_text)
        try:
            assert asked == str(under_torchrun)
            parent.kill()  # torchrun killed, as the mom kills a job's session
            parent.wait()
            if under_torchrun:
                for _ in range(300):
                    if process_state(pid) in ("", "Z"):
                        break
                    time.sleep(0.1)
                assert process_state(pid) in ("", "Z"), "the rank outlived its torchrun"
            else:
                assert process_state(pid) not in ("", "Z"), "a process not under torchrun ended with its parent"
        finally:
            if process_state(pid) not in ("", "Z"):
                os.kill(pid, signal.SIGKILL)

"""`llmft plan --model ...`: the memory plan on the command line (in-process), its JSON, --write, and bad input."""

from __future__ import annotations

import json
import math
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from llmft import plan

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def llama_config(tmp_path_factory) -> Path:
    """A directory holding only config.json: Llama-3.1-8B's published hyper-parameters (nothing downloaded)."""
    from published_shapes import llama_3_1_8b

    out = tmp_path_factory.mktemp("llama-3.1-8b")
    llama_3_1_8b().save_pretrained(out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]
    return out


def llmft_plan(capsys, *argv) -> tuple[int, str, str]:
    rc = plan.main(plan.make_parser().parse_args([str(a) for a in argv]))
    out, err = capsys.readouterr()
    return rc, out, err


def test_8b_on_a2_highgpu_8g_prints_the_recommendation_and_the_table(capsys, llama_config):
    rc, out, err = llmft_plan(
        capsys,
        "--model",
        llama_config,
        "--node_type",
        "a2-highgpu-8g",
        "--global_batch_size",
        64,
        "--max_length",
        2048,
    )
    assert rc == 0, err
    lines = out.splitlines()
    assert "8.03B parameters, full fine-tuning; bf16, sequence 2048, global batch 64" in lines[0]
    assert "1 x a2-highgpu-8g: 8 x A100-40GB (39.4 GiB) per node, 680 GiB host RAM per node; world size 8" in lines[1]
    assert lines[2].startswith("llmft plan: recommended ZeRO-") and lines[3].startswith("llmft plan: why: ")
    rows = [line for line in lines if line.startswith("  ") and "|" in line][1:]
    assert rows[0].rstrip().endswith("| yes") and any("no: GPU memory: needs" in r for r in rows)
    assert any(line.startswith("llmft plan: warning: a checkpoint") and "USR1" in line for line in lines)
    assert "llmft plan: assumed:" in lines[-1]


def test_8b_on_two_g2_standard_4_full_fine_tune_does_not_fit_lora_does(capsys, llama_config):
    args = (
        "--model",
        llama_config,
        "--node_type",
        "g2-standard-4",
        "--nnodes",
        2,
        "--global_batch_size",
        32,
        "--max_length",
        2048,
    )
    rc, out, err = llmft_plan(capsys, *args)
    assert rc == 2
    assert err.strip().splitlines() == [
        next(line for line in out.splitlines() if "nothing fits" in line).replace(
            "llmft plan: nothing fits", "llmft plan: error: nothing fits"
        )
    ]
    rc, out, err = llmft_plan(capsys, *args, "--use_peft", "--lora_r", 16)
    assert rc == 0, err
    assert "LoRA: 6.8M trainable" in out and "llmft plan: recommended ZeRO-" in out


def test_json_holds_every_candidate_with_the_documented_keys(capsys, llama_config):
    rc, out, _ = llmft_plan(
        capsys,
        "--model",
        llama_config,
        "--node_type",
        "g6.12xlarge",
        "--global_batch_size",
        16,
        "--max_length",
        2048,
        "--json",
    )
    assert rc == 0
    doc = json.loads(out)
    assert doc["params"] == doc["trainable_params"] == 8_030_261_248
    keys = {
        "zero_stage",
        "offload",
        "micro_batch",
        "grad_accum",
        "gradient_checkpointing",
        "model_states_gib",
        "activations_gib",
        "gpu_total_gib",
        "host_ram_gib_per_node",
        "checkpoint_gib",
        "fits",
        "why",
    }
    assert keys <= set(doc["recommended"]) and all(keys <= set(c) for c in doc["candidates"])
    assert doc["candidates"][0] == doc["recommended"] and doc["recommended"]["fits"]
    assert doc["recommended"]["gpu_total_gib"] <= 22.0 and doc["recommended"]["host_ram_gib_per_node"] <= 192


def test_write_gives_a_resolved_config_and_an_sbatch_line_the_script_accepts(capsys, llama_config, tmp_path):
    rc, out, _ = llmft_plan(
        capsys,
        "--model",
        llama_config,
        "--node_type",
        "g2-standard-4",
        "--nnodes",
        2,
        "--global_batch_size",
        32,
        "--max_length",
        2048,
        "--use_peft",
        "--write",
        tmp_path / "w",
    )
    assert rc == 0
    rec = json.loads((tmp_path / "w" / "plan.json").read_text())["recommended"]
    cfg = json.loads((tmp_path / "w" / "ds_config.json").read_text())
    assert cfg["zero_optimization"]["stage"] == rec["zero_stage"]
    assert cfg["train_micro_batch_size_per_gpu"] == rec["micro_batch"] and cfg["train_batch_size"] == 32
    assert cfg["bf16"]["enabled"] is True and "auto" not in json.dumps(cfg)
    line = (tmp_path / "w" / "sbatch.txt").read_text().strip()
    assert f"run it: {line}" in out
    words = shlex.split(line)
    # Slurm is asked for the host memory the plan needs per node (rounded up to a GiB)
    mem = math.ceil(rec["host_ram_gib_per_node"])
    assert (
        words[:4] == ["sbatch", "--nodes=2", "--gpus-per-node=1", f"--mem={mem}G"]
        and words[4] == "slurm/run_llm.slurm"
    )
    export = words[5]
    assert f"MICRO_BATCH={rec['micro_batch']}" in export and "LORA=1" in export and "--max_length 2048" in export
    proc = subprocess.run(
        ["bash", str(REPO / "slurm" / "run_llm.slurm"), export],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "DRY_RUN": "1"},
        timeout=60,
    )
    assert proc.returncode == 0 and "knobs are valid" in proc.stdout, proc.stderr


def test_write_for_pbs_gives_a_qsub_line_the_pbs_script_accepts(capsys, llama_config, tmp_path):
    """--scheduler pbs: a select statement with the node type's CPUs, its GPUs and the host memory the plan needs
    per node, place=scatter, the walltime, and every knob in -v, which pbs/run_llm.pbs checks as the job would."""
    rc, out, _ = llmft_plan(
        capsys,
        "--model", llama_config, "--node_type", "a2-highgpu-2g", "--nnodes", 2, "--global_batch_size", 32,
        "--max_length", 2048, "--use_peft", "--lora_target_modules", "q_proj", "v_proj",
        "--write", tmp_path / "w", "--scheduler", "pbs", "--walltime", "08:00:00",
    )  # fmt: skip
    assert rc == 0
    rec = json.loads((tmp_path / "w" / "plan.json").read_text())["recommended"]
    line = (tmp_path / "w" / "qsub.txt").read_text().strip()
    assert f"run it: {line}" in out and not (tmp_path / "w" / "sbatch.txt").exists()
    words = shlex.split(line)
    mem = math.ceil(rec["host_ram_gib_per_node"])
    assert words[:7] == [
        "qsub", "-l", f"select=2:ncpus=24:ngpus=2:mem={mem}gb", "-l", "place=scatter", "-l", "walltime=08:00:00",
    ]  # fmt: skip
    assert words[7] == "-v" and words[9] == "pbs/run_llm.pbs"
    variables = words[8]
    assert f"MICRO_BATCH={rec['micro_batch']}" in variables and "LORA=1" in variables
    assert "EXTRA_ARGS=--gradient_checkpointing" in variables and "--lora_target_modules q_proj v_proj" in variables
    # what qsub -v hands the job: KEY=VALUE items; the PBS script checks each as it would in the job
    items = [item for item in variables.split(",")]
    proc = subprocess.run(
        ["bash", str(REPO / "pbs" / "run_llm.pbs"), f"VENV={sys.prefix}", *items],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "DRY_RUN": "1"},
        timeout=60,
        cwd=REPO,
    )
    assert proc.returncode == 0 and "knobs are valid" in proc.stdout, proc.stderr


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "{cfg}", "--scheduler", "pbs"], "--scheduler and --walltime shape the submission line --write"),
        (["--model", "{cfg}", "--walltime", "1:00:00", "--write", "{out}"], "--walltime is the PBS job's"),
        (["--model", "{cfg}", "--scheduler", "pbs", "--walltime", "4h", "--write", "{out}"], "give HH:MM:SS"),
    ],
)
def test_a_submission_flag_without_its_line_is_refused(capsys, llama_config, tmp_path, argv, message):
    argv = [a.replace("{cfg}", str(llama_config)).replace("{out}", str(tmp_path / "w")) for a in argv]
    rc, _, err = llmft_plan(capsys, *argv, "--node_type", "a2-highgpu-2g")
    assert rc == 2 and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "{missing}"], "no such directory"),
        (["--model", "{empty}"], "no config.json in that directory"),
        (["--model", "{cfg}", "--node_type", "g9.huge"], "unknown node type 'g9.huge'; known: g2-standard-4"),
        (["--model", "{cfg}", "--gpu", "L4"], "--gpu/--gpu_memory_gb needs --host_ram_gb"),
        (
            ["--model", "{cfg}", "--gpu", "A100-80GB", "--node_type", "g2-standard-4"],
            "contradicts --node_type g2-standard-4",
        ),
        (
            ["--model", "{cfg}", "--gpu", "T4", "--host_ram_gb", "64", "--precision", "bf16"],
            "bf16 needs a GPU with compute capability 8.0",
        ),
        (["--model", "{cfg}", "--node_type", "g6.xlarge", "--load_in_4bit"], "--load_in_4bit trains LoRA adapters"),
        (["--model", "{cfg}", "--node_type", "g6.xlarge", "--mfu", "2"], "--mfu must be in (0, 1]"),
        (
            ["--model", "{cfg}", "--node_type", "g6.xlarge", "--use_peft", "--save_consolidated"],
            "a LoRA run saves its adapter",
        ),
        (["--node_type", "g2-standard-4", "--json"], "--node_type, --json need --model"),
        (["--max_length", "2048"], "--max_length needs --model"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, llama_config, tmp_path, argv, message):
    (tmp_path / "empty").mkdir()
    subs = {"{missing}": str(tmp_path / "nope"), "{empty}": str(tmp_path / "empty"), "{cfg}": str(llama_config)}
    rc, out, err = llmft_plan(capsys, *[subs.get(a, a) for a in argv])
    assert rc == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("llmft plan: error: "), err
    assert message in err


def test_auto_plan_as_run_llm_slurm_asks_for_it_prints_the_launch_line(capsys, llama_config, monkeypatch):
    """ZERO_STAGE=auto: the script runs `llmft plan --model M --auto --print_launch` and launches from its last line;
    a --max_length beyond the model's positions is clipped as llmft train clips it, and said."""
    monkeypatch.setenv("LLMFT_HOST_RAM_GB", "192")
    args = (
        "--model",
        llama_config,
        "--auto",
        "--gpu",
        "L4",
        "--host_ram_gb",
        192,
        "--nproc_per_node",
        4,
        "--global_batch_size",
        16,
        "--per_device_train_batch_size",
        2,
        "--use_peft",
        "--print_launch",
    )
    rc, out, err = llmft_plan(capsys, *args, "--max_length", 2048)
    assert rc == 0, err
    lines = out.splitlines()
    assert "llmft plan: recommended ZeRO-" in out and "micro-batch 2 x accumulation 2" in out
    assert lines[-1].startswith("llmft launch: nnodes=1 nproc_per_node=4 cpus_per_node=")
    rc, out, err = llmft_plan(capsys, *args, "--max_length", 200000)
    assert out.splitlines()[0] == "llmft plan: max_length 200000 exceeds the model's 131072 positions; using 131072"
    rc, out, err = llmft_plan(
        capsys,
        "--model",
        llama_config,
        "--node_type",
        "g6.xlarge",
        "--json",
        "--use_peft",
        "--per_device_train_batch_size",
        1,
    )
    assert rc == 0 and json.loads(out)["recommended"]["micro_batch"] == 1  # --json stays one JSON document


def test_the_batch_only_plan_is_unchanged(capsys):
    rc, out, _ = llmft_plan(capsys, "--global_batch_size", 128, "--nnodes", 2, "--nproc_per_node", 4)
    assert rc == 0
    assert out.splitlines()[:4] == [
        "llmft plan: world size 8 (2 nodes x 4 processes, from arguments)",
        "llmft plan: micro-batch 8 per process",  # HF's default, as before
        "llmft plan: gradient accumulation 2",
        "llmft plan: global batch 128 = micro-batch 8 x accumulation 2 x world size 8",
    ]


def test_every_machine_type_in_the_blueprints_is_in_the_node_catalogue():
    """`llmft plan --node_type` knows every node the GCP and AWS blueprints create (and their GPU and provider)."""
    import re

    from llmft.planning.hardware import NODE_TYPES, node_type_by_name

    gcp = re.findall(r"machine_type: (\S+)", (REPO / "blueprints" / "gcp" / "hpc-slurm.yaml").read_text())
    aws = re.findall(r"InstanceType: (\S+)", (REPO / "blueprints" / "aws" / "config.yaml").read_text())
    gpu_nodes = [m for m in gcp if m.startswith(("g2-", "a2-", "a3-"))] + [
        m for m in aws if m.startswith(("g6.", "p4d.", "p5."))
    ]
    assert {"g2-standard-4", "a2-highgpu-1g", "g6.2xlarge", "g6.12xlarge", "p4d.24xlarge"} <= set(gpu_nodes)
    for name in gpu_nodes:
        node = node_type_by_name(name.upper())
        assert node.provider == ("gcp" if name in gcp else "aws") and node.source.startswith("https://")
    assert NODE_TYPES["g6.12xlarge"].gpus == 4 and NODE_TYPES["p4d.24xlarge"].efa


def test_host_ram_of_this_node_for_auto(tmp_path):
    from llmft.planning.hardware import HardwareError, local_host_ram_gib

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16393216 kB\nMemFree:  1 kB\n")
    assert local_host_ram_gib({}, str(meminfo)) == 15.6
    assert local_host_ram_gib({"SLURM_MEM_PER_NODE": "8192"}, str(meminfo)) == 8.0  # sbatch --mem wins when smaller
    assert (
        local_host_ram_gib({"LLMFT_HOST_RAM_GB": "15.5"}, str(tmp_path / "none")) == 15.5
    )  # the first node's, via run_llm.slurm
    with pytest.raises(HardwareError, match="LLMFT_HOST_RAM_GB='lots' is not a positive number"):
        local_host_ram_gib({"LLMFT_HOST_RAM_GB": "lots"}, str(meminfo))
    with pytest.raises(HardwareError, match="give --host_ram_gb"):
        local_host_ram_gib({}, str(tmp_path / "none"))


def test_documented_plan_examples_are_this_codes_output(capsys, llama_config, monkeypatch, tmp_path):
    """Every `$ llmft plan ...` in docs/memory-planning.md's examples prints exactly what the page shows (run from a
    directory holding the page's llama-3.1-8b config), so the documented numbers cannot drift from the code."""
    import re
    import shutil

    text = (REPO / "docs" / "memory-planning.md").read_text()
    section = text[text.index("<!-- PLAN_EXAMPLES -->") : text.index("<!-- /PLAN_EXAMPLES -->")]
    shutil.copytree(llama_config, tmp_path / "llama-3.1-8b")
    monkeypatch.chdir(tmp_path)
    examples = [block.strip("\n").split("\n") for block in re.findall(r"```text\n(.*?)```", section, re.S)]
    commands = 0
    for block in examples:
        starts = [i for i, line in enumerate(block) if line.startswith("$ llmft plan ")] + [len(block)]
        for a, b in zip(starts, starts[1:]):
            shown = [line for line in block[a + 1 : b] if line]
            rc, out, err = llmft_plan(capsys, *shlex.split(block[a])[3:])
            assert (out + err).splitlines() == shown, block[a]
            assert rc == (2 if "llmft plan: error:" in err else 0)
            commands += 1
    assert commands == 4  # a2-highgpu-8g; 2 x g2-standard-4 full and LoRA; g6.12xlarge


def test_save_total_limit_is_checked_against_the_output_dirs_free_space(capsys, llama_config, tmp_path):
    args = (
        "--model",
        llama_config,
        "--node_type",
        "a2-highgpu-8g",
        "--global_batch_size",
        64,
        "--max_length",
        2048,
        "--output_dir",
        tmp_path / "not" / "yet" / "there",
    )  # the nearest existing parent's filesystem
    rc, out, _ = llmft_plan(capsys, *args, "--save_total_limit", 100_000)
    assert rc == 0
    assert (
        "llmft plan: warning: save_total_limit 100000 keeps 100000 complete checkpoints while writing the next: 100001 x 104.7 GiB per checkpoint = 1047"
        in out
    )
    assert "GiB free in the output directory; lower --save_total_limit or free space" in out
    rc, out, _ = llmft_plan(capsys, *args)
    assert "llmft plan: warning: --save_total_limit is not set: every checkpoint is kept (104.7 GiB each" in out


def test_a3_plans_its_gpudirect_tcpx_bandwidth_only_with_the_nccl_profile_that_loads_it(capsys, llama_config):
    args = ("--model", llama_config, "--node_type", "a3-highgpu-8g", "--nnodes", 2, "--global_batch_size", 64)
    rc, plain, _ = llmft_plan(capsys, *args, "--zero_stage", 2)
    assert rc == 0
    assert "200 Gbps network (the host gVNIC, NCCL's plain sockets); --nccl_profile gcp-tcpx: 800 Gbps" in plain
    rc, tcpx, _ = llmft_plan(capsys, *args, "--zero_stage", 2, "--nccl_profile", "gcp-tcpx")
    assert rc == 0 and "800 Gbps network (GPUDirect-TCPX, NCCL_PROFILE=gcp-tcpx)" in tcpx
    rc, slow, _ = llmft_plan(capsys, *args, "--zero_stage", 2, "--json")
    rc, fast, _ = llmft_plan(capsys, *args, "--zero_stage", 2, "--nccl_profile", "gcp-tcpx", "--json")
    slow, fast = json.loads(slow)["recommended"], json.loads(fast)["recommended"]
    assert fast["comm_s"] < slow["comm_s"] and fast["tokens_per_s"] >= slow["tokens_per_s"]


@pytest.mark.parametrize("gpu, counted", [("L4", True), ("A100-40GB", True), ("H100-80GB", True), ("T4", False)])
def test_the_plan_counts_ligers_kernels_where_llmft_train_would_run_them(
    capsys, llama_config, monkeypatch, gpu, counted
):
    """Liger's kernels keep fewer activations (4.4 GiB less for a 1.1B model on an H100). The plan counts them as
    llmft train decides (llmft.planning.hardware.choose_liger): on a bf16 GPU where liger-kernel is installed, not
    on a T4; --use_liger_kernel says it either way, and --write passes the same choice to the run."""
    from llmft.planning import run_plan

    monkeypatch.setattr(run_plan, "liger_model_types", lambda: frozenset({"llama", "mistral"}))  # installed here
    common = ("--model", llama_config, "--gpu", gpu, "--host_ram_gb", 500, "--nproc_per_node", 8, "--nnodes", 1)
    common += ("--global_batch_size", 64, "--per_device_train_batch_size", 1, "--max_length", 2048, "--zero_stage", 3)
    common += ("--gradient_checkpointing", "false")

    def activations(*flags):
        rc, out, _ = llmft_plan(capsys, *common, *flags, "--json")
        return json.loads(out)["candidates"][0]["activations_gib"]

    auto, on, off = activations(), activations("--use_liger_kernel"), activations("--use_liger_kernel", "false")
    assert on < off and auto == (on if counted else off)
    rc, out, _ = llmft_plan(capsys, *common)
    said = "Liger's RMSNorm/SwiGLU kernels, which keep fewer activations (--use_liger_kernel false: without)"
    assert (said in out) == counted
    monkeypatch.setattr(run_plan, "liger_model_types", lambda: None)  # not installed: counted only when asked
    assert activations() == off
    if gpu == "H100-80GB":  # where this setting fits
        write = llama_config.parent / "liger-write"
        rc, out, _ = llmft_plan(capsys, *common, "--use_liger_kernel", "false", "--write", write)
        assert rc == 0 and "EXTRA_ARGS=--gradient_checkpointing false" in out and "--use_liger_kernel false" in out

"""GPU decisions without a GPU: how `llmft train` must be launched, and which precision it trains in.

Both are pure functions of facts (the environment, the CUDA device count, a GPU's compute capability), so
these tests drive them with the facts of 4-GPU machines, Slurm jobs, an A100, an L4 and a T4.
"""

from __future__ import annotations

import re

import pytest

from llmft.planning.hardware import GPUS, HardwareError, choose_precision
from llmft.planning.world import launch_problem

ARGV = [
    "--model_name_or_path",
    "meta-llama/Llama-3.1-8B",
    "--dataset_name",
    "data.jsonl",
    "--output_dir",
    "runs/my run",
]
SAME_ARGS = (
    "-m llmft.train --model_name_or_path meta-llama/Llama-3.1-8B --dataset_name data.jsonl --output_dir 'runs/my run'"
)


# ------------------------------------------------------------------ launch


@pytest.mark.parametrize(
    "env, gpus, expected",
    [
        (
            {},
            4,
            f"this machine has 4 GPUs, but llmft train was started without torchrun and would train as one process: "
            f"run torchrun --nproc_per_node 4 {SAME_ARGS}",
        ),
        ({}, 1, None),
        ({}, 0, None),
        ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "RANK": "2"}, 4, None),  # under torchrun
        ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, 4, None),  # torchrun on 2 nodes
        (
            {"SLURM_JOB_ID": "7", "SLURM_NNODES": "1", "SLURM_GPUS_ON_NODE": "4"},
            4,
            f"this Slurm job has 4 GPUs on its node, but llmft train was started without torchrun and would train as one "
            f"process: run torchrun --nproc_per_node 4 {SAME_ARGS}",
        ),
        (
            {"SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "4"},
            4,
            "this Slurm job has 2 nodes x 4 processes, but llmft train was started without torchrun and would train as one "
            "process: submit slurm/run_llm.slurm, which starts one torchrun per node",
        ),
        (
            {"SLURM_JOB_ID": "7", "SLURM_NNODES": "1", "SLURM_GPUS_ON_NODE": "1"},
            1,
            None,
        ),  # Slurm gave this job one GPU
        ({"SLURM_JOB_ID": "7", "SLURM_NNODES": "1"}, 0, None),  # a CPU-only Slurm node
    ],
    ids=[
        "4-gpus",
        "1-gpu",
        "cpu",
        "torchrun",
        "torchrun-2-nodes",
        "slurm-1-node-4-gpus",
        "slurm-2-nodes",
        "slurm-1-gpu",
        "slurm-cpu",
    ],
)
def test_several_gpus_without_torchrun_stop_with_the_exact_command(env, gpus, expected):
    problem = launch_problem(env, gpus, ARGV)
    if expected is None:
        assert problem is None
    else:
        assert problem is not None and problem.startswith(expected), problem


def test_train_on_a_4_gpu_machine_stops_before_loading_anything(tiny_model, tiny_data, tmp_path, capsys, monkeypatch):
    """Through the real entry point, with the CUDA device count of a 4-GPU machine: one line, exit 2, no output dir."""
    import llmft.planning.world
    from llmft.train import cli, make_parser

    for name in ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "SLURM_JOB_ID", "SLURM_NNODES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(llmft.planning.world, "_cuda_device_count", lambda: 4)
    out = tmp_path / "out"
    argv = [
        "--model_name_or_path",
        str(tiny_model),
        "--dataset_name",
        str(tiny_data),
        "--output_dir",
        str(out),
        "--report_to",
        "none",
    ]
    assert cli(make_parser(), argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("llmft train: error: this machine has 4 GPUs"), err
    assert err[0].endswith(
        f"run torchrun --nproc_per_node 4 -m llmft.train {' '.join(argv)}   (or CUDA_VISIBLE_DEVICES=0 for one GPU)"
    )
    assert not out.exists()


# ------------------------------------------------------------------ precision


@pytest.mark.parametrize(
    "precision, bf16, fp16, gpu, expected",
    [
        ("auto", None, None, "A100-40GB", "bf16"),
        ("auto", None, None, "L4", "bf16"),
        ("auto", None, None, "T4", "fp16"),
        ("auto", None, None, None, "fp32"),
        ("auto", False, None, "A100-40GB", "fp32"),  # --bf16 false: no mixed precision (HF's meaning), not bf16 anyway
        ("auto", False, None, "T4", "fp32"),
        ("auto", None, True, "A100-40GB", "fp16"),  # --fp16 on an A100: asked for, and the A100 has it
        ("auto", False, True, "T4", "fp16"),
        ("auto", True, None, "L4", "bf16"),
        ("auto", True, False, "L4", "bf16"),
        ("auto", None, False, "T4", "fp32"),  # --fp16 false on a T4: auto would be fp16, so full precision
        ("auto", None, False, "A100-40GB", "bf16"),
        ("auto", False, False, "H100-80GB", "fp32"),
        ("fp16", False, None, "A100-40GB", "fp16"),  # consistent: not bf16
        ("bf16", True, None, "A100-40GB", "bf16"),
        ("bf16", None, None, None, "bf16"),  # bf16 on CPU runs (slowly): allowed when asked for
    ],
)
def test_precision_flags_are_mapped_onto_the_one_decision(precision, bf16, fp16, gpu, expected):
    assert choose_precision(precision, GPUS[gpu] if gpu else None, bf16=bf16, fp16=fp16) == expected


@pytest.mark.parametrize(
    "precision, bf16, fp16, gpu, message",
    [
        ("auto", True, True, "A100-40GB", "--bf16 and --fp16 contradict each other"),
        ("fp32", True, None, "A100-40GB", "--bf16 contradicts --precision fp32"),
        ("bf16", False, None, "A100-40GB", "--bf16 false contradicts --precision bf16"),
        ("fp16", None, False, "T4", "--fp16 false contradicts --precision fp16"),
        (
            "auto",
            True,
            None,
            "T4",
            "bf16 needs a GPU with compute capability 8.0 or newer; this T4 has 7.5: use --precision fp16",
        ),
        ("auto", None, True, None, "fp16 mixed precision needs a GPU and none is visible here"),
    ],
)
def test_contradicting_or_impossible_precision_flags_are_refused(precision, bf16, fp16, gpu, message):
    with pytest.raises(HardwareError, match=re.escape(message)):
        choose_precision(precision, GPUS[gpu] if gpu else None, bf16=bf16, fp16=fp16)


def _parse(argv, tmp_path):
    from llmft.train import make_parser

    return make_parser().parse_args_and_config(
        args=["--model_name_or_path", "m", "--dataset_name", "d.jsonl", "--output_dir", str(tmp_path / "o"), *argv]
    )


@pytest.mark.parametrize(
    "argv, flags",
    [
        ([], (None, None)),
        (["--bf16", "false"], (False, None)),
        (["--bf16", "true"], (True, None)),
        (["--fp16"], (None, True)),
        (["--fp16", "false", "--bf16", "true"], (True, False)),
    ],
)
def test_the_parser_records_the_precision_flags_as_given(argv, flags, tmp_path):
    _, training_args, _, llmft_args = _parse(argv, tmp_path)
    assert (llmft_args.bf16_flag, llmft_args.fp16_flag) == flags
    assert training_args.bf16 is False and training_args.fp16 is False  # llmft sets them from its decision


def test_precision_flags_from_a_yaml_config_count_as_given(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("bf16: false\n")
    _, _, _, llmft_args = _parse(["--config", str(config)], tmp_path)
    assert llmft_args.bf16_flag is False


def test_trl_bf16_default_does_not_fail_parsing_on_a_t4(tmp_path, monkeypatch):
    """On a T4, HF answers "bf16 supported?" with no on older PyTorch builds (with torch 2.13 the emulation
    probe says yes): TRL's default bf16=True then fails in TrainingArguments.__post_init__. llmft's parser
    records the flags and hands SFTConfig bf16=False, so parsing passes and the T4 trains in fp16."""
    import transformers.training_args
    from accelerate.state import PartialState
    from trl import SFTConfig, TrlParser

    from llmft.training.model_files import train_precision

    monkeypatch.setattr(transformers.training_args, "is_torch_bf16_gpu_available", lambda: False)
    argv = [
        "--output_dir",
        str(tmp_path / "o"),
        "--use_cpu",
        "false",
    ]  # use_cpu false: what llmft sets on a GPU machine
    try:
        with pytest.raises(ValueError, match="Your setup doesn't support bf16/gpu"):
            TrlParser((SFTConfig,)).parse_args_and_config(args=argv)  # the failure llmft avoids
        _, training_args, _, llmft_args = _parse(argv, tmp_path)
        assert train_precision(training_args, llmft_args, GPUS["T4"]) == "fp16"
        _, training_args, _, llmft_args = _parse([*argv, "--bf16", "true"], tmp_path)
        with pytest.raises(HardwareError, match="this T4 has 7.5"):
            train_precision(training_args, llmft_args, GPUS["T4"])
        _, training_args, _, llmft_args = _parse([*argv, "--bf16", "false"], tmp_path)
        assert train_precision(training_args, llmft_args, GPUS["A100-40GB"]) == "fp32"
    finally:
        PartialState._reset_state()  # parsing with use_cpu false set accelerate's shared state up differently


def test_inference_asks_the_same_function(monkeypatch):
    """llmft infer: auto on a T4 generates in fp16, bf16 asked on a T4 is refused, fp16 on CPU is fine for generation."""
    import torch

    import llmft.checkpoint.loader
    from llmft.checkpoint.loader import pick_dtype
    from llmft.checkpoint.zero import CheckpointError

    monkeypatch.setattr(llmft.checkpoint.loader, "local_gpu", lambda index=0: GPUS["T4"])
    assert pick_dtype("auto", "cuda:0", exporting=False) == torch.float16
    with pytest.raises(CheckpointError, match="this T4 has 7.5: use --dtype float16"):
        pick_dtype("bf16", "cuda:0", exporting=False)
    monkeypatch.setattr(llmft.checkpoint.loader, "local_gpu", lambda index=0: GPUS["L4"])
    assert pick_dtype("auto", "cuda:0", exporting=False) == torch.bfloat16
    assert pick_dtype("auto", "cpu", exporting=False) == torch.float32
    assert pick_dtype("float16", "cpu", exporting=False) == torch.float16
    assert pick_dtype("auto", "cuda:0", exporting=True) == torch.float32  # exports keep the fp32 masters


def test_plan_on_a_login_node_says_what_auto_will_pick(capsys):
    from llmft.plan import main, make_parser

    assert (
        main(
            make_parser().parse_args(["--per_device_train_batch_size", "1", "--nnodes", "1", "--nproc_per_node", "1"])
        )
        == 0
    )
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("llmft plan: precision"))
    assert line == (
        "llmft plan: precision bf16 on GPUs with compute capability 8.0+ (A100, L4, H100), "
        "fp16 on older GPUs (T4, V100), fp32 on CPU"
    )

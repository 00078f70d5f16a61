"""No flag accepted and silently ignored: every `llmft train` flag takes effect or stops the run with the reason.

The table in llmft/training/flag_policy.py names each field of ScriptArguments, SFTConfig, ModelConfig and LlmftArguments;
these tests hold the code to it (a new field from a TRL/transformers upgrade fails the first test).
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
from pathlib import Path

import pytest

from llmft.planning.methods import METHODS
from llmft.training.flag_policy import CHECKED, EVAL, PASSED, POLICY, REFUSED, USED, policy_for
from llmft.training.flags import FlagError, check_flags

REPO = Path(__file__).resolve().parents[1]


def _parse(tmp_path, *argv):
    from llmft.train import make_parser

    return make_parser().parse_args_and_config(
        args=[
            "--model_name_or_path",
            "m",
            "--dataset_name",
            "d.jsonl",
            "--output_dir",
            str(tmp_path / "o"),
            *map(str, argv),
        ]
    )


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_flag_llmft_train_accepts_has_a_decision(name):
    """For each --method: every field of ScriptArguments, the method's TRL config (SFTConfig, DPOConfig, KTOConfig,
    RewardConfig), ModelConfig and LlmftArguments has a row in its policy (POLICY and the method's own rows)."""
    from trl import ModelConfig, ScriptArguments

    from llmft.training.arguments import LlmftArguments
    from llmft.training.flags import import_class

    entry = METHODS[name]
    fields = {
        f.name
        for dt in (ScriptArguments, import_class(entry.config_class), ModelConfig, LlmftArguments)
        for f in dataclasses.fields(dt)
        if f.init
    }
    policy = policy_for(name)
    assert sorted(fields - set(policy)) == [], (
        f"new flags of --method {name}: decide in llmft/training/flag_policy.py POLICY (or the method's `flags` rows "
        "in llmft/planning/methods.py) what llmft does with them"
    )
    assert sorted(set(entry.flag_policy) - fields) == [], f"--method {name}'s rows name flags its config lacks"
    assert {kind for kind, _ in policy.values()} <= {USED, PASSED, CHECKED, REFUSED, EVAL}


def test_the_shared_policy_names_only_flags_some_method_has():
    from trl import ModelConfig, ScriptArguments

    from llmft.training.arguments import LlmftArguments
    from llmft.training.flags import import_class

    fields = {
        f.name
        for dt in (
            ScriptArguments,
            ModelConfig,
            LlmftArguments,
            *(import_class(m.config_class) for m in METHODS.values()),
        )
        for f in dataclasses.fields(dt)
        if f.init
    }
    assert sorted(set(POLICY) - fields) == [], "POLICY names flags that no longer exist"
    assert {kind for kind, _ in POLICY.values()} == {USED, PASSED, CHECKED, REFUSED, EVAL}


def test_the_table_the_launchers_check_sweeps_against_is_llmft_trains_parser():
    """llmft.launch.sweep checks a SWEEP's flags against POLICY (importable with the standard library alone): every
    long flag of llmft train's own parser is in it, but --help and the valueless --no_X of a flag X that is."""
    import sys

    from llmft.train import make_parser

    names = {
        s[2:] for a in make_parser()._actions for s in a.option_strings if s.startswith("--") and "-" not in s[2:]
    }
    extra = {n for n in names - set(POLICY) if n != "help" and not (n.startswith("no_") and n[3:] in POLICY)}
    assert extra == set() and set(POLICY) <= names
    # the launchers with the standard library alone (-S: no site-packages), as a batch host's python3 runs them
    code = f"import sys; sys.path.insert(0, {str(REPO)!r}); import llmft.launch.slurm, llmft.launch.pbs"
    subprocess.run([sys.executable, "-I", "-S", "-c", code], check=True, timeout=60)


# One value other than the default for each refused flag (set on the parsed arguments: some are not CLI-shaped).
REFUSED_VALUES = {
    "dataset_streaming": True,
    "ignore_bias_buffers": True,
    "optim_target_modules": ["attn"],
    "auto_find_batch_size": True,
    "save_only_model": True,
    "save_on_each_node": True,
    "enable_jit_checkpoint": True,
    "ddp_find_unused_parameters": True,
    "ddp_bucket_cap_mb": 25,
    "ddp_broadcast_buffers": False,
    "ddp_static_graph": True,
    "fsdp": "full_shard",
    "fsdp_config": {"min_num_params": 1},
    "parallelism_config": object(),
    "do_predict": True,
}


def test_each_refused_flag_stops_the_run_naming_itself(tmp_path):
    refused = sorted(name for name, (kind, _) in POLICY.items() if kind == REFUSED)
    assert refused == sorted(REFUSED_VALUES), "give every refused flag a value to test with"
    parsed = _parse(tmp_path)
    check_flags(*parsed[:3], cuda=False)  # the defaults pass
    for name, value in REFUSED_VALUES.items():
        args = [dataclasses.replace(a) if dataclasses.is_dataclass(a) else a for a in parsed[:3]]
        owner = next(a for a in args if name in {f.name for f in dataclasses.fields(a)})
        object.__setattr__(owner, name, value)
        with pytest.raises(FlagError, match=f"^--{name} .* is not supported: {re.escape(POLICY[name][1][:30])}"):
            check_flags(*args, cuda=False)


@pytest.mark.parametrize(
    "argv, cuda, message",
    [
        (["--lora_r", "8"], False, "--lora_r is a LoRA setting but --use_peft is not given"),
        (["--lora_target_modules", "q_proj", "v_proj"], False, "--lora_target_modules is a LoRA setting"),
        (["--use_dora"], False, "--use_dora is a LoRA setting"),
        (["--use_cpu", "false"], False, "--use_cpu false, but no CUDA GPU is visible here"),
        ([], True, "--use_cpu true, but CUDA GPUs are visible"),  # parsed on this CPU machine, checked as on a GPU one
        (["--learning_rate=-1e-4"], False, "--learning_rate -0.0001 is negative"),
        (["--max_length", "0"], False, "--max_length 0 must be a positive number of tokens"),
        (["--num_train_epochs", "0"], False, "--num_train_epochs 0 trains nothing"),
    ],
)
def test_checked_flags_refuse_the_values_llmft_cannot_honour(argv, cuda, message, tmp_path):
    script_args, training_args, model_args, _ = _parse(tmp_path, *argv)
    with pytest.raises(FlagError, match=re.escape(message)):
        check_flags(script_args, training_args, model_args, cuda=cuda)


def test_lora_flags_with_use_peft_reach_peft(tmp_path):
    from trl import get_peft_config

    script_args, training_args, model_args, _ = _parse(
        tmp_path,
        "--use_peft",
        "--lora_r",
        8,
        "--lora_alpha",
        4,
        "--lora_dropout",
        0.2,
        "--use_rslora",
        "--lora_target_modules",
        "q_proj",
        "v_proj",
    )
    check_flags(script_args, training_args, model_args, cuda=False)
    config = get_peft_config(model_args)
    assert (config.r, config.lora_alpha, config.lora_dropout, config.use_rslora, sorted(config.target_modules)) == (
        8,
        4,
        0.2,
        True,
        ["q_proj", "v_proj"],
    )


def test_passed_flags_reach_the_trainer_unchanged_and_llmft_sets_only_its_own(tmp_path):
    """trainer_arguments() builds what SFTTrainer runs with; every 'passed' field must come out as it went in."""
    from llmft.planning.run_plan import make_plan
    from llmft.planning.world import World
    from llmft.training.model_files import trainer_arguments

    _, training_args, _, _ = _parse(
        tmp_path,
        "--lr_scheduler_type",
        "cosine",
        "--warmup_steps",
        3,
        "--logging_steps",
        7,
        "--save_steps",
        11,
        "--gradient_checkpointing",
        "false",
        "--packing",
        "--seed",
        5,
        "--dataloader_num_workers",
        2,
        "--max_steps",
        9,
        "--neftune_noise_alpha",
        5,
        "--report_to",
        "none",
        "--ddp_timeout",
        99,
        "--dataloader_pin_memory",
        "false",
    )
    plan = make_plan(micro_batch=2, global_batch=8, world=World(1, 2), output_dir=training_args.output_dir)
    ds = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 2},
    }
    out = trainer_arguments(
        training_args, plan=plan, precision="fp32", resolved_ds_config=ds, cuda=True, max_length=256, resume=None
    )
    passed = [name for name, (kind, _) in POLICY.items() if kind == PASSED and hasattr(training_args, name)]
    changed = [name for name in passed if getattr(out, name) != getattr(training_args, name)]
    assert changed == []
    assert (out.per_device_train_batch_size, out.gradient_accumulation_steps, out.max_length) == (2, 2, 256)
    assert out.dataloader_pin_memory is False  # the user's false is kept on a GPU machine
    assert (
        out.include_num_input_tokens_seen == "no"
    )  # the Trainer's default: llmft.training.metrics counts tokens itself
    kept = dataclasses.replace(training_args, include_num_input_tokens_seen="non_padding")
    assert (
        trainer_arguments(
            kept, plan=plan, precision="fp32", resolved_ds_config=ds, cuda=False, max_length=None, resume=None
        ).include_num_input_tokens_seen
        == "non_padding"
    )


def test_model_revision_reaches_config_tokenizer_and_weights(tmp_path, monkeypatch):
    import transformers

    from llmft.training.model_files import load_model_files, model_init_kwargs

    calls = []

    def fake(kind):
        return classmethod(lambda cls, name, **kw: calls.append((kind, name, kw.get("revision"))) or object())

    from huggingface_hub import constants

    import llmft.training.hub

    snapshot = str(tmp_path / "snapshot")  # what the once-per-job download (llmft.training.hub) returns
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(
        llmft.training.hub,
        "_download_snapshot",
        lambda name, revision: calls.append(("download", name, revision)) or snapshot,
    )
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", fake("config"))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake("tokenizer"))
    _, training_args, model_args, _ = _parse(tmp_path, "--model_revision", "v1.2")
    model_args.model_name_or_path = "org/model"
    assert load_model_files(model_args, training_args)[2] == snapshot
    assert calls == [("download", "org/model", "v1.2"), ("config", snapshot, "v1.2"), ("tokenizer", snapshot, "v1.2")]
    assert model_init_kwargs(model_args, training_args, None)["revision"] == "v1.2"


# ------------------------------------------------------------------ --optim


def _template(name="zero2.json"):
    from llmft.planning.ds_config import load_config, templates_dir

    return load_config(templates_dir() / name)


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused", "adamw_apex_fused"])
def test_adamw_variants_run_as_deepspeeds_adamw(optim):
    from llmft.planning.ds_config import choose_optimizer

    for name in ("zero2.json", "zero3_offload.json"):
        assert choose_optimizer(_template(name), optim)["optimizer"]["type"] == "AdamW"


@pytest.mark.parametrize("optim", ["sgd", "adagrad", "rmsprop", "adafactor"])
def test_plain_torch_optimizers_run_as_the_trainers_optimizer(optim):
    from llmft.planning.ds_config import DSConfigError, choose_optimizer

    assert "optimizer" not in choose_optimizer(_template(), optim)  # HF then builds it and hands it to DeepSpeed
    with pytest.raises(
        DSConfigError,
        match=f"--optim {optim} runs as the Trainer's optimizer, and DeepSpeed's CPU offload needs its own",
    ):
        choose_optimizer(_template("zero2_offload.json"), optim)


@pytest.mark.parametrize(
    "config, optim, kwargs, message",
    [
        ("zero2.json", "adamw_bnb_8bit", {}, "--optim adamw_bnb_8bit is not supported with DeepSpeed in llmft"),
        ("zero2.json", "paged_adamw_8bit", {}, "--optim paged_adamw_8bit is not supported"),
        ("zero2.json", "galore_adamw", {}, "--optim galore_adamw is not supported"),
        (
            "zero2.json",
            "adamw_torch",
            {"optim_args": "foo=1"},
            "--optim_args 'foo=1' is not used by DeepSpeed's AdamW",
        ),
        ("zero2.json", "adafactor", {"optim_args": "foo=1"}, "--optim_args is not used by adafactor"),
        (
            {"optimizer": {"type": "Lamb", "params": {}}},
            "adamw_torch",
            {"user_config": True},
            "--optim adamw_torch contradicts the optimizer block (Lamb) of your DeepSpeed config",
        ),
        (
            {"optimizer": {"type": "AdamW", "params": {}}},
            "sgd",
            {"user_config": True},
            "--optim sgd contradicts the optimizer block (AdamW) of your DeepSpeed config",
        ),
    ],
)
def test_optimizers_llmft_cannot_run_are_refused(config, optim, kwargs, message):
    from llmft.planning.ds_config import DSConfigError, choose_optimizer

    config = _template(config) if isinstance(config, str) else config
    with pytest.raises(DSConfigError, match=re.escape(message)):
        choose_optimizer(config, optim, **kwargs)


def test_a_users_own_optimizer_block_decides_when_optim_is_left_alone():
    from llmft.planning.ds_config import choose_optimizer

    lamb = {"optimizer": {"type": "Lamb", "params": {"lr": "auto"}}, "zero_optimization": {"stage": 2}}
    assert choose_optimizer(lamb, "adamw_torch_fused", user_config=True) == lamb
    no_block = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert (
        choose_optimizer(no_block, "adamw_torch", user_config=True)["optimizer"]["type"] == "AdamW"
    )  # offload needs it
    assert "optimizer" not in choose_optimizer({"zero_optimization": {"stage": 2}}, "adamw_torch", user_config=True)


def test_sgd_really_trains_as_the_trainers_optimizer_under_zero2(tiny_model, tiny_data, tmp_path):
    """--optim sgd --optim_args momentum=0.9: the checkpoint's optimizer state is SGD's (momentum buffers, no Adam moments)."""
    import torch
    from conftest import PYTHON, run

    out = tmp_path / "sgd"
    run(
        [
            PYTHON,
            "-m",
            "llmft.train",
            "--model_name_or_path",
            str(tiny_model),
            "--dataset_name",
            str(tiny_data),
            "--output_dir",
            str(out),
            "--report_to",
            "none",
            "--zero_stage",
            "2",
            "--max_steps",
            "2",
            "--save_steps",
            "2",
            "--per_device_train_batch_size",
            "2",
            "--optim",
            "sgd",
            "--optim_args",
            "momentum=0.9",
            "--learning_rate",
            "0.01",
        ],
        check=True,
        timeout=300,
    )
    assert "optimizer" not in json.loads((out / "ds_config.json").read_text())
    shard = torch.load(
        out / "checkpoint-2" / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False
    )
    state = shard["optimizer_state_dict"]["base_optimizer_state"]
    inner = state["state"] if "state" in state else state[0]["state"]
    names = {k for per_param in inner.values() for k in per_param}
    assert "momentum_buffer" in names and "exp_avg" not in names
    assert state["param_groups"][0]["momentum"] == 0.9 if "param_groups" in state else True


# ------------------------------------------------------------------ QLoRA (--load_in_4bit / --load_in_8bit)


def _quant(gpu="A100-80GB", zero_stage=2, offload=False, use_peft=True, precision="bf16", bnb="0.50.2", **request):
    from llmft.planning.hardware import GPUS
    from llmft.planning.qlora import QuantRequest, choose_quantization

    return choose_quantization(
        QuantRequest(**request),
        gpu=GPUS[gpu] if gpu else None,
        zero_stage=zero_stage,
        offload=offload,
        use_peft=use_peft,
        precision=precision,
        bitsandbytes=bnb,
    )


def test_qlora_4bit_on_an_a100_under_zero3_packs_weights_in_bf16():
    assert _quant(zero_stage=3, load_in_4bit=True) == {
        "load_in_4bit": True,
        "bnb_4bit_compute_dtype": "bfloat16",
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": False,
        "bnb_4bit_quant_storage": "bfloat16",
        "model_dtype": "bfloat16",
    }


def test_qlora_on_a_t4_under_zero2_computes_in_fp16_and_8bit_works_there():
    q = _quant(gpu="T4", precision="fp16", load_in_4bit=True, nested=True, quant_type="fp4")
    assert (
        q["bnb_4bit_compute_dtype"],
        q["bnb_4bit_quant_type"],
        q["bnb_4bit_use_double_quant"],
        "bnb_4bit_quant_storage" in q,
    ) == ("float16", "fp4", True, False)
    assert _quant(gpu="L4", zero_stage=1, load_in_8bit=True) == {"load_in_8bit": True, "model_dtype": "bfloat16"}
    assert _quant(gpu="L4") is None  # no quantization asked


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"gpu": None, "precision": "fp32", "load_in_4bit": True}, "--load_in_4bit (QLoRA) needs a CUDA GPU"),
        (
            {"gpu": "V100-16GB", "precision": "fp16", "load_in_4bit": True},
            "needs compute capability 7.5+ (T4 or newer) for bitsandbytes; this V100-16GB has 7.0",
        ),
        ({"zero_stage": 3, "load_in_8bit": True}, "--load_in_8bit cannot run under ZeRO-3"),
        (
            {"zero_stage": 3, "offload": True, "load_in_4bit": True},
            "--load_in_4bit with --offload saves no GPU memory",
        ),
        ({"use_peft": False, "load_in_4bit": True}, "add --use_peft"),
        ({"bnb": None, "load_in_4bit": True}, "--load_in_4bit needs bitsandbytes: pip install"),
        ({"bnb": "0.42.0", "load_in_4bit": True}, "bitsandbytes 0.42.0 is too old"),
        ({"load_in_4bit": True, "load_in_8bit": True}, "--load_in_4bit and --load_in_8bit contradict each other"),
        (
            {"zero_stage": 3, "load_in_4bit": True, "quant_storage": "uint8"},
            "--bnb_4bit_quant_storage uint8 under ZeRO-3 must match",
        ),
        ({"load_in_4bit": True, "dtype": "float16"}, "--dtype float16 contradicts the bf16 this run trains in"),
        ({"nested": True}, "set without --load_in_4bit"),
        ({"load_in_8bit": True, "quant_type": "fp4"}, "apply to --load_in_4bit, not --load_in_8bit"),
    ],
)
def test_qlora_is_refused_where_it_cannot_run(kwargs, message):
    from llmft.planning.qlora import QuantizationError

    with pytest.raises(QuantizationError, match=re.escape(message)):
        _quant(**kwargs)


def test_load_in_4bit_on_this_cpu_machine_is_one_line_before_anything_loads(tiny_model, tiny_data, tmp_path, capsys):
    from llmft.train import cli, make_parser

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
        "--use_peft",
        "--load_in_4bit",
    ]
    assert cli(make_parser(), argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "llmft train: error: --load_in_4bit (QLoRA) needs a CUDA GPU for bitsandbytes' kernels and none is "
        "visible here: drop it to train LoRA in full precision, or run on a GPU node"
    ]
    assert not out.exists()


def test_an_unknown_flag_names_the_closest_known_one():
    from llmft.train import make_parser
    from llmft.training.flags import unknown_flag_message

    parser = make_parser()
    known = [s for a in parser._actions for s in a.option_strings]
    assert (
        unknown_flag_message(["--golbal_batch_size", "8"], known)
        == "unknown flag --golbal_batch_size: did you mean --global_batch_size?"
    )
    assert (
        unknown_flag_message(["--lerning_rate=1e-4"], known)
        == "unknown flag --lerning_rate: did you mean --learning_rate?"
    )
    assert (
        unknown_flag_message(["--zzzz", "1", "--qqqq"], known)
        == "unknown flag --zzzz (and 1 more unknown): llmft train --help lists every flag"
    )
    with pytest.raises(ValueError, match="unknown flag --num_epochs: did you mean --num_train_epochs"):
        parser.parse_args_and_config(args=["--num_epochs", "3"])


@pytest.mark.parametrize(
    "argv, message",
    [
        # argparse would have run these as --max_steps 4 and --learning_rate 1e-4: a prefix is not a flag
        (
            ["--max_step", "4"],
            "unknown flag --max_step: did you mean --max_steps? (flags match only by their full name)",
        ),
        (["--learning=1e-4"], "unknown flag --learning: did you mean --learning_rate? (flags match only by"),
        (
            ["--max", "4"],
            "unknown flag --max: did you mean --max_steps, --max_length or --max_grad_norm? (flags match",
        ),
        (
            ["--nproc", "2"],
            "unknown flag --nproc: did you mean --nproc_per_node? (flags match only by their full name)",
        ),
    ],
)
def test_flags_match_only_by_their_full_name(argv, message, tmp_path):
    with pytest.raises(ValueError, match=re.escape(message)):
        _parse(tmp_path, *argv)


def test_training_without_output_dir_is_refused_with_the_fix(tiny_model, tiny_data, tmp_path, monkeypatch, capsys):
    """TRL would write to ./trainer_output, said nowhere: llmft train refuses, naming the flag, and writes nothing."""
    from llmft.train import cli, make_parser

    monkeypatch.chdir(tmp_path)
    argv = ["--model_name_or_path", str(tiny_model), "--dataset_name", str(tiny_data), "--report_to", "none"]
    assert cli(make_parser(), argv) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "llmft train: error: --output_dir is required: checkpoints, the resolved DeepSpeed config and the run record "
        "go there, and a rerun with the same directory resumes; add --output_dir runs/NAME"
    ]
    assert list(tmp_path.iterdir()) == []
    # given (or from a --config file), it passes
    config = tmp_path / "run.yaml"
    config.write_text(f"output_dir: {tmp_path / 'out'}\n")
    script_args, training_args, model_args, _ = make_parser().parse_args_and_config(
        args=[*argv, "--config", str(config)]
    )
    check_flags(script_args, training_args, model_args, cuda=False)
    assert training_args.output_dir == str(tmp_path / "out")


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["plan", "--global_batch", "8"],
            "llmft plan: error: unknown flag --global_batch: did you mean --global_batch_size?",
        ),
        (["plan", "--nnode", "1"], "llmft plan: error: unknown flag --nnode: did you mean --nnodes?"),
        (
            ["tiny", "--out", "x", "--example", "5"],
            "llmft tiny: error: unknown flag --example: did you mean --examples?",
        ),
        (["report", "x", "--out", "y"], "llmft report: error: unknown flag --out: did you mean --output?"),
        (["--version"], "llmft: error: unknown flag --version: llmft --help lists every flag"),
    ],
)
def test_every_command_takes_flags_by_full_name_only(argv, message, capsys):
    """The argparse commands (llmft.command.CommandParser): a prefix is an unknown flag, exit 2, the flag it began."""
    from llmft.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]
    assert errors == [message + (" (flags match only by their full name)" if "did you mean" in message else "")]


def test_a_subcommands_flags_are_by_full_name_too(capsys):
    """python -m llmft.tracking slurm-env (run by slurm/run_llm.slurm): its subcommand's parser is a CommandParser."""
    from llmft import tracking

    with pytest.raises(SystemExit):
        tracking.make_parser().parse_args(["slurm-env", "--output_dir", "x", "--time", "3"])
    assert (
        "llmft tracking: error: unknown flag --time: did you mean --timeout? (flags match only by their full name)"
        in capsys.readouterr().err
    )

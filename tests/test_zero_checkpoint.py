"""The shard reader against DeepSpeed itself, on checkpoints a plain `deepspeed.initialize(...).save_checkpoint(...)`
script writes with 2 real processes (torchrun, gloo on CPU): ZeRO stages 0-3, fp32 and bf16 mixed precision.

Run as a script (under torchrun) this module is that writer:
    torchrun --nproc_per_node 2 tests/test_zero_checkpoint.py OUT MODEL_DIR 0 1 2 3 0bf16 2bf16 3bf16
and `python tests/test_zero_checkpoint.py --fixture DIR` writes the tiny model and every checkpoint these tests read
into DIR once, for tests/other_pythons.sh to share between interpreters (SHARED_FIXTURE).
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import pytest

# Each spec is a ZeRO stage, optionally with bf16 mixed precision; "2" is saved twice (steps 2 and 3)
# so that a glob over its tag directories has something to choose from.
SPECS = ["0", "1", "2", "3", "0bf16", "2bf16", "3bf16"]
SPECS_3_RANKS = ["1", "3"]  # written again by 3 processes, under ranks3/
MEMORY_SPEC = "2wide"  # a wider model for the peak-memory test (not in SPECS: its config differs)


def write_checkpoints(out: Path, model_dir: Path, specs: list[str]) -> None:
    """Train the tiny model a few steps per spec with a bare DeepSpeed engine and save_checkpoint()."""
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM

    from llmft.training.deepspeed_env import skip_deepspeed_shm_op

    skip_deepspeed_shm_op()  # as llmft train does: no minute-long CPU shared-memory op build; checkpoints are unchanged
    for spec in specs:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if spec.endswith("wide"):  # ~50 MB of fp32 weights: large enough to measure memory against
            from transformers import GPT2Config

            model = AutoModelForCausalLM.from_config(
                GPT2Config(**{**model.config.to_dict(), "n_embd": 512, "n_layer": 4, "n_head": 8})
            )
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
            "zero_optimization": {"stage": int(spec[0])},
            "bf16": {"enabled": "bf16" in spec},
        }
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        torch.manual_seed(1 + engine.global_rank)
        for step in range(1, 4):
            ids = torch.randint(0, model.config.vocab_size, (2, 16))
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
            if step == 3 or (spec == "2" and step == 2):
                engine.save_checkpoint(str(out / spec))
        if spec.startswith("0") and engine.global_rank == 0:
            # DeepSpeed's zero_to_fp32 does not read stage 0: the reference is the engine's own fp32
            # weights (with bf16, the optimizer's fp32 master copies of the bf16 module weights)
            opt, masters = engine.optimizer, {}
            for g16, g32 in zip(getattr(opt, "fp16_groups", []), getattr(opt, "fp32_groups", [])):
                masters.update({p.data_ptr(): m for p, m in zip(g16, g32)})
            assert ("bf16" in spec) == bool(masters)
            ref = {k: masters.get(v.data_ptr(), v).detach().clone() for k, v in engine.module.state_dict().items()}
            torch.save(ref, out / spec / "engine_weights.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def free_port() -> int:
    """A free TCP port for torchrun's rendezvous (other test runs may share this machine)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_fixture(out: Path, model_dir: Path) -> Path:
    """Every spec in SPECS (and MEMORY_SPEC) written by one torchrun of 2 processes under OUT/<spec>/, and
    SPECS_3_RANKS by 3 processes under OUT/ranks3/ (partitions and paddings that do not divide evenly)."""
    from conftest import PYTHON, run

    for nproc, target, specs in ((2, out, [*SPECS, MEMORY_SPEC]), (3, out / "ranks3", SPECS_3_RANKS)):
        torchrun = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
        args = ["--master_port", str(free_port()), __file__, str(target), str(model_dir), *specs]
        run([*torchrun, *args], timeout=900, check=True, PYTHONFAULTHANDLER="1")  # Python stacks if a rank aborts
    return out


# tests/other_pythons.sh writes the model and its checkpoints once, with .venv's Python (the one that trains), and
# names the directory here: each other interpreter then reads checkpoints another Python wrote, as users do.
SHARED_FIXTURE = "LLMFT_TEST_DS_CHECKPOINTS"


def shared_fixture() -> Path | None:
    """The directory SHARED_FIXTURE names (model/ and ds_ckpt/ in it), None without it; a named one that is not
    there fails the tests rather than being quietly rewritten."""
    import os

    named = os.environ.get(SHARED_FIXTURE)
    if not named:
        return None
    if not (Path(named) / "model" / "config.json").is_file() or not (Path(named) / "ds_ckpt" / "ranks3").is_dir():
        pytest.fail(f"{SHARED_FIXTURE}={named} holds no written fixture (model/, ds_ckpt/ranks3/)", pytrace=False)
    return Path(named)


@pytest.fixture(scope="session")
def tiny_model(tiny_model) -> Path:
    """conftest's tiny model, or the one the shared fixture's checkpoints were trained from."""
    shared = shared_fixture()
    return shared / "model" if shared else tiny_model


@pytest.fixture(scope="session")
def ds_checkpoints(tmp_path_factory, tiny_model) -> Path:
    """The DeepSpeed checkpoints of every spec (write_fixture), written here unless shared."""
    shared = shared_fixture()
    return shared / "ds_ckpt" if shared else write_fixture(tmp_path_factory.mktemp("ds_ckpt"), tiny_model)


def _deepspeed_reference(ckpt_dir: Path) -> dict:
    """What DeepSpeed's own consolidation reconstructs (stage 0: the engine's weights at save time)."""
    import torch

    if (ckpt_dir / "engine_weights.pt").is_file():
        return torch.load(ckpt_dir / "engine_weights.pt", weights_only=True)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()):
        return get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir))


def _tag(ds_checkpoints: Path, spec: str) -> Path:
    return ds_checkpoints / spec / "global_step3"


@pytest.mark.parametrize("spec", SPECS + [f"ranks3/{s}" for s in SPECS_3_RANKS])
def test_weights_equal_deepspeed_bit_for_bit(ds_checkpoints, spec):
    import torch

    from llmft.checkpoint.zero import load_fp32_state_dict, open_checkpoint

    world = 3 if spec.startswith("ranks3/") else 2
    stage = int(spec.split("/")[-1][0])
    ckpt = open_checkpoint(_tag(ds_checkpoints, spec))
    assert (ckpt.stage, ckpt.world_size, ckpt.step) == (stage, world, 3)
    ours = load_fp32_state_dict(_tag(ds_checkpoints, spec))
    ref = _deepspeed_reference(ds_checkpoints / spec)
    assert set(ours) == set(ref)
    for name, tensor in ref.items():
        assert ours[name].dtype == tensor.dtype == torch.float32, name
        assert torch.equal(ours[name], tensor), f"{spec}: {name} differs from DeepSpeed's reconstruction"
    # GPT-2 ties lm_head to the token embedding: one tensor, as DeepSpeed returns it
    assert ours["lm_head.weight"] is ours["transformer.wte.weight"]


@pytest.mark.parametrize("spec", ["0", "2", "3bf16"])
def test_logits_match_deepspeed_reconstruction(ds_checkpoints, tiny_model, spec):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmft.checkpoint.loader import load

    loaded = load(_tag(ds_checkpoints, spec), model_name=str(tiny_model))
    reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model))
    reference.load_state_dict(_deepspeed_reference(ds_checkpoints / spec))
    reference.eval()
    ids = torch.arange(3, 40).reshape(1, -1)
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, reference(ids).logits)
    assert loaded.model.lm_head.weight.data_ptr() == loaded.model.transformer.wte.weight.data_ptr()


def test_reads_into_bf16_destination(ds_checkpoints):
    """The reader casts while copying, so a bf16 model never needs an fp32 copy of itself."""
    import torch

    from llmft.checkpoint.zero import open_checkpoint

    ckpt = open_checkpoint(_tag(ds_checkpoints, "3"))
    dest = {n: torch.empty(s, dtype=torch.bfloat16) for n, s in ckpt.shapes.items() if n not in ckpt.shared}
    ckpt.read_into(dest)
    ref = _deepspeed_reference(ds_checkpoints / "3")
    for name, t in dest.items():
        assert torch.equal(t, ref[name].to(torch.bfloat16)), name


def test_peak_memory_is_about_the_model_not_the_optimizer(ds_checkpoints):
    """Loading never materialises the optimizer moments or a second copy: the peak RSS added by loading
    stays near the fp32 weights' size (a ZeRO-2 checkpoint of 2 ranks holds 4x that in moments and
    partitions, plus a full fp32 module copy)."""
    import json

    from conftest import PYTHON, run

    code = (
        "import json, resource, sys, torch\n"
        "from llmft.checkpoint.zero import load_fp32_state_dict\n"
        "load_fp32_state_dict(sys.argv[1])  # warm-up: imports and allocator\n"
        "rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024\n"
        "base = rss()\n"
        "sd = load_fp32_state_dict(sys.argv[2])\n"
        "size = sum(t.numel() * 4 for t in {id(t): t for t in sd.values()}.values()) / 2**20\n"
        "print(json.dumps({'delta': rss() - base, 'size': size}))\n"
    )
    wide = ds_checkpoints / MEMORY_SPEC / "global_step3"
    ckpt_mb = sum(f.stat().st_size for f in wide.iterdir()) / 2**20
    proc = run([PYTHON, "-c", code, str(_tag(ds_checkpoints, "2")), str(wide)], timeout=180, check=True)
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    assert m["size"] > 40 and ckpt_mb > 4 * m["size"]
    assert m["delta"] < 1.25 * m["size"], m


# --------------------------------------------------------------------------------------------------
# The plain DeepSpeed layout through the CLI: no config beside the shards, so --model_name is needed


def infer_cli(*args: str):
    from conftest import PYTHON, run

    return run([PYTHON, "-m", "llmft.infer", *map(str, args)], timeout=180)


def cli_error(*argv) -> str:
    """Run `llmft infer` in-process; it must return 2 after printing one error line to stderr."""
    from llmft.infer import main, make_parser

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(make_parser().parse_args([str(a) for a in argv])) == 2
    errors = [line for line in err.getvalue().splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("llmft infer: error: "), err.getvalue()
    return errors[0]


def test_plain_checkpoint_generates_with_model_name_and_glob_picks_highest_step(ds_checkpoints, tiny_model, capsys):
    import json

    from llmft.infer import main, make_parser

    tags = sorted(str(p) for p in (ds_checkpoints / "2").glob("global_step*"))
    assert [Path(t).name for t in tags] == ["global_step2", "global_step3"]
    main(
        make_parser().parse_args(
            [
                *tags,
                "--model_name",
                str(tiny_model),
                "--prompt",
                "What is 2 plus 3?",
                "--max_new_tokens",
                "6",
                "--json",
            ]
        )
    )
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["checkpoint"].endswith("global_step3") and out["step"] == 3 and out["zero_stage"] == 2
    assert "using the highest step" in captured.err and "global_step3" in captured.err
    assert out["generations"][0]["new_tokens"] == 6


def test_no_deepspeed_engine_and_no_process_group(ds_checkpoints, tiny_model):
    """Inference reads the shards itself: DeepSpeed is never imported and no process group starts."""
    from conftest import PYTHON, run

    code = (
        "import sys, torch, llmft.infer as i; "
        f"i.main(i.make_parser().parse_args([{str(_tag(ds_checkpoints, '3'))!r}, '--model_name', {str(tiny_model)!r}, "
        "'--prompt', 'hi', '--max_new_tokens', '2', '--json'])); "
        "print('deepspeed' in sys.modules, torch.distributed.is_initialized(), file=sys.stderr)"
    )
    proc = run([PYTHON, "-c", code], timeout=180, check=True)
    assert proc.stderr.strip().splitlines()[-1] == "False False"


def _corrupt_copy(ds_checkpoints: Path, spec: str, name: str, how) -> Path:
    import shutil

    work = ds_checkpoints / f"bad_{name}"
    if not work.exists():
        shutil.copytree(ds_checkpoints / spec, work)
        how(work / "global_step3")
    return work / "global_step3"


def _truncate(tag: Path):
    f = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _garbage(tag: Path):
    f = tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    f.write_bytes(b"not a checkpoint" * 1000)


def _drop_rank1_optim(tag: Path):
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()


def _drop_rank1_model_states(tag: Path):
    (tag / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()


def _code_bearing(tag: Path):
    """An optimizer shard that pickles an arbitrary Python object next to the tensors."""
    import argparse

    import torch

    f = tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    sd = torch.load(f, weights_only=False)
    sd["extra"] = argparse.Namespace(note="pickled object")
    torch.save(sd, f)


@pytest.fixture(scope="session")
def other_model(tmp_path_factory) -> Path:
    """A tiny model with a different width: the wrong --model_name for the checkpoints above."""
    from llmft.data.synthetic import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("other") / "model", n_embd=32)


BAD_INPUTS = {
    "does_not_exist": (lambda d: d / "nope" / "global_step3", "does not exist"),
    "glob_matched_nothing": (lambda d: d / "nope" / "global_step*", "no checkpoint matched"),
    "no_shards": (lambda d: (d / "empty").mkdir(exist_ok=True) or d / "empty", "holds no DeepSpeed checkpoint"),
    "missing_rank_optim": (
        lambda d: _corrupt_copy(d, "2", "missing", _drop_rank1_optim),
        "missing shard for rank 1 of 2",
    ),
    "missing_rank_model_states": (
        lambda d: _corrupt_copy(d, "3", "missing3", _drop_rank1_model_states),
        "missing shard for rank 1 of 2",
    ),
    "truncated_shard": (lambda d: _corrupt_copy(d, "2", "truncated", _truncate), "is truncated or corrupt"),
    "garbage_shard": (lambda d: _corrupt_copy(d, "3", "garbage", _garbage), "is truncated or corrupt"),
    "code_bearing_shard": (lambda d: _corrupt_copy(d, "2", "code", _code_bearing), "--trust_checkpoint"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_clear_line(ds_checkpoints, tiny_model, case):
    path = BAD_INPUTS[case][0](ds_checkpoints)
    msg = cli_error(path, "--model_name", tiny_model, "--prompt", "hi", "--max_new_tokens", "2")
    assert BAD_INPUTS[case][1] in msg
    if case.startswith("missing_rank"):
        assert "zero_pp_rank_1_mp_rank_00_" in msg  # names the file to copy over
    if case not in ("glob_matched_nothing", "no_shards"):
        assert str(path).split("/")[-2] in msg  # names the checkpoint


@pytest.mark.parametrize("case", ["glob_matched_nothing", "missing_rank_optim"])
def test_bad_input_exits_nonzero_without_traceback(ds_checkpoints, tiny_model, case):
    """The same errors from the real command line: exit status 2, one line on stderr."""
    path = BAD_INPUTS[case][0](ds_checkpoints)
    proc = infer_cli(path, "--model_name", tiny_model, "--prompt", "hi", "--max_new_tokens", "2")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("llmft infer: error:")]
    assert len(errors) == 1 and BAD_INPUTS[case][1] in errors[0], proc.stderr


def test_wrong_model_name_and_missing_model_name(ds_checkpoints, other_model):
    tag = ds_checkpoints / "2" / "global_step3"
    msg = cli_error(tag, "--model_name", other_model, "--prompt", "hi")
    assert "has shape (481, 64) but" in msg and "expects (481, 32)" in msg and "--model_name" in msg
    msg = cli_error(tag, "--prompt", "hi")
    assert "no config.json beside" in msg and "pass --model_name" in msg


def test_trust_checkpoint_loads_a_code_bearing_shard(ds_checkpoints):
    import torch

    from llmft.checkpoint.zero import load_fp32_state_dict

    tag = _corrupt_copy(ds_checkpoints, "2", "code", _code_bearing)
    trusted = load_fp32_state_dict(tag, trust=True)
    clean = load_fp32_state_dict(ds_checkpoints / "2" / "global_step3")
    assert all(torch.equal(trusted[k], clean[k]) for k in clean)


if __name__ == "__main__":
    if sys.argv[1] == "--fixture":  # python tests/test_zero_checkpoint.py --fixture DIR: the shared fixture
        from llmft.data.synthetic import make_model_dir

        write_fixture(Path(sys.argv[2]) / "ds_ckpt", make_model_dir(Path(sys.argv[2]) / "model"))
    else:  # under torchrun: the writer
        from llmft.command import exit_process

        write_checkpoints(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])
        # as llmft.train's ranks end: this writer's 3-rank run aborted in CI at interpreter finalization (SIGABRT,
        # "terminate called without an active exception", under Python 3.12.1 and again under 3.11.2), with the gloo
        # threads of DeepSpeed's groups still running after destroy_process_group()
        exit_process(0)

"""Waits and noise: a line before DeepSpeed compiles an op, op caches per environment, no warning llmft's own settings cause."""

from __future__ import annotations

import logging
from pathlib import Path

from llmft.training import upstream_noise
from tests.conftest import run
from tests.test_train import train_cmd


def test_the_op_cache_is_keyed_by_environment_torch_and_deepspeed_unless_the_user_set_it(tmp_path):
    root = tmp_path / "torch_extensions"
    a = upstream_noise.keyed_extensions_dir({}, "/envs/a", "2.13.0+cpu", "0.19.8", root)
    assert a.parent == root and a.name.startswith("llmft-torch2.13.0-ds0.19.8-")
    assert a == upstream_noise.keyed_extensions_dir({}, "/envs/a", "2.13.0+cpu", "0.19.8", root)
    others = {
        upstream_noise.keyed_extensions_dir({}, "/envs/b", "2.13.0+cpu", "0.19.8", root),
        upstream_noise.keyed_extensions_dir({}, "/envs/a", "2.12.0", "0.19.8", root),
        upstream_noise.keyed_extensions_dir({}, "/envs/a", "2.13.0+cpu", "0.18.0", root),
    }
    assert a not in others and len(others) == 3
    assert (
        upstream_noise.keyed_extensions_dir({"TORCH_EXTENSIONS_DIR": "/mine"}, "/envs/a", "2.13.0", "0.19.8", root)
        is None
    )
    # the Slurm script's node-local root: still one directory per environment under it
    node = {"LLMFT_EXTENSIONS_ROOT": "/tmp/llmft-me/torch_extensions"}
    a_node = upstream_noise.keyed_extensions_dir(node, "/envs/a", "2.13.0+cpu", "0.19.8", root)
    assert a_node.parent == Path("/tmp/llmft-me/torch_extensions") and a_node.name == a.name
    assert a_node != upstream_noise.keyed_extensions_dir(node, "/envs/b", "2.13.0+cpu", "0.19.8", root)


def test_a_line_is_said_before_deepspeed_compiles_an_op_and_not_when_it_is_cached(tmp_path, monkeypatch):
    from deepspeed.ops.op_builder.builder import OpBuilder
    from deepspeed.ops.op_builder.cpu.cpu_adam import CPUAdamBuilder

    built = []
    monkeypatch.setattr(OpBuilder, "jit_load", lambda self, verbose=True: built.append(self.name) or "module")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lines = []
    upstream_noise.say_op_builds(lines.append)
    upstream_noise.say_op_builds(lines.append)  # wrapped once
    assert CPUAdamBuilder().jit_load() == "module" and built == ["cpu_adam"]
    assert len(lines) == 1 and lines[0].startswith(
        "DeepSpeed is compiling its cpu_adam op for cpu (it is not prebuilt"
    )
    assert "usually about 1 minute, once" in lines[0] and str(tmp_path) in lines[0]
    build_dir = next(Path(tmp_path).glob("**/cpu_adam"), None) or Path(tmp_path) / "cpu_adam"
    build_dir.mkdir(parents=True, exist_ok=True)
    (build_dir / "cpu_adam.so").write_bytes(b"")
    CPUAdamBuilder().jit_load()
    assert len(lines) == 1  # cached: loads in a second, nothing to say


def test_only_the_meaningless_accumulation_message_is_dropped():
    f = upstream_noise.quiet_accumulation_mismatch(4)
    try:
        logger = logging.getLogger("accelerate.accelerator")
        record = lambda msg: logging.LogRecord("accelerate.accelerator", logging.WARNING, __file__, 1, msg, None, None)  # noqa: E731
        assert not f.filter(
            record(
                "[RANK 0] Gradient accumulation steps mismatch: GradientAccumulationPlugin has 1, "
                "DeepSpeed config has 4. Using DeepSpeed's value."
            )
        )
        assert f.filter(
            record("Gradient accumulation steps mismatch: GradientAccumulationPlugin has 2, DeepSpeed config has 4. x")
        )
        assert f.filter(record("something else"))
        assert f in logger.filters
    finally:
        logging.getLogger("accelerate.accelerator").removeFilter(f)


def test_a_short_run_prints_no_deprecation_and_no_accumulation_mismatch(tiny_model, tiny_data, tmp_path):
    proc = run(
        train_cmd(
            tiny_model,
            tiny_data,
            tmp_path / "run",
            "--zero_stage",
            2,
            "--max_steps",
            1,
            "--global_batch_size",
            4,
            "--per_device_train_batch_size",
            2,
            "--gradient_checkpointing",
            "true",
            nproc=1,
        ),
        check=True,
    )  # the environment's own op cache: a fresh one would compile fused_adam (248 s measured here)
    both = proc.stdout + proc.stderr
    assert "llmft plan: gradient accumulation 2" in both
    assert "is deprecated" not in both and "FutureWarning" not in both
    assert "Gradient accumulation steps mismatch" not in both

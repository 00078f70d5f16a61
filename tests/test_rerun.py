"""A rerun into a run directory: a changed optimizer or schedule flag takes effect from the resumed step, or is refused."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from llmft.training import rerun
from tests.conftest import run
from tests.test_train import steps, train_cmd

SAVED = {
    "learning_rate": 2e-5,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_epsilon": 1e-8,
    "weight_decay": 0.0,
    "lr_scheduler_type": "linear",
    "lr_scheduler_kwargs": {},
    "warmup_steps": 0,
    "optim": "adamw_torch_fused",
}


@pytest.mark.parametrize(
    "flag, new",
    [
        ("learning_rate", 1e-3),
        ("adam_beta1", 0.8),
        ("adam_beta2", 0.95),
        ("adam_epsilon", 1e-6),
        ("weight_decay", 0.1),
        ("lr_scheduler_type", "cosine"),
        ("lr_scheduler_kwargs", {"num_cycles": 2}),
        ("warmup_steps", 10),
    ],
)
def test_each_restored_hyperparameter_changed_on_a_rerun_is_applied_and_named(flag, new):
    current = {**SAVED, flag: new}
    assert rerun.decide(SAVED, current, deepspeed_scheduler=False, output_dir="runs/a") == [
        f"--{flag} {rerun._show(SAVED[flag])} -> {rerun._show(new)}"
    ]
    assert rerun.decide(SAVED, dict(SAVED), deepspeed_scheduler=False, output_dir="runs/a") == []
    assert (
        rerun.decide(None, current, deepspeed_scheduler=False, output_dir="runs/a") == []
    )  # a record from before llmft kept them


@pytest.mark.parametrize("flag, new", [("learning_rate", 1e-3), ("lr_scheduler_type", "cosine"), ("warmup_steps", 10)])
def test_a_schedule_change_under_a_deepspeed_scheduler_block_is_refused(flag, new):
    with pytest.raises(
        rerun.RerunRefused,
        match=rf"^--{flag} .* -> .*: your DeepSpeed config's scheduler block restores its own "
        r"schedule from the checkpoint in runs/a; use a new --output_dir",
    ):
        rerun.decide(SAVED, {**SAVED, flag: new}, deepspeed_scheduler=True, output_dir="runs/a")
    # the optimizer's own hyper-parameters are still carried over
    assert rerun.decide(SAVED, {**SAVED, "adam_beta2": 0.95}, deepspeed_scheduler=True, output_dir="runs/a")


def test_another_optimizer_is_refused_with_both_values_and_the_way_out():
    with pytest.raises(
        rerun.RerunRefused,
        match=r"^--optim adamw_torch_fused -> sgd: the checkpoint in runs/a holds "
        r"adamw_torch_fused's state, which sgd cannot continue; use a new --output_dir",
    ):
        rerun.decide(SAVED, {**SAVED, "optim": "sgd"}, deepspeed_scheduler=False, output_dir="runs/a")


def test_apply_to_writes_the_flags_over_a_restored_optimizer_and_schedule():
    import torch
    from transformers import get_linear_schedule_with_warmup

    w, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([{"params": [w], "weight_decay": 0.01}, {"params": [b], "weight_decay": 0.0}], lr=2e-5)
    sched = get_linear_schedule_with_warmup(opt, 0, 10)
    for _ in range(4):
        opt.step()
        sched.step()
    state = (opt.state_dict(), sched.state_dict())
    # the rerun: new objects from the new flags, then the checkpoint's state loaded over them (what DeepSpeed does)
    opt = torch.optim.AdamW(
        [{"params": [w], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}],
        lr=1e-3,
        betas=(0.8, 0.95),
        eps=1e-6,
    )
    sched = get_linear_schedule_with_warmup(opt, 0, 10)
    opt.load_state_dict(state[0])
    sched.load_state_dict(state[1])
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-5 * 6 / 10)  # the old schedule: the bug
    args = SimpleNamespace(learning_rate=1e-3, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6, weight_decay=0.1)
    changed = rerun.apply_to(opt, sched, args)
    assert changed == {
        "adam_beta1/adam_beta2": ((0.9, 0.999), (0.8, 0.95)),
        "adam_epsilon": (1e-8, 1e-6),
        "weight_decay": (0.01, 0.1),
        "learning_rate": (2e-5, 1e-3),
    }
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([1e-3 * 6 / 10] * 2)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]  # biases and norms keep no decay
    sched.step()
    assert sched.get_last_lr() == pytest.approx([1e-3 * 5 / 10] * 2)  # and the schedule goes on from the new rate
    assert "--learning_rate 2e-05 -> 0.001" in rerun.applied_line(4, changed)


def test_a_rerun_with_a_new_learning_rate_trains_on_it_from_the_resumed_step(tiny_model, tiny_data, tmp_path):
    out = tmp_path / "run"
    common = (
        "--zero_stage",
        2,
        "--global_batch_size",
        4,
        "--per_device_train_batch_size",
        2,
        "--save_steps",
        2,
        "--max_steps",
        4,
    )
    run(
        train_cmd(tiny_model, tiny_data, out, *common[:-2], "--max_steps", 2, "--learning_rate", "2e-5", nproc=1),
        check=True,
    )
    again = run(
        train_cmd(tiny_model, tiny_data, out, *common, "--learning_rate", "1e-3", "--adam_beta2", "0.95", nproc=1),
        check=True,
    )
    assert "resumed at step 2 with new values, in effect from this step: " in again.stdout
    assert (
        "--learning_rate 2e-05 -> 0.001" in again.stdout
        and "--adam_beta1/adam_beta2 (0.9, 0.999) -> (0.9, 0.95)" in again.stdout
    )
    lrs = {step: lr for step, _, _, lr in steps(again.stdout)}
    assert lrs[3] == pytest.approx(
        1e-3 * 1 / 4, rel=0.01
    )  # linear decay over 4 steps at the new rate (2e-5 would give 5e-6)
    assert json.loads((out / "ds_config.json").read_text())["optimizer"]["params"]["lr"] == 1e-3
    assert json.loads((out / "llmft_run.json").read_text())["hyperparameters"]["learning_rate"] == 1e-3

    refused = run(
        train_cmd(
            tiny_model,
            tiny_data,
            out,
            *common[:-2],
            "--max_steps",
            6,
            "--learning_rate",
            "1e-3",
            "--adam_beta2",
            "0.95",
            "--optim",
            "sgd",
            nproc=1,
        )
    )
    assert refused.returncode == 2
    errors = [line for line in refused.stderr.splitlines() if "error" in line]
    assert errors == [
        f"llmft train: error: --optim adamw_torch_fused -> sgd: the checkpoint in {out} holds adamw_torch_fused's "
        f"state, which sgd cannot continue; use a new --output_dir, or rerun with the old value to continue {out}"
    ]

"""A rerun into a run directory: every optimizer and schedule flag takes effect from the resumed step, or is refused.

Resuming restores the checkpoint's DeepSpeed optimizer (its param groups: lr, betas, eps, weight_decay) and its
learning-rate scheduler state (the step count and the base learning rates). The Trainer rebuilds its scheduler from the
flags (--lr_scheduler_type, --warmup_steps, --lr_scheduler_kwargs, the run's length) before loading that state, so
those take effect; the restored base learning rate and optimizer hyper-parameters would silently override the new
flags. llmft writes the flags' values over the restored ones once the checkpoint is loaded (`apply_to`), says so in one
line, and refuses what it cannot carry over: another --optim (the saved state is another algorithm's), or a schedule
change under a DeepSpeed config with its own "scheduler" block (DeepSpeed restores that scheduler's parameters whole).
The run record (llmft_run.json, "hyperparameters") and ds_config.json are rewritten with what runs.
"""

from __future__ import annotations

from llmft.errors import LlmftError

# flag -> what the checkpoint restores it into
OPTIMIZER_FLAGS = ("learning_rate", "adam_beta1", "adam_beta2", "adam_epsilon", "weight_decay")
SCHEDULE_FLAGS = ("lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps")


class RerunRefused(LlmftError, ValueError):
    """A changed flag a resumed run cannot honour; the message names the flag, both values and the way out."""


def hyperparameters(training_args) -> dict:
    """The optimizer and schedule flags of a run, as the run record keeps them."""
    out = {name: getattr(training_args, name) for name in OPTIMIZER_FLAGS + SCHEDULE_FLAGS}
    out["lr_scheduler_type"] = str(getattr(out["lr_scheduler_type"], "value", out["lr_scheduler_type"]))
    out["lr_scheduler_kwargs"] = dict(out["lr_scheduler_kwargs"] or {})
    out["optim"] = str(getattr(training_args.optim, "value", training_args.optim))
    return out


def decide(saved: dict | None, current: dict, *, deepspeed_scheduler: bool, output_dir: str) -> list[str]:
    """The changed flags a resumed run applies, as 'flag old -> new'; RerunRefused for one it cannot.

    saved: the hyper-parameters the run record holds (None for a record written before llmft kept them: nothing
    to compare, and `apply_to` still writes the flags over the restored state)."""
    if not saved:
        return []
    changed = [
        name
        for name in ("optim",) + OPTIMIZER_FLAGS + SCHEDULE_FLAGS
        if name in saved and saved[name] != current[name]
    ]
    way_out = f"use a new --output_dir, or rerun with the old value to continue {output_dir}"
    for name in changed:
        if name == "optim":
            raise RerunRefused(
                f"--optim {saved[name]} -> {current[name]}: the checkpoint in {output_dir} holds {saved[name]}'s "
                f"state, which {current[name]} cannot continue; {way_out}"
            )
        if deepspeed_scheduler and name in SCHEDULE_FLAGS + ("learning_rate",):
            raise RerunRefused(
                f"--{name} {_show(saved[name])} -> {_show(current[name])}: your DeepSpeed config's scheduler block "
                f"restores its own schedule from the checkpoint in {output_dir}; {way_out} (or change the "
                "scheduler block with a new --output_dir)"
            )
    return [f"--{name} {_show(saved[name])} -> {_show(current[name])}" for name in changed]


def _show(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}" if value else "{}"
    return str(value)


def apply_to(optimizer, scheduler, training_args) -> dict:
    """Write the flags over what the checkpoint restored: the optimizer's betas/eps/weight decay (weight decay on the
    groups that decay; the Trainer keeps biases and norms at 0), the scheduler's base learning rates, and the learning
    rate of the current step. Returns {flag: (restored, now)} for the values that differed."""
    changed: dict[str, tuple] = {}
    groups = optimizer.param_groups
    betas = (training_args.adam_beta1, training_args.adam_beta2)
    for group in groups:
        if "betas" in group and tuple(group["betas"]) != betas:
            changed.setdefault("adam_beta1/adam_beta2", (tuple(group["betas"]), betas))
            group["betas"] = betas
        if "eps" in group and group["eps"] != training_args.adam_epsilon:
            changed.setdefault("adam_epsilon", (group["eps"], training_args.adam_epsilon))
            group["eps"] = training_args.adam_epsilon
    decaying = [g for g in groups if g.get("weight_decay", 0.0) != 0.0] or (groups[:1] if len(groups) > 1 else groups)
    for group in decaying:
        if "weight_decay" in group and group["weight_decay"] != training_args.weight_decay:
            changed.setdefault("weight_decay", (group["weight_decay"], training_args.weight_decay))
            group["weight_decay"] = training_args.weight_decay
    while scheduler is not None and not hasattr(scheduler, "base_lrs") and hasattr(scheduler, "scheduler"):
        scheduler = scheduler.scheduler  # accelerate's DeepSpeedSchedulerWrapper around the Trainer's LambdaLR
    base_lrs = getattr(scheduler, "base_lrs", None)
    if base_lrs is not None and any(lr != training_args.learning_rate for lr in base_lrs):
        changed["learning_rate"] = (base_lrs[0], training_args.learning_rate)
        scheduler.base_lrs = [training_args.learning_rate] * len(base_lrs)
        lambdas = getattr(scheduler, "lr_lambdas", None)
        if lambdas is not None:  # LambdaLR (every schedule the Trainer builds): the rate of the step it resumes at
            lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, lambdas)]
            for group, lr in zip(groups, lrs):
                group["lr"] = lr
            scheduler._last_lr = lrs
    return changed


def applied_line(step: int, changed: dict) -> str:
    """One line: the restored values replaced by the flags, from the resumed step on."""
    parts = [f"--{flag} {_show(old)} -> {_show(new)}" for flag, (old, new) in changed.items()]
    return (
        f"resumed at step {step} with new values, in effect from this step: {'; '.join(parts)} "
        "(the checkpoint's optimizer moments and step count are kept)"
    )


def callback(log):
    """A TrainerCallback that applies the flags once the checkpoint is loaded (on_train_begin comes after it)."""
    from transformers import TrainerCallback

    class ApplyFlagsOnResume(TrainerCallback):
        def __init__(self):
            self.changed: dict = {}

        def on_train_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
            if state.global_step > 0 and optimizer is not None:
                self.changed = apply_to(optimizer, lr_scheduler, args)
                if self.changed:
                    log(applied_line(state.global_step, self.changed))

    return ApplyFlagsOnResume()

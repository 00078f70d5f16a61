"""METHOD= in both job scripts (issue 43): checked against llmft.planning.methods, passed as --method to llmft train and
to llmft plan's memory check, keyed into a non-SFT run's directory, and a SWEEP over the method's own flags. No
cluster: the scripts run with DRY_RUN=1 outside a job, and the launchers' argument builders are called directly."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
from test_launch import run_pbs_script
from test_slurm_script import run_script

from llmft.launch import job, knobs, sweep
from llmft.planning import methods

VENV = str(Path(sys.executable).parents[1])


def test_method_dpo_reaches_llmft_train_and_the_plans_memory_check(tmp_path):
    k = knobs.resolve({}, ["MODEL=org/m", "DATASET=org/d", "METHOD=dpo", "LORA=1"])
    train = job.train_arguments(k, tmp_path, "none")
    assert train[train.index("--method") + 1] == "dpo"
    plan = job.plan_arguments(k, tmp_path, tmp_path / "nodes", 1, 2)
    assert "--check_memory" in plan and plan[plan.index("--method") + 1] == "dpo"
    auto = job.plan_arguments(
        knobs.resolve({}, ["MODEL=org/m", "METHOD=kto", "ZERO_STAGE=auto"]), tmp_path, tmp_path / "n", 1, 2
    )
    assert "--auto" in auto and auto[auto.index("--method") + 1] == "kto"
    # --precompute_ref_log_probs in EXTRA_ARGS is planned as the run will do it
    k = knobs.resolve({}, ["MODEL=org/m", "METHOD=dpo", "EXTRA_ARGS=--precompute_ref_log_probs true --beta 0.2"])
    plan = job.plan_arguments(k, tmp_path, tmp_path / "n", 1, 2)
    assert plan[plan.index("--check_memory") + 1 :][:2] == ["--precompute_ref_log_probs", "true"]
    assert "--beta" not in plan


def test_sft_keeps_its_arguments_and_its_run_directory(tmp_path):
    """METHOD=sft (the default) adds nothing: the same llmft train and llmft plan lines and run key as before."""
    plain = knobs.resolve({}, ["MODEL=org/m", "DATASET=org/d"])
    sft = knobs.resolve({}, ["MODEL=org/m", "DATASET=org/d", "METHOD=sft"])
    assert plain["METHOD"] == "sft"
    assert job.train_arguments(plain, tmp_path, "none") == job.train_arguments(sft, tmp_path, "none")
    assert "--method" not in job.train_arguments(sft, tmp_path, "none")
    assert "--method" not in job.plan_arguments(sft, tmp_path, tmp_path / "n", 1, 1)
    assert job.run_key(plain) == job.run_key(sft)
    dpo = knobs.resolve({}, ["MODEL=org/m", "DATASET=org/d", "METHOD=dpo"])
    assert job.run_key(dpo) != job.run_key(sft)  # a DPO run never resumes an SFT run's checkpoints


@pytest.mark.parametrize("script", ["slurm", "pbs"])
def test_an_unknown_method_is_one_line_naming_the_choices(script):
    run = run_script if script == "slurm" else run_pbs_script
    proc = run("METHOD=bogus", DRY_RUN="1")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stdout + proc.stderr
    assert "METHOD=bogus is not a training method; use sft, dpo, kto, reward (default sft)" in proc.stderr


@pytest.mark.parametrize("script", ["slurm", "pbs"])
def test_a_sweep_over_beta_runs_with_method_dpo_and_is_refused_under_sft(script):
    run = run_script if script == "slurm" else run_pbs_script
    env = {"DRY_RUN": "1", "VIRTUAL_ENV": VENV}
    proc = run("METHOD=dpo", "DATASET=org/d", "SWEEP=beta=0.05,0.1,0.3", **env)
    assert proc.returncode == 0, proc.stderr
    assert "sweep variant 3: beta=0.3 -> beta-0.3" in proc.stdout
    proc = run("DATASET=org/d", "SWEEP=beta=0.05,0.1,0.3", **env)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stdout + proc.stderr
    assert (
        "SWEEP=beta=0.05,0.1,0.3: --beta is a flag of --method dpo and kto, not of sft; set METHOD=dpo" in proc.stderr
    )


def test_sweep_checks_flags_against_the_chosen_methods_rows():
    assert [v.name for v in sweep.parse("beta=0.1,0.3 learning_rate=1e-6,5e-7", "dpo")][
        0
    ] == "beta-0.1_learning_rate-1e-6"
    assert len(sweep.parse("desirable_weight=1.0,1.33", "kto")) == 2
    assert len(sweep.parse("learning_rate=1e-5,3e-5")) == 2  # sft's flags, as before
    with pytest.raises(
        sweep.SweepError, match="--center_rewards_coefficient is a flag of --method reward, not of dpo"
    ):
        sweep.parse("center_rewards_coefficient=0.01,0.1", "dpo")
    with pytest.raises(sweep.SweepError, match="--betta is not a flag of llmft train; did you mean beta"):
        sweep.parse("betta=0.1,0.2", "dpo")
    refused = dataclasses.replace(methods.METHODS["dpo"], flags=(("beta", ("refused", "test row")),))
    methods.METHODS["dpo-test"] = dataclasses.replace(refused, name="dpo-test")
    try:
        with pytest.raises(sweep.SweepError, match="refuses --beta other than its default: test row"):
            sweep.parse("beta=0.1,0.2", "dpo-test")
    finally:
        del methods.METHODS["dpo-test"]


@pytest.mark.parametrize("name, config", [("dpo", "DPOConfig"), ("kto", "KTOConfig"), ("reward", "RewardConfig")])
def test_every_field_a_methods_trl_config_adds_has_a_row_a_sweep_checks(name, config):
    """Each field TRL's config adds to TrainingArguments is in the method's own rows or in POLICY (SFTConfig's shared
    fields: max_length, ...), and no row names anything else: a sweep's flag is checked against a real one."""
    import trl
    from transformers import TrainingArguments

    from llmft.training.flag_policy import POLICY

    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    own = {f.name for f in dataclasses.fields(getattr(trl, config))} - base
    rows = set(methods.method(name).flag_policy)
    assert rows <= own and own <= rows | set(POLICY)


DOC = Path(__file__).resolve().parents[1] / "docs" / "preference.md"
KNOBS = "METHOD=dpo,MODEL=meta-llama/Llama-3.1-8B,DATASET=hh.jsonl,LORA=1,GLOBAL_BATCH=64,MICRO_BATCH=1"


def test_the_preference_pages_job_commands_pass_both_scripts_dry_runs(tmp_path):
    """docs/preference.md's sbatch and qsub lines, their knobs as written there, checked by each script as the job
    would (DRY_RUN=1 outside a job, the page's hh.jsonl beside it), and its sweep's variants listed."""
    import os
    import subprocess

    text = DOC.read_text()
    assert f"sbatch slurm/run_llm.slurm --export=ALL,{KNOBS}\n" in text
    assert f"qsub -v {KNOBS} pbs/run_llm.pbs\n" in text
    assert "SWEEP=beta=0.05,0.1,0.3" in text and "SWEEP='beta=0.05,0.1,0.3'" in text
    record = text.split("```json\n", 1)[1].split("\n```", 1)[0]
    assert set(json.loads(record)) == {"chosen", "rejected"}
    (tmp_path / "hh.jsonl").write_text(record + "\n")
    repo = DOC.parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PBS_")) and k not in knobs.NAMES}
    env.update(DRY_RUN="1", VIRTUAL_ENV=VENV)

    def script(*args):
        return subprocess.run(["bash", *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)

    slurm = script(str(repo / "slurm" / "run_llm.slurm"), f"--export=ALL,{KNOBS}", "SWEEP=beta=0.05,0.1,0.3")
    assert slurm.returncode == 0 and "knobs are valid" in slurm.stdout, slurm.stderr
    assert "sweep variant 3: beta=0.3 -> beta-0.3" in slurm.stdout
    pbs = script(str(repo / "pbs" / "run_llm.pbs"), f"VENV={VENV}", *KNOBS.split(","))
    assert pbs.returncode == 0 and "knobs are valid" in pbs.stdout, pbs.stderr

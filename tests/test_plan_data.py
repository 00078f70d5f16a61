"""`llmft plan` with your data: its fit against max_length, and an sbatch line holding every knob the plan used."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from llmft import plan
from llmft.data.synthetic import write_jsonl
from tests.test_data_fit import gsm8k_like

REPO = Path(__file__).resolve().parents[1]


def llmft_plan(capsys, *argv) -> tuple[int, str, str]:
    rc = plan.main(plan.make_parser().parse_args([str(a) for a in argv]))
    out, err = capsys.readouterr()
    return rc, out, err


def dry_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(REPO / "slurm" / "run_llm.slurm"), *args],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "DRY_RUN": "1"},
        timeout=60,
    )


def test_plan_with_data_prints_its_fit_and_an_sbatch_line_with_every_knob(capsys, tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("LLMFT_CACHE", str(tmp_path / "cache"))
    data = write_jsonl(gsm8k_like(60), tmp_path / "gsm.jsonl")
    rc, out, err = llmft_plan(
        capsys,
        "--model",
        tiny_model,
        "--gpu",
        "L4",
        "--host_ram_gb",
        64,
        "--nproc_per_node",
        1,
        "--global_batch_size",
        8,
        "--dataset_name",
        data,
        "--prompt_column",
        "question",
        "--completion_column",
        "answer",
        "--max_length",
        32,
        "--num_train_epochs",
        2,
        "--data_percentage",
        50,
        "--write",
        tmp_path / "w",
    )
    assert rc == 0, err
    assert "llmft plan: train data: " in out and "vs max_length 32" in out
    assert "llmft plan: warning: " in out and "raise --max_length to" in out  # GSM8K-like answers do not fit 32 tokens
    line = (tmp_path / "w" / "sbatch.txt").read_text().strip()
    export = next(a for a in shlex.split(line) if a.startswith("--export="))
    for knob in (f"MODEL={tiny_model}", f"DATASET={data}", "DATA_PERCENTAGE=50", "EPOCHS=2", "GLOBAL_BATCH=8"):
        assert f",{knob}," in export + ",", knob
    assert "--prompt_column question --completion_column answer" in export and "--max_length 32" in export
    proc = dry_run(export)
    assert proc.returncode == 0 and "knobs are valid" in proc.stdout and "WARNING" not in proc.stdout, proc.stdout


def test_plan_without_data_says_the_line_needs_a_dataset(capsys, tiny_model, tmp_path):
    rc, out, _ = llmft_plan(
        capsys,
        "--model",
        tiny_model,
        "--gpu",
        "L4",
        "--host_ram_gb",
        64,
        "--nproc_per_node",
        1,
        "--global_batch_size",
        8,
        "--write",
        tmp_path / "w",
    )
    assert rc == 0
    export = next(a for a in shlex.split((tmp_path / "w" / "sbatch.txt").read_text()) if a.startswith("--export="))
    assert (
        "EPOCHS=3" in export and "DATA_PERCENTAGE=100" in export
    )  # llmft train's defaults, not the script's 10 and 10%
    assert "llmft plan: warning: no --dataset_name: the line trains on run_llm.slurm's default dataset" in out


def test_the_slurm_script_says_loudly_when_it_falls_back_to_its_default_dataset():
    proc = dry_run("EPOCHS=2")
    assert proc.returncode == 0
    assert (
        "run_llm.slurm: WARNING: no DATASET given: training on this script's default, the hub dataset trl-lib/Capybara "
        "(defaults used: DATASET DATA_PERCENTAGE; DATA_PERCENTAGE=10 EPOCHS=2)"
    ) in proc.stdout
    assert "WARNING" not in dry_run("DATASET=my.jsonl").stdout

"""`llmft plan` with your data: its fit against max_length, and an sbatch line holding every knob the plan used."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from llmft import plan
from llmft.data.synthetic import as_format, make_examples, write_jsonl
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
    world = [w for w in shlex.split(line) if w.startswith(("--nodes=", "--gpus-per-node="))]  # sbatch's, for 1 GPU
    proc = dry_run(*world, export)  # the dry run checks the batch for the world the line asks for
    assert proc.returncode == 0 and "knobs are valid" in proc.stdout and "WARNING" not in proc.stdout, proc.stdout
    assert "x 1 processes (given: --nodes=1, --gpus-per-node=1) x accumulation 1" in proc.stdout, proc.stdout
    assert (
        dry_run(export).returncode == 2
    )  # for the #SBATCH lines' 2 processes, GLOBAL_BATCH=8 is one micro-batch short


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
    assert "EPOCHS=3" in export and "DATA_PERCENTAGE=100" in export  # llmft train's defaults, said explicitly
    assert "llmft plan: warning: no --dataset_name: the line trains on run_llm.slurm's default dataset" in out


def test_the_slurm_script_says_loudly_when_it_falls_back_to_its_default_dataset(tmp_path):
    proc = dry_run("EPOCHS=2")
    assert proc.returncode == 0
    assert (
        "run_llm.slurm: WARNING: no DATASET given: training on this script's default, the hub dataset trl-lib/Capybara "
        "(defaults used: DATASET DATA_PERCENTAGE; DATA_PERCENTAGE=100 EPOCHS=2)"
    ) in proc.stdout
    mine = write_jsonl(gsm8k_like(2), tmp_path / "my.jsonl")
    assert "WARNING" not in dry_run(f"DATASET={mine}").stdout


def test_plan_takes_a_dataset_mixture_as_train_does(capsys, tiny_model, tmp_path, monkeypatch):
    """`llmft plan --dataset_mixture` previews a mixture's fit as --dataset_name does, and its --write line trains the
    whole mixture (MIXTURE=FILE: no DATASET, no DATA_PERCENTAGE, which the script refuses beside it)."""
    monkeypatch.setenv("LLMFT_CACHE", str(tmp_path / "cache"))
    write_jsonl(gsm8k_like(30), tmp_path / "gsm.jsonl")
    write_jsonl(as_format(make_examples(30), "prompt_completion"), tmp_path / "pc.jsonl")
    mix = tmp_path / "mix.yaml"
    mix.write_text(
        "datasets:\n"
        f"  - path: {tmp_path / 'gsm.jsonl'}\n    columns: {{prompt: question, completion: answer}}\n    weight: 1\n"
        f"  - path: {tmp_path / 'pc.jsonl'}\n    weight: all\n"
    )
    common = ["--model", tiny_model, "--gpu", "L4", "--host_ram_gb", 64, "--nproc_per_node", 1]
    rc, out, err = llmft_plan(
        capsys,
        *common,
        "--global_batch_size",
        8,
        "--dataset_mixture",
        mix,
        "--max_length",
        32,
        "--write",
        tmp_path / "w",
    )
    assert rc == 0, err
    assert "llmft plan: train data: " in out and "vs max_length 32" in out, out
    assert "no --dataset_name" not in out
    export = next(a for a in shlex.split((tmp_path / "w" / "sbatch.txt").read_text()) if a.startswith("--export="))
    assert f",MIXTURE={mix}," in export + "," and "DATASET=" not in export and "DATA_PERCENTAGE" not in export, export
    # beside --dataset_name it is refused in one line, as llmft train refuses it
    rc, _, err = llmft_plan(capsys, *common, "--dataset_mixture", mix, "--dataset_name", tmp_path / "gsm.jsonl")
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert lines[0].startswith("llmft plan: error: --dataset_mixture lists the datasets: drop --dataset_name "), err
    # and it is a memory-plan flag, as --dataset_name is
    rc, _, err = llmft_plan(capsys, "--dataset_mixture", mix)
    assert rc == 2 and "--dataset_mixture needs --model" in err, err

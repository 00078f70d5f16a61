"""`llmft plan` with your data: its fit against max_length, and an sbatch line holding every knob the plan used."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

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


GSM8K_RECORD = {  # GSM8K's fields and shape: a long word problem, its worked answer ending in "#### N"
    "question": "A bakery sells muffins for $3 each and cookies for $2 each. On Monday it sold 45 muffins and twice as "
    "many cookies as muffins. On Tuesday it sold 12 more muffins than on Monday and 30 fewer cookies than on Monday. "
    "On Wednesday the bakery was closed for repairs, and on Thursday it sold as many muffins as on Monday and Tuesday "
    "together, but only half as many cookies as on Tuesday. How much money, in dollars, did the bakery make from "
    "muffins and cookies over these four days?",
    "answer": "On Monday the bakery sold 45 * 2 = <<45*2=90>>90 cookies.\nOn Tuesday it sold 45 + 12 = <<45+12=57>>57 "
    "muffins and 90 - 30 = <<90-30=60>>60 cookies.\nOn Thursday it sold 45 + 57 = <<45+57=102>>102 muffins and "
    "60 / 2 = <<60/2=30>>30 cookies.\nIn all it sold 45 + 57 + 102 = <<45+57+102=204>>204 muffins, worth "
    "204 * 3 = $<<204*3=612>>612.\nIt sold 90 + 60 + 30 = <<90+60+30=180>>180 cookies, worth 180 * 2 = "
    "$<<180*2=360>>360.\nSo the bakery made 612 + 360 = $<<612+360=972>>972.\n#### 972",
}
ALPACA_RECORD = {  # Stanford Alpaca's fields and shape: instruction, input, a long output
    "instruction": "Write a short essay comparing the two given approaches to learning a new language.",
    "input": "Approach A: studying grammar and vocabulary from textbooks. Approach B: immersion through conversation "
    "with native speakers.",
    "output": "Learning a new language can follow two very different paths. The first relies on textbooks: the "
    "learner studies grammar rules, memorises lists of vocabulary and practises with written exercises. This approach "
    "gives a solid foundation, because the learner understands why sentences are built the way they are, and it suits "
    "people who like structure and can set aside regular time to study. Its weakness is that knowledge stays "
    "passive: many textbook learners can read well but struggle to follow a fast conversation or to answer without "
    "translating in their heads first. The second path, immersion, builds confidence and a natural ear instead, but "
    "leaves gaps in grammar and is hard to arrange without living abroad.\n\nIn practice the "
    "best results often come from combining the two: a textbook for structure and immersion for fluency.",
}


def test_llmft_tinys_default_context_fits_gsm8k_and_alpaca_records(capsys, tmp_path, monkeypatch):
    """`llmft tiny` builds a model of 1024 positions (TRL's default max_length; --max_positions changes it): a long
    GSM8K record and a long Alpaca record (about 1,100 characters each, longer than most of either dataset's; the tiny
    tokenizer takes about 1.2 characters a token) fit whole, where the old 256 positions cut both."""
    from llmft import tiny

    monkeypatch.setenv("LLMFT_CACHE", str(tmp_path / "cache"))
    gsm = write_jsonl([GSM8K_RECORD], tmp_path / "gsm8k.jsonl")
    alpaca = write_jsonl([ALPACA_RECORD], tmp_path / "alpaca.jsonl")
    common = ["--gpu", "L4", "--host_ram_gb", 64, "--nproc_per_node", 1, "--global_batch_size", 8]
    for positions, fits in ((None, True), (256, False)):
        out_dir = tmp_path / f"tiny-{positions}"
        argv = ["--out", str(out_dir), "--examples", "4", *(["--max_positions", str(positions)] if positions else [])]
        tiny.main(tiny.make_parser().parse_args(argv))
        assert f"({positions or 1024} positions)" in capsys.readouterr().out
        model = out_dir / "model"
        for data, columns in ((gsm, ["--prompt_column", "question", "--completion_column", "answer"]), (alpaca, [])):
            rc, out, err = llmft_plan(capsys, "--model", model, *common, "--dataset_name", data, *columns)
            fit = rc == 0 and "1 of 1 records kept, 0 truncated" in out
            assert fit == fits, (
                out + err
            )  # at 256 positions: cut, or nothing left to learn from (the prompt fills them)
    with pytest.raises(SystemExit):
        tiny.make_parser().parse_args(["--out", str(tmp_path), "--max_positions", "0"])
    assert "argument --max_positions: '0': give a whole number of tokens from 1 to 32768" in capsys.readouterr().err


def test_plan_takes_the_data_format_flags_train_takes(capsys, tiny_model, tmp_path, monkeypatch):
    """--prompt_template, --dataset_format, --role_map, --assistant_only_loss and --drop_long_records prepare the
    data as llmft train's do, and ride in the --write line's EXTRA_ARGS; without --model they are refused."""
    monkeypatch.setenv("LLMFT_CACHE", str(tmp_path / "cache"))
    data = write_jsonl(gsm8k_like(40), tmp_path / "gsm.jsonl")
    rc, out, err = llmft_plan(
        capsys,
        *("--model", tiny_model, "--gpu", "L4", "--host_ram_gb", 64, "--nproc_per_node", 1, "--global_batch_size", 8),
        *("--dataset_name", data, "--prompt_template", "gsm8k", "--max_length", 32, "--drop_long_records"),
        *("--write", tmp_path / "w"),
    )
    assert rc == 0, err
    assert "prompt template gsm8k" in out and re.search(r"train data: \d+ of 40 records kept, 0 truncated, [1-9]", out)
    line = (tmp_path / "w" / "sbatch.txt").read_text()
    assert "--prompt_template gsm8k" in line and "--drop_long_records" in line, line
    rc, _, err = llmft_plan(capsys, "--prompt_template", "gsm8k", "--assistant_only_loss", "false")
    assert rc == 2 and "--prompt_template, --assistant_only_loss need --model" in err, err

"""docs/your-data.md's commands, run in order as a user would type them: tiny model and question/answer data,
plan with the data, train on CPU (in lm-evaluation-harness's gsm8k format), the sbatch line through the script's
dry run, infer, eval, report; and the formats section's Alpaca, ShareGPT and GSM8K records through
`llmft prepare --show`."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "your-data.md"


def page_commands(marker: str = "YOUR_DATA_COMMANDS") -> list[str]:
    """The commands of the marked block, continuation lines joined and comments dropped."""
    text = PAGE.read_text()
    section = text[text.index(f"<!-- {marker} -->") : text.index(f"<!-- /{marker} -->")]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1).replace("\\\n", " ")
    return [line for line in block.splitlines() if shlex.split(line, comments=True)]


def as_run_here(command: str) -> list[str]:
    """The argv that runs a page command here, through bash as typed (redirections, quotes); the sbatch line goes
    through the script's DRY_RUN mode instead of a Slurm job (the test's environment sets DRY_RUN=1)."""
    assert not command.startswith("sbatch ") or command.startswith("sbatch slurm/run_llm.slurm "), command
    return ["bash", "-euo", "pipefail", "-c", re.sub(r"^sbatch ", "bash ", command)]


def test_every_command_of_the_your_data_page_runs_in_order(tmp_path):
    commands = page_commands()
    assert [shlex.split(c)[:2] for c in commands] == [
        ["llmft", "tiny"],
        ["head", "-n"],
        ["tail", "-n"],
        ["llmft", "plan"],
        ["llmft", "train"],
        ["sbatch", "slurm/run_llm.slurm"],
        ["llmft", "infer"],
        ["llmft", "eval"],
        ["llmft", "report"],
    ]
    (tmp_path / "slurm").symlink_to(REPO / "slurm")  # "from your llmft checkout"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "LLMFT_CACHE": str(tmp_path / "cache"),
        "DRY_RUN": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }  # llmft from this environment
    outputs = {}
    for command in commands:
        proc = subprocess.run(as_run_here(command), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        outputs[" ".join(shlex.split(command)[:2])] = proc.stdout + proc.stderr

    # llmft tiny: a model directory and question/answer records, split by the page's head/tail into 48 + 16
    assert (tmp_path / "tiny" / "model" / "config.json").exists()
    records = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert len(records) == 48 and all(set(r) == {"question", "answer"} for r in records)
    assert len((tmp_path / "test.jsonl").read_text().splitlines()) == 16
    # llmft plan: the data-fit line the page explains, and the files --write names
    assert re.search(
        r"llmft plan: train data: 48 of 48 records kept, 0 truncated, 0 dropped; .* vs max_length 128",
        outputs["llmft plan"],
    )
    assert {p.name for p in (tmp_path / "plans" / "mine").iterdir()} >= {"ds_config.json", "plan.json", "sbatch.txt"}
    # llmft train: a complete run of 4 steps
    assert "llmft: training complete at step 4" in outputs["llmft train"]
    # sbatch line: the script accepted every knob (DRY_RUN=1 outside a Slurm job)
    assert "knobs are valid" in outputs["sbatch slurm/run_llm.slurm"]
    # infer, eval, report read the run
    assert "What is 4 plus 8?" in outputs["llmft infer"]
    assert (tmp_path / "runs" / "mine" / "eval" / "summary.jsonl").exists()
    assert {p.name for p in (tmp_path / "runs" / "mine" / "report").iterdir()} >= {
        "report.md",
        "loss.png",
        "learning_rate.png",
    }


def test_the_formats_section_runs_in_order_and_shows_the_loss(tiny_model, tmp_path, monkeypatch, capsys):
    """Alpaca, ShareGPT and GSM8K records as the page writes them, each prepared and shown (tiny/model: the page's
    `llmft tiny`, here the session's tiny model). The printf lines run through bash as typed; the `llmft prepare`
    lines run in this process (llmft.cli.main with the line's arguments), which spares each a Python start-up."""
    from llmft.cli import main

    commands = page_commands("FORMATS_COMMANDS")
    assert [shlex.split(c, comments=True)[:2] for c in commands] == [["printf", "%s\\n"], ["llmft", "prepare"]] * 3
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "model").symlink_to(tiny_model)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LLMFT_CACHE", str(tmp_path / "cache"))
    shown = []
    for command in commands:
        if command.startswith("llmft "):
            assert main(shlex.split(command, comments=True)[1:]) == 0, command
            shown.append(capsys.readouterr().out)
        else:
            proc = subprocess.run(as_run_here(command), cwd=tmp_path, capture_output=True, text=True, timeout=60)
            assert proc.returncode == 0, f"{command}\n{proc.stderr[-3000:]}"
    alpaca, sharegpt, gsm8k = shown
    assert "(alpaca -> prompt_completion, prompt template alpaca; loss on the completion)" in alpaca
    assert "### Input:\nTwitter, Instagram, Telegram\n\n### Response:\n«Telegram<|endoftext|>»" in alpaca
    assert "--- record 2 of 2:" in alpaca and "### Response:\n«Glad<|endoftext|>»" in alpaca
    assert "(sharegpt -> messages; loss on the assistant turns)" in sharegpt
    assert "<|user|>\nCapital of France?<|endoftext|>\n<|assistant|>\n«Paris.<|endoftext|>»" in sharegpt
    assert "Question: What is 4 plus 8?\nAnswer:« 4 + 8 = 12\n#### 12<|endoftext|>»" in gsm8k

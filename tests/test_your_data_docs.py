"""docs/your-data.md's commands, run in order as a user would type them: tiny model and question/answer data,
plan with the data, train on CPU, the sbatch line through the script's dry run, infer, eval, report."""

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


def page_commands() -> list[str]:
    """The commands of the marked block, continuation lines joined and comments dropped."""
    text = PAGE.read_text()
    section = text[text.index("<!-- YOUR_DATA_COMMANDS -->") : text.index("<!-- /YOUR_DATA_COMMANDS -->")]
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

"""Shared by the training benches: offline models and data, running a command under a clock, reading its results.

Nothing is downloaded: models are built from configs with random weights, tokenizers trained locally
(llmft.tiny), data generated in code.
"""

from __future__ import annotations

import json
import os
import platform
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
STEP_RE = re.compile(r"llmft: step (\d+)/\d+ loss ([\d.]+) lr \S+ tokens/s (\d+) padded/s (\d+)")
ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "WANDB_MODE": "disabled",
    "PYTHONUNBUFFERED": "1",
}


def environment() -> str:
    """One line for bench/README.md: date, machine, versions."""
    import deepspeed
    import torch
    import transformers
    import trl

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}; {cpu}, {os.cpu_count()} cores, {gpu}; Python {platform.python_version()}, "
        f"torch {torch.__version__}, deepspeed {deepspeed.__version__}, transformers {transformers.__version__}, trl {trl.__version__}"
    )


def demo_model(root: Path) -> tuple[Path, Path]:
    """The model and data `make demo` trains: GPT-2-style, 2 layers x 128, 1024 prompt/completion examples."""
    from llmft.data.synthetic import as_format, make_examples, make_model_dir, write_jsonl

    model, data = root / "demo-model", root / "demo-data.jsonl"
    if not (model / "config.json").is_file():
        make_model_dir(model, n_layer=2, n_embd=128, n_head=4)
    if not data.is_file():
        write_jsonl(as_format(make_examples(1024), "prompt_completion"), data)
    return model, data


def gpt2_124m_model(root: Path) -> Path:
    """GPT-2 small's shape (GPT2Config(): 12 x 768, vocabulary 50257, 124M parameters), random weights, with the
    locally trained tokenizer (its ids are a subset of the vocabulary)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from llmft.data.synthetic import make_tokenizer

    model = root / "gpt2-124m"
    if not (model / "config.json").is_file():
        tokenizer = make_tokenizer()
        config = GPT2Config(
            bos_token_id=tokenizer.eos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        GPT2LMHeadModel(config).save_pretrained(model)
        tokenizer.save_pretrained(model)
    return model


def varied_texts(path: Path, n: int, lo: int, hi: int, tokenizer, seed: int = 0) -> Path:
    """n {"text": ...} records whose token counts are spread uniformly over [lo, hi]."""
    from llmft.data.synthetic import _WORDS, write_jsonl

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        target = rng.randint(lo, hi)
        words = [rng.choice(_WORDS) for _ in range(target)]
        ids = tokenizer(" ".join(words))["input_ids"][: target - 1]  # TRL appends the EOS token: target in all
        rows.append({"text": tokenizer.decode(ids)})
    return write_jsonl(rows, path)


@dataclass
class Run:
    name: str
    wall: float  # the whole process, start to exit
    stdout: str
    out: Path
    returncode: int = 0
    stderr: str = ""

    def summary(self) -> dict:
        return json.loads((self.out / "run_summary.json").read_text())

    def train_runtime(self) -> float:
        """Trainer's own loop clock (from after DeepSpeed's set-up to the last step), which Trainer prints at the end
        of every run, llmft's and a plain TRL script's alike."""
        return float(re.search(r"'train_runtime': '?([\d.]+)", self.stdout).group(1))

    def losses(self) -> list[tuple[int, float]]:
        return [(int(s), float(loss)) for s, loss, *_ in STEP_RE.findall(self.stdout)]

    def failure(self) -> str | None:
        """None for a run that finished with its summary; else its last error line (for a bench that goes on)."""
        if self.returncode == 0 and (self.out / "run_summary.json").is_file():
            return None
        return f"exit {self.returncode}: {self.error_line()}"

    def error_line(self) -> str:
        """The last line that names an error, else the last line: not torchrun's banner of '=' or its
        ChildFailedError, which name none (the rank's own error comes before them)."""
        lines = [l for l in (self.stderr + "\n" + self.stdout).splitlines() if l.strip()]
        errors = [l for l in lines if re.search(r"Error|error:|Exception|Killed|out of memory|No space left", l)]
        errors = [l for l in errors if "ChildFailedError" not in l]
        return (errors or lines or ["no output"])[-1].strip()[:300]


def run(
    name: str,
    cmd: list[str],
    out: Path,
    check: bool = True,
    timeout: float | None = None,
    log: Path | None = None,
    **env: str,
) -> Run:
    """Run one training process tree under a wall clock. check: fail loudly with its output if it fails; else the
    caller reads Run.failure(). log: append the run's command and output there (benches on a lent GPU machine)."""
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, cwd=REPO, env={**os.environ, **ENV, **env}, capture_output=True, text=True, timeout=timeout
        )
        returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        as_text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
        returncode, stdout, stderr = (
            124,
            as_text(e.stdout),
            as_text(e.stderr) + f"\nTimeout: killed after {timeout:.0f} s",
        )
    wall = time.perf_counter() - t
    if log is not None:
        with open(log, "a") as f:
            f.write(
                f"\n===== {name}: exit {returncode}, {wall:.1f} s\n$ {' '.join(map(str, cmd))}\n{stdout}\n--- stderr\n{stderr[-20000:]}\n"
            )
    if check and returncode != 0:
        sys.exit(f"{name}: {' '.join(map(str, cmd))} exited {returncode}\n{stdout[-3000:]}\n{stderr[-5000:]}")
    return Run(name, wall, stdout, out, returncode, stderr)


def launcher(nproc: int) -> list[str]:
    return [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)] if nproc > 1 else [PYTHON]

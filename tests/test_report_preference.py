"""`llmft report` on preference runs (issue 43 item 6): the method's own metrics plotted (rewards/chosen,
rewards/rejected, rewards/accuracies, rewards/margins for DPO) and a sweep's variants compared on them. The log
history is written in code in the shape TRL 1.16's DPOTrainer logs (trl/trainer/dpo_trainer.py's _metrics keys)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from test_report import fake_run, legends, png_size  # noqa: F401 (legends: a fixture)

from llmft import report
from llmft.launch import sweep

DPO_PLOTS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


def dpo_log(beta: float, steps: int = 20) -> list[dict]:
    """What DPOTrainer.log writes each logging step: its averaged _metrics beside HF's loss, grad norm and rate."""
    history = []
    for s in range(1, steps + 1):
        margin = beta * 10 * (1 - math.exp(-s / 8))
        chosen, rejected = margin / 2, -margin / 2
        history.append(
            {
                "loss": math.log1p(math.exp(-margin)),
                "grad_norm": 1.5,
                "learning_rate": 5e-7,
                "entropy": 1.2,
                "num_tokens": 4096.0 * s,
                "mean_token_accuracy": 0.4,
                "logits/chosen": -1.0,
                "logits/rejected": -1.1,
                "rewards/chosen": chosen,
                "rewards/rejected": rejected,
                "rewards/accuracies": min(1.0, 0.5 + s / 40),
                "rewards/margins": chosen - rejected,
                "logps/chosen": -120.0 + s,
                "logps/rejected": -130.0 - s,
                "epoch": s / steps,
                "step": s,
            }
        )
    return history


def dpo_run(path: Path, beta: float, record: bool = True) -> Path:
    fake_run(path, 0.1, steps=20)
    state = path / "checkpoint-20" / "trainer_state.json"
    state.write_text(json.dumps({"global_step": 20, "log_history": dpo_log(beta)}))
    if record:  # llmft train records its method in the run's identity
        (path / "llmft_run.json").write_text(json.dumps({"method": "dpo"}))
    return path


def test_a_dpo_run_plots_its_rewards(tmp_path, legends):  # noqa: F811
    written = report.report([dpo_run(tmp_path / "dpo", 0.1)], tmp_path / "out")
    assert written["runs"][0].method == "dpo"
    for metric in DPO_PLOTS:
        path = written["plots"][metric]
        assert path.name == metric.replace("/", "_") + ".png"
        width, height = png_size(path)
        assert width >= 800 and height >= 500
        [ax] = legends[path.name]
        assert ax["title"] == metric and ax["x"] == "optimizer step" and ax["legend"] == ["dpo"]
    md = written["summary"].read_text()
    assert "### rewards/margins" in md and "](rewards_margins.png)" in md
    assert "| run | method | rewards/chosen | rewards/rejected | rewards/accuracies | rewards/margins |" in md
    last = dpo_log(0.1)[-1]
    assert f"| dpo | dpo | {report._fmt(last['rewards/chosen'])} |" in md


def test_a_sweeps_variants_are_compared_on_the_methods_metrics(tmp_path, legends):  # noqa: F811
    """SWEEP=beta=0.05,0.1,0.3 with METHOD=dpo: `llmft report <sweep dir>` draws each variant on every reward plot
    and lists their last values side by side; the method is read from the log when the run records none."""
    d = tmp_path / "sweep"
    variants = sweep.parse("beta=0.05,0.1,0.3", "dpo")
    for v in variants:
        dpo_run(d / v.name, float(v.values[0][1]), record=False)
    sweep.record(d, "beta=0.05,0.1,0.3", variants)
    written = report.report([d], tmp_path / "out")
    assert [r.method for r in written["runs"]] == ["dpo"] * 3
    assert legends["rewards_accuracies.png"][0]["legend"] == ["beta-0.05", "beta-0.1", "beta-0.3"]
    md = written["summary"].read_text()
    margins = {}
    for line in md.splitlines():
        if line.startswith("| beta-") and "| dpo |" in line:
            cells = [c.strip() for c in line.strip("|").split("|")]
            margins[cells[0]] = float(cells[-1])
    assert list(margins) == ["beta-0.05", "beta-0.1", "beta-0.3"]
    assert margins["beta-0.05"] < margins["beta-0.1"] < margins["beta-0.3"]  # the larger beta, the wider margin


def test_an_sft_run_reports_as_before(tmp_path):
    """No method metrics for SFT: the same plots and no preference table."""
    written = report.report([fake_run(tmp_path / "sft", 0.1)], tmp_path / "out")
    assert written["runs"][0].method == "sft"
    assert set(written["plots"]) == {"loss", "learning_rate", "tokens_per_second", "mfu", "gpu_memory"}
    assert "Preference metrics" not in written["summary"].read_text()


def test_the_method_is_read_from_the_log_when_nothing_names_it():
    assert report.run_method(dpo_log(0.1), {}, {}) == "dpo"
    kto = [{"step": 1, "rewards/chosen": 1.0, "rewards/rejected": -1.0, "rewards/margins": 2.0, "kl": 0.1}]
    assert report.run_method(kto, {}, {}) == "kto"
    assert report.run_method([{"step": 1, "accuracy": 0.7, "margin": 0.5, "loss": 0.6}], {}, {}) == "reward"
    assert report.run_method([{"step": 1, "loss": 2.0, "mean_token_accuracy": 0.5}], {}, {}) == "sft"
    assert report.run_method([], {"method": "kto"}, {}) == "kto"

"""`llmft report`: PNG plots and a Markdown summary from run directories, with what older runs lack left out."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from llmft import report


def fake_run(path: Path, lr: float, steps: int = 30, speed: bool = True, benchmarks: list[dict] | None = None) -> Path:
    """A run directory as llmft train + llmft eval leave it (numbers generated in code)."""
    (path / f"checkpoint-{steps}").mkdir(parents=True)
    history = []
    for s in range(1, steps + 1):
        entry = {"loss": 3 * math.exp(-s * lr) + 0.5, "learning_rate": lr * 1e-3 * (1 - s / steps), "step": s}
        if speed:
            entry.update(tokens_per_second=3000.0 + s, mfu=0.38, peak_gpu_memory_gib=10.5)
        history.append(entry)
        if s % 10 == 0:
            history.append(
                {
                    "eval_loss": 3 * math.exp(-s * lr) + 0.7,
                    "eval_perplexity": math.exp(3 * math.exp(-s * lr) + 0.7),
                    "step": s,
                }
            )
    (path / f"checkpoint-{steps}" / "trainer_state.json").write_text(
        json.dumps({"global_step": steps, "log_history": history})
    )
    (path / f"checkpoint-{steps}" / "llmft_complete.json").write_text(
        json.dumps({"world_size": 2, "zero_stage": 2, "files": {}})
    )
    (path / "ds_config.json").write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    (path / "llmft_data.json").write_text(json.dumps({"dataset_name": "gsm8k.jsonl"}))
    if speed:
        (path / "run_summary.json").write_text(
            json.dumps(
                {
                    "world_size": 8,
                    "gpu": "NVIDIA A100-SXM4-40GB",
                    "wall_seconds": 3725,
                    "tokens_per_second": 24000.0,
                    "peak_gpu_memory_gib": 31.2,
                    "steps": steps,
                }
            )
        )
    if benchmarks:
        (path / "eval").mkdir()
        (path / "eval" / "summary.jsonl").write_text("".join(json.dumps(line) + "\n" for line in benchmarks))
    return path


def summary_line(step, task, group=None, **metrics):
    """One line of llmft eval's eval/summary.jsonl."""
    return {
        "checkpoint": f"x/checkpoint-{step}/global_step{step}",
        "step": step,
        "task": task,
        "group": group,
        "num_fewshot": 5,
        "n": 50,
        "metrics": {k.replace("__", ","): v for k, v in metrics.items()},
        "stderr": {k.replace("__", ","): 0.05 for k in metrics},
    }


@pytest.fixture
def legends(monkeypatch):
    """What each saved figure shows: title, axis labels and legend entries, captured as it is saved."""
    from matplotlib.figure import Figure

    seen = {}
    original = Figure.savefig

    def savefig(fig, path, *args, **kwargs):
        seen[Path(path).name] = [
            {
                "title": ax.get_title(),
                "x": ax.get_xlabel(),
                "y": ax.get_ylabel(),
                "legend": [t.get_text() for t in ax.get_legend().get_texts()] if ax.get_legend() else [],
                "ticks": [t.get_text() for t in ax.get_xticklabels()],
            }
            for ax in fig.axes
        ]
        return original(fig, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return seen


def png_size(path: Path) -> tuple[int, int]:
    from PIL import Image

    with Image.open(path) as im:
        assert im.format == "PNG"
        return im.size


def test_several_runs_give_labelled_plots_a_bar_chart_and_a_summary(tmp_path, legends):
    a = fake_run(
        tmp_path / "lr-1e-4",
        0.05,
        benchmarks=[
            summary_line(20, "gsm8k", exact_match__strict_match=0.20),
            summary_line(30, "gsm8k", exact_match__strict_match=0.25),
            summary_line(30, "gsm8k", exact_match__strict_match=0.30),  # evaluated again: the newest line counts
            summary_line(30, "minerva_math", exact_match=0.08),
            summary_line(30, "minerva_math_algebra", group="minerva_math", exact_match=0.1),
        ],
    )
    b = fake_run(tmp_path / "lr-3e-4", 0.15, benchmarks=[summary_line(30, "gsm8k", exact_match__strict_match=0.36)])
    old = fake_run(tmp_path / "older", 0.1, speed=False)  # no summary, no tokens/s, no llmft eval
    written = report.report([a, b, old], tmp_path / "out")

    assert set(written["plots"]) == {
        "loss",
        "learning_rate",
        "tokens_per_second",
        "mfu",
        "gpu_memory",
        "eval_metrics",
        "benchmarks",
    }
    for path in written["plots"].values():
        width, height = png_size(path)
        assert width >= 800 and height >= 500  # readable at default size
    [loss] = legends["loss.png"]
    assert loss["x"] == "optimizer step" and "loss" in loss["y"]
    assert loss["legend"] == [
        "lr-1e-4 train",
        "lr-1e-4 eval",
        "lr-3e-4 train",
        "lr-3e-4 eval",
        "older train",
        "older eval",
    ]
    assert legends["tokens_per_second.png"][0]["legend"] == ["lr-1e-4", "lr-3e-4"]  # the older run has none: left out
    assert legends["gpu_memory.png"][0]["y"] == "peak GPU memory (GiB)"
    assert legends["mfu.png"][0]["legend"] == ["lr-1e-4", "lr-3e-4"] and legends["mfu.png"][0]["y"].startswith(
        "MFU (%"
    )
    [ppl] = legends["eval_metrics.png"]
    assert ppl["ticks"] == ["lr-1e-4", "lr-3e-4", "older"] and ppl["y"] == "perplexity (lower is better)"
    [bench] = legends["benchmarks.png"]  # across runs and checkpoints; a group's subtasks stay out of the chart
    assert bench["ticks"] == ["gsm8k\nexact_match,strict_match", "minerva_math\nexact_match"]
    assert bench["legend"] == ["lr-1e-4 step 20", "lr-1e-4 step 30", "lr-3e-4 step 30"]
    _, _, values = report.benchmark_scores([report.read_run(p, p.name) for p in (a, b)])
    assert values[("gsm8k\nexact_match,strict_match", "lr-1e-4 step 30")] == 0.30
    assert ("minerva_math\nexact_match", "lr-3e-4 step 30") not in values  # not evaluated: an n/a bar, not a zero

    md = written["summary"].read_text()
    rows = {}
    for line in md.splitlines():  # the first table: one row per run
        if line.startswith(("| lr-", "| older")):
            rows.setdefault(line.split("|")[1].strip(), line)
    assert (
        "8 x NVIDIA A100-SXM4-40GB" in rows["lr-1e-4"] and "1h02m" in rows["lr-1e-4"] and "ZeRO-2" in rows["lr-1e-4"]
    )
    assert "| 2 |" in rows["older"]  # GPUs from the checkpoint marker when there is no run summary
    assert "| lr-3e-4 | 30 | gsm8k | 5 | 50 | exact_match,strict_match | 0.36 | 0.05 |" in md
    for path in written["plots"].values():
        assert f"]({path.name})" in md


def test_an_older_run_alone_degrades_and_says_what_is_missing(tmp_path):
    old = fake_run(tmp_path / "old", 0.1, speed=False)
    written = report.report([old], tmp_path / "out")
    assert set(written["plots"]) == {"loss", "learning_rate"}  # one run, no llmft eval: nothing to compare in bars
    assert (
        "Not plotted (not in these runs' logs): throughput, model flops utilisation, gpu memory, eval perplexity across runs, benchmarks across runs and "
        "checkpoints."
    ) in written["summary"].read_text()


def test_not_a_run_directory_is_one_clear_line(tmp_path, capsys):
    """Like every llmft command: one line on stderr, exit code 2 (llmft.command.report_error)."""
    (tmp_path / "empty").mkdir()
    for path, message in (
        (tmp_path / "missing", "is not a directory"),
        (tmp_path / "empty", "holds no trainer_state.json"),
    ):
        assert report.main(SimpleNamespace(run_dir=[path], output=tmp_path / "out")) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("llmft report: error: ") and message in err[0]


def test_a_real_run_and_its_llmft_eval_result(run_with_eval, tmp_path, legends, monkeypatch):
    """The shared 2-process run, then `llmft eval` (gsm8k from a local file) writing into <run>/eval: the report
    shows both."""
    import shutil

    from llmft import eval as ev
    from llmft.data.synthetic import make_examples, write_jsonl

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = Path(shutil.copytree(run_with_eval[0], tmp_path / "run"))
    data = write_jsonl(
        [{"question": e["prompt"], "answer": e["completion"] + "\n#### 1"} for e in make_examples(3, seed=9)],
        tmp_path / "gsm8k.jsonl",
    )
    ev.run(
        SimpleNamespace(
            checkpoint=[str(out), str(out / "checkpoint-3")],
            tasks="gsm8k",
            task_data=[f"gsm8k={data}"],
            num_fewshot=0,
            limit=None,
            batch_size="3",
            gen_kwargs="max_gen_toks=4",
            max_length=None,
            apply_chat_template=False,
            fewshot_as_multiturn=False,
            include_path=None,
            log_samples=False,
            seed=1234,
            output=None,
            model_name=None,
            device="cpu",
            dtype="auto",
            trust_checkpoint=False,
        )
    )
    assert len(list((out / "eval").glob("results-step*.json"))) == 2
    written = report.report([out], tmp_path / "report")
    assert {"loss", "learning_rate", "tokens_per_second", "benchmarks"} <= set(written["plots"])
    # Tokens/s per logging step kept in trainer_state.json (not only printed); CPU: no GPU memory, no MFU peak.
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    losses = [e for e in history if "loss" in e and "step" in e]
    assert len(losses) == 6 and all(e["tokens_per_second"] > 0 for e in losses)
    [attempt] = report.read_attempts(out / "run_summaries.jsonl")
    assert attempt["global_step"] == 6 and attempt["steps"] == 6
    [loss] = legends["loss.png"]
    assert loss["legend"] == ["run train", "run eval"]
    [bench] = legends["benchmarks.png"]
    assert bench["legend"] == ["run step 3", "run step 6"] and bench["ticks"][0] == "gsm8k\nexact_match,strict-match"
    md = written["summary"].read_text()
    row = next(line for line in md.splitlines() if "GPT2LMHeadModel" in line)
    assert "ZeRO-2" in row and "| yes |" in row and "| 6 |" in row and "| 2 |" in row
    assert "| run | 6 | gsm8k | 0 | 3 | exact_match,strict-match |" in md


def test_throughput_metrics_join_the_log_history_entry_of_their_loss_log():
    """HF appends a copy of the logs to log_history before callbacks run: the metrics are added to that entry."""
    from llmft.training.metrics import keep_in_log_history

    history = [{"loss": 2.0, "step": 4}, {"eval_loss": 2.5, "step": 5}]
    keep_in_log_history(history, 5, {"tokens_per_second": 100.0})
    assert history[1] == {"eval_loss": 2.5, "step": 5}  # not a loss log: left alone
    history.append({"loss": 1.9, "learning_rate": 1e-3, "step": 6})
    keep_in_log_history(history, 6, {"tokens_per_second": 100.0, "mfu": 0.4, "peak_gpu_memory_gib": 12.0})
    assert history[-1] == {
        "loss": 1.9,
        "learning_rate": 1e-3,
        "step": 6,
        "tokens_per_second": 100.0,
        "mfu": 0.4,
        "peak_gpu_memory_gib": 12.0,
    }


def test_a_requeued_run_shows_all_its_steps_and_the_time_of_every_attempt(tmp_path):
    """An 80-step run preempted after 40 steps and resumed (its last attempt ran 47 steps in 55 s, from step 33's
    checkpoint): the table shows step 80 and both attempts' time, not the last attempt's 47 steps and 55 s."""
    run = fake_run(
        tmp_path / "requeued", 0.05, steps=80
    )  # the log history HF restored from the checkpoint: steps 1-80
    attempts = [
        {"steps": 40, "global_step": 40, "wall_seconds": 65.0, "tokens_per_second": 2000.0},
        {"steps": 47, "global_step": 80, "wall_seconds": 55.0, "tokens_per_second": 2100.0},
        {"steps": 0, "global_step": 80, "wall_seconds": 9.0},
    ]  # a rerun of the finished run: trains nothing
    (run / "run_summaries.jsonl").write_text("".join(json.dumps(a) + "\n" for a in attempts))
    (run / "run_summary.json").write_text(json.dumps(attempts[-1]))
    md = report.report([run], tmp_path / "out")["summary"].read_text()
    row = next(line for line in md.splitlines() if line.startswith("| requeued"))
    assert "| 80 |" in row and "| 2m00s (2 attempts) |" in row, row

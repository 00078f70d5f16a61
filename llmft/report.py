"""A report a person can look at: PNG plots and a Markdown summary of one or more runs.

```bash
llmft report runs/x                        # runs/x/report/: loss.png, learning_rate.png, ... and report.md
llmft report runs/lr-1e-4 runs/lr-3e-4 runs/lr-1e-3 --output sweep_report
llmft report runs/sft-1a2b3c4d             # a SWEEP's directory: its variants compared, in runs/sft-1a2b3c4d/report/
python -m llmft.report runs/x
```

It reads what a run leaves in its output directory: the trainer state (log history: training and eval
loss, learning rate, per logging step tokens/s, MFU and GPU memory when the run logged them, and a preference
method's own metrics: rewards/chosen, rewards/rejected, rewards/accuracies and rewards/margins for DPO, compared
across a sweep's variants, from llmft.planning.methods' report_metrics); a resume
restores it from the checkpoint), `run_summary.json` (GPUs, throughput), `run_summaries.jsonl` (each attempt's
time: a requeued or resumed run's whole time), `llmft_data.json` (the data), the DeepSpeed config, and `eval/summary.jsonl` from `llmft eval`
(lm-evaluation-harness scores per task and checkpoint: a bar chart across runs and checkpoints). What a run
lacks (older runs, runs stopped early) is left out of the plots and named in the summary, never an error.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from llmft.checkpoint.run_dir import RUN_RECORD
from llmft.command import command_parser, report_error
from llmft.errors import LlmftError
from llmft.launch.sweep import variant_dirs
from llmft.planning import methods

TOKENS_PER_SECOND_KEYS = ("tokens_per_second", "train_tokens_per_second_step", "tokens_per_sec")
MFU_KEYS = ("mfu",)
MEMORY_KEYS = ("peak_gpu_memory_gib", "gpu_memory_gib", "gpu_peak_memory_gib", "memory_gib")


class ReportError(LlmftError, ValueError):
    """A run directory that cannot be reported on; the message names it and the fix."""


# --------------------------------------------------------------------------------------------------
# Reading a run (pure: files in, a Run out)


@dataclass
class Run:
    name: str
    path: Path
    history: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    attempts: list[dict] = field(
        default_factory=list
    )  # run_summaries.jsonl: one run summary per attempt, oldest first
    data: dict = field(default_factory=dict)
    ds_config: dict = field(default_factory=dict)
    model_config: dict = field(default_factory=dict)
    benchmarks: list[dict] = field(default_factory=list)
    done: dict | None = None
    world_size: int | None = None
    state_file: Path | None = None
    method: str = methods.DEFAULT  # llmft train --method (`run_method`): which of its metrics the report plots


def _json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
        return value if isinstance(value, dict) else None
    except (OSError, ValueError):
        return None


def _checkpoints(path: Path) -> list[Path]:
    found = [
        (int(m.group(1)), p)
        for p in path.glob("checkpoint-*")
        if p.is_dir() and (m := re.fullmatch(r"checkpoint-(\d+)", p.name))
    ]
    return [p for _, p in sorted(found)]


def read_run(path: Path, name: str) -> Run:
    """Everything the report uses from one run directory; missing pieces stay empty."""
    if not path.is_dir():
        raise ReportError(f"{path} is not a directory: pass a run's --output_dir")
    ckpts = _checkpoints(path)
    state_file = next(
        (
            p
            for p in [path / "trainer_state.json", *(c / "trainer_state.json" for c in reversed(ckpts))]
            if p.is_file()
        ),
        None,
    )
    if (
        state_file is None
        and not (path / "run_summary.json").is_file()
        and not (path / "eval" / "summary.jsonl").is_file()
    ):
        raise ReportError(
            f"{path} holds no trainer_state.json, run_summary.json or eval/summary.jsonl: pass a run's --output_dir "
            "(it has them once a checkpoint was saved)"
        )
    run = Run(name=name, path=path, state_file=state_file)
    state = _json(state_file) if state_file else None
    run.history = list((state or {}).get("log_history") or [])
    run.summary = _json(path / "run_summary.json") or {}
    run.attempts = read_attempts(path / "run_summaries.jsonl") or ([run.summary] if run.summary else [])
    run.data = _json(path / "llmft_data.json") or {}
    run.ds_config = _json(path / "ds_config.json") or {}
    run.model_config = _json(path / "config.json") or next(
        (c for c in (_json(c / "config.json") for c in reversed(ckpts)) if c), {}
    )
    run.done = _json(path / "llmft_done.json")
    marker = next((m for m in (_json(c / "llmft_complete.json") for c in reversed(ckpts)) if m), None)
    run.world_size = run.summary.get("world_size") or (marker or {}).get("world_size")
    run.benchmarks = read_benchmarks(path / "eval" / "summary.jsonl")
    run.method = run_method(run.history, run.summary, _json(path / RUN_RECORD) or {})
    return run


def run_method(history: list[dict], summary: dict, record: dict) -> str:
    """The run's training method: as its run summary or record names it (llmft train --method), else the method
    whose every report metric (llmft.planning.methods) its log history holds (rewards/accuracies is DPO's, kl
    KTO's, accuracy and margin a reward model's); a run that logged none of them is SFT's."""
    named = summary.get("method") or record.get("method")
    if named in methods.METHODS:
        return named
    logged = {key for entry in history for key in entry}
    for entry in methods.METHODS.values():
        if not methods.is_default(entry.name) and set(entry.report_metrics) <= logged:
            return entry.name
    return methods.DEFAULT


def read_benchmarks(path: Path) -> list[dict]:
    """llmft eval's summary lines, the newest per (checkpoint step, task); lines that do not parse are skipped."""
    latest: dict[tuple, dict] = {}
    try:
        text = path.read_text()
    except OSError:
        return []
    for raw in text.splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if isinstance(line, dict) and isinstance(line.get("metrics"), dict) and line.get("task"):
            latest[(line.get("step"), line["task"])] = line
    return sorted(
        latest.values(), key=lambda x: (x.get("step") if isinstance(x.get("step"), int) else math.inf, x["task"])
    )


def read_attempts(path: Path) -> list[dict]:
    """Every attempt's run summary (llmft.training.metrics.ATTEMPTS_FILE); unreadable lines are skipped."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    attempts = []
    for line in lines:
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict):
            attempts.append(doc)
    return attempts


def run_time(attempts: list[dict]) -> tuple[float | None, int]:
    """(wall seconds summed over the attempts that trained, how many): a requeued or resumed run's whole time.
    An attempt of 0 steps (a rerun of a finished run) is not counted."""
    timed = [a for a in attempts if isinstance(a.get("wall_seconds"), (int, float))]
    trained = [a for a in timed if a.get("steps") != 0] or timed
    return (sum(a["wall_seconds"] for a in trained) if trained else None), len(trained)


def run_names(paths: list[Path]) -> list[str]:
    """Legend names: the directory names, or more of the path where two runs share a name."""
    names = [p.resolve().name for p in paths]
    if len(set(names)) == len(names):
        return names
    return [str(p) for p in paths]


def series(history: list[dict], keys) -> tuple[str | None, list[tuple[int, float]]]:
    """(key found, [(step, value)]) for the first of `keys` the log history holds."""
    for key in keys:
        points = [
            (int(e["step"]), float(e[key]))
            for e in history
            if key in e and "step" in e and isinstance(e[key], (int, float)) and math.isfinite(e[key])
        ]
        if points:
            return key, points
    return None, []


def variant(run: Run, line: dict) -> str:
    """A bar's name: the run, and the checkpoint's step when it has one."""
    return f"{run.name} step {line['step']}" if line.get("step") is not None else run.name


# --------------------------------------------------------------------------------------------------
# Plots


def _axes(title: str, xlabel: str, ylabel: str):
    import matplotlib

    matplotlib.use("Agg")  # files only: works on nodes without a display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _save(fig, ax, path: Path) -> Path:
    import matplotlib.pyplot as plt

    handles, labels = ax.get_legend_handles_labels()
    if labels:
        ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _colors(n: int):
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    return [cmap(i % 10) for i in range(n)]


def plot_loss(runs: list[Run], out: Path) -> Path | None:
    """Training loss (lines) and eval loss (dashed, markers) over optimizer steps, one colour per run."""
    fig, ax = _axes("Loss", "optimizer step", "loss (mean cross-entropy, nats/token)")
    drawn = False
    for run, color in zip(runs, _colors(len(runs))):
        _, train = series(run.history, ("loss",))
        _, ev = series(run.history, ("eval_loss",))
        if train:
            ax.plot(*zip(*train), color=color, label=f"{run.name} train")
        if ev:
            ax.plot(*zip(*ev), color=color, linestyle="--", marker="o", label=f"{run.name} eval")
        drawn = drawn or bool(train or ev)
    return _save(fig, ax, out / "loss.png") if drawn else _discard(fig)


def plot_series(
    runs: list[Run], keys, title: str, ylabel: str, out_file: Path, scale: float = 1.0, log_y: bool = False
) -> Path | None:
    fig, ax = _axes(title, "optimizer step", ylabel)
    drawn = False
    for run, color in zip(runs, _colors(len(runs))):
        _, points = series(run.history, keys)
        if points:
            steps, values = zip(*points)
            ax.plot(
                steps,
                [v * scale for v in values],
                color=color,
                marker="." if len(points) < 30 else None,
                label=run.name,
            )
            drawn = True
    if drawn and log_y:
        ax.set_yscale("log")
    return _save(fig, ax, out_file) if drawn else _discard(fig)


def method_metrics(runs: list[Run]) -> list[str]:
    """The metrics the runs' methods plot beside the loss (llmft.planning.methods' report_metrics), in the table's
    order, each once; SFT's runs add none (their report is as it was)."""
    out: list[str] = []
    for run in runs:
        if not methods.is_default(run.method):
            out += [m for m in methods.METHODS[run.method].report_metrics if m not in out]
    return out


def plot_method_metrics(runs: list[Run], out: Path) -> dict[str, Path | None]:
    """One plot per method metric (rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins for DPO), one
    line per run: a sweep's variants compared on each."""
    plots = {}
    for metric in method_metrics(runs):
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", metric)
        plots[metric] = plot_series(runs, (metric,), metric, metric, out / f"{name}.png")
    return plots


def method_table(runs: list[Run], metrics: list[str]) -> list[str]:
    """The runs side by side on each method metric: its last logged value (a sweep's variants compared)."""
    if not metrics:
        return []
    lines = ["", "## Preference metrics (last logged value)", ""]
    lines += ["| run | method | " + " | ".join(metrics) + " |", "|---|---|" + "---|" * len(metrics)]
    for run in runs:
        last = [series(run.history, (m,))[1] for m in metrics]
        cells = [_fmt(points[-1][1]) if points else "-" for points in last]
        lines.append(f"| {run.name} | {run.method} | " + " | ".join(cells) + " |")
    return lines


def _discard(fig) -> None:
    import matplotlib.pyplot as plt

    plt.close(fig)
    return None


def final_perplexity(run: Run) -> float | None:
    """The training run's last evaluation perplexity (exp of its eval loss)."""
    _, ppl = series(run.history, ("eval_perplexity",))
    _, loss = series(run.history, ("eval_loss",))
    return ppl[-1][1] if ppl else (math.exp(loss[-1][1]) if loss else None)


def plot_eval_bars(runs: list[Run], out: Path) -> Path | None:
    """Across runs: the perplexity of each run's last evaluation during training."""
    values = [final_perplexity(r) for r in runs]
    if all(v is None for v in values):
        return None
    fig, ax = _axes("Perplexity at the last evaluation during training", "run", "perplexity (lower is better)")
    x = list(range(len(runs)))
    heights = [v if v is not None else 0.0 for v in values]
    bars = ax.bar(x, heights, width=0.6, color=_colors(len(runs)))
    ax.bar_label(bars, labels=[f"{v:.3g}" if v is not None else "n/a" for v in values], fontsize="small")
    ax.set_ylim(0, 1.2 * max(heights))
    names = [r.name for r in runs]
    _run_ticks(ax, x, names, 30 if max(len(n) for n in names) > 10 or len(runs) > 4 else 0)
    return _save(fig, ax, out / "eval_metrics.png")


def benchmark_scores(runs: list[Run]) -> tuple[list[str], list[str], dict[tuple[str, str], float]]:
    """(bar groups "task metric", variants "run step N", {(group, variant): value}) from the runs' llmft eval
    summaries: the tasks and groups asked for, not a group's subtasks."""
    groups: list[str] = []
    variants: list[str] = []
    values: dict[tuple[str, str], float] = {}
    for run in runs:
        for line in run.benchmarks:
            if line.get("group"):
                continue
            name = variant(run, line)
            if name not in variants:
                variants.append(name)
            for metric, value in line["metrics"].items():
                if not isinstance(value, (int, float)) or not math.isfinite(value):
                    continue
                group = f"{line['task']}\n{metric}"
                if group not in groups:
                    groups.append(group)
                values[(group, name)] = float(value)
    return groups, variants, values


def plot_benchmarks(runs: list[Run], out: Path) -> Path | None:
    """The accuracy-per-variant figure: one group of bars per task and metric, one bar per run and checkpoint."""
    groups, variants, values = benchmark_scores(runs)
    if not values:
        return None
    fig, ax = _axes("Benchmarks (lm-evaluation-harness)", "task and metric", "score")
    fig.set_size_inches(max(7.5, 0.5 * len(groups) * len(variants) + 2), 4.8)
    width = 0.8 / len(variants)
    for i, (name, color) in enumerate(zip(variants, _colors(len(variants)))):
        xs = [g + (i - (len(variants) - 1) / 2) * width for g in range(len(groups))]
        heights = [values.get((group, name), 0.0) for group in groups]
        bars = ax.bar(xs, heights, width=width, color=color, label=name)
        ax.bar_label(
            bars,
            labels=[f"{values[(group, name)]:.3f}" if (group, name) in values else "n/a" for group in groups],
            fontsize="x-small",
        )
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize="small")
    top = max(values.values())
    ax.set_ylim(0, 1.3 * top if top > 0 else 1.0)  # room above the bars for the legend and the labels
    ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, ax, out / "benchmarks.png")


def _run_ticks(ax, x, names, rotate):
    ax.set_xticks(x)
    ax.set_xticklabels(names, rotation=rotate, ha="right" if rotate else "center")
    ax.set_xlabel("run")
    ax.grid(True, axis="y", alpha=0.3)


# --------------------------------------------------------------------------------------------------
# Markdown


def _fmt(value, unit: str = "", digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}{unit}"
    return f"{value}{unit}"


def _duration(seconds) -> str:
    if not isinstance(seconds, (int, float)):
        return "-"
    seconds = int(seconds)
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"
    )


def describe(run: Run) -> dict:
    """One row of the summary table."""
    s, hist = run.summary, run.history
    _, loss = series(hist, ("loss",))
    _, eval_loss = series(hist, ("eval_loss",))
    runtime = next((e["train_runtime"] for e in reversed(hist) if "train_runtime" in e), None)
    # The optimizer step reached: the log history (restored from the checkpoint on resume) spans every attempt;
    # run_summary.json's `steps` counts only the last attempt's.
    steps = (
        max((e["step"] for e in hist if isinstance(e.get("step"), int)), default=None)
        or s.get("global_step")
        or s.get("steps")
    )
    wall, attempts = run_time(run.attempts)
    zero = (run.ds_config.get("zero_optimization") or {}).get("stage")
    model = (
        run.model_config.get("architectures", ["-"])[0]
        if run.model_config.get("architectures")
        else run.model_config.get("model_type", "-")
    )
    gpus = run.world_size
    return {
        "run": run.name,
        "model": model,
        "data": run.data.get("dataset_name", "-"),
        "gpus": f"{gpus} x {s['gpu']}" if gpus and s.get("gpu") else (str(gpus) if gpus else "-"),
        "zero": f"ZeRO-{zero}" if zero is not None else "-",
        "steps": _fmt(steps),
        "finished": "yes" if run.done is not None else "no",
        "time": (_duration(wall) + (f" ({attempts} attempts)" if attempts > 1 else ""))
        if wall is not None
        else (f"{_duration(runtime)} (training only)" if runtime else "-"),
        "tokens/s": _fmt(s.get("tokens_per_second"), digits=5),
        "peak GPU GiB": _fmt(s.get("peak_gpu_memory_gib"), digits=3),
        "train loss": _fmt(loss[-1][1] if loss else s.get("train_loss")),
        "eval loss": _fmt(eval_loss[-1][1] if eval_loss else None),
    }


def markdown(runs: list[Run], plots: dict[str, Path | None], out: Path) -> str:
    rows = [describe(r) for r in runs]
    cols = list(rows[0])
    lines = [
        "# llmft report",
        "",
        f"{len(runs)} run(s): " + ", ".join(f"`{r.path}`" for r in runs),
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    lines += ["| " + " | ".join(str(row[c]) for c in cols) + " |" for row in rows]
    scored = [(r, line) for r in runs for line in r.benchmarks]
    if scored:
        lines += [
            "",
            "## Benchmarks (llmft eval, lm-evaluation-harness)",
            "",
            "| run | step | task | shots | n | metric | value | stderr |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r, line in scored:
            for metric, value in line["metrics"].items():
                err = (line.get("stderr") or {}).get(metric)
                lines.append(
                    f"| {r.name} | {line.get('step', '-')} | {line['task']} | {_fmt(line.get('num_fewshot'))} | {_fmt(line.get('n'))} "
                    f"| {metric} | {_fmt(value)} | {_fmt(err)} |"
                )
    lines += ["", "## Plots", ""]
    titles = {
        "loss": "Training and eval loss",
        "learning_rate": "Learning rate",
        "tokens_per_second": "Throughput",
        "mfu": "Model FLOPs utilisation",
        "gpu_memory": "GPU memory",
        "eval_metrics": "Eval perplexity across runs",
        "benchmarks": "Benchmarks across runs and checkpoints",
    }
    metrics = method_metrics(runs)
    titles.update({m: m for m in metrics})
    missing = []
    for key, title in titles.items():
        path = plots.get(key)
        if path is not None:
            lines += [f"### {title}", "", f"![{title}]({path.relative_to(out)})", ""]
        else:
            missing.append(title.lower() if key not in metrics else title)
    if missing:
        lines += [f"Not plotted (not in these runs' logs): {', '.join(missing)}.", ""]
    return "\n".join(lines + method_table(runs, metrics))


# --------------------------------------------------------------------------------------------------
# CLI


def make_parser(subparsers=None):

    parser = command_parser(
        subparsers,
        "report",
        "PNG plots and a Markdown summary of one or more runs (loss, learning rate, "
        "tokens/s, GPU memory, eval metrics).",
    )
    parser.add_argument(
        "run_dir",
        nargs="+",
        type=Path,
        help="a run's --output_dir (several: compared; a sweep's directory: its variants)",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="where the PNGs and report.md go (default: RUN_DIR/report for one run, ./llmft_report for several)",
    )
    parser.set_defaults(func=main)
    return parser


def expand_sweeps(paths: list[Path]) -> list[Path]:
    """A sweep's directory (llmft_sweep.json, from SWEEP=... in the job scripts) stands for its variants' runs, in
    the sweep's order; a variant not started yet is named and left out."""
    out = []
    for path in paths:
        variants = variant_dirs(path)
        if variants is None:
            out.append(path)
            continue
        missing = [v.name for v in variants if not v.is_dir()]
        if missing:
            print(f"llmft report: sweep {path}: not started yet, left out: {' '.join(missing)}")
        if len(missing) == len(variants):
            raise ReportError(f"{path}: no variant of this sweep has a run directory yet; report once one has trained")
        out += [v for v in variants if v.is_dir()]
    return out


def report(run_dirs: list[Path], out: Path) -> dict:
    """Read the runs (a sweep's directory: its variants), write the plots and report.md into `out`; returns what
    was written."""
    run_dirs = expand_sweeps(run_dirs)
    runs = [read_run(p, name) for p, name in zip(run_dirs, run_names(run_dirs))]
    out.mkdir(parents=True, exist_ok=True)
    plots = {
        "loss": plot_loss(runs, out),
        "learning_rate": plot_series(
            runs, ("learning_rate",), "Learning rate", "learning rate", out / "learning_rate.png"
        ),
        "tokens_per_second": plot_series(
            runs, TOKENS_PER_SECOND_KEYS, "Throughput", "tokens per second", out / "tokens_per_second.png"
        ),
        "mfu": plot_series(
            runs,
            MFU_KEYS,
            "Model FLOPs utilisation",
            "MFU (% of the GPU's dense 16-bit peak)",
            out / "mfu.png",
            scale=100,
        ),
        "gpu_memory": plot_series(runs, MEMORY_KEYS, "GPU memory", "peak GPU memory (GiB)", out / "gpu_memory.png"),
        "eval_metrics": plot_eval_bars(runs, out) if len(runs) > 1 else None,
        "benchmarks": plot_benchmarks(runs, out),
        **plot_method_metrics(runs, out),
    }
    summary = out / "report.md"
    summary.write_text(markdown(runs, plots, out) + "\n")
    return {"summary": summary, "plots": {k: v for k, v in plots.items() if v is not None}, "runs": runs}


def main(args) -> int:
    out = args.output or (args.run_dir[0] / "report" if len(args.run_dir) == 1 else Path("llmft_report"))
    try:
        written = report(args.run_dir, out)
    except LlmftError as e:
        return report_error("report", e, all_ranks=True)
    for path in written["plots"].values():
        print(f"llmft report: wrote {path}")
    print(f"llmft report: summary {written['summary']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(make_parser().parse_args()))

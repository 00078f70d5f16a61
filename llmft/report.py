"""A report a person can look at: PNG plots and a Markdown summary of one or more runs.

```bash
llmft report runs/x                        # runs/x/report/: loss.png, learning_rate.png, ... and report.md
llmft report runs/lr-1e-4 runs/lr-3e-4 runs/lr-1e-3 --output sweep_report
python -m llmft.report runs/x
```

It reads what a run leaves in its output directory: the trainer state (log history: training and eval
loss, learning rate, and tokens/s and GPU memory when the run logged them), `run_summary.json` (GPUs, time,
throughput), `llmft_data.json` (the data), the DeepSpeed config, and `eval-*.json` from `llmft eval`. What a
run lacks (older runs, runs stopped early) is left out of the plots and named in the summary, never an error.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from llmft.command import command_parser
from llmft.errors import LlmftError

TOKENS_PER_SECOND_KEYS = ("tokens_per_second", "train_tokens_per_second_step", "tokens_per_sec")
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
    data: dict = field(default_factory=dict)
    ds_config: dict = field(default_factory=dict)
    model_config: dict = field(default_factory=dict)
    evals: list[dict] = field(default_factory=list)
    done: dict | None = None
    world_size: int | None = None
    state_file: Path | None = None


def _json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
        return value if isinstance(value, dict) else None
    except (OSError, ValueError):
        return None


def _checkpoints(path: Path) -> list[Path]:
    found = [(int(m.group(1)), p) for p in path.glob("checkpoint-*") if p.is_dir() and (m := re.fullmatch(r"checkpoint-(\d+)", p.name))]
    return [p for _, p in sorted(found)]


def read_run(path: Path, name: str) -> Run:
    """Everything the report uses from one run directory; missing pieces stay empty."""
    if not path.is_dir():
        raise ReportError(f"{path} is not a directory: pass a run's --output_dir")
    ckpts = _checkpoints(path)
    state_file = next((p for p in [path / "trainer_state.json", *(c / "trainer_state.json" for c in reversed(ckpts))] if p.is_file()), None)
    if state_file is None and not (path / "run_summary.json").is_file() and not list(path.glob("eval-*.json")):
        raise ReportError(f"{path} holds no trainer_state.json, run_summary.json or eval-*.json: pass a run's --output_dir "
                          "(it has them once a checkpoint was saved)")
    run = Run(name=name, path=path, state_file=state_file)
    state = _json(state_file) if state_file else None
    run.history = list((state or {}).get("log_history") or [])
    run.summary = _json(path / "run_summary.json") or {}
    run.data = _json(path / "llmft_data.json") or {}
    run.ds_config = _json(path / "ds_config.json") or {}
    run.model_config = _json(path / "config.json") or next((c for c in (_json(c / "config.json") for c in reversed(ckpts)) if c), {})
    run.done = _json(path / "llmft_done.json")
    marker = next((m for m in (_json(c / "llmft_complete.json") for c in reversed(ckpts)) if m), None)
    run.world_size = run.summary.get("world_size") or (marker or {}).get("world_size")
    for f in sorted(path.glob("eval-*.json")):
        doc = _json(f)
        if doc and isinstance(doc.get("metrics"), dict):
            run.evals.append({**doc, "file": f.name})
    return run


def run_names(paths: list[Path]) -> list[str]:
    """Legend names: the directory names, or more of the path where two runs share a name."""
    names = [p.resolve().name for p in paths]
    if len(set(names)) == len(names):
        return names
    return [str(p) for p in paths]


def series(history: list[dict], keys) -> tuple[str | None, list[tuple[int, float]]]:
    """(key found, [(step, value)]) for the first of `keys` the log history holds."""
    for key in keys:
        points = [(int(e["step"]), float(e[key])) for e in history
                  if key in e and "step" in e and isinstance(e[key], (int, float)) and math.isfinite(e[key])]
        if points:
            return key, points
    return None, []


def latest_evals(run: Run) -> list[dict]:
    """The newest llmft eval result per dataset file name prefix (eval-<data>-step<N>.json)."""
    best: dict[str, dict] = {}
    for doc in run.evals:
        data_name = re.sub(r"(-step\d+)?\.json$", "", doc["file"])
        step = doc.get("step") if isinstance(doc.get("step"), int) else -1
        if data_name not in best or step >= (best[data_name].get("step") if isinstance(best[data_name].get("step"), int) else -1):
            best[data_name] = doc
    return [best[k] for k in sorted(best)]


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


def plot_series(runs: list[Run], keys, title: str, ylabel: str, out_file: Path, scale: float = 1.0, log_y: bool = False) -> Path | None:
    fig, ax = _axes(title, "optimizer step", ylabel)
    drawn = False
    for run, color in zip(runs, _colors(len(runs))):
        _, points = series(run.history, keys)
        if points:
            steps, values = zip(*points)
            ax.plot(steps, [v * scale for v in values], color=color, marker="." if len(points) < 30 else None, label=run.name)
            drawn = True
    if drawn and log_y:
        ax.set_yscale("log")
    return _save(fig, ax, out_file) if drawn else _discard(fig)


def _discard(fig) -> None:
    import matplotlib.pyplot as plt

    plt.close(fig)
    return None


def final_metrics(run: Run) -> dict:
    """The numbers compared across runs: llmft eval results first, else the trainer's last evaluation."""
    evals = latest_evals(run)
    if evals:
        m = evals[-1]["metrics"]
        return {"exact_match_strict": m.get("exact_match_strict"), "exact_match_flexible": m.get("exact_match_flexible"),
                "perplexity": m.get("perplexity"), "source": "llmft eval"}
    _, ppl = series(run.history, ("eval_perplexity",))
    _, loss = series(run.history, ("eval_loss",))
    value = ppl[-1][1] if ppl else (math.exp(loss[-1][1]) if loss else None)
    return {"exact_match_strict": None, "exact_match_flexible": None, "perplexity": value, "source": "training eval" if value else None}


def plot_eval_bars(runs: list[Run], out: Path) -> Path | None:
    """Across runs: exact match (strict and flexible, %) and perplexity side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [final_metrics(r) for r in runs]
    has_em = any(m["exact_match_strict"] is not None or m["exact_match_flexible"] is not None for m in metrics)
    has_ppl = any(m["perplexity"] is not None for m in metrics)
    if not (has_em or has_ppl):
        return None
    panels = int(has_em) + int(has_ppl)
    width = max(7.5, 1.2 * len(runs) * panels + 2)
    fig, axes = plt.subplots(1, panels, figsize=(width, 4.8), dpi=120, squeeze=False)
    axes = list(axes[0])
    x = list(range(len(runs)))
    names = [r.name for r in runs]
    rotate = 30 if max(len(n) for n in names) > 10 or len(runs) > 4 else 0
    if has_em:
        ax = axes.pop(0)
        for offset, key, label in ((-0.2, "exact_match_strict", "strict (answer pattern)"), (0.2, "exact_match_flexible", "flexible (last number)")):
            values = [100 * m[key] if m[key] is not None else 0.0 for m in metrics]
            bars = ax.bar([i + offset for i in x], values, width=0.4, label=label)
            ax.bar_label(bars, labels=[f"{v:.1f}" if m[key] is not None else "n/a" for v, m in zip(values, metrics)], fontsize="small")
        ax.set_ylim(0, 122)  # room above 100% for the legend and the labels
        ax.set_yticks(range(0, 101, 20))
        ax.set_ylabel("exact match (%)")
        ax.set_title("Exact match")
        ax.legend(loc="upper left", fontsize="small")
        _run_ticks(ax, x, names, rotate)
    if has_ppl:
        ax = axes.pop(0)
        values = [m["perplexity"] if m["perplexity"] is not None else 0.0 for m in metrics]
        bars = ax.bar(x, values, width=0.6, color=_colors(len(runs)))
        for bar, m in zip(bars, metrics):
            if m["source"] == "training eval":  # not the same measurement as llmft eval: marked
                bar.set_hatch("//")
        ax.bar_label(bars, labels=[f"{v:.3g}" if m["perplexity"] is not None else "n/a" for v, m in zip(values, metrics)], fontsize="small")
        if any(m["source"] == "training eval" for m in metrics):
            from matplotlib.patches import Patch

            ax.legend(handles=[Patch(facecolor="white", edgecolor="black", hatch="//", label="from the training run's last eval loss")],
                      loc="upper left", fontsize="small")
        ax.set_ylim(0, 1.3 * max(values))  # room for the legend above the bars
        ax.set_ylabel("perplexity (lower is better)")
        ax.set_title("Perplexity on the evaluation data")
        _run_ticks(ax, x, names, rotate)
    fig.tight_layout()
    path = out / "eval_metrics.png"
    fig.savefig(path)
    plt.close(fig)
    return path


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
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def describe(run: Run) -> dict:
    """One row of the summary table."""
    s, hist = run.summary, run.history
    _, loss = series(hist, ("loss",))
    _, eval_loss = series(hist, ("eval_loss",))
    runtime = next((e["train_runtime"] for e in reversed(hist) if "train_runtime" in e), None)
    steps = s.get("steps") or next((e["step"] for e in reversed(hist) if "step" in e), None)
    zero = (run.ds_config.get("zero_optimization") or {}).get("stage")
    model = run.model_config.get("architectures", ["-"])[0] if run.model_config.get("architectures") else run.model_config.get("model_type", "-")
    gpus = run.world_size
    return {
        "run": run.name,
        "model": model,
        "data": run.data.get("dataset_name", "-"),
        "gpus": f"{gpus} x {s['gpu']}" if gpus and s.get("gpu") else (str(gpus) if gpus else "-"),
        "zero": f"ZeRO-{zero}" if zero is not None else "-",
        "steps": _fmt(steps),
        "finished": "yes" if run.done is not None else "no",
        "time": _duration(s["wall_seconds"]) if "wall_seconds" in s else (f"{_duration(runtime)} (training only)" if runtime else "-"),
        "tokens/s": _fmt(s.get("tokens_per_second"), digits=5),
        "peak GPU GiB": _fmt(s.get("peak_gpu_memory_gib"), digits=3),
        "train loss": _fmt(loss[-1][1] if loss else s.get("train_loss")),
        "eval loss": _fmt(eval_loss[-1][1] if eval_loss else None),
    }


def markdown(runs: list[Run], plots: dict[str, Path | None], out: Path) -> str:
    rows = [describe(r) for r in runs]
    cols = list(rows[0])
    lines = ["# llmft report", "", f"{len(runs)} run(s): " + ", ".join(f"`{r.path}`" for r in runs), "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(row[c]) for c in cols) + " |" for row in rows]
    evals = [(r, doc) for r in runs for doc in latest_evals(r)]
    if evals:
        lines += ["", "## llmft eval", "", "| run | file | step | perplexity | exact match strict | exact match flexible | n |", "|---|---|---|---|---|---|---|"]
        for r, doc in evals:
            m = doc["metrics"]
            pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
            lines.append(f"| {r.name} | {doc['file']} | {doc.get('step', '-')} | {_fmt(m.get('perplexity'))} | "
                         f"{pct(m.get('exact_match_strict'))} | {pct(m.get('exact_match_flexible'))} | {m.get('n', '-')} |")
    lines += ["", "## Plots", ""]
    titles = {"loss": "Training and eval loss", "learning_rate": "Learning rate", "tokens_per_second": "Throughput",
              "gpu_memory": "GPU memory", "eval_metrics": "Eval metrics across runs"}
    missing = []
    for key, title in titles.items():
        path = plots.get(key)
        if path is not None:
            lines += [f"### {title}", "", f"![{title}]({path.relative_to(out)})", ""]
        else:
            missing.append(title.lower())
    if missing:
        lines += [f"Not plotted (not in these runs' logs): {', '.join(missing)}.", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# CLI


def make_parser(subparsers=None):

    parser = command_parser(subparsers, "report", "PNG plots and a Markdown summary of one or more runs (loss, learning rate, "
                                                  "tokens/s, GPU memory, eval metrics).")
    parser.add_argument("run_dir", nargs="+", type=Path, help="a run's --output_dir (several: compared)")
    parser.add_argument("--output", type=Path, default=None, help="where the PNGs and report.md go (default: RUN_DIR/report for one run, ./llmft_report for several)")
    parser.set_defaults(func=main)
    return parser


def report(run_dirs: list[Path], out: Path) -> dict:
    """Read the runs, write the plots and report.md into `out`; returns what was written."""
    runs = [read_run(p, name) for p, name in zip(run_dirs, run_names(run_dirs))]
    out.mkdir(parents=True, exist_ok=True)
    plots = {
        "loss": plot_loss(runs, out),
        "learning_rate": plot_series(runs, ("learning_rate",), "Learning rate", "learning rate", out / "learning_rate.png"),
        "tokens_per_second": plot_series(runs, TOKENS_PER_SECOND_KEYS, "Throughput", "tokens per second", out / "tokens_per_second.png"),
        "gpu_memory": plot_series(runs, MEMORY_KEYS, "GPU memory", "peak GPU memory (GiB)", out / "gpu_memory.png"),
        "eval_metrics": plot_eval_bars(runs, out) if len(runs) > 1 or any(latest_evals(r) for r in runs) else None,
    }
    summary = out / "report.md"
    summary.write_text(markdown(runs, plots, out) + "\n")
    return {"summary": summary, "plots": {k: v for k, v in plots.items() if v is not None}, "runs": runs}


def main(args) -> int:
    out = args.output or (args.run_dir[0] / "report" if len(args.run_dir) == 1 else Path("llmft_report"))
    try:
        written = report(args.run_dir, out)
    except ReportError as e:
        raise SystemExit(f"llmft report: error: {e}") from None
    for path in written["plots"].values():
        print(f"llmft report: wrote {path}")
    print(f"llmft report: summary {written['summary']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(make_parser().parse_args()))

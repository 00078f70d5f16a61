"""The model card (README.md) `llmft export` writes: huggingface_hub's ModelCardData for the metadata, then what a
reader needs to trust and use the model, from the files the run left in its output directory:

| card section | from |
|---|---|
| base model, data, method, hyperparameters, ZeRO stage | `llmft_run.json` (llmft.training.run_identity) |
| data fit counts (records kept, truncated, dropped) | `llmft_data.json` (llmft.data.cache) |
| the resolved DeepSpeed config | `ds_config.json` |
| the exact command, nodes, scheduler, package versions | `llmft_launch.json` (written at the run's start) |
| GPUs, GPU-hours, tokens/s, MFU | `run_summary.json`, `run_summaries.jsonl` (llmft.training.metrics) |
| model-index results | `eval/summary.jsonl` (`llmft eval`) |

What a run lacks is said, never invented: no licence unless the base model's local card names one (TRL's card
writes the placeholder `license`), no results section without `llmft eval`.
"""

from __future__ import annotations

import json
from pathlib import Path

DATA_FILE_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet", ".txt", ".arrow", ".tsv")
REPO_ID_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./")


def _json(path: Path) -> dict:
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _jsonl(path: Path) -> list[dict]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def hub_id(name: str | None) -> str | None:
    """A Hub repository id (`org/name` or a legacy `name`), or None for a local path: card metadata names Hub repos."""
    if not name or Path(name).exists() or name.startswith(("/", ".", "~")) or not set(name) <= REPO_ID_CHARS:
        return None
    if name.lower().endswith(DATA_FILE_SUFFIXES):  # a data file that is not on this machine any more
        return None
    return name if name.count("/") <= 1 else None


def base_license(base: str | None) -> str | None:
    """The base model's licence from its own card where it is on this machine; None leaves it for the user."""
    from huggingface_hub import ModelCard

    if not base or not (Path(base) / "README.md").is_file():
        return None
    try:
        license_ = ModelCard.load(Path(base) / "README.md").data.license
    except Exception:  # a card that does not parse names no licence we can trust
        return None
    return license_ if isinstance(license_, str) and license_ not in ("license", "other", "") else None


def eval_results(rows: list[dict], step: int | None, model_name: str) -> list:
    """model-index entries from `llmft eval`'s summary lines for the exported step (the newest line per task and
    metric); numeric metrics only."""
    from huggingface_hub import EvalResult

    latest: dict[tuple, tuple] = {}
    for row in rows:
        if row.get("step") != step or not row.get("task") or not isinstance(row.get("metrics"), dict):
            continue
        for metric, value in row["metrics"].items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                latest[(row["task"], metric)] = (row, value)
    return [
        EvalResult(
            task_type="text-generation",
            dataset_type=task,
            dataset_name=task,
            metric_type=metric.split(",")[0],
            metric_name=metric,
            metric_value=value,
        )
        for (task, metric), (row, value) in sorted(latest.items())
    ]


def run_dir_of(source: str) -> Path:
    """The run's output directory from the exported tag directory (run/checkpoint-N/global_stepN)."""
    ckpt_dir = Path(source).parent
    return ckpt_dir.parent if ckpt_dir.name.startswith("checkpoint-") else ckpt_dir


def gpu_hours(attempts: list[dict]) -> float | None:
    """GPU-hours over every attempt (requeues and resumes included): wall seconds x ranks; None without GPUs."""
    total = 0.0
    for a in attempts:
        if not a.get("gpu") or not a.get("wall_seconds") or not a.get("world_size"):
            continue
        total += a["wall_seconds"] * a["world_size"] / 3600
    return round(total, 3) if total else None


def card_data(facts: dict, record: dict):
    """The card's YAML metadata (ModelCardData): only what is known, never a placeholder."""
    from huggingface_hub import ModelCardData

    run = facts["run"]
    base = hub_id(run.get("model"))
    dataset = hub_id(run.get("dataset"))
    method = "lora" if run.get("lora") else "full"
    data = ModelCardData(
        base_model=base,
        license=base_license(run.get("model")),
        datasets=[dataset] if dataset else None,
        tags=["llmft", "deepspeed", "trl", "sft", method] + (["qlora"] if run.get("quantization") else []),
        pipeline_tag="text-generation",
        library_name="peft" if record.get("lora") == "adapter" else "transformers",
        model_name=facts["name"],
        eval_results=eval_results(facts["evals"], record.get("step"), facts["name"]) or None,
    )
    if base:
        data.base_model_relation = "adapter" if record.get("lora") == "adapter" else "finetune"
    return data


def gather(name: str, record: dict) -> dict:
    """Everything the card says, read from the run directory beside the exported checkpoint."""
    run_dir = run_dir_of(record["source"])
    summary = _json(run_dir / "run_summary.json")
    return {
        "name": name,
        "run_dir": run_dir,
        "run": _json(run_dir / "llmft_run.json"),
        "data": _json(run_dir / "llmft_data.json"),
        "ds_config": _json(run_dir / "ds_config.json"),
        "launch": _json(run_dir / "llmft_launch.json"),
        "summary": summary,
        "attempts": _jsonl(run_dir / "run_summaries.jsonl") or ([summary] if summary else []),
        "evals": _jsonl(run_dir / "eval" / "summary.jsonl"),
    }


def _table(rows: list[tuple[str, object]]) -> str:
    lines = ["| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows if v not in (None, "", [], {})]
    return "\n".join(lines)


def merge_line(dequantized: dict | None) -> str | None:
    """A QLoRA merge's row: the adapter went into the base as training held it, not into the original weights."""
    if not dequantized:
        return None
    double = ", double quantization" if dequantized.get("double_quant") else ""
    return (
        f"the adapter merged into the base dequantized from {dequantized['quant_type']} 4-bit (block size "
        f"{dequantized['blocksize']}{double}, from {dequantized['dtype']}), the weights the adapter was trained on"
    )


def training_section(facts: dict, record: dict) -> str:
    run, data = facts["run"], facts["data"]
    lora = run.get("lora")
    method = f"LoRA ({json.dumps(lora)})" if lora else "full fine-tune"
    if run.get("quantization"):
        method = f"QLoRA ({json.dumps(run['quantization'])}), {method}"
    fit = (data.get("fit") or {}).get("train") or {}
    fit_line = (
        f"{fit.get('records')} records: {fit.get('kept')} kept whole, {fit.get('truncated')} truncated, "
        f"{fit.get('dropped')} dropped at max_length {fit.get('max_length')} ({fit.get('tokens')} tokens)"
        if fit
        else None
    )
    rows = [
        ("method", method),
        ("merge", merge_line(record.get("dequantized_base"))),
        ("base model", run.get("model")),
        ("data", run.get("dataset")),
        ("data format, loss on", f"{data.get('format')}, {data.get('loss_on')}" if data else None),
        ("data fit", fit_line),
        ("max_length, packing", f"{run.get('max_length')}, {run.get('packing')}" if run else None),
        ("global batch", run.get("global_batch")),
        ("ZeRO stage", run.get("zero_stage")),
        ("steps", record.get("step")),
    ]
    rows += [(k, v) for k, v in (run.get("hyperparameters") or {}).items()]
    text = "## How it was trained\n\n" + _table(rows)
    command = facts["launch"].get("command")
    text += (
        "\n\nThe exact command:\n\n```bash\n"
        + (command or "(not recorded: the run predates llmft_launch.json)")
        + "\n```\n"
    )
    if facts["ds_config"]:
        text += "\nThe resolved DeepSpeed config:\n\n```json\n" + json.dumps(facts["ds_config"], indent=2) + "\n```\n"
    return text


def compute_section(facts: dict) -> str:
    summary, launch = facts["summary"], facts["launch"]
    if not summary and not launch:
        return "## Where, and how fast\n\nNot recorded: the run directory holds no run_summary.json.\n"
    rows = [
        ("GPUs", f"{summary.get('world_size')} x {summary['gpu']}" if summary.get("gpu") else "none (CPU)"),
        ("nodes x processes per node", f"{launch.get('nnodes')} x {launch.get('nproc_per_node')}" if launch else None),
        ("scheduler", (launch.get("scheduler") or "none") if launch else None),
        ("GPU-hours", gpu_hours(facts["attempts"])),
        ("tokens/s", summary.get("tokens_per_second")),
        ("MFU", summary.get("mfu") if summary.get("mfu") is not None else "n/a (no GPU peak known)"),
        ("training seconds, wall seconds", f"{summary.get('train_seconds')}, {summary.get('wall_seconds')}"),
        ("final training loss", summary.get("train_loss")),
    ]
    return "## Where, and how fast\n\n" + _table(rows) + "\n"


def usage_section(facts: dict, record: dict, repo: str) -> str:
    versions = facts["launch"].get("versions") or {}
    text = "## Packages\n\n" + (
        _table(sorted(versions.items())) if versions else "Not recorded (the run predates llmft_launch.json)."
    )
    text += f"\n\nExported by `llmft export` from `{record['source']}` (step {record.get('step')}, ZeRO-{record.get('zero_stage')}) as {record['dtype']}.\n"
    if record.get("lora") == "adapter":
        base = facts["run"].get("model")
        return text + (
            "\n## Use\n\n```python\nfrom peft import AutoPeftModelForCausalLM\n"
            f'model = AutoPeftModelForCausalLM.from_pretrained("{repo}")\n```\n\n'
            f"```bash\nvllm serve {base} --enable-lora --lora-modules adapter={repo}\n```\n"
        )
    chat = record.get("end_of_turn")
    stop = f"; generation_config.json stops at `{chat}` as well as the EOS" if chat else ""
    return text + (
        "\n## Use\n\n```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f'tokenizer = AutoTokenizer.from_pretrained("{repo}")\n'
        f'model = AutoModelForCausalLM.from_pretrained("{repo}", dtype="auto")\n```\n\n'
        f"```bash\nvllm serve {repo}   # the chat template is the tokenizer's, as trained{stop}\n```\n"
    )


def render(name: str, record: dict, repo: str | None = None):
    """The whole card as a huggingface_hub ModelCard."""
    from huggingface_hub import ModelCard

    facts = gather(name, record)
    data = card_data(facts, record)
    licence = (
        ""
        if data.license
        else "\nLicence: not set. The base model's licence applies; add `license:` above before publishing.\n"
    )
    results = ""
    if data.eval_results:
        results = (
            "\n## Results (`llmft eval`)\n\n"
            + _table([(f"{r.dataset_name}: {r.metric_name}", r.metric_value) for r in data.eval_results])
            + "\n"
        )
    body = (
        f"---\n{data.to_yaml()}\n---\n\n# {facts['name']}\n\n"
        f"A fine-tune of {facts['run'].get('model') or 'its base model'} with llmft (TRL's SFTTrainer on DeepSpeed ZeRO).\n"
        + licence
        + results
        + "\n"
        + training_section(facts, record)
        + "\n"
        + compute_section(facts)
        + "\n"
        + usage_section(facts, record, repo or facts["name"])
    )
    return ModelCard(body)


def write_card(out: Path, record: dict, repo: str | None = None, name: str | None = None) -> Path:
    """README.md in `out`; `name` is the model's (the directory it ends up in), by default out's own name."""
    card = render(name or Path(out).resolve().name, record, repo)
    path = Path(out) / "README.md"
    card.save(path)
    return path

"""Standard benchmarks on a checkpoint through lm-evaluation-harness.

```bash
llmft eval runs/x --tasks gsm8k,minerva_math,mmlu                 # the run's newest complete checkpoint
llmft eval runs/x/checkpoint-500 runs/x/checkpoint-1000 exported/ --tasks gsm8k --limit 200
llmft eval runs/x --tasks gsm8k --task_data gsm8k=gsm8k_test.jsonl --task_data gsm8k:train=gsm8k_train.jsonl  # offline
llmft eval runs/x --tasks mmlu_abstract_algebra --task_data mmlu_abstract_algebra=mmlu/abstract_algebra/   # test.jsonl, dev.jsonl
```

A checkpoint is a ZeRO `global_stepN` directory, a `checkpoint-N` directory or a run directory (its newest
complete checkpoint), read by llmft's inference loader (exact fp32 masters from the shards, no DeepSpeed, no
export), or a Hugging Face model directory. The model is handed in memory to the harness's `HFLM`; the tasks,
prompts, few-shot examples, answer extraction and metrics are the harness's own (`lm-eval` 0.4). Device and
precision are chosen as `llmft infer` chooses them; batch size `auto` is the harness's search for the largest
batch that fits on a GPU, 8 on the CPU.

`--task_data TASK=FILE` points a task's evaluated split (test, else validation) at a local file in the task's
own format, `TASK:SPLIT=FILE` another split (e.g. `gsm8k:train`, where GSM8K draws its few-shot examples),
`TASK=DIR` every split with a file `DIR/<split>.jsonl` (or .json, .parquet, .csv). The harness's YAML is not
edited: llmft writes a task file that `include:`s it and changes only where the data comes from.

Results go to `<run>/eval/` (`--output` elsewhere): the harness's JSON (`results-step<N>-<time>.json`), with
`--log_samples` every prompt, response and score (`samples-step<N>-<task>-<time>.jsonl`), and one line per task
appended to `summary.jsonl`, which `llmft report` plots across runs and checkpoints.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import sys
import time
from pathlib import Path

from llmft.checkpoint.loader import DTYPES, Model, load_model, pick_device, pick_dtype
from llmft.checkpoint.zero import CheckpointError
from llmft.command import command_parser, report_error
from llmft.errors import LlmftError

DATA_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
SPLIT_KEYS = ("test_split", "validation_split", "training_split", "fewshot_split")


class EvalError(LlmftError, ValueError):
    """Evaluation cannot run as asked; the message names the problem and the fix."""


# --------------------------------------------------------------------------------------------------
# --task_data: a standard task read from local files (pure but for reading the first record)


def parse_task_data(values: list[str]) -> dict[str, dict[str | None, Path]]:
    """`TASK=PATH` / `TASK:SPLIT=FILE` values -> {task: {split or None (the evaluated split): path}}."""
    out: dict[str, dict[str | None, Path]] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise EvalError(
                f"--task_data {value!r}: use TASK=FILE, TASK:SPLIT=FILE or TASK=DIR (e.g. gsm8k=gsm8k_test.jsonl)"
            )
        task, _, split = name.partition(":")
        p = Path(path)
        if not p.exists():
            raise EvalError(f"--task_data {value}: {p} does not exist: check the path")
        if p.is_file() and p.suffix not in DATA_SUFFIXES:
            raise EvalError(f"--task_data {value}: {p.name} is not a {', '.join(DATA_SUFFIXES)} file")
        if p.is_dir() and split:
            raise EvalError(f"--task_data {value}: a split names one file, not a directory")
        splits = out.setdefault(task, {})
        key = split or None
        if key in splits:
            raise EvalError(f"--task_data gives {task}{':' + split if split else ''} twice: give each task split once")
        splits[key] = p
    return out


def split_files(task: str, cfg: dict, given: dict[str | None, Path]) -> dict[str, Path]:
    """{split name: file} for a task whose (include-resolved) YAML config is `cfg`."""
    used = [cfg[k] for k in SPLIT_KEYS if cfg.get(k)]
    evaluated = cfg.get("test_split") or cfg.get("validation_split")
    files: dict[str, Path] = {}
    for split, path in given.items():
        if path.is_dir():
            for name in dict.fromkeys(used):
                found = [path / f"{name}{s}" for s in DATA_SUFFIXES if (path / f"{name}{s}").is_file()]
                if found:
                    files[name] = found[0]
            continue
        name = split or evaluated
        if name not in used:
            raise EvalError(
                f"--task_data {task}:{split}: {task} has no split {split!r}; its splits are {', '.join(dict.fromkeys(used))}"
            )
        files[name] = path
    if evaluated not in files:
        where = next(iter(given.values()))
        raise EvalError(
            f"--task_data {task}: no file for {task}'s evaluated split {evaluated!r} (looked for {where}/{evaluated}.jsonl): "
            f"give {task}={evaluated}.jsonl"
        )
    builders = {DATA_SUFFIXES[p.suffix] for p in files.values()}
    if len(builders) > 1:
        raise EvalError(
            f"--task_data {task}: its files mix formats ({', '.join(sorted(p.name for p in files.values()))}): use one format"
        )
    return files


def fewshot_split_needed(cfg: dict, num_fewshot: int | None) -> str | None:
    """The split a task draws its few-shot examples from, when it draws any and they are not fixed in its YAML."""
    shots = cfg.get("num_fewshot", 0) if num_fewshot is None else num_fewshot
    fewshot_config = cfg.get("fewshot_config") or {}
    if not shots or fewshot_config.get("samples") is not None:
        return None
    return (
        fewshot_config.get("split")
        or cfg.get("fewshot_split")
        or cfg.get("training_split")
        or cfg.get("validation_split")
    )


def template_fields(cfg: dict) -> set[str]:
    """The record fields the task's Jinja templates read (none when it preprocesses records in Python)."""
    if cfg.get("process_docs") is not None:
        return set()
    import jinja2
    from jinja2 import meta

    env = jinja2.Environment()
    fields: set[str] = set()
    for key in ("doc_to_text", "doc_to_target", "doc_to_choice"):
        value = cfg.get(key)
        if isinstance(value, str) and "{" in value:
            try:
                fields |= meta.find_undeclared_variables(env.parse(value))
            except jinja2.TemplateSyntaxError:
                pass
    return fields


def first_record(path: Path) -> dict | None:
    """The first record of a JSON Lines / JSON file (None for other formats: the harness reads those)."""
    if path.suffix not in (".jsonl", ".json"):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            if path.suffix == ".jsonl":
                line = next((line for line in f if line.strip()), None)
                if line is None:
                    raise EvalError(f"{path} is empty: it needs the task's records, one JSON object a line")
                record = json.loads(line)
            else:
                data = json.load(f)
                record = (data[0] if data else None) if isinstance(data, list) else data
    except (ValueError, UnicodeDecodeError) as e:
        raise EvalError(
            f"{path} is not valid JSON ({str(e).splitlines()[0]}): give the task's records as JSON Lines"
        ) from None
    return record if isinstance(record, dict) else None


def task_override(task: str, cfg: dict, yaml_path: Path, files: dict[str, Path]) -> dict:
    """A task config that includes the harness's YAML and changes only the data source: local files for the
    splits given, the splits not given removed (so nothing is fetched for them)."""
    override = {
        "include": str(yaml_path),
        "task": task,
        "dataset_path": DATA_SUFFIXES[next(iter(files.values())).suffix],
        "dataset_name": None,
        "dataset_kwargs": {"data_files": {s: str(p.resolve()) for s, p in files.items()}},
    }
    for key in SPLIT_KEYS:
        if cfg.get(key) and cfg[key] not in files:
            override[key] = None
    fewshot_config = cfg.get("fewshot_config") or {}
    if fewshot_config.get("split") and fewshot_config["split"] not in files:
        override["fewshot_config"] = {k: v for k, v in fewshot_config.items() if k != "split"}
    return override


def write_overrides(task_data: dict, num_fewshot: int | None, manager, directory: Path) -> Path:
    """Check every --task_data task against its YAML and its files; write the including YAMLs into `directory`."""
    import yaml
    from lm_eval.tasks._index import Kind
    from lm_eval.tasks._yaml_loader import load_yaml

    directory.mkdir(parents=True, exist_ok=True)
    for task, given in task_data.items():
        entry = manager.task_index.get(task)
        if entry is None or entry.yaml_path is None or entry.kind not in (Kind.TASK,):
            if entry is not None and entry.kind in (Kind.GROUP, Kind.TAG):
                raise EvalError(
                    f"--task_data {task}: {task} is a group of tasks; give data for each of its tasks "
                    f"(e.g. --task_data {task}_<name>=FILE)"
                )
            if entry is not None:
                raise EvalError(
                    f"--task_data {task}: {task} is defined in Python, not YAML: its data source cannot be changed"
                )
            raise EvalError(f"--task_data {task}: {unknown_task(task, manager)}")
        cfg = load_yaml(entry.yaml_path, resolve_func=False, recursive=True)
        files = split_files(task, cfg, given)
        needed = fewshot_split_needed(cfg, num_fewshot)
        if needed and needed not in files:
            shots = cfg.get("num_fewshot", 0) if num_fewshot is None else num_fewshot
            raise EvalError(
                f"--task_data {task}: {task} draws its {shots} few-shot examples from its {needed!r} split: "
                f"add --task_data {task}:{needed}=FILE, or pass --num_fewshot 0"
            )
        fields = template_fields(cfg)
        for split, path in files.items():
            record = first_record(path)
            missing = sorted(f for f in fields if record is not None and f not in record)
            if missing:
                raise EvalError(
                    f"--task_data {task}:{split}: {path.name}'s records lack {', '.join(missing)} "
                    f"(the fields {task}'s prompts read: {', '.join(sorted(fields))}); they have {', '.join(record)}"
                )
        (directory / f"{task}.yaml").write_text(
            yaml.safe_dump(task_override(task, cfg, Path(entry.yaml_path), files), sort_keys=False)
        )
    return directory


def unknown_task(name: str, manager) -> str:
    close = difflib.get_close_matches(name, manager.all_tasks, n=3)
    return (
        f"unknown task {name!r} in lm-evaluation-harness"
        + (f" (close: {', '.join(close)})" if close else "")
        + ": see `lm-eval ls tasks`, or --include_path DIR for your own task YAMLs"
    )


def parse_tasks(value: str) -> list[str]:
    tasks = [t.strip() for t in value.split(",") if t.strip()]
    if not tasks:
        raise EvalError("--tasks names no task: e.g. --tasks gsm8k,minerva_math,mmlu")
    return list(dict.fromkeys(tasks))


def eval_batch_size(requested: str, device: str) -> int | str:
    """--batch_size: a number as given; auto is the harness's search for the largest batch that fits on a GPU,
    and 8 on the CPU (no memory to search against there)."""
    if requested == "auto":
        return "auto" if device.startswith("cuda") else 8
    try:
        size = int(requested)
    except ValueError:
        size = 0
    if size < 1:
        raise EvalError(f"--batch_size {requested}: give a positive number or auto")
    return size


# --------------------------------------------------------------------------------------------------
# Results: the harness's JSON, and llmft's one line per task


def summary_lines(results: dict, meta: dict) -> list[dict]:
    """One record per task (and group) the harness scored: its metrics, their standard errors, the shots and n."""
    parent = {t: g for g, subtasks in (results.get("group_subtasks") or {}).items() for t in subtasks}
    lines = []
    for task, values in results["results"].items():
        metrics, stderr = {}, {}
        for key, value in values.items():
            if "," not in key or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            metric, _, flt = key.partition(",")
            name = metric.removesuffix("_stderr") + ("" if flt == "none" else f",{flt}")
            (stderr if metric.endswith("_stderr") else metrics)[name] = float(value)
        n = (results.get("n-samples") or {}).get(task, {}).get("effective")
        lines.append(
            {
                **meta,
                "task": task,
                "group": parent.get(task),
                "num_fewshot": (results.get("n-shot") or {}).get(task),
                "n": n,
                "metrics": metrics,
                "stderr": stderr,
            }
        )
    return lines


def describe_line(line: dict) -> str:
    shots = f"{line['num_fewshot']}-shot" if line["num_fewshot"] is not None else "-"
    values = ", ".join(
        f"{k} {v:.4f}"
        + (
            f" ± {line['stderr'][k]:.4f}"
            if isinstance(line["stderr"].get(k), float) and math.isfinite(line["stderr"][k])
            else ""
        )
        for k, v in line["metrics"].items()
    )
    at = f"step {line['step']}" if line["step"] is not None else "the model"
    return f"{line['task']} ({shots}, n={line['n']}) {at}: {values or 'no numeric metric'}"


def write_results(results: dict, meta: dict, out_dir: Path, stamp: str) -> tuple[Path, list[dict]]:
    """The harness's results (samples apart) as JSON, the samples as JSON Lines per task, the summary lines appended."""
    from lm_eval.utils import handle_non_serializable

    out_dir.mkdir(parents=True, exist_ok=True)
    step = f"step{meta['step']}" if meta["step"] is not None else "final"
    samples = results.pop("samples", None) or {}
    path = out_dir / f"results-{step}-{stamp}.json"
    path.write_text(
        json.dumps({**results, "llmft": meta}, indent=2, default=handle_non_serializable, ensure_ascii=False) + "\n"
    )
    for task, rows in samples.items():
        with open(out_dir / f"samples-{step}-{task}-{stamp}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row, default=handle_non_serializable, ensure_ascii=False) + "\n" for row in rows)
    lines = summary_lines(results, {**meta, "results_file": path.name})
    with open(out_dir / "summary.jsonl", "a", encoding="utf-8") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    return path, lines


# --------------------------------------------------------------------------------------------------
# CLI


def make_parser(subparsers=None):
    parser = command_parser(
        subparsers, "eval", "Standard benchmarks (lm-evaluation-harness tasks) on one or more checkpoints."
    )
    parser.add_argument(
        "checkpoint",
        nargs="+",
        help="global_stepN dir, checkpoint-N dir, run dir or Hugging Face model dir (several: each evaluated)",
    )
    parser.add_argument(
        "--tasks", required=True, help="comma-separated harness tasks or groups, e.g. gsm8k,minerva_math,mmlu"
    )
    parser.add_argument(
        "--task_data",
        action="append",
        default=[],
        metavar="TASK[:SPLIT]=PATH",
        help="read a task's data from a local file in its format (repeat): TASK=FILE (evaluated split), "
        "TASK:SPLIT=FILE, TASK=DIR (DIR/<split>.jsonl)",
    )
    parser.add_argument(
        "--num_fewshot", type=int, default=None, help="few-shot examples per prompt (default: each task's own)"
    )
    parser.add_argument("--limit", type=int, default=None, help="evaluate the first N documents of each task")
    parser.add_argument(
        "--batch_size", default="auto", help="a number, or auto: the largest that fits on a GPU, 8 on the CPU"
    )
    parser.add_argument(
        "--gen_kwargs", default=None, help="generation settings over the tasks' own, e.g. max_gen_toks=256"
    )
    parser.add_argument(
        "--apply_chat_template", action="store_true", help="wrap prompts in the tokenizer's chat template"
    )
    parser.add_argument(
        "--fewshot_as_multiturn", action="store_true", help="with --apply_chat_template: few-shot examples as turns"
    )
    parser.add_argument("--include_path", default=None, help="a directory of your own task YAMLs (harness format)")
    parser.add_argument("--log_samples", action="store_true", help="also write every prompt, response and score")
    parser.add_argument(
        "--seed", type=int, default=1234, help="seed for few-shot sampling and the harness's random state"
    )
    parser.add_argument(
        "--output", type=Path, default=None, help="results directory (default: <run>/eval for each checkpoint)"
    )
    parser.add_argument(
        "--model_name",
        "--model_name_or_path",
        dest="model_name",
        default=None,
        help="base model for config and tokenizer (plain DeepSpeed checkpoints)",
    )
    parser.add_argument("--device", default=None, help="cuda:0 when available, else cpu")
    parser.add_argument("--dtype", default="auto", help="auto: bf16 on Ampere+ GPUs, fp16 on older ones, fp32 on CPU")
    parser.add_argument(
        "--trust_checkpoint",
        action="store_true",
        help="unpickle shards with full pickle (only for checkpoints you trust)",
    )
    parser.set_defaults(func=main)
    return parser


def check_args(args, env) -> None:
    """Bad numbers and launches, before any model loads."""
    if args.limit is not None and args.limit < 1:
        raise EvalError(f"--limit must be at least 1, got {args.limit}")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise EvalError(f"--num_fewshot must be 0 or more, got {args.num_fewshot}")
    if args.dtype != "auto" and args.dtype not in DTYPES:
        raise EvalError(f"--dtype {args.dtype}: use auto, float32, bfloat16 or float16")
    if args.fewshot_as_multiturn and not args.apply_chat_template:
        raise EvalError("--fewshot_as_multiturn needs --apply_chat_template")
    world = next((env[n] for n in ("WORLD_SIZE", "SLURM_NTASKS") if env.get(n, "").strip()), "1")
    if world != "1":
        raise EvalError(
            f"llmft eval runs in one process (the harness scores one in-memory model), but this launch has {world}: "
            "run it without torchrun, or with srun --ntasks 1"
        )
    if args.include_path is not None and not Path(args.include_path).is_dir():
        raise EvalError(f"--include_path {args.include_path} is not a directory of task YAMLs")


def task_manager(args, work: Path):
    """The harness's task index with --include_path and the --task_data overrides (later paths win)."""
    from lm_eval.tasks import TaskManager

    base = TaskManager(include_path=args.include_path)
    requested = parse_tasks(args.tasks)
    for task in requested:
        if task not in base.task_index:
            raise EvalError(f"--tasks: {unknown_task(task, base)}")
    task_data = parse_task_data(args.task_data)
    if not task_data:
        return base, requested
    overrides = write_overrides(task_data, args.num_fewshot, base, work)
    paths = [p for p in (args.include_path, str(overrides)) if p]
    return TaskManager(include_path=paths), requested


def counting_hflm():
    """The harness's HFLM, counting the generation prompts it cuts from the left to fit the model's positions
    (the harness only logs a warning per batch)."""
    from lm_eval.models.huggingface import HFLM

    class CountingHFLM(HFLM):
        left_truncated = 0

        def tok_batch_encode(self, strings, padding_side="left", left_truncate_len=None, truncation=False):
            ids, mask = super().tok_batch_encode(strings, padding_side, None, truncation)
            if left_truncate_len and ids.size(1) > left_truncate_len:
                self.left_truncated += int((mask.sum(dim=1) > left_truncate_len).sum())
                ids, mask = ids[:, -left_truncate_len:], mask[:, -left_truncate_len:]
            return ids, mask

    return CountingHFLM


def evaluate(m: Model, args, manager, tasks: list[str], device: str, batch_size) -> tuple[dict, int]:
    """The harness's simple_evaluate on the in-memory model; (results, generation prompts cut to fit)."""
    import lm_eval

    lm = counting_hflm()(pretrained=m.model, tokenizer=m.tokenizer, batch_size=batch_size, device=device)
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=tasks,
        task_manager=manager,
        num_fewshot=args.num_fewshot,
        limit=args.limit,
        gen_kwargs=args.gen_kwargs,
        apply_chat_template=args.apply_chat_template,
        fewshot_as_multiturn=args.fewshot_as_multiturn,
        log_samples=args.log_samples,
        random_seed=args.seed,
        numpy_random_seed=args.seed,
        torch_random_seed=args.seed,
        fewshot_random_seed=args.seed,
    )
    return results, lm.left_truncated


def run(args, env=None) -> list[dict]:
    """Evaluate each checkpoint on the tasks; returns one {meta, results file, summary lines} per checkpoint."""
    import tempfile

    env = os.environ if env is None else env
    check_args(args, env)

    def say(msg):
        print(f"llmft eval: {msg}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="llmft-eval-tasks-") as work:
        manager, tasks = task_manager(args, Path(work))
        try:
            device = pick_device(args.device)
            dtype = pick_dtype(args.dtype if args.dtype != "auto" else None, device, exporting=False)
        except CheckpointError as e:
            raise EvalError(str(e)) from None
        batch_size = eval_batch_size(str(args.batch_size), device)
        done = []
        for path in args.checkpoint:
            t0 = time.time()
            try:
                m = load_model(path, args.model_name, device, dtype, args.trust_checkpoint)
            except CheckpointError as e:
                raise EvalError(str(e)) from None
            say(
                f"{m.checkpoint} (step {m.step}) on {device} as {str(dtype).replace('torch.', '')}, batch size {batch_size}: {', '.join(tasks)}"
            )
            results, cut = evaluate(m, args, manager, tasks, device, batch_size)
            if cut:
                say(
                    f"{cut} generation prompt(s) were longer than the model's positions less the tokens to generate and lost "
                    "their beginning (the harness cuts from the left): fewer --num_fewshot or a smaller max_gen_toks keeps them whole"
                )
            meta = {
                "checkpoint": m.checkpoint,
                "step": m.step,
                "run": str(m.run_dir),
                "device": device,
                "dtype": str(dtype).replace("torch.", ""),
                "batch_size": batch_size,
                "seconds": round(time.time() - t0, 1),
                "prompts_left_truncated": cut,
                "task_data": args.task_data,
                "lm_eval_version": results.get("lm_eval_version"),
            }
            out_dir = args.output or (m.run_dir / "eval")
            path_written, lines = write_results(results, meta, out_dir, time.strftime("%Y%m%dT%H%M%S"))
            for line in lines:
                say(describe_line(line))
            say(f"wrote {path_written}")
            done.append({"meta": meta, "results_file": path_written, "lines": lines})
            del m
    return done


def main(args) -> int:
    try:
        run(args)
    except (EvalError, CheckpointError) as e:
        raise SystemExit(report_error("eval", e, all_ranks=True)) from None
    return 0


if __name__ == "__main__":
    sys.exit(main(make_parser().parse_args()))

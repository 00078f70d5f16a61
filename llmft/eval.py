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
batch that fits on a GPU, 8 on the CPU. The harness's context length is the run's training max_length (its
`llmft_run.json`), else 4096 (`--max_length` overrides), and a run trained on chat data is scored through its
chat template (`--no-apply_chat_template` turns it off); a model larger than one GPU is refused with the fix.

`--task_data TASK=FILE` points a task's evaluated split (test, else validation) at a local file in the task's
own format, `TASK:SPLIT=FILE` another split (e.g. `gsm8k:train`, where GSM8K draws its few-shot examples),
`TASK=DIR` every split with a file `DIR/<split>.jsonl` (or .json, .parquet, .csv). The harness's YAML is not
edited: llmft writes a task file that `include:`s it and changes only where the data comes from.

Results go to `<run>/eval/` (`--output` elsewhere): the harness's JSON (`results-step<N>-<time>.json`), with
`--log_samples` every prompt, response and score (`samples-step<N>-<task>-<time>.jsonl`), and one line per task
appended to `summary.jsonl`, which `llmft report` plots across runs and checkpoints.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from llmft.checkpoint.loader import (
    DTYPES,
    Model,
    find_source,
    is_exported,
    load_model,
    pick_device,
    pick_dtype,
    resolve_checkpoint,
)
from llmft.checkpoint.zero import CheckpointError
from llmft.command import command_parser, report_error
from llmft.data.loading import DEFAULT_CHAT_TEMPLATE, DataError, check_jsonl_objects
from llmft.errors import LlmftError
from llmft.planning.hardware import local_gpu
from llmft.planning.memory import MemoryPlanError
from llmft.planning.model_shape import load_model_config, model_positions, model_shape

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
    if path.suffix == ".jsonl":  # every line an object, before the harness's `datasets` reads arrays as records
        try:
            check_jsonl_objects(path)
        except DataError as e:
            raise EvalError(str(e)) from None
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


# --------------------------------------------------------------------------------------------------
# Decisions per checkpoint: context length, chat template, processes, one GPU (pure)

DEFAULT_MAX_LENGTH = 4096
# GiB of a GPU kept free beside the weights for the CUDA context (0.5-1 GiB), the allocator's fragments and one
# layer's activations at a batch of one; the logits of one max_length sequence (fp32 log-softmax) are counted apart.
GPU_RESERVE_GIB = 2.0


def eval_max_length(requested: int | None, trained: int | None, positions: int | None) -> tuple[int, str]:
    """The harness's max_length (HFLM's `max_length`) and where it came from.

    Without one the harness takes the model's max_position_embeddings: 131,072 for Llama-3.1, so `--batch_size
    auto` probes batches of 131,072-token rows, every probe runs out of memory and the tasks run one prompt at a time.
    --max_length wins; else the length the run trained at (llmft_run.json: the model never saw longer inputs); else
    4096. Never more than the model's positions (it cannot read past them)."""
    if requested is not None:
        value, source = requested, "--max_length"
    elif trained:
        value, source = trained, "the run's training max_length, llmft_run.json"
    else:
        value, source = DEFAULT_MAX_LENGTH, "llmft's default: no training max_length recorded"
    if positions and value > positions:
        return positions, f"{source} {value} capped at the model's {positions} positions"
    return value, source


def chat_template_choice(requested: bool | None, data_shape: str | None, has_template: bool) -> tuple[bool, bool, str]:
    """(apply the chat template, give the tokenizer llmft's default template first, why).

    A model fine-tuned on chat records (llmft_data.json's shape `messages`) saw every prompt in its chat template,
    so it is scored in that format unless --no-apply_chat_template says otherwise. Training gave a tokenizer
    without a template llmft's default one (llmft.data.loading.ensure_chat_template), so such a tokenizer gets
    the same default here. Asking for the template on a tokenizer that has none is refused: the harness would fail
    on the first prompt."""
    if requested is True:
        if not has_template:
            raise EvalError(
                "--apply_chat_template: this checkpoint's tokenizer has no chat template: pass --model_name with a "
                "tokenizer that has one, or leave the flag out"
            )
        return True, False, "--apply_chat_template"
    if requested is False:
        return False, False, "--no-apply_chat_template"
    if data_shape == "messages":
        if has_template:
            return True, False, "the run trained on chat data, llmft_data.json"
        return True, True, "the run trained on chat data, llmft_data.json; llmft's default template, as in training"
    if data_shape:
        return False, False, f"the run trained on {data_shape} data, llmft_data.json"
    return False, False, "no run record of chat data"


def launched_processes(env) -> int:
    """How many processes this launch started: torchrun's WORLD_SIZE, else the Slurm step's SLURM_STEP_NUM_TASKS.

    SLURM_NTASKS is the allocation's task count, inherited by everything in it: an sbatch --ntasks=8 script that
    runs `python -m llmft.eval` directly starts one process. `srun -n 8 python -m llmft.eval` starts eight, and
    srun sets SLURM_STEP_NUM_TASKS=8 in each."""
    for name in ("WORLD_SIZE", "SLURM_STEP_NUM_TASKS"):
        value = env.get(name, "").strip()
        if value:
            try:
                return int(value)
            except ValueError:
                raise EvalError(f"{name}={value!r} is not a number of processes: unset it or launch again") from None
    return 1


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def gpu_fit(shape, dtype: str, max_length: int, gpu, visible_gpus: int) -> None:
    """Refuse, with the fix, a model (`shape`: llmft.planning.memory.ModelShape) whose weights in `dtype` do not fit
    on one GPU (`gpu`: llmft.planning.hardware.GPU) of the `visible_gpus`.

    llmft eval hands the harness the model in memory (read from the ZeRO shards, no export), and the harness puts
    an in-memory model on one device: its `parallelize=True` (accelerate's device_map over the visible GPUs) works
    only when the harness loads the model from a path itself, and lm-eval 0.4.13 asserts against it for a model
    passed in. So a model larger than one GPU is refused before any shard is read, naming what would run it. The
    weights must leave the logits of one max_length sequence and GPU_RESERVE_GIB free."""
    weight_bytes = shape.params * DTYPE_BYTES[dtype]
    logits_bytes = max_length * shape.vocab * 4
    gib = 2**30
    required = math.ceil((weight_bytes + logits_bytes) / gib + GPU_RESERVE_GIB)  # GiB of one GPU
    if required <= gpu.memory_gib:
        return
    what = (
        f"the model's weights ({weight_bytes / gib:.1f} GiB in {dtype}) and the logits of one max_length sequence "
        f"({logits_bytes / gib:.1f} GiB) need a GPU of {required} GiB ({GPU_RESERVE_GIB:g} GiB kept free); "
        f"one {gpu.name} has {gpu.memory_gib:g} GiB"
    )
    if visible_gpus > 1 and required <= visible_gpus * gpu.memory_gib:
        fix = (
            f"llmft eval runs the model on one GPU (the harness spreads only a model it loads itself over GPUs): export "
            f"it (llmft export CHECKPOINT --out DIR) and run lm_eval --model hf --model_args "
            f"pretrained=DIR,parallelize=True,dtype={dtype} on these {visible_gpus} GPUs, or use a GPU with "
            f"{required} GiB or more"
        )
    elif weight_bytes / gib + GPU_RESERVE_GIB <= gpu.memory_gib:
        fix = f"a shorter --max_length (the logits grow with it), or a GPU with {required} GiB or more"
    else:
        fix = f"use a GPU with {required} GiB or more"
    raise EvalError(f"{what}: {fix}")


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
        "--apply_chat_template",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="wrap prompts in the tokenizer's chat template (default: when the run trained on chat data)",
    )
    parser.add_argument(
        "--fewshot_as_multiturn", action="store_true", help="with the chat template: few-shot examples as turns"
    )
    parser.add_argument(
        "--max_length",
        type=int,
        default=None,
        help="the harness's context length in tokens (default: the run's training max_length, else 4096)",
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
    if args.max_length is not None and args.max_length < 1:
        raise EvalError(f"--max_length must be a positive number of tokens, got {args.max_length}")
    if args.fewshot_as_multiturn and args.apply_chat_template is False:
        raise EvalError("--fewshot_as_multiturn needs the chat template: drop --no-apply_chat_template")
    world = launched_processes(env)
    if world != 1:
        raise EvalError(
            f"llmft eval runs in one process (the harness scores one in-memory model), but this launch started {world}: "
            "run it without torchrun or srun, or with srun --ntasks 1"
        )
    if args.include_path is not None and not Path(args.include_path).is_dir():
        raise EvalError(f"--include_path {args.include_path} is not a directory of task YAMLs")
    for path in args.checkpoint:  # a wrong or half-written checkpoint is named before the harness indexes its tasks
        if not is_exported(Path(path)):
            try:
                resolve_checkpoint([path])
            except CheckpointError as e:
                raise EvalError(str(e)) from None


# The harness's own tasks (lm_eval/tasks, thousands of YAML files) as TaskIndex.build returns them, walked once per
# process: the walk took 10.2 s on the 2-core machine, and every TaskManager the harness makes walks them again.
_HARNESS_TASKS: dict[str, dict] = {}


def new_task_manager(include_path):
    """lm_eval's TaskManager over its own tasks and `include_path` (later paths win), with its own tasks indexed
    once per process.

    llmft eval needs two managers (one to check the tasks and read the YAMLs --task_data overrides, one with the
    overrides), and each re-walked the harness's directory: 20 s of a run's start-up. The manager's constructor is
    the harness's; only the walk of its own directory is taken from this process's first one (a new mapping of the
    same entries: the harness's task factory deep-copies an entry's config before it uses it). The other paths are
    small, and walked each time."""
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks import manager as harness_manager

    walk = harness_manager.TaskIndex
    own = Path(harness_manager.__file__).parent

    class OwnTasksWalkedOnce(walk):
        @staticmethod
        def build(paths, *, resolve_includes=True):
            paths = list(paths)
            if not paths or Path(paths[0]) != own or not resolve_includes:
                return walk.build(paths, resolve_includes=resolve_includes)
            if str(own) not in _HARNESS_TASKS:
                _HARNESS_TASKS[str(own)] = walk.build([own])
            index = dict(_HARNESS_TASKS[str(own)])
            index.update(walk.build(paths[1:]))  # --include_path and the overrides win, as in the harness
            return index

    harness_manager.TaskIndex = OwnTasksWalkedOnce
    try:
        return TaskManager(include_path=include_path)
    finally:
        harness_manager.TaskIndex = walk


def task_manager(args, work: Path):
    """The harness's task index with --include_path and the --task_data overrides (later paths win)."""
    base = new_task_manager(args.include_path)
    requested = parse_tasks(args.tasks)
    for task in requested:
        if task not in base.task_index:
            raise EvalError(f"--tasks: {unknown_task(task, base)}")
    task_data = parse_task_data(args.task_data)
    if not task_data:
        return base, requested
    overrides = write_overrides(task_data, args.num_fewshot, base, work)
    paths = [p for p in (args.include_path, str(overrides)) if p]
    return new_task_manager(paths), requested


def counting_hflm():
    """The harness's HFLM, counting the generation prompts it cuts from the left to fit the max length less the
    tokens to generate (the harness only logs a warning per batch)."""
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


@dataclass(frozen=True)
class Settings:
    """What one checkpoint is evaluated with, each with where it came from (printed, and in the results)."""

    max_length: int
    max_length_from: str
    chat_template: bool
    chat_template_from: str


def run_records(run_dir: Path) -> dict:
    """What the run's records say about how it trained: the max_length (llmft_run.json) and the data's shape
    (llmft_data.json: messages, prompt_completion or text). {} for a directory llmft train did not write."""
    found = {}
    for name, key, field in (("llmft_run.json", "max_length", "max_length"), ("llmft_data.json", "shape", "shape")):
        try:
            record = json.loads((run_dir / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get(field) is not None:
            found[key] = record[field]
    return found


def checkpoint_run_dir(path: str) -> Path:
    """The run directory a checkpoint (or an exported model) belongs to, whose records say how it was trained."""
    p = Path(path)
    if is_exported(p):
        return p
    try:
        tag, _ = resolve_checkpoint([path])
    except CheckpointError as e:
        raise EvalError(str(e)) from None
    ckpt_dir = tag.parent
    return ckpt_dir.parent if ckpt_dir.name.startswith("checkpoint-") else ckpt_dir


def checkpoint_config(path: str, model_name: str | None):
    """The model config of a checkpoint, before any weight is read (None when only the loader can tell: an exported
    LoRA adapter without config.json)."""
    p = Path(path)
    if is_exported(p):  # --model_name names only its tokenizer
        if not (p / "config.json").is_file():
            return None
        source = str(p)
    else:
        try:
            source = find_source(resolve_checkpoint([path])[0], model_name).config
        except CheckpointError as e:
            raise EvalError(str(e)) from None
    try:
        return load_model_config(source)
    except MemoryPlanError as e:
        reason = str(e).split(": ", 1)[-1]
        raise EvalError(
            f"cannot read the config of {source} ({reason}): pass --model_name with a local model directory "
            "or a hub name you can download"
        ) from None


def check_one_gpu(config, dtype, max_length: int, device: str) -> None:
    """gpu_fit with this machine's facts: the model's shape (llmft.planning.model_shape, built on the meta device),
    the GPU and how many are visible."""
    import torch

    try:
        shape = model_shape(config)
    except MemoryPlanError as e:
        raise EvalError(str(e)) from None
    gpu = local_gpu(torch.device(device).index or 0)
    gpu_fit(shape, str(dtype).replace("torch.", ""), max_length, gpu, torch.cuda.device_count())


def evaluate(m: Model, args, settings: Settings, manager, tasks: list[str], device: str, batch_size):
    """The harness's simple_evaluate on the in-memory model; (results, generation prompts cut to fit, the harness's
    max_length as it used it)."""
    import lm_eval

    lm = counting_hflm()(
        pretrained=m.model, tokenizer=m.tokenizer, batch_size=batch_size, device=device, max_length=settings.max_length
    )
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=tasks,
        task_manager=manager,
        num_fewshot=args.num_fewshot,
        limit=args.limit,
        gen_kwargs=args.gen_kwargs,
        apply_chat_template=settings.chat_template,
        fewshot_as_multiturn=args.fewshot_as_multiturn,
        log_samples=args.log_samples,
        random_seed=args.seed,
        numpy_random_seed=args.seed,
        torch_random_seed=args.seed,
        fewshot_random_seed=args.seed,
    )
    return results, lm.left_truncated, lm.max_length


def load_for_eval(path: str, args, device: str, dtype) -> tuple[Model, Settings]:
    """The model, with its context length and chat template decided from the flags and the run's records. On a GPU
    a model larger than it is refused from its config, before its shards are read; elsewhere the loader reads the
    checkpoint first, so a broken one is named as such."""
    records = run_records(checkpoint_run_dir(path))
    if device.startswith("cuda"):
        config = checkpoint_config(path, args.model_name)
        if config is not None:
            max_length, _ = eval_max_length(args.max_length, records.get("max_length"), model_positions(config))
            check_one_gpu(config, dtype, max_length, device)
    try:
        m = load_model(path, args.model_name, device, dtype, args.trust_checkpoint)
    except CheckpointError as e:
        raise EvalError(str(e)) from None
    max_length, length_from = eval_max_length(
        args.max_length, records.get("max_length"), model_positions(m.model.config)
    )
    chat, give_default, chat_from = chat_template_choice(
        args.apply_chat_template, records.get("shape"), bool(getattr(m.tokenizer, "chat_template", None))
    )
    if give_default:
        m.tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    if args.fewshot_as_multiturn and not chat:
        raise EvalError(f"--fewshot_as_multiturn needs the chat template ({chat_from}): add --apply_chat_template")
    return m, Settings(max_length, length_from, chat, chat_from)


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
            m, settings = load_for_eval(path, args, device, dtype)
            say(
                f"{m.checkpoint} (step {m.step}) on {device} as {str(dtype).replace('torch.', '')}, batch size {batch_size}, "
                f"max length {settings.max_length} ({settings.max_length_from}), chat template "
                f"{'on' if settings.chat_template else 'off'} ({settings.chat_template_from}): {', '.join(tasks)}"
            )
            results, cut, harness_max_length = evaluate(m, args, settings, manager, tasks, device, batch_size)
            if cut:
                say(
                    f"{cut} generation prompt(s) were longer than the max length ({harness_max_length}) less the tokens to "
                    "generate and lost their beginning (the harness cuts from the left): fewer --num_fewshot, a smaller "
                    "max_gen_toks or a longer --max_length (up to the model's positions) keeps them whole"
                )
            meta = {
                "checkpoint": m.checkpoint,
                "step": m.step,
                "run": str(m.run_dir),
                "device": device,
                "dtype": str(dtype).replace("torch.", ""),
                "batch_size": batch_size,
                "max_length": harness_max_length,
                "max_length_from": settings.max_length_from,
                "chat_template": settings.chat_template,
                "chat_template_from": settings.chat_template_from,
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

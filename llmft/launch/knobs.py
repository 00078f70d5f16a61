"""The job scripts' knobs (KEY=VALUE): their names, defaults and checks, for every scheduler.

A knob comes from the job's environment (`qsub -v`, `sbatch --export`) or from a KEY=VALUE argument after the script;
an argument wins. Every knob is checked before anything runs, and a bad one ends the job in one line that names it
and the fix (`KnobError`). The values are data, never code: nothing here hands one to a shell.

Both schedulers' jobs (llmft.launch.slurm, llmft.launch.pbs) resolve their knobs here, so a knob is refused in the same
words on either (tests/test_launch.py).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from llmft.errors import LlmftError
from llmft.launch import sweep
from llmft.planning import methods


class KnobError(LlmftError, ValueError):
    """A knob the job cannot run with, said in one line with its fix; the job script exits 2."""


@dataclass(frozen=True)
class Knob:
    name: str
    default: str  # "" = unset; what the job applies is in `resolve`
    help: str


KNOBS: tuple[Knob, ...] = (
    Knob("EPOCHS", "3", "training epochs (a positive number; llmft train's default)"),
    Knob(
        "CHECKPOINT_DIR",
        "",
        "output and checkpoint directory on storage every node shares; default runs/<job name>-<run key> under the "
        "submit directory (a key of the knobs that define the run); a rerun with the same directory resumes",
    ),
    Knob("DATA_PERCENTAGE", "100", "use this percentage of the dataset (0 < p <= 100)"),
    Knob("MODEL", "Qwen/Qwen2.5-0.5B", "hub id or a local model directory (a local one must exist)"),
    Knob("DATASET", "trl-lib/Capybara", "hub id or a local .jsonl/.json/.parquet/.csv file (a local one must exist)"),
    Knob("MIXTURE", "", "a --dataset_mixture YAML file instead of DATASET (the whole mixture trains)"),
    Knob("ZERO_STAGE", "2", "DeepSpeed ZeRO stage 0-3, or auto (llmft's planner picks; llmft train --auto)"),
    Knob("DS_CONFIG", "", "your own DeepSpeed JSON instead of llmft's ZeRO templates"),
    Knob("OFFLOAD", "0", "1: ZeRO CPU offload (stage 2 or 3)"),
    Knob("GLOBAL_BATCH", "32", "global batch, kept on any number of nodes by the gradient accumulation"),
    Knob("MICRO_BATCH", "4", "micro-batch per GPU process (memory, not the result)"),
    Knob("MAX_STEPS", "", "stop after this many optimizer steps (overrides EPOCHS)"),
    Knob("SAVE_STEPS", "", "checkpoint every N steps (empty: llmft train's default)"),
    Knob("SAVE_TOTAL_LIMIT", "2", "complete checkpoints kept (0: all)"),
    Knob(
        "MAX_RESTARTS",
        "3",
        "a failed attempt is run again at most this many times, and only after progress (0: never)",
    ),
    Knob("LORA", "0", "1: train LoRA adapters (PEFT) instead of all weights"),
    Knob("WANDB_PROJECT", "", "log to Weights & Biases in this project (else --report_to none)"),
    Knob("WANDB_MODE", "", "online | offline | disabled; empty: offline when the node cannot reach W&B"),
    Knob("CONTAINER_IMAGE", "", "run inside this image (Slurm: pyxis; PBS: enroot, an image.sqsh)"),
    Knob("CONTAINER_MOUNTS", "", "more mounts SRC:DST[:FLAGS], separated by ';'"),
    Knob("NCCL_PROFILE", "", "gcp-g2 | aws-efa | gcp-tcpx | ib; empty: NCCL's own defaults"),
    Knob("VENV", "", "virtual environment to run in; default: the Python environment the job was submitted from"),
    Knob("EXTRA_ARGS", "", "more `llmft train` flags, split on spaces"),
    Knob("DRY_RUN", "0", "1: print the plan and the launch command, run nothing"),
    Knob("PREPARE", "0", "1: tokenise the data with `llmft prepare` before the nodes start"),
    Knob(
        "EXPORT",
        "",
        "after the training finishes, `llmft export` its final checkpoint into this new or empty directory (relative "
        "to the submit directory), with the export's checks",
    ),
    Knob("NUMA_BINDING", "auto", "torchrun --numa-binding: auto | off | node | socket | exclusive | core-complex"),
    Knob(
        "SWEEP",
        "",
        "train variants as a job array, each in <run dir>/<variant>: e.g. learning_rate=1e-5,3e-5,1e-4 (several "
        "flags: 'learning_rate=1e-5,3e-5 lora_r=8,16', every combination); submit with qsub -J 1-N / sbatch --array=1-N",
    ),
    Knob(
        "METHOD",
        "sft",
        f"what llmft train --method trains: {', '.join(methods.METHODS)} (llmft.planning.methods); a SWEEP may vary "
        "the method's own flags (METHOD=dpo SWEEP=beta=0.05,0.1,0.3)",
    ),
    Knob(
        "SEQUENCE_PARALLEL",
        "1",
        "Ulysses sequence parallelism (llmft train --sequence_parallel N): each sample's sequence split over N ranks, "
        "GLOBAL_BATCH counted over the ranks / N data-parallel groups",
    ),
)
NAMES: tuple[str, ...] = tuple(k.name for k in KNOBS)
DEFAULTED_SHOWN = ("MODEL", "DATASET", "DATA_PERCENTAGE", "EPOCHS", "GLOBAL_BATCH", "MICRO_BATCH", "ZERO_STAGE")
DEFAULTED_SHOWN += ("SAVE_TOTAL_LIMIT",)  # the knobs that shape the training: the job's first lines name each default
BOOLEANS = ("OFFLOAD", "LORA", "DRY_RUN", "PREPARE")
ZERO_STAGES = ("0", "1", "2", "3", "auto")
WANDB_MODES = ("", "online", "offline", "disabled")
NCCL_PROFILES = ("gcp-g2", "aws-efa", "gcp-tcpx", "ib")
NUMA_BINDINGS = ("auto", "off", "node", "socket", "exclusive", "core-complex")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MOUNT = re.compile(r"""^[^\s:'"]+(:[^\s:'"]+(:[a-z+]+)?)?$""")


@dataclass
class Knobs:
    """Every knob's value as the job runs with it, and the ones that shape the training left to their defaults."""

    values: dict[str, str]
    defaulted: list[str] = field(default_factory=list)
    extra_args: list[str] = field(default_factory=list)
    mounts: list[str] = field(default_factory=list)

    def __getitem__(self, name: str) -> str:
        return self.values[name]

    def flag(self, name: str) -> bool:
        return self.values[name] == "1"


def known_knobs() -> str:
    return "known knobs: " + " ".join(NAMES)


def unknown_knob_message(name: str, source: str) -> str:
    close = difflib.get_close_matches(name, NAMES, n=1, cutoff=0.8)
    hint = f" did you mean {close[0]}?" if close else ""
    return f"unknown knob '{name}' in '{source}';{hint} {known_knobs()}"


def from_arguments(args: Sequence[str]) -> dict[str, str]:
    """The KEY=VALUE arguments after the script, each key checked against the knobs."""
    given: dict[str, str] = {}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or not _NAME.match(key):
            raise KnobError(f"cannot read argument '{arg}'; pass knobs as KEY=VALUE; {known_knobs()}")
        if key not in NAMES:
            raise KnobError(unknown_knob_message(key, arg))
        given[key] = value
    return given


def unknown_in_variable_list(names: Sequence[str], source: str) -> None:
    """A name the job was given (`qsub -v NAME=...`) that is a knob misspelt: refused, since it would be ignored.

    Other names pass: `qsub -v` is also how a job gets HF_TOKEN, NCCL_DEBUG or any variable it needs."""
    for name in names:
        if name not in NAMES and name.isupper() and difflib.get_close_matches(name, NAMES, n=1, cutoff=0.8):
            raise KnobError(unknown_knob_message(name, source))


def _unquote(value: str) -> str:
    """One matching pair of quotes around a value dropped: schedulers keep the quotes of `KEY='a,b'`."""
    m = re.fullmatch(r"'(.*)'|\"(.*)\"", value, flags=re.S)
    return value if not m else (m.group(1) if m.group(1) is not None else m.group(2))


def positive_number(text: str) -> bool:
    return bool(re.fullmatch(r"([0-9]+([.][0-9]*)?|[.][0-9]+)", text)) and not re.fullmatch(r"[0.]*", text)


def positive_int(text: str) -> bool:
    return bool(re.fullmatch(r"[1-9][0-9]*", text))


def as_bool(name: str, value: str) -> str:
    low = value.lower()
    if low in ("1", "true", "yes", "on"):
        return "1"
    if low in ("0", "false", "no", "off", ""):
        return "0"
    raise KnobError(f"{name}={value} is not a boolean; use 1 or 0")


def dataset_is_local(value: str) -> bool:
    """What llmft counts as a local dataset (llmft.data.loading.looks_like_path); a hub id is org/name."""
    return (
        Path(value).exists()
        or value[:1] in "./~"
        or bool(re.search(r"[.](jsonl|json|parquet|csv|txt)$", value.lower()))
    )


def model_is_local(value: str) -> bool:
    """What llmft counts as a local model (llmft.planning.model_shape.load_model_config)."""
    return Path(value).exists() or value[:1] in "./~" or value.count("/") >= 2


def resolve(env: Mapping[str, str], args: Sequence[str] = (), cwd: Path | None = None) -> Knobs:
    """The knobs from the environment and the arguments (which win), defaults applied, every check passed.

    Raises KnobError, whose text is the one line the job prints (after `<script>: error: `)."""
    raw = {name: env.get(name, "") for name in NAMES}
    raw.update(from_arguments(args))
    cwd = cwd or Path.cwd()
    mixture = raw["MIXTURE"]
    if mixture:
        for knob in ("DATASET", "DATA_PERCENTAGE"):
            if raw[knob]:
                raise KnobError(
                    f"give either MIXTURE or {knob}, not both (MIXTURE={mixture}, {knob}={raw[knob]}): the mixture file "
                    f"names its datasets, and a percentage: per dataset; drop {knob}"
                )
    defaulted = [
        k
        for k in DEFAULTED_SHOWN
        if not raw[k]
        and not (mixture and k in ("DATASET", "DATA_PERCENTAGE"))
        and not (k == "ZERO_STAGE" and raw["DS_CONFIG"])
    ]
    values = dict(raw)
    for knob in KNOBS:
        if knob.name in ("DATASET", "DATA_PERCENTAGE") and mixture:
            continue
        if knob.name == "ZERO_STAGE":
            continue  # its default only without DS_CONFIG, below
        values[knob.name] = values[knob.name] or knob.default
    values = {k: _unquote(v) for k, v in values.items()}
    check(values, cwd)
    for name in BOOLEANS:
        values[name] = as_bool(name, values[name])
    if not values["DS_CONFIG"]:
        values["ZERO_STAGE"] = values["ZERO_STAGE"] or "2"
        check_zero(values)
    extra = values["EXTRA_ARGS"].split()
    mounts = [m for m in re.split(r"[;,]", values["CONTAINER_MOUNTS"])] if values["CONTAINER_MOUNTS"] else []
    return Knobs(values, defaulted, extra, mounts)


def check_export(value: str, cwd: Path) -> None:
    """EXPORT names a new or empty directory: checked before the training, not found out after it."""
    if not value:
        return
    path = Path(value) if Path(value).is_absolute() else cwd / value
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        what = "a file" if not path.is_dir() else "a directory that is not empty"
        raise KnobError(f"EXPORT={value} is {what}: give a new or empty directory (an export never overwrites)")


def check(v: dict[str, str], cwd: Path) -> None:
    """The checks of slurm/run_llm.slurm, in its order and words."""
    if not positive_number(v["EPOCHS"]):
        raise KnobError(f"EPOCHS={v['EPOCHS']} is not a positive number (default 3)")
    pct = v["DATA_PERCENTAGE"]
    if pct and not (positive_number(pct) and re.fullmatch(r"(100([.]0*)?|[0-9]{1,2}([.][0-9]*)?|[.][0-9]+)", pct)):
        raise KnobError(f"DATA_PERCENTAGE={pct} must be a number with 0 < DATA_PERCENTAGE <= 100 (default 100)")
    for name, default in (("GLOBAL_BATCH", "32"), ("MICRO_BATCH", "4")):
        if not positive_int(v[name]):
            raise KnobError(f"{name}={v[name]} is not a positive integer (default {default})")
    if v["MAX_STEPS"] and not positive_int(v["MAX_STEPS"]):
        raise KnobError(f"MAX_STEPS={v['MAX_STEPS']} is not a positive integer (default: unset, EPOCHS decides)")
    if v["SAVE_STEPS"] and not positive_int(v["SAVE_STEPS"]):
        raise KnobError(f"SAVE_STEPS={v['SAVE_STEPS']} is not a positive integer")
    if not re.fullmatch(r"0|[1-9][0-9]*", v["MAX_RESTARTS"]):
        raise KnobError(
            f"MAX_RESTARTS={v['MAX_RESTARTS']} is not a number of restarts; use 0 (never requeue a failed attempt) or "
            "more (default 3)"
        )
    if not positive_int(v["SEQUENCE_PARALLEL"]):
        raise KnobError(f"SEQUENCE_PARALLEL={v['SEQUENCE_PARALLEL']} is not a positive integer (default 1)")
    if not re.fullmatch(r"0|[1-9][0-9]*", v["SAVE_TOTAL_LIMIT"]):
        raise KnobError(
            f"SAVE_TOTAL_LIMIT={v['SAVE_TOTAL_LIMIT']} is not a number of checkpoints; use 0 (keep all) or more "
            "(default 2)"
        )
    for name in BOOLEANS:
        as_bool(name, v[name])
    check_export(v["EXPORT"], cwd)
    if v["DS_CONFIG"]:
        if v["ZERO_STAGE"]:
            raise KnobError(
                f"give either ZERO_STAGE or DS_CONFIG, not both (ZERO_STAGE={v['ZERO_STAGE']}, DS_CONFIG={v['DS_CONFIG']})"
            )
        if not (cwd / v["DS_CONFIG"]).is_file():
            raise KnobError(f"DS_CONFIG={v['DS_CONFIG']}: no such file")
    if v["WANDB_MODE"] not in WANDB_MODES:
        raise KnobError(f"WANDB_MODE={v['WANDB_MODE']}: use online, offline or disabled")
    if v["NCCL_PROFILE"] and v["NCCL_PROFILE"] not in NCCL_PROFILES:
        raise KnobError(
            f"NCCL_PROFILE={v['NCCL_PROFILE']} is unknown; use gcp-g2, aws-efa, gcp-tcpx or ib (or leave it empty)"
        )
    if v["NUMA_BINDING"] not in NUMA_BINDINGS:
        raise KnobError(
            f"NUMA_BINDING={v['NUMA_BINDING']} is unknown; use auto, off, node, socket, exclusive or core-complex "
            "(default auto)"
        )
    if "\n" in v["EXTRA_ARGS"]:
        raise KnobError("EXTRA_ARGS must be one line")
    for arg in v["EXTRA_ARGS"].split():
        if arg == "--dataset_mixture" or arg.startswith("--dataset_mixture="):
            raise KnobError(
                f"EXTRA_ARGS={v['EXTRA_ARGS']}: give the mixture as MIXTURE=FILE, not --dataset_mixture in EXTRA_ARGS "
                "(the job would also pass --dataset_name and --data_percentage, and train on a percentage of it)"
            )
    if v["MIXTURE"] and not (cwd / v["MIXTURE"]).is_file():
        raise KnobError(f"MIXTURE={v['MIXTURE']}: no such file (a --dataset_mixture YAML file)")
    if not v["CONTAINER_IMAGE"]:  # inside a container the paths may live in the image
        data = v["DATASET"]
        if data and dataset_is_local(data) and not (cwd / data).exists():
            raise KnobError(
                f"DATASET={data}: no such file or directory (looked in {cwd}); give your .jsonl/.json/.parquet/.csv "
                "file's path, or a hub dataset as org/name"
            )
        model = v["MODEL"]
        if model_is_local(model) and not (cwd / model).is_dir():
            raise KnobError(
                f"MODEL={model}: no such directory (looked in {cwd}); give a local model directory, or a hub model as "
                "org/name"
            )
        venv = v["VENV"]
        if venv and not (cwd / venv / "bin" / "python").exists():
            raise KnobError(f"VENV={venv} is not a virtual environment (no {venv}/bin/python)")
    if v["METHOD"] not in methods.METHODS:
        raise KnobError(
            f"METHOD={v['METHOD']} is not a training method; use {', '.join(methods.METHODS)} (default sft)"
        )
    if v["SWEEP"]:
        sweep.parse(v["SWEEP"], v["METHOD"])
    if v["CONTAINER_MOUNTS"]:
        if not v["CONTAINER_IMAGE"]:
            raise KnobError(
                f"CONTAINER_MOUNTS={v['CONTAINER_MOUNTS']} needs CONTAINER_IMAGE (mounts apply to a container)"
            )
        for m in re.split(r"[;,]", v["CONTAINER_MOUNTS"]):
            if not _MOUNT.match(m):
                raise KnobError(
                    f"CONTAINER_MOUNTS={v['CONTAINER_MOUNTS']}: '{m}' is not a mount SRC[:DST[:FLAGS]]; separate mounts "
                    "with ';'"
                )


def check_zero(v: dict[str, str]) -> None:
    stage, offload = v["ZERO_STAGE"], v["OFFLOAD"]
    if stage not in ZERO_STAGES:
        raise KnobError(f"ZERO_STAGE={stage} is not a ZeRO stage; use 0, 1, 2 or 3, or auto (default 2)")
    if stage == "auto" and offload == "1":
        raise KnobError("ZERO_STAGE=auto chooses the offload itself; drop OFFLOAD=1")
    if offload == "1" and stage != "auto" and int(stage) < 2:
        raise KnobError(f"OFFLOAD=1 needs ZERO_STAGE=2 or 3 (got ZERO_STAGE={stage})")


def defaults_line(k: Knobs) -> str:
    """The job's first line: every knob that shapes the training and was left to its default, with its value."""
    shown = " ".join(f"{name}={k[name]}" for name in k.defaulted) or "none"
    given_lr = any(a == "--learning_rate" or a.startswith("--learning_rate=") for a in k.extra_args)
    swept = any(re.match(r"(--)?learning_rate=", part) for part in re.split(r"[;\s]+", k["SWEEP"]))
    lr = (
        "learning rate from SWEEP"
        if swept
        else "learning rate from EXTRA_ARGS"
        if given_lr
        else "learning rate 2e-5 (llmft train's; --learning_rate in EXTRA_ARGS changes it)"
    )
    return f"defaults applied: {shown}; {lr}"


def default_dataset_warning(k: Knobs, raw_dataset: str, plan_hint: str) -> str | None:
    """Said loudly: a job submitted without DATASET trains on a hub dataset."""
    if k["MIXTURE"] or raw_dataset:
        return None
    used = [n for n in ("DATASET", "DATA_PERCENTAGE", "EPOCHS") if n in k.defaulted]
    return (
        f"WARNING: no DATASET given: training on this script's default, the hub dataset {k['DATASET']} (defaults used: "
        f"{' '.join(used)}; DATA_PERCENTAGE={k['DATA_PERCENTAGE']} EPOCHS={k['EPOCHS']}); set DATASET=your.jsonl "
        f"({plan_hint})"
    )


def help_text(script: str, usage: str, extra: Callable[[], str] | None = None) -> str:
    """`<script> --help`: usage, then every knob with its default."""
    lines = [usage, "", "Knobs (KEY=VALUE; arguments override the environment; any other key is an error):"]
    for k in KNOBS:
        lines.append(f"  {k.name + '=' + k.default:<32}{k.help}")
    if extra:
        lines += ["", extra()]
    return "\n".join(lines)

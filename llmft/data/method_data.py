"""The data of a method TRL tokenises itself (llmft.planning.methods: prepared_by "trl", DPO, KTO, reward models),
and the check that a file holds the records its method trains on.

`method_dataset` is the one seam `llmft train` calls for such a method: it returns the loaded records in TRL's shapes
({"prompt", "chosen", "rejected"} or {"prompt", "completion", "label"}), held-out split and percentage applied, and
the trainer tokenises them. Its insides are the preference formats' (--dataset_format preference,
unpaired_preference); what is here takes data already in TRL's explicit-prompt shapes.
"""

from __future__ import annotations

import json
from pathlib import Path

from llmft.data import loading as data
from llmft.data.cache import DataOptions, Prepared
from llmft.data.loading import DataError
from llmft.planning.methods import METHODS, Method

# the columns that say which records a file holds: format -> columns every record of it has
SHAPES: dict[str, frozenset[str]] = {
    "preference": frozenset({"chosen", "rejected"}),
    "unpaired_preference": frozenset({"prompt", "completion", "label"}),
}
# TRL's explicit-prompt columns for each format
COLUMNS: dict[str, tuple[str, ...]] = {
    "preference": ("prompt", "chosen", "rejected"),
    "unpaired_preference": ("prompt", "completion", "label"),
}


class MethodDataError(DataError):
    """The records are another method's (preference pairs given to --method sft, SFT data to --method dpo)."""


def records_format(columns) -> str | None:
    """The preference format the columns say (None: not preference data)."""
    cols = set(columns)
    for fmt, needed in SHAPES.items():
        if needed <= cols:
            return fmt
    return None


def check_records_fit(entry: Method, columns) -> None:
    """Records of a format this method does not train on are refused in one line naming the method(s) that do."""
    fmt = records_format(columns)
    if fmt in entry.formats:
        return
    if fmt is not None:
        owners = [m.name for m in METHODS.values() if fmt in m.formats]
        raise MethodDataError(
            f"the dataset holds {fmt} records ({', '.join(COLUMNS[fmt])}), which --method {entry.name} does not train "
            f"on: train them with --method {' or '.join(owners)}"
        )
    wanted = " or ".join("{" + ", ".join(COLUMNS[f]) + "}" for f in entry.formats if f in COLUMNS)
    if wanted:
        raise MethodDataError(
            f"--method {entry.name} trains on {wanted} records; the dataset has columns {', '.join(sorted(columns))} "
            "(SFT data: train it with --method sft)"
        )


def first_record_columns(opts: DataOptions) -> list[str] | None:
    """The fields of the first record of a local JSON-lines file, read without loading the data (None otherwise):
    enough to refuse preference pairs given to --method sft before the cache tokenises anything."""
    name = opts.dataset_name
    if not name or opts.dataset_mixture or not data.looks_like_path(name):
        return None
    try:
        files = data.data_files(name)
    except (OSError, DataError):
        return None
    first = files[0] if files else None
    if first is None or Path(first).suffix != ".jsonl":
        return None
    with open(first, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                try:
                    record = json.loads(line)
                except ValueError:
                    return None  # the loader names a bad line
                return list(record) if isinstance(record, dict) else None
    return None


def method_dataset(entry: Method, opts: DataOptions) -> Prepared:
    """The training (and held-out) records of a method TRL tokenises, checked and in TRL's columns; `info` holds the
    counts `llmft train` says and records (records: {"train": N, "eval": M}, format)."""
    train = data.load_train_split(opts.dataset_name, opts.dataset_config, opts.train_split)
    fmt = checked_format(entry, train)
    evaluation = None
    if opts.eval_split_ratio:
        train, evaluation = data.held_out_split(train, opts.eval_split_ratio)
    elif opts.eval_dataset_name:
        evaluation = data.load_train_split(opts.eval_dataset_name, None, opts.eval_split)
        checked_format(entry, evaluation)
    train = data.take_percentage(train, opts.data_percentage, seed=opts.seed)
    if evaluation is not None:
        evaluation = evaluation.select_columns(list(COLUMNS[fmt]))
    info = {
        "records": {"train": len(train), "eval": len(evaluation) if evaluation is not None else 0},
        "format": fmt,
    }
    fingerprint = data.content_fingerprint(opts.dataset_name, opts.dataset_config)
    return Prepared(train.select_columns(list(COLUMNS[fmt])), evaluation, fmt, Path(), fingerprint, False, info)


def checked_format(entry: Method, ds) -> str:
    """The records' format, refused when it is not the method's; KTO's labels must be true or false."""
    check_records_fit(entry, ds.column_names)
    fmt = records_format(ds.column_names)
    missing = [c for c in COLUMNS[fmt] if c not in ds.column_names]
    if missing:
        raise DataError(
            f"{fmt} records need the columns {', '.join(COLUMNS[fmt])}; the dataset lacks {', '.join(missing)}"
        )
    if "label" in COLUMNS[fmt]:
        check_labels(ds["label"])
    return fmt


def check_labels(labels) -> None:
    """KTO's label says whether the completion is desirable: true or false, nothing else (1, "yes" and null are
    refused, not guessed)."""
    for i, value in enumerate(labels):
        if not isinstance(value, bool):
            raise DataError(
                f"record {i + 1}: 'label' is {json.dumps(value)}; KTO's label must be true (desirable) or false "
                "(undesirable): write it as a JSON boolean"
            )

"""The checks `llmft train` makes before anything loads that a file holds the records its method trains on, and that
no data flag is given that the method's data path would not apply (the records themselves: llmft.data.pairs).

Preference pairs given to --method sft, or SFT data given to --method dpo, are one line naming the method that
trains them, from the first record's fields, before the model loads.
"""

from __future__ import annotations

import json
from pathlib import Path

from llmft.data import loading as data
from llmft.data import pairs
from llmft.data.cache import DataOptions
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


def check_method_options(entry: Method, opts: DataOptions) -> None:
    """Before anything loads: a data flag that preference shaping (llmft.data.pairs) would not apply is refused in
    one line, never ignored (--dataset_format takes auto or one of the method's formats)."""
    if entry.prepared_by == "llmft":
        return
    pairs.check_method_options(opts, entry)  # the flags that shape SFT data only
    if opts.dataset_format not in (None, "", "auto", *entry.formats):
        raise MethodDataError(
            f"--dataset_format {opts.dataset_format} is not a format --method {entry.name} trains on: use auto or "
            f"{' or '.join(entry.formats)}"
        )

"""Training on a weighted mixture of datasets: `llmft train --dataset_mixture mix.yaml` (instead of --dataset_name).

```yaml
seed: 42                             # optional: the sampling seed (default: the run's --seed)
stopping_strategy: first_exhausted   # optional; or all_exhausted (see datasets.interleave_datasets)
datasets:
  - path: chat.jsonl                 # a .jsonl/.json/.parquet/.csv file or directory, or a hub dataset
    columns: {messages: conversations}   # optional: prompt/completion/messages/text -> the source's own field
    weight: 3
  - path: math.jsonl
    format: prompt_completion        # optional: forces the format (llmft.data.formats), else it is recognised
    prompt_template: gsm8k           # optional: a preset or a format string over the source's fields
    columns: {prompt: question, completion: answer}
    percentage: 50                   # optional: a deterministic random 50% of the split (default 100)
    weight: 1
  - path: openai/gsm8k               # a hub dataset: its config and split
    config: main
    split: train
    columns: {prompt: question, completion: answer}
    weight: all                      # every record once, not sampled
```

Sources with a weight are sampled by `datasets.interleave_datasets` with probabilities proportional to the
weights and the mixture's seed: `first_exhausted` stops when one source runs out (no record repeats),
`all_exhausted` goes on until every source was used whole (the smaller ones repeat). Sources marked `all`
contribute each record exactly once; they are added to the sampled records and the whole is shuffled with
the seed. Each source's format is recognised from its fields as for --dataset_name (Alpaca, ShareGPT, ...;
llmft.data.formats) and every source must give the same shape (prompt/completion, messages or text) after its
conversion. The prepared mixture is cached under a fingerprint of every source's bytes, its split, percentage,
column mapping and weight, the stopping strategy and the seed, so a resumed or requeued run trains on the
same records in the same order; `llmft_data.json` records the sources and how many records each gave.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

from llmft.data import formats
from llmft.data import loading as data
from llmft.data.loading import DataError

STRATEGIES = ("first_exhausted", "all_exhausted")
FORMATS = ("prompt_completion", "messages", "text", "alpaca", "sharegpt")
COLUMN_ROLES = ("prompt", "completion", "messages", "text")
SOURCE_KEYS = {"path", "config", "split", "percentage", "weight", "columns", "format", "prompt_template"}
SOURCE_COLUMN = "_llmft_source"


@dataclass(frozen=True)
class Source:
    path: str
    config: str | None = None
    split: str = "train"
    percentage: float = 100.0
    weight: float | None = None  # None: all of it
    columns: tuple[tuple[str, str], ...] = ()  # (role, the source's field)
    format: str | None = None
    prompt_template: str | None = None

    def describe(self) -> str:
        return f"{self.path}" + (f" ({self.config})" if self.config else "")


@dataclass(frozen=True)
class Mixture:
    file: str
    sources: tuple[Source, ...]
    seed: int
    stopping_strategy: str = "first_exhausted"

    @property
    def weighted(self) -> list[int]:
        return [i for i, s in enumerate(self.sources) if s.weight is not None]

    def probabilities(self) -> list[float]:
        """The sampling probability of each weighted source: its weight over their sum."""
        total = sum(self.sources[i].weight for i in self.weighted)
        return [self.sources[i].weight / total for i in self.weighted]


def _weight(value, where: str) -> float | None:
    if isinstance(value, str) and value.strip().lower() == "all":
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise DataError(f"{where}: weight {value!r} must be a positive number, or all (every record once)")
    return float(value)


def parse_mixture(doc, file: str, default_seed: int) -> Mixture:
    """The mixture a YAML document describes, checked (pure: reads no data)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("datasets"), list) or not doc["datasets"]:
        raise DataError(
            f"--dataset_mixture {file}: expected a mapping with a non-empty 'datasets' list (path, weight, ... per source)"
        )
    unknown = set(doc) - {"datasets", "seed", "stopping_strategy"}
    if unknown:
        raise DataError(
            f"--dataset_mixture {file}: unknown key(s) {', '.join(sorted(unknown))}; use datasets, seed, stopping_strategy"
        )
    strategy = doc.get("stopping_strategy", "first_exhausted")
    if strategy not in STRATEGIES:
        raise DataError(f"--dataset_mixture {file}: stopping_strategy {strategy!r}: use {' or '.join(STRATEGIES)}")
    seed = doc.get("seed", default_seed)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise DataError(f"--dataset_mixture {file}: seed {seed!r} must be an integer")
    sources = []
    for i, entry in enumerate(doc["datasets"], 1):
        where = f"--dataset_mixture {file}, dataset {i}"
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str) or not entry["path"].strip():
            raise DataError(f"{where}: needs a path (a data file or directory, or a hub dataset)")
        where = f"--dataset_mixture {file}, dataset {i} ({entry['path']})"
        unknown = set(entry) - SOURCE_KEYS
        if unknown:
            raise DataError(
                f"{where}: unknown key(s) {', '.join(sorted(unknown))}; use {', '.join(sorted(SOURCE_KEYS))}"
            )
        if "weight" not in entry:
            raise DataError(f"{where}: no weight: give a positive number, or all (every record once)")
        percentage = entry.get("percentage", 100.0)
        if isinstance(percentage, bool) or not isinstance(percentage, (int, float)) or not 0 < percentage <= 100:
            raise DataError(f"{where}: percentage {percentage!r} must be in (0, 100]")
        columns = entry.get("columns") or {}
        if not isinstance(columns, dict) or any(
            r not in COLUMN_ROLES or not isinstance(c, str) for r, c in columns.items()
        ):
            raise DataError(
                f"{where}: columns {columns!r} must map {', '.join(COLUMN_ROLES)} to the source's field names"
            )
        fmt = entry.get("format")
        if fmt is not None and fmt not in FORMATS:
            raise DataError(f"{where}: format {fmt!r}: use {', '.join(FORMATS)} (or leave it out: the columns decide)")
        template = entry.get("prompt_template")
        if template is not None and (not isinstance(template, str) or not template.strip()):
            raise DataError(f"{where}: prompt_template {template!r} must be a preset name or a format string")
        sources.append(
            Source(
                prompt_template=template,
                path=entry["path"],
                config=entry.get("config"),
                split=str(entry.get("split", "train")),
                percentage=float(percentage),
                weight=_weight(entry["weight"], where),
                columns=tuple(sorted(columns.items())),
                format=fmt,
            )
        )
    return Mixture(file=file, sources=tuple(sources), seed=seed, stopping_strategy=strategy)


def read_mixture(path: str, default_seed: int) -> Mixture:
    """Parse the --dataset_mixture file: one clear line when it cannot be read or is not a mixture."""
    import yaml

    try:
        doc = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise DataError(f"--dataset_mixture {path}: cannot read it ({e.strerror or e})") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise DataError(f"--dataset_mixture {path} is not valid YAML ({str(e).splitlines()[0]})") from None
    return parse_mixture(doc, path, default_seed)


def source_key(source: Source) -> dict:
    return {
        "data": data.content_fingerprint(source.path, source.config),
        "config": source.config,
        "split": source.split,
        "percentage": source.percentage,
        "weight": "all" if source.weight is None else source.weight,
        "columns": dict(source.columns),
        "format": source.format,
        "prompt_template": source.prompt_template,
    }


def mixture_key(mixture: Mixture) -> dict:
    """Everything that decides the mixed records: every source (its bytes, not its path), weights, strategy, seed."""
    return {
        "sources": [source_key(s) for s in mixture.sources],
        "stopping_strategy": mixture.stopping_strategy,
        "seed": mixture.seed,
    }


def mixture_fingerprint(mixture: Mixture) -> str:
    return hashlib.sha256(json.dumps(mixture_key(mixture), sort_keys=True).encode()).hexdigest()[:16]


def load_source(source: Source, text_field: str, seed: int, role_map: str | None = None, shaped: list | None = None):
    """(records in TRL's columns, shape) of one source: loaded, its percentage taken, its columns mapped, its format
    recognised and converted (what it was goes into `shaped`, with its lines prefixed by the source)."""
    where = f"--dataset_mixture source {source.describe()}"
    found: list = []
    try:
        ds = data.load_train_split(source.path, source.config, source.split)
        ds = data.take_percentage(ds, source.percentage, seed=seed)
        columns = dict(source.columns)
        if "text" in columns and columns["text"] != text_field:
            if columns["text"] not in ds.column_names:
                raise DataError(
                    f"column(s) {columns['text']} not in the dataset; its columns are {', '.join(ds.column_names)}"
                )
            ds = ds.rename_column(columns["text"], text_field)
        ds, shape = formats.shape_for_sft(
            ds,
            prompt_column=columns.get("prompt"),
            completion_column=columns.get("completion"),
            messages_column=columns.get("messages"),
            text_field=text_field,
            dataset_format=source.format,
            prompt_template=source.prompt_template,
            role_map=role_map,
            shaped=found,
        )
    except DataError as e:
        raise DataError(f"{where}: {e}") from None
    except Exception as e:  # a hub dataset that cannot be fetched, a split that does not exist
        reason = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise DataError(f"{where} cannot be read ({reason}): check its path, config and split") from None
    for info in found:
        info.notes = [f"{where}: {note}" for note in info.notes]
    if shaped is not None:
        shaped += found
    return ds, shape


def load_sources(
    mixture: Mixture, text_field: str, role_map: str | None = None, shaped: list | None = None
) -> tuple[list, str]:
    """Every source loaded and mapped; they must share one shape. Raises DataError naming the source."""
    loaded = [load_source(s, text_field, mixture.seed, role_map, shaped) for s in mixture.sources]
    shapes = {shape for _, shape in loaded}
    if len(shapes) > 1:
        listing = ", ".join(f"{s.describe()} is {shape}" for s, (_, shape) in zip(mixture.sources, loaded))
        raise DataError(
            f"--dataset_mixture {mixture.file}: the sources must give one format after their column mappings ({listing})"
        )
    return [ds for ds, _ in loaded], shapes.pop()


def mix(datasets_: list, mixture: Mixture) -> tuple[object, list[int]]:
    """(the mixed records, records taken from each source): the weighted sources interleaved with their
    probabilities, the `all` sources added whole, the whole shuffled; all with the mixture's seed."""
    from datasets import concatenate_datasets, interleave_datasets

    tagged = [ds.add_column(SOURCE_COLUMN, [i] * len(ds)) for i, ds in enumerate(datasets_)]
    parts = []
    try:
        if mixture.weighted:
            weighted = [tagged[i] for i in mixture.weighted]
            parts.append(
                weighted[0]
                if len(weighted) == 1
                else interleave_datasets(
                    weighted,
                    probabilities=mixture.probabilities(),
                    seed=mixture.seed,
                    stopping_strategy=mixture.stopping_strategy,
                )
            )
        parts += [tagged[i] for i, s in enumerate(mixture.sources) if s.weight is None]
        mixed = concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    except ValueError as e:
        raise DataError(
            f"--dataset_mixture {mixture.file}: the sources' records differ in type and cannot be mixed "
            f"({str(e).splitlines()[0][:200]}); give every source the same fields"
        ) from None
    if len(parts) > 1:
        mixed = mixed.shuffle(seed=mixture.seed).flatten_indices()
    counts = [0] * len(datasets_)
    for i in mixed[SOURCE_COLUMN]:
        counts[i] += 1
    return mixed.remove_columns(SOURCE_COLUMN), counts


def record(mixture: Mixture, counts: list[int] | None) -> dict:
    """The mixture as `llmft_data.json` and the cache marker show it."""
    total = sum(counts) if counts else 0
    return {
        "file": mixture.file,
        "seed": mixture.seed,
        "stopping_strategy": mixture.stopping_strategy,
        "sources": [
            {
                "path": s.path,
                "config": s.config,
                "split": s.split,
                "percentage": s.percentage,
                "weight": "all" if s.weight is None else s.weight,
                "columns": dict(s.columns),
                **({"records": counts[i], "share": round(counts[i] / total, 4) if total else None} if counts else {}),
            }
            for i, s in enumerate(mixture.sources)
        ],
    }

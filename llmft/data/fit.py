"""How the data fits max_length: records kept, truncated and dropped, completions cut, tokens lost, lengths.

TRL truncates every tokenised record to max_length (or, packing with "bfd", cuts it when packing) and drops the
records left with no trained token; it says nothing about either. llmft.prepare tokenises with TRL once, without
truncation, counts here what TRL's truncation will do to each record, and then lets TRL truncate that same
tokenised data: the counts are of the tokens the run trains on, and nothing is tokenised twice.

`fit_of` is the one decision (pure, numpy only); `summarise` reads the columns it needs from an untruncated
prepared split; `fit_line` and `fit_warning` say it.
"""

from __future__ import annotations

import math

import numpy as np

# Above this share of truncated records (or with any completion fully cut) the preparation warns.
WARN_TRUNCATED_SHARE = 0.05
LENGTH_STEP = 64  # a suggested --max_length is rounded up to this


def summarise(ds, max_length: int | None) -> dict[str, np.ndarray]:
    """Per record, from an untruncated TRL-prepared split (input_ids, labels): its length, its trained tokens, and
    the trained tokens within its first / last max_length tokens (what keep_start / keep_end keep)."""
    import pyarrow as pa

    def flat(name):
        column = ds.data.column(name).combine_chunks()
        if isinstance(column, pa.ChunkedArray):  # empty
            column = pa.concat_arrays(column.chunks) if column.num_chunks else pa.array([], pa.list_(pa.int64()))
        return column

    ids = flat("input_ids")
    offsets = ids.offsets.to_numpy().astype(np.int64)
    offsets = offsets - offsets[0]
    lengths = np.diff(offsets)
    if "labels" in ds.column_names:
        labels = flat("labels")
        values = labels.flatten().to_numpy(zero_copy_only=False)
        trained = values != -100
    else:  # no mask: every token trains
        trained = np.ones(int(offsets[-1]), dtype=bool)
    cum = np.concatenate([[0], np.cumsum(trained, dtype=np.int64)])
    starts, ends = offsets[:-1], offsets[1:]
    total = cum[ends] - cum[starts]
    if max_length is None:
        head = tail = total
    else:
        head = cum[np.minimum(ends, starts + max_length)] - cum[starts]
        tail = cum[ends] - cum[np.maximum(starts, ends - max_length)]
    return {"lengths": lengths, "trained": total, "trained_head": head, "trained_tail": tail}


def truncation_of(
    max_length: int | None, packing: bool, packing_strategy: str, truncation_mode: str
) -> tuple[str | None, bool]:
    """(what is kept of a long record: "keep_start" / "keep_end" / None for nothing cut, whether records left without a
    trained token are dropped), as TRL's SFTTrainer._prepare_dataset and pack_dataset do it."""
    if max_length is None:
        return None, False
    if packing:  # bfd cuts each record to max_length; bfd_split and wrapped carry the rest into other rows
        return ("keep_start" if packing_strategy == "bfd" else None), False
    return truncation_mode, True


def fit_of(
    summary: dict[str, np.ndarray],
    *,
    max_length: int | None,
    keep: str | None,
    drops: bool,
    masked: bool,
    drop_long: bool = False,
) -> dict:
    """The figures for one split. keep/drops: `truncation_of`; masked: only part of each record trains (prompt/completion
    data, or assistant-only loss), so a cut can take part or all of what trains (the completion); drop_long
    (--drop_long_records): a record longer than max_length is dropped whole instead of cut, and counted as such."""
    lengths = np.asarray(summary["lengths"], dtype=np.int64)
    n = int(lengths.size)
    trained = np.asarray(summary["trained"], dtype=np.int64)
    if drop_long and max_length is not None:
        too_long = lengths > max_length
        dropped = too_long | ((trained == 0) if drops else np.zeros(n, dtype=bool))
        fit = {
            "records": n,
            "kept": int(n - dropped.sum()),
            "truncated": 0,
            "dropped": int(dropped.sum()),
            "dropped_long": int(too_long.sum()),
            "tokens": int(lengths.sum()),
            "tokens_cut": int(lengths[too_long].sum()),
            "max_length": max_length,
            "length_p50": _percentile(lengths, 50),
            "length_p95": _percentile(lengths, 95),
            "length_max": int(lengths.max()) if n else 0,
        }
        if masked:
            fit["completion_partly_cut"] = fit["completion_fully_cut"] = 0
        return fit
    if keep is None or max_length is None:
        over = np.zeros(n, dtype=bool)
        kept_trained = trained
    else:
        over = lengths > max_length
        kept_trained = np.asarray(summary["trained_head" if keep == "keep_start" else "trained_tail"], dtype=np.int64)
    dropped = (kept_trained == 0) if drops else np.zeros(n, dtype=bool)
    fully_cut = over & (trained > 0) & (kept_trained == 0)
    partly_cut = over & (kept_trained > 0) & (kept_trained < trained)
    fit = {
        "records": n,
        "kept": int(n - dropped.sum()),
        "truncated": int((over & ~dropped).sum()),
        "dropped": int(dropped.sum()),
        "tokens": int(lengths.sum()),
        "tokens_cut": int(np.maximum(lengths - max_length, 0)[over].sum()) if max_length else 0,
        "max_length": max_length,
        "length_p50": _percentile(lengths, 50),
        "length_p95": _percentile(lengths, 95),
        "length_max": int(lengths.max()) if n else 0,
    }
    if masked:
        fit["completion_partly_cut"] = int(partly_cut.sum())
        fit["completion_fully_cut"] = int(fully_cut.sum())
    return fit


def _percentile(lengths: np.ndarray, q: float) -> int:
    """The nearest-rank percentile (a length some record has)."""
    if lengths.size == 0:
        return 0
    ordered = np.sort(lengths)
    return int(ordered[max(0, math.ceil(q / 100 * ordered.size) - 1)])


def fit_line(split: str, fit: dict) -> str:
    """One line: records kept/truncated/dropped, completions cut, tokens cut, length percentiles against max_length."""
    parts = [
        f"{split} data: {fit['kept']} of {fit['records']} records kept, {fit['truncated']} truncated, {fit['dropped']} dropped"
        + (
            f" ({fit['dropped_long']} longer than max_length, --drop_long_records)"
            if fit.get("dropped_long") is not None
            else ""
        )
    ]
    if "completion_fully_cut" in fit:
        parts.append(
            f"completion cut in {fit['completion_partly_cut'] + fit['completion_fully_cut']} "
            f"({fit['completion_fully_cut']} entirely)"
        )
    share = fit["tokens_cut"] / fit["tokens"] if fit["tokens"] else 0.0
    lost = "in dropped records" if fit.get("dropped_long") is not None else "cut"
    parts.append(f"{fit['tokens_cut']} of {fit['tokens']} tokens {lost} ({share:.1%})")
    parts.append(
        f"length p50 {fit['length_p50']}, p95 {fit['length_p95']}, max {fit['length_max']} vs max_length "
        f"{fit['max_length'] if fit['max_length'] else 'none'}"
    )
    return "; ".join(parts)


def needs_warning(fit: dict) -> bool:
    """More than WARN_TRUNCATED_SHARE of the records truncated, or any record dropped or its completion fully cut."""
    if not fit["records"]:
        return False
    lost = fit["truncated"] + fit["dropped"]
    return lost / fit["records"] > WARN_TRUNCATED_SHARE or fit["dropped"] > 0 or fit.get("completion_fully_cut", 0) > 0


def suggested_max_length(fit: dict) -> int:
    """A max_length that fits 95% of the records (and every one when p95 is the maximum), rounded up."""
    return int(math.ceil(max(fit["length_p95"], 1) / LENGTH_STEP) * LENGTH_STEP)


def fit_warning(split: str, fit: dict, positions: int | None) -> str | None:
    """The warning naming the fix, or None when the data fits well enough."""
    if not needs_warning(fit):
        return None
    lost = []
    if fit["truncated"]:
        lost.append(f"{fit['truncated']} of {fit['records']} {split} records are truncated")
    long_dropped = fit.get("dropped_long") or 0
    if long_dropped:
        lost.append(f"{long_dropped} of {fit['records']} {split} records are dropped as longer than max_length")
    if fit["dropped"] - long_dropped:
        lost.append(f"{fit['dropped'] - long_dropped} dropped (nothing left to train on)")
    if fit.get("completion_fully_cut"):
        lost.append(f"{fit['completion_fully_cut']} lost their whole completion")
    want = suggested_max_length(fit)
    if positions and want > positions:
        fix = (
            f"use a model with at least {want} positions (this one has {positions}; --max_length {positions} is its limit), "
            f"or filter out records longer than {positions} tokens"
        )
    else:
        fix = f"raise --max_length to {want} (fits 95% of the records), use a longer-context model, or filter out the long records"
    return f"warning: {', '.join(lost)} at max_length {fit['max_length']}: {fix}"

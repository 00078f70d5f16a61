"""Preference data for `--method dpo|kto|reward`: loaded, shaped into TRL's columns, tokenised as the trainer
tokenises it (for `llmft prepare --show` and the data-fit line), and its fit counted.

These methods are `prepared_by="trl"` in llmft.planning.methods: the trainer (DPOTrainer, KTOTrainer,
RewardTrainer) tokenises the shaped records itself. What llmft adds before it:

- `load_method_records`: the records of --dataset_name (and the evaluation split) in TRL's shape, each record
  dropped by llmft.data.formats counted by reason and said in one line; none left is one line (exit 2).
- `tokenise`: the trainer's own `_prepare_dataset` run without truncation, so `--show` prints the tokens the
  trainer sees and the fit counts what its truncation will cut, as llmft.data.cache does for SFT.
- `pair_fit` / `pair_fit_line`: records kept, dropped (by llmft, by reason, and by TRL's own filter, which TRL
  does without a word), truncated, tokens cut, lengths against max_length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import numpy as np

from llmft.data import formats
from llmft.data import loading as data
from llmft.data.cache import DataOptions, _this_process_only
from llmft.data.loading import DataError
from llmft.planning.methods import method as method_entry

LOSS_OPEN, LOSS_CLOSE = "«", "»"

# What each TRL trainer (1.16, its _prepare_dataset and collator) does to a long record: which module tokenises it,
# and which records its filter drops ("prompt": the prompt alone fills max_length, under keep_start for DPO and
# always for KTO; "longer": either whole sequence is longer than max_length, as RewardTrainer filters).
TRL_PREPARATION = {
    "trl:DPOTrainer": ("trl.trainer.dpo_trainer", "DPOTrainer", "prompt_keep_start"),
    "trl:KTOTrainer": ("trl.trainer.kto_trainer", "KTOTrainer", "prompt"),
    # the reward trainer scores prompt+chosen and prompt+rejected whole: DPO's tokenisation of the same text gives
    # those tokens, split where the prompt ends (what --show marks)
    "trl:RewardTrainer": ("trl.trainer.dpo_trainer", "DPOTrainer", "longer"),
}


def _entry(method):
    return method if hasattr(method, "trainer_class") else method_entry(method)


def check_method_options(opts: DataOptions, entry) -> None:
    """The data flags preference shaping has no use for, refused in one line rather than ignored."""
    if opts.dataset_mixture:
        raise DataError("--dataset_mixture mixes SFT datasets; for preference data give one file with --dataset_name")
    unused = [
        flag
        for flag, given in (
            ("--prompt_template", opts.prompt_template),
            ("--messages_column", opts.messages_column),
            ("--role_map", opts.role_map),
            ("--assistant_only_loss", opts.assistant_only_loss is not None),
            ("--drop_long_records", opts.drop_long_records),
            ("--dataset_text_field", opts.text_field != "text"),
        )
        if given
    ]
    if unused:
        raise DataError(
            f"{', '.join(unused)} shape(s) SFT data; --method {entry.name} trains on its records' prompt and "
            "completions as they are (the loss on the completions): drop the flag(s)"
        )


def load_method_records(opts: DataOptions, method, log: Callable[[str], None] = print) -> tuple:
    """(train, eval or None, [formats.Shaped]): --dataset_name's records in `method`'s TRL shape (a name or a
    llmft.planning.methods.Method; sft goes through llmft.data.cache as before), the evaluation split held out
    or loaded, --data_percentage taken. Each dataset's notes and its dropped-record line are logged."""
    check_method_options(opts, _entry(method))
    flags = dict(
        dataset_format=opts.dataset_format,
        prompt_column=opts.prompt_column,
        completion_column=opts.completion_column,
    )
    shaped: list = []
    train, info = formats.shape_for_method(
        data.load_train_split(opts.dataset_name, opts.dataset_config, opts.train_split), method, **flags
    )
    shaped.append(info)
    evaluation = None
    if opts.eval_split_ratio:
        train, evaluation = data.held_out_split(train, opts.eval_split_ratio)
    elif opts.eval_dataset_name:
        evaluation, eval_info = formats.shape_for_method(
            data.load_train_split(opts.eval_dataset_name, None, opts.eval_split), method, **flags
        )
        eval_info.notes = [f"--eval_dataset_name: {note}" for note in eval_info.notes]
        shaped.append(eval_info)
    train = data.take_percentage(train, opts.data_percentage, seed=opts.seed)
    for split, found in zip(("train", "eval"), shaped):
        for note in found.notes:
            log(note)
        line = found.dropped.line(split) if found.dropped else None
        if line:
            log(line)
    return train, evaluation, shaped


def tokenise(ds, tokenizer, method, *, num_proc: int | None = None):
    """The shaped records tokenised by the method's TRL trainer's own `_prepare_dataset`, with max_length None (nothing
    truncated or filtered): prompt_ids with chosen_ids/rejected_ids (pairs) or completion_ids (KTO)."""
    import importlib

    method = _entry(method)
    module_name, class_name, _ = TRL_PREPARATION[method.trainer_class]
    module = importlib.import_module(module_name)
    trainer = getattr(module, class_name)
    if formats.conversational_records(ds):
        data.ensure_chat_template(tokenizer)
    # KTOTrainer reads its desirable/undesirable weights to warn about an unbalanced dataset: TRL's defaults here
    view = SimpleNamespace(_tokenizer=tokenizer, calculate_KL=False, desirable_weight=1.0, undesirable_weight=1.0)
    args = SimpleNamespace(dataset_num_proc=num_proc, max_length=None, truncation_mode="keep_start")
    with _this_process_only(module):
        return trainer._prepare_dataset(view, ds, tokenizer, args, "train")


def _sides(row: dict) -> list[tuple[str, list[int]]]:
    if "chosen_ids" in row:
        return [("chosen", row["chosen_ids"]), ("rejected", row["rejected_ids"])]
    return [(f"completion (label {str(bool(row['label'])).lower()})", row["completion_ids"])]


def show_lines(tokenised, tokenizer, n: int) -> list[str]:
    """The first n tokenised records: the prompt, then each side (chosen and rejected, or KTO's completion and its
    label), decoded after the chat template, the tokens that carry loss between « and » (each side's completion,
    which follows the prompt in its sequence; the prompt never carries loss)."""

    def text(ids):
        return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    out = []
    for i in range(min(n, len(tokenised))):
        row = tokenised[i]
        sides = _sides(row)
        counts = ", ".join(f"{name.split(' ')[0]} {len(ids)}" for name, ids in sides)
        out.append(f"--- record {i + 1} of {len(tokenised)}: prompt {len(row['prompt_ids'])} tokens, {counts} ---")
        out.append("prompt: " + text(row["prompt_ids"]))
        for name, ids in sides:
            out.append(f"{name}: {LOSS_OPEN}{text(ids)}{LOSS_CLOSE}")
    return out


def pair_fit(tokenised, method, max_length: int | None, dropped: formats.Dropped | None) -> dict:
    """The fit of the tokenised records at max_length, as TRL's trainer will cut them: each sequence (prompt+chosen,
    prompt+rejected; KTO: prompt+completion) longer than max_length is truncated, and the trainer's filter
    (TRL_PREPARATION) drops records; llmft's own drops (`dropped`, by reason) are carried in."""
    prompts = np.array([len(x) for x in tokenised["prompt_ids"]], dtype=np.int64)
    side_columns = ["chosen_ids", "rejected_ids"] if "chosen_ids" in tokenised.column_names else ["completion_ids"]
    seqs = np.stack([prompts + np.array([len(x) for x in tokenised[c]], dtype=np.int64) for c in side_columns])
    rule = TRL_PREPARATION[_entry(method).trainer_class][2]
    n = int(prompts.size)
    if max_length is None:
        trl_dropped = np.zeros(n, dtype=bool)
        over = np.zeros(n, dtype=bool)
        cut = 0
    else:
        if rule == "longer":
            trl_dropped = (seqs > max_length).any(axis=0)
        else:  # prompt_keep_start: TRL's default truncation_mode, which llmft keeps
            trl_dropped = prompts >= max_length
        over = (seqs > max_length).any(axis=0) & ~trl_dropped
        cut = int(np.maximum(seqs - max_length, 0)[:, over].sum() + seqs[:, trl_dropped].sum())
    lengths = seqs.max(axis=0) if n else np.zeros(0, dtype=np.int64)
    shaping = dropped.counts if dropped else {}
    return {
        "records": n + sum(shaping.values()),
        "kept": int(n - trl_dropped.sum()),
        "truncated": int(over.sum()),
        "dropped": int(trl_dropped.sum()) + sum(shaping.values()),
        "dropped_by_reason": dict(shaping),
        "dropped_too_long": int(trl_dropped.sum()),
        "tokens": int(seqs.sum()),
        "tokens_cut": cut,
        "max_length": max_length,
        "length_p50": _percentile(lengths, 50),
        "length_p95": _percentile(lengths, 95),
        "length_max": int(lengths.max()) if n else 0,
        "unit": "pairs" if len(side_columns) == 2 else "examples",
    }


def _percentile(lengths: np.ndarray, q: float) -> int:
    if lengths.size == 0:
        return 0
    ordered = np.sort(lengths)
    return int(ordered[max(0, math.ceil(q / 100 * ordered.size) - 1)])


def pair_fit_line(split: str, fit: dict) -> str:
    """One line: records kept, each drop counted by its reason, truncated, tokens cut, lengths against max_length."""
    reasons = [f"{k} with {formats.DROP_REASONS[r]}" for r, k in fit["dropped_by_reason"].items() if k]
    if fit["dropped_too_long"]:
        reasons.append(f"{fit['dropped_too_long']} too long for max_length (the trainer's filter)")
    share = fit["tokens_cut"] / fit["tokens"] if fit["tokens"] else 0.0
    return (
        f"{split} data: {fit['kept']} of {fit['records']} {fit['unit']} kept, {fit['truncated']} truncated, "
        f"{fit['dropped']} dropped" + (f" ({', '.join(reasons)})" if reasons else "") + "; "
        f"{fit['tokens_cut']} of {fit['tokens']} tokens cut ({share:.1%}); "
        f"longest sequence p50 {fit['length_p50']}, p95 {fit['length_p95']}, max {fit['length_max']} vs max_length "
        f"{fit['max_length'] if fit['max_length'] else 'none'}"
    )


@dataclass
class PreparedPairs:
    """What `prepare_method_data` gives the trainer and `llmft prepare`: the shaped records (TRL tokenises them),
    the same tokenised without truncation (for --show), each split's fit, and what each dataset was."""

    train: object
    eval: object | None
    tokenised: dict
    fit: dict
    shaped: list


def prepare_method_data(opts: DataOptions, method, tokenizer, max_length: int | None, *, log=print, num_proc=None):
    """The one call for a method whose TRL trainer tokenises its own data (`prepared_by == "trl"`): the records loaded
    and shaped (`load_method_records`, drops logged), tokenised as the trainer will, and the fit line of each split
    logged; where the trainer's filter would leave nothing, one line naming --max_length."""
    entry = _entry(method)
    train, evaluation, shaped = load_method_records(opts, entry, log)
    tokenised, fit = {}, {}
    for split, ds in (("train", train), ("eval", evaluation)):
        if ds is None:
            continue
        dropped = shaped[0].dropped if split == "train" else (shaped[1].dropped if len(shaped) > 1 else None)
        tokenised[split] = tokenise(ds, tokenizer, entry, num_proc=num_proc)
        fit[split] = pair_fit(tokenised[split], entry, max_length, dropped)
        log(pair_fit_line(split, fit[split]))
        if fit[split]["kept"] == 0:
            raise DataError(
                f"no {split} records left: every one is too long for max_length {max_length} (the prompt fills it"
                + (", or a side is longer" if TRL_PREPARATION[entry.trainer_class][2] == "longer" else "")
                + "); raise --max_length or shorten the prompts"
            )
    return PreparedPairs(train, evaluation, tokenised, fit, shaped)


def shape_and_count(ds, method, tokenizer, max_length: int | None, **flags) -> tuple:
    """(records in TRL's shape for the trainer, their fit, the fit line): for a caller holding a loaded dataset."""
    shaped, info = formats.shape_for_method(ds, method, **flags)
    fit = pair_fit(tokenise(shaped, tokenizer, method), method, max_length, info.dropped)
    return shaped, fit, pair_fit_line("train", fit)

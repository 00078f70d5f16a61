"""The tokenised (and packed) training and evaluation data, prepared once into a cache every run can reuse.

`llmft prepare` and `llmft train` both call `prepare`. The result is what TRL's
SFTTrainer computes on the fly, token for token: TRL's own `SFTTrainer._prepare_dataset` computes it,
and the trainer receives it with `dataset_kwargs={"skip_prepare_dataset": True}`.

The cache is `$LLMFT_CACHE/prepared/<fingerprint>/` (default `$HF_HOME/llmft/prepared/`), keyed by
the data files' bytes, the tokenizer, the chat template, the format, column and prompt-template options,
the loss mask (assistant-only or not), max_length, --drop_long_records, packing and data_percentage
(`fingerprint`): a learning-rate sweep or a rerun into another
--output_dir tokenises nothing again. A directory is built under a temporary name and renamed into
place with its marker inside, so a preparation killed half-way is never taken as complete. In a
distributed job global rank 0 prepares while the other ranks wait for the marker (polling files,
not inside a collective with a timeout); every rank then memory-maps the Arrow files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Mapping

from llmft.data import fit as data_fit
from llmft.data import formats, masking, mixture
from llmft.data import loading as data
from llmft.data.loading import DataError

PREPARE_VERSION = 3  # bump when what is stored changes (3: formats, assistant-only loss by default for chat)
MARKER = "llmft_prepared.json"
START_GRACE_S = 600  # waiting ranks give up when rank 0 has not started in this long (cache not shared?)


cache_root = (
    data.cache_root
)  # $LLMFT_CACHE, else llmft/ under $HF_HOME (llmft.data.loading: its fingerprints live there too)


@dataclass(frozen=True)
class DataOptions:
    """Which records, in which shape: everything about the data that is not the tokenizer or TRL's options."""

    dataset_name: str
    dataset_config: str | None = None
    train_split: str = "train"
    eval_dataset_name: str | None = None
    eval_split: str = "test"
    eval_split_ratio: float | None = None
    prompt_column: str | None = None
    completion_column: str | None = None
    messages_column: str | None = None
    text_field: str = "text"
    data_percentage: float = 100.0
    seed: int = 42
    dataset_mixture: str | None = None  # a mixture YAML (llmft.data.mixture) instead of dataset_name
    dataset_format: str | None = None  # None/auto: recognised from the fields (llmft.data.formats)
    prompt_template: str | None = None  # a preset name or a format string over the record's fields
    role_map: str | None = None  # extra speaker names -> chat roles ("bot=assistant")
    assistant_only_loss: bool | None = None  # None: on for chat data (the loss on the assistant turns)
    drop_long_records: bool = False  # drop records longer than max_length instead of truncating them

    @classmethod
    def from_args(cls, script_args, training_args, llmft_args) -> "DataOptions":
        return cls(
            dataset_name=script_args.dataset_name,
            dataset_config=script_args.dataset_config,
            train_split=script_args.dataset_train_split,
            eval_dataset_name=llmft_args.eval_dataset_name,
            eval_split=script_args.dataset_test_split,
            eval_split_ratio=llmft_args.eval_split_ratio,
            prompt_column=llmft_args.prompt_column,
            completion_column=llmft_args.completion_column,
            messages_column=llmft_args.messages_column,
            text_field=getattr(training_args, "dataset_text_field", "text"),  # SFTConfig's alone
            data_percentage=llmft_args.data_percentage,
            seed=training_args.seed,
            dataset_mixture=getattr(llmft_args, "dataset_mixture", None),
            dataset_format=getattr(llmft_args, "dataset_format", None),
            prompt_template=getattr(llmft_args, "prompt_template", None),
            role_map=getattr(llmft_args, "role_map", None),
            assistant_only_loss=getattr(training_args, "assistant_only_loss", None),
            drop_long_records=bool(getattr(llmft_args, "drop_long_records", False)),
        )

    @property
    def format_options(self) -> dict:
        """The keyword arguments of llmft.data.formats.shape_for_sft for --dataset_name and --eval_dataset_name."""
        return dict(
            prompt_column=self.prompt_column,
            completion_column=self.completion_column,
            messages_column=self.messages_column,
            text_field=self.text_field,
            dataset_format=self.dataset_format,
            prompt_template=self.prompt_template,
            role_map=self.role_map,
        )

    @property
    def has_eval(self) -> bool:
        return bool(self.eval_dataset_name or self.eval_split_ratio)


def check_options(opts: DataOptions, eval_strategy: str = "no", dataset_kwargs: dict | None = None) -> None:
    """Cheap checks before anything loads: percentages, ratios, evaluation flags that need evaluation data."""
    if opts.dataset_mixture:
        check_mixture_options(opts)
    elif not opts.dataset_name:
        raise DataError(
            "--dataset_name is required (a .jsonl/.json/.parquet/.csv file or directory, or a hub dataset)"
        )
    check_format_options(opts)
    data.check_percentage(opts.data_percentage)
    if opts.eval_split_ratio is not None:
        data.check_eval_split_ratio(opts.eval_split_ratio)
        if opts.eval_dataset_name:
            raise DataError("give either --eval_dataset_name or --eval_split_ratio, not both")
    strategy = getattr(eval_strategy, "value", eval_strategy)
    if strategy not in (None, "no") and not opts.has_eval:
        raise DataError(
            f"--eval_strategy {strategy} needs evaluation data: add --eval_dataset_name FILE or --eval_split_ratio 0.05"
        )
    if (dataset_kwargs or {}).get("skip_prepare_dataset"):
        raise DataError(
            "llmft prepares the data itself (tokenised once, cached): drop skip_prepare_dataset from --dataset_kwargs"
        )


def check_format_options(opts: DataOptions) -> None:
    """--dataset_format, --prompt_template and --role_map checked before anything loads."""
    if opts.dataset_format not in (None, "", "auto", *formats.FORMATS):
        raise DataError(f"--dataset_format {opts.dataset_format!r}: use auto or one of {', '.join(formats.FORMATS)}")
    if opts.prompt_template and opts.prompt_template not in formats.PRESETS:
        if not formats.template_fields(opts.prompt_template):
            raise DataError(
                f"--prompt_template {opts.prompt_template!r} is neither a preset ({', '.join(formats.PRESETS)}) nor a "
                "format string naming a field (e.g. 'Question: {question}\\nAnswer:')"
            )
    formats.parse_role_map(opts.role_map)


def check_mixture_options(opts: DataOptions) -> None:
    """A mixture replaces --dataset_name and the per-dataset flags (they go per source in its YAML); its sources
    are read and mapped here on rank 0, so a bad mixture stops the run before any model loads."""
    given = [
        flag
        for flag, value in (
            ("--dataset_name", opts.dataset_name),
            ("--dataset_config", opts.dataset_config),
            ("--prompt_column", opts.prompt_column),
            ("--completion_column", opts.completion_column),
            ("--messages_column", opts.messages_column),
            ("--dataset_format", opts.dataset_format if opts.dataset_format != "auto" else None),
            ("--prompt_template", opts.prompt_template),
        )
        if value
    ]
    if opts.data_percentage != 100:
        given.append("--data_percentage")
    if given:
        raise DataError(
            f"--dataset_mixture lists the datasets: drop {', '.join(given)} (per source in the mixture YAML: "
            "path, config, columns, format, prompt_template, percentage)"
        )
    spec = mixture.read_mixture(opts.dataset_mixture, opts.seed)
    # The sources are read and checked (formats, JSON Lines objects) where the data is prepared, once: on rank 0,
    # before any model loads. The other ranks hear of a bad source through rank 0's exit (torchrun ends the group)
    # instead of each reading every source again.
    if os.environ.get("RANK", "0") == "0":
        mixture.load_sources(spec, opts.text_field, role_map=opts.role_map)


def apply_tokenizer_options(tokenizer, args) -> None:
    """What SFTTrainer's constructor does to the tokenizer before tokenising (--eos_token, --chat_template_path)."""
    if args.eos_token is not None:
        if args.eos_token not in tokenizer.get_vocab():
            raise DataError(
                f"--eos_token {args.eos_token!r} is not in the tokenizer's vocabulary; pick one of its special tokens"
            )
        tokenizer.eos_token = args.eos_token
    if args.chat_template_path is not None:
        path = args.chat_template_path
        if not (os.path.isfile(path) and path.endswith((".jinja", ".j2"))):
            raise DataError(
                f"--chat_template_path {path}: llmft tokenises before the model loads, so it takes a .jinja/.j2 template file "
                "(cloning a model's template adds tokens to the model); save that template to a file and pass the file"
            )
        tokenizer.chat_template = Path(path).read_text(encoding="utf-8")


# --------------------------------------------------------------------------------------------------
# The key


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of the tokenizer's files as `save_pretrained` writes them (vocabulary, merges, special tokens,
    chat template): equal for the same tokenizer loaded from anywhere, different after any change."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    with tempfile.TemporaryDirectory(prefix="llmft-tok-") as tmp:
        tokenizer.save_pretrained(tmp)
        for path in sorted(Path(tmp).rglob("*")):
            if path.is_file():
                h.update(str(path.relative_to(tmp)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def fingerprint(opts: DataOptions, tokenizer, args) -> tuple[str, dict]:
    """(fingerprint, key): everything that decides the prepared tokens, hashed. Paths are not in it (the bytes are),
    nor anything that only changes training (learning rate, output_dir, batch sizes)."""
    import datasets
    import tokenizers
    import transformers
    import trl

    if opts.eval_split_ratio:
        evaluation = {"held_out_ratio": opts.eval_split_ratio, "seed": data.EVAL_SPLIT_SEED}
    elif opts.eval_dataset_name:
        evaluation = {"data": data.content_fingerprint(opts.eval_dataset_name, None), "split": opts.eval_split}
    else:
        evaluation = None
    subset = opts.data_percentage < 100 or args.shuffle_dataset
    if opts.dataset_mixture:
        train = {"mixture": mixture.mixture_key(mixture.read_mixture(opts.dataset_mixture, opts.seed))}
    else:
        train = {
            "data": data.content_fingerprint(opts.dataset_name, opts.dataset_config),
            "config": opts.dataset_config,
            "split": opts.train_split,
        }
    key = {
        "version": PREPARE_VERSION,
        "libraries": {m.__name__: m.__version__ for m in (trl, transformers, tokenizers, datasets)},
        "train": train,
        "eval": evaluation,
        "columns": {
            "prompt": opts.prompt_column,
            "completion": opts.completion_column,
            "messages": opts.messages_column,
            "text": opts.text_field,
        },
        "format": {
            "format": opts.dataset_format if opts.dataset_format != "auto" else None,
            "prompt_template": opts.prompt_template,
            "role_map": opts.role_map,
        },
        "assistant_only_loss": opts.assistant_only_loss,
        "drop_long_records": opts.drop_long_records if args.max_length else False,
        "data_percentage": opts.data_percentage,
        "seed": opts.seed if subset else None,  # a --seed sweep over the full data shares one preparation
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "chat_template": getattr(tokenizer, "chat_template", None) or {"llmft_default": data.DEFAULT_CHAT_TEMPLATE},
        "eos_token": tokenizer.eos_token,
        "sft": {
            name: getattr(args, name)
            for name in (
                "dataset_text_field",
                "max_length",
                "truncation_mode",
                "packing",
                "packing_strategy",
                "eval_packing",
                "completion_only_loss",
                "shuffle_dataset",
            )
        },
    }
    blob = json.dumps(key, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16], key


# --------------------------------------------------------------------------------------------------
# Building: TRL's own preparation


@contextlib.contextmanager
def _this_process_only(sft_trainer_module):
    """TRL orders processes around dataset preparation with barriers (a collective). Here one process prepares
    and the others wait on files, so the ordering is switched off while TRL's function runs."""
    saved = sft_trainer_module.global_then_local_main_first
    sft_trainer_module.global_then_local_main_first = contextlib.nullcontext
    try:
        yield
    finally:
        sft_trainer_module.global_then_local_main_first = saved


def completion_only_loss(args, first_example: dict) -> bool:
    """As SFTTrainer decides it: the flag, else on for prompt/completion data."""
    if args.completion_only_loss is not None:
        return args.completion_only_loss
    return "prompt" in first_example and "completion" in first_example


def assistant_only(opts: "DataOptions", shape: str) -> bool:
    """The loss on the assistant turns only: --assistant_only_loss, else on for chat data (as the docs, Axolotl and
    LLaMA-Factory do); TRL's default (off) would train a chat model on its users' turns and the template's tokens."""
    if opts.assistant_only_loss is None:
        return shape == "messages"
    if opts.assistant_only_loss and shape != "messages":
        raise DataError(
            f"--assistant_only_loss needs chat data (messages or ShareGPT conversations); this dataset is {shape} "
            "(its loss is on the completion already): drop the flag"
        )
    return bool(opts.assistant_only_loss)


def trl_prepare(
    dataset, tokenizer, args, *, packing: bool, name: str, completion_only: bool, chat_template: str | None = None
):
    """SFTTrainer._prepare_dataset itself (tokenise, labels from the completion/assistant masks, truncate, pack),
    given the three things it reads from the trainer, set as SFTTrainer's constructor sets them (chat_template:
    TRL's training template for an assistant-only loss, `tokenise_chat`). The assistant-only mask of a template
    neither marked nor known to TRL is llmft's (llmft.data.masking: the data arrives tokenised, with TRL's
    `assistant_masks` column, and TRL builds the labels from it)."""
    from jinja2 import TemplateError
    from trl import SFTTrainer
    from trl.trainer import sft_trainer

    trainer_view = SimpleNamespace(
        _tokenizer=tokenizer, chat_template=chat_template, completion_only_loss=completion_only
    )
    with _this_process_only(sft_trainer):
        try:
            return SFTTrainer._prepare_dataset(trainer_view, dataset, tokenizer, args, packing, None, name)
        except TemplateError as e:  # the chat template's own checks (roles must alternate, ...)
            raise DataError(masking.template_refuses(e)) from None
        except ValueError as e:  # TRL's own checks (e.g. packing without max_length)
            raise DataError(f"preparing the {name} data failed: {str(e).strip().splitlines()[0]}") from None


def tokenise_chat(dataset, tokenizer, args, *, name: str, assistant_only_loss: bool):
    """(chat records, the chat template TRL tokenises them with): where the loss is on the assistant turns, the mask
    comes from the template's {% generation %} markers (transformers), else from TRL's training version of a
    template TRL knows (what SFTTrainer itself does), else from llmft (llmft.data.masking renders each
    conversation prefix; the records come back tokenised with their mask). Every token trains otherwise."""
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    if not assistant_only_loss or has_generation_markers(tokenizer.chat_template):
        return dataset, None
    try:
        patched = get_training_chat_template(tokenizer)
    except ValueError:  # a template TRL does not know ("not training-compatible")
        patched = None
    if patched:
        return dataset, patched
    return masking.tokenise_dataset(dataset, tokenizer, name, num_proc=args.dataset_num_proc), None


def prepare_counted(
    dataset,
    tokenizer,
    args,
    *,
    packing: bool,
    name: str,
    completion_only: bool,
    masked: bool,
    drop_long: bool = False,
    chat_template: str | None = None,
):
    """(TRL's prepared split, its data fit): TRL tokenises and labels the records without truncating them, the fit is
    counted on those tokens (llmft.data.fit), then TRL's same preparation truncates, drops and packs them (it skips
    tokenising data that already has input_ids and labels): the tokens are TRL's, tokenised once. With drop_long
    (--drop_long_records) the records longer than max_length are dropped before that, and counted."""
    full = trl_prepare(
        dataset,
        tokenizer,
        dataclasses.replace(args, max_length=None, packing=False, shuffle_dataset=False),
        packing=False,
        name=name,
        completion_only=completion_only,
        chat_template=chat_template,
    )
    drop_long = bool(drop_long and args.max_length)
    keep, drops = data_fit.truncation_of(args.max_length, packing, args.packing_strategy, args.truncation_mode)
    summary = data_fit.summarise(full, args.max_length)
    fit = data_fit.fit_of(
        summary, max_length=args.max_length, keep=keep, drops=drops, masked=masked, drop_long=drop_long
    )
    if drop_long:
        short = [i for i, n in enumerate(summary["lengths"]) if n <= args.max_length]
        if len(short) < len(full):
            full = full.select(short)
    return trl_prepare(full, tokenizer, args, packing=packing, name=name, completion_only=completion_only), fit


def fit_lines(info: dict, positions: int | None = None) -> list[str]:
    """The data-fit line of each split, and the warning naming the fix where too much is cut."""
    out = []
    for split, fit in (info.get("fit") or {}).items():
        out.append(data_fit.fit_line(split, fit))
        warning = data_fit.fit_warning(split, fit, positions)
        if warning:
            out.append(warning)
    return out


def load_records(opts: DataOptions, mixed: dict | None = None, shaped: list | None = None):
    """(train, eval or None, shape): loaded, checked, recognised and converted to TRL's columns
    (llmft.data.formats), the eval split held out (before --data_percentage, so it does not move with it), then
    the training percentage taken. A mixture's record (its sources and the records each gave) goes into `mixed`;
    what each dataset was (llmft.data.formats.Shaped: format, template, lines to say) into `shaped`."""
    shaped = [] if shaped is None else shaped
    if opts.dataset_mixture:
        spec = mixture.read_mixture(opts.dataset_mixture, opts.seed)
        sources, shape = mixture.load_sources(spec, opts.text_field, role_map=opts.role_map, shaped=shaped)
        train, counts = mixture.mix(sources, spec)
        if mixed is not None:
            mixed.update(mixture.record(spec, counts))
    else:
        train, shape = formats.shape_for_sft(
            data.load_train_split(opts.dataset_name, opts.dataset_config, opts.train_split),
            **opts.format_options,
            shaped=shaped,
        )
    evaluation = None
    if opts.eval_split_ratio:
        train, evaluation = data.held_out_split(train, opts.eval_split_ratio)
    elif opts.eval_dataset_name:
        eval_shaped: list = []
        evaluation, eval_shape = formats.shape_for_sft(
            data.load_train_split(opts.eval_dataset_name, None, opts.eval_split),
            **opts.format_options,
            shaped=eval_shaped,
        )
        for info in eval_shaped:
            info.notes = [f"--eval_dataset_name: {note}" for note in info.notes]
        shaped += eval_shaped
        if eval_shape != shape:
            raise DataError(
                f"--eval_dataset_name {opts.eval_dataset_name} holds {eval_shape} records but the training data is {shape}; use one format for both"
            )
    train = data.take_percentage(train, opts.data_percentage, seed=opts.seed)
    return train, evaluation, shape


def describe_formats(shaped: list) -> str:
    """The format(s) the data came in, as the start and prepare lines say it (a mixture: each distinct one)."""
    return "; ".join(dict.fromkeys(info.describe() for info in shaped))


def build(opts: DataOptions, tokenizer, args, out: Path, log: Callable[[str], None]) -> dict:
    """Prepare into `out` (a fresh directory): train/ and eval/ Arrow datasets, and the marker written last."""
    t0 = time.time()
    mixed: dict = {}
    shaped: list = []
    train, evaluation, shape = load_records(opts, mixed, shaped)
    described = describe_formats(shaped) or shape
    for info in shaped:
        for note in info.notes:
            log(note)
    assistant_only_loss = assistant_only(opts, shape)
    if shape == "messages" and data.ensure_chat_template(tokenizer):
        log("the tokenizer has no chat template; using llmft's default")
    no_assistant = {}
    if assistant_only_loss:
        train, no_assistant["train"] = formats.drop_without_assistant(train)
        if evaluation is not None:
            evaluation, no_assistant["eval"] = formats.drop_without_assistant(evaluation)
        for split, count in no_assistant.items():
            if count:
                log(
                    f"warning: {count} {split} conversation(s) have no assistant turn and were dropped (the loss is on "
                    "the assistant turns; --assistant_only_loss false trains on every token)"
                )
        if len(train) == 0:
            raise DataError(
                "no training conversation has an assistant turn: the loss is on the assistant turns; give conversations "
                "with assistant replies (map their role with --role_map NAME=assistant) or pass --assistant_only_loss false"
            )
    records = {"train": len(train), "eval": len(evaluation) if evaluation is not None else 0}
    completion_only = completion_only_loss(args, train[0])
    loss_on = (
        "the assistant turns"
        if assistant_only_loss
        else "the completion"
        if completion_only and shape == "prompt_completion"
        else "every token"
    )
    log(
        f"preparing {records['train']} training and {records['eval']} evaluation records ({described}; loss on "
        f"{loss_on}) into {out.parent}"
    )
    masked = completion_only and shape == "prompt_completion" or assistant_only_loss
    prepared, fit = {}, {}
    eval_packing = args.packing if args.eval_packing is None else args.eval_packing
    trl_args = dataclasses.replace(args, assistant_only_loss=assistant_only_loss)
    for split, records_of_split, split_packing in (("train", train, args.packing), ("eval", evaluation, eval_packing)):
        if records_of_split is None:
            continue
        chat_template = None
        if shape == "messages":
            records_of_split, chat_template = tokenise_chat(
                records_of_split, tokenizer, trl_args, name=split, assistant_only_loss=assistant_only_loss
            )
        prepared[split], fit[split] = prepare_counted(
            records_of_split,
            tokenizer,
            trl_args,
            packing=split_packing,
            name=split,
            completion_only=completion_only,
            masked=masked,
            drop_long=opts.drop_long_records,
            chat_template=chat_template,
        )
    for split, ds in prepared.items():
        if len(ds) == 0:
            raise DataError(
                f"no {split} sequences left after preparation (every record was fully masked, empty"
                + (", or longer than max_length with --drop_long_records" if opts.drop_long_records else "")
                + "); check max_length and the data"
            )
        ds.save_to_disk(str(out / split))
    files = {str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()}
    info = {
        "shape": shape,
        "format": described,
        "loss_on": loss_on,
        "records": records,
        "no_assistant_dropped": no_assistant or None,
        "sequences": {k: len(v) for k, v in prepared.items()},
        "tokens": {k: _token_count(v) for k, v in prepared.items()},
        "fit": fit,
        "seconds": round(time.time() - t0, 2),
        "created": time.time(),
        "files": files,
    }
    if mixed:
        info["mixture"] = mixed
    return info


def _token_count(ds) -> int:
    import pyarrow.compute as pc

    return int(pc.sum(pc.list_value_length(ds.data.column("input_ids"))).as_py() or 0)


# --------------------------------------------------------------------------------------------------
# The cache: complete or absent, one preparer, the others wait


@dataclass
class Prepared:
    train: object
    eval: object | None
    shape: str
    directory: Path
    fingerprint: str
    reused: bool
    info: dict


def write_run_record(output_dir: str | Path, opts: DataOptions, prepared: Prepared) -> Path:
    """`<output_dir>/llmft_data.json`: which data the run trained and evaluated on (for `llmft report`)."""
    info = prepared.info
    record = {
        "dataset_name": opts.dataset_name,
        "eval_dataset_name": opts.eval_dataset_name,
        "eval_split_ratio": opts.eval_split_ratio,
        "data_percentage": opts.data_percentage,
        "shape": prepared.shape,
        "format": info.get("format"),
        "loss_on": info.get("loss_on"),
        "no_assistant_dropped": info.get("no_assistant_dropped"),
        "fingerprint": prepared.fingerprint,
        "prepared_dir": str(prepared.directory),
        "records": info.get("records"),
        "sequences": info.get("sequences"),
        "tokens": info.get("tokens"),
        "fit": info.get("fit"),
    }
    if opts.dataset_mixture:
        record["dataset_name"] = f"mixture {opts.dataset_mixture}"
        record["mixture"] = info.get("mixture")
    path = Path(output_dir) / "llmft_data.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_json(path, record)
    return path


def read_marker(directory: Path) -> dict | None:
    """The marker of a complete preparation, or None (absent, unreadable, or a listed file missing/truncated)."""
    try:
        info = json.loads((directory / MARKER).read_text())
        for rel, size in info["files"].items():
            if (directory / rel).stat().st_size != size:
                return None
        return info
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def load_prepared_train(path: str | Path):
    """The training split of a complete preparation: its directory (`llmft prepare` prints it), or a run's
    --output_dir (its llmft_data.json names it). ValueError saying what is missing."""
    path = Path(path)
    record = path / "llmft_data.json"
    if record.is_file():
        path = Path(json.loads(record.read_text()).get("prepared_dir") or path)
    if read_marker(path) is None:
        raise ValueError(
            f"{path} is not complete prepared data: give the directory `llmft prepare` printed, or a run's --output_dir"
        )
    from datasets import load_from_disk

    return load_from_disk(str(path / "train"))


def open_prepared(directory: Path, info: dict, fp: str, reused: bool) -> Prepared:
    """Memory-map the Arrow files (nothing is read into memory until used)."""
    from datasets import load_from_disk

    train = load_from_disk(str(directory / "train"))
    evaluation = load_from_disk(str(directory / "eval")) if (directory / "eval").is_dir() else None
    return Prepared(train, evaluation, info["shape"], directory, fp, reused, info)


def attempt_id(env: Mapping[str, str] | None = None) -> str:
    """The same on every rank of one launch, different on the next (a requeue, a restart, another torchrun)."""
    env = os.environ if env is None else env
    names = (
        "SLURM_JOB_ID",
        "SLURM_RESTART_COUNT",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_RESTART_COUNT",
        "MASTER_ADDR",
        "MASTER_PORT",
        "WORLD_SIZE",
    )
    return hashlib.sha256("|".join(env.get(n, "") for n in names).encode()).hexdigest()[:12]


def _process_start() -> float:
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # no psutil: only markers from now on count
        return time.time()


def _write_json(path: Path, payload: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, path)


def _fresh_note(path: Path, attempt: str, since: float) -> dict | None:
    """A rank-0 note (started/error) of this launch, written after this process started."""
    try:
        note = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return note if note.get("attempt") == attempt and note.get("time", 0) >= since - 10 else None


def _remove_dead_tmp_dirs(root: Path, fp: str) -> None:
    """Temporary directories of preparations on this host whose process is gone (killed half-way)."""
    host = socket.gethostname()
    for tmp in root.glob(f".tmp-{fp}-{host}-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(tmp, ignore_errors=True)


def prepare(
    opts: DataOptions,
    tokenizer,
    args,
    *,
    log: Callable[[str], None] = print,
    timeout: float = 7200.0,
    env: Mapping[str, str] | None = None,
    root: Path | None = None,
    positions: int | None = None,
) -> Prepared:
    """The prepared train/eval datasets for these options: reused if complete in the cache, else built by global
    rank 0 while the other ranks wait for its marker (or its error note, or the timeout). The data fit of each split
    (llmft.data.fit) is logged, with a warning naming the fix where much is cut (positions: the model's)."""
    prepared = _prepare(opts, tokenizer, args, log=log, timeout=timeout, env=env, root=root)
    for line in fit_lines(prepared.info, positions):
        log(line)
    return prepared


def _prepare(opts: DataOptions, tokenizer, args, *, log, timeout, env, root) -> Prepared:
    env = os.environ if env is None else env
    apply_tokenizer_options(tokenizer, args)
    fp, key = fingerprint(opts, tokenizer, args)
    root = (root or cache_root(env)) / "prepared"
    final = root / fp
    info = read_marker(final)
    if info is not None:
        log(f"reused prepared data {final} (fingerprint {fp})")
        return open_prepared(final, info, fp, reused=True)

    attempt, since = attempt_id(env), _process_start()
    started, failed = root / f".{fp}.{attempt}.started", root / f".{fp}.{attempt}.error"
    if env.get("RANK", "0") != "0":
        return _wait(final, fp, started, failed, attempt, since, timeout, root)
    try:
        try:
            root.mkdir(parents=True, exist_ok=True)
            _write_json(
                started, {"attempt": attempt, "time": time.time(), "host": socket.gethostname(), "pid": os.getpid()}
            )
            return _build_once(opts, tokenizer, args, root, fp, key, log)
        except OSError as e:  # the cache, not the data (data errors are DataErrors already)
            raise DataError(
                f"cannot write prepared data under {root} ({e.strerror or e}): check its free space and "
                "permissions, or point LLMFT_CACHE at a writable directory every node shares"
            ) from None
    except BaseException as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        with contextlib.suppress(OSError):
            _write_json(failed, {"attempt": attempt, "time": time.time(), "error": reason})
        raise
    finally:
        with contextlib.suppress(OSError):
            started.unlink()


def _build_once(opts, tokenizer, args, root: Path, fp: str, key: dict, log) -> Prepared:
    """Build under a lock (concurrent jobs with the same data prepare it once), in a temporary directory renamed
    into place: the final directory exists only complete."""
    from filelock import FileLock

    final = root / fp
    with FileLock(str(root / f".{fp}.lock")):
        info = read_marker(final)
        if info is not None:  # another job prepared it while this one waited for the lock
            log(f"reused prepared data {final} (fingerprint {fp})")
            return open_prepared(final, info, fp, reused=True)
        _remove_dead_tmp_dirs(root, fp)
        tmp = root / f".tmp-{fp}-{socket.gethostname()}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            info = {"fingerprint": fp, "key": key, **build(opts, tokenizer, args, tmp, log)}
            _write_json(tmp / MARKER, info)
            if final.exists():  # incomplete or damaged leftovers: moved aside, then removed
                aside = root / f".broken-{fp}-{os.getpid()}"
                os.replace(final, aside)
                shutil.rmtree(aside, ignore_errors=True)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    seqs, tokens = info["sequences"], info["tokens"]
    log(
        f"prepared data {final} (fingerprint {fp}): {seqs['train']} training sequences ({tokens['train']} tokens)"
        + (f", {seqs['eval']} evaluation sequences" if "eval" in seqs else "")
        + f" in {info['seconds']:.1f}s"
    )
    return open_prepared(final, read_marker(final) or info, fp, reused=False)


def _wait(
    final: Path,
    fp: str,
    started: Path,
    failed: Path,
    attempt: str,
    since: float,
    timeout: float,
    root: Path,
    poll: float = 1.0,
) -> Prepared:
    """Wait for rank 0's preparation: its marker, its error note, or give up with a reason."""
    t0 = time.time()
    seen_start = False
    while True:
        info = read_marker(final)
        if info is not None:
            return open_prepared(final, info, fp, reused=False)
        error = _fresh_note(failed, attempt, since)
        if error:
            raise DataError(f"rank 0 could not prepare the data: {error.get('error')}")
        waited = time.time() - t0
        seen_start = seen_start or _fresh_note(started, attempt, since) is not None
        if not seen_start and waited > min(START_GRACE_S, timeout):
            raise DataError(
                f"rank 0 has not started preparing the data in {root} after {waited:.0f}s; LLMFT_CACHE must be on storage "
                "every node shares (or run `llmft prepare` with the same flags before the job)"
            )
        if waited > timeout:
            raise DataError(
                f"waited {waited:.0f}s for rank 0 to prepare the data in {final}; raise --prepare_timeout, "
                "or run `llmft prepare` with the same flags before the job"
            )
        time.sleep(poll)

"""The record formats users bring, recognised from their fields and turned into one of TRL's three shapes.

| format            | a record                                                              | becomes            |
|-------------------|-----------------------------------------------------------------------|--------------------|
| text              | {"text": ...}                                                         | text               |
| prompt_completion | {"prompt": ..., "completion": ...} (or a --prompt_template's fields)   | prompt/completion  |
| messages          | {"messages": [{"role": ..., "content": ...}, ...]}                    | messages           |
| alpaca            | {"instruction", "input" (optional), "output", "system" (optional)}    | prompt/completion  |
| sharegpt          | {"conversations": [{"from": "human"/"gpt"/..., "value": ...}, ...]}   | messages           |

Why here and not in TRL: TRL knows prompt/completion, role/content messages and (half of) ShareGPT; Alpaca and
ShareGPT files as published, a prompt in the format an evaluation prompts with, and one clear line for each
malformed conversation are what users of Axolotl or LLaMA-Factory expect, and what a traceback deep inside
TRL's tokenisation does not give. Nothing is dropped silently: fields the format leaves unused are counted in a
line (`unused_fields_line`), as are prompts glued to their completions without whitespace.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field

from llmft.data.loading import DataError

FORMATS = ("text", "prompt_completion", "messages", "alpaca", "sharegpt")

# ShareGPT speaker names (FastChat's and those other exports use) -> chat roles; --role_map adds or overrides.
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "observation": "tool",
}
CHAT_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Preset:
    """A named prompt template: the prompt (and, for optional fields, a variant without them) and the completion."""

    prompt: str
    completion: str
    prompt_without: str | None = None  # used when `optional` is empty in a record
    optional: str | None = None
    system_replaces: str | None = None  # a non-empty `system` field replaces this opening sentence

    def fields(self) -> set[str]:
        return {
            f for text in (self.prompt, self.completion, self.prompt_without or "") for f in template_fields(text)
        } | ({"system"} if self.system_replaces else set())


_ALPACA_INTRO = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request."
)
_ALPACA_INTRO_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request."
)

PRESETS = {
    # Stanford Alpaca's own templates (github.com/tatsu-lab/stanford_alpaca, train.py PROMPT_DICT)
    "alpaca": Preset(
        prompt=_ALPACA_INTRO + "\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n",
        prompt_without=_ALPACA_INTRO_NO_INPUT + "\n\n### Instruction:\n{instruction}\n\n### Response:\n",
        optional="input",
        completion="{output}",
        system_replaces="intro",
    ),
    # lm-evaluation-harness gsm8k: doc_to_text "Question: {{question}}\nAnswer:", target_delimiter " ", doc_to_target
    # "{{answer}}": a fine-tune in this format is scored by `llmft eval --tasks gsm8k` in the format it learnt
    "gsm8k": Preset(prompt="Question: {question}\nAnswer:", completion=" {answer}"),
}


def template_fields(template: str) -> list[str]:
    """The record fields a format string names ({question}, ...), in order."""
    try:
        return [name for _, name, _, _ in string.Formatter().parse(template) if name]
    except ValueError as e:
        raise DataError(
            f"--prompt_template {template!r} is not a format string ({e}); write fields as {{name}} and literal braces as {{{{ }}}}"
        ) from None


@dataclass
class Shaped:
    """What a dataset became: its format, TRL's shape, the prompt template used, and lines to say about it."""

    format: str
    shape: str
    template: str | None = None
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        out = self.format if self.format == self.shape else f"{self.format} -> {self.shape}"
        return out + (f", prompt template {self.template}" if self.template else "")


def parse_role_map(value: str | None) -> dict[str, str]:
    """--role_map "bot=assistant,person=user": extra speaker names and the chat role each stands for."""
    out: dict[str, str] = {}
    for item in (value or "").split(","):
        if not item.strip():
            continue
        name, sep, role = item.partition("=")
        if not sep or role.strip() not in CHAT_ROLES or not name.strip():
            raise DataError(
                f"--role_map {value!r}: give NAME=ROLE pairs separated by commas, ROLE one of {', '.join(CHAT_ROLES)} "
                "(e.g. --role_map bot=assistant,person=user)"
            )
        out[name.strip()] = role.strip()
    return out


def _nonempty(value) -> bool:
    return value is not None and value != "" and value != [] and value != {}


def _count_nonempty(ds, column: str) -> int:
    return sum(1 for v in ds[column] if _nonempty(v))


def shape_for_sft(ds, *, shaped: list | None = None, **flags):
    """(records in TRL's columns, TRL's shape): `to_sft` with the same keyword flags, with what the records were (a
    `Shaped`: format, template, lines to say) appended to `shaped` when given."""
    ds, info = to_sft(ds, **flags)
    if shaped is not None:
        shaped.append(info)
    return ds, info.shape


def detect(columns: list[str], first: dict, *, text_field: str, prompt_template: str | None) -> str | None:
    """The format the fields say (None: none recognised). A messages/conversations list decides by its turns' keys."""
    cols = set(columns)
    for col in ("messages", "conversations"):
        if col in cols:
            turns = first.get(col)
            turn = turns[0] if isinstance(turns, list) and turns and isinstance(turns[0], dict) else {}
            if "from" in turn or "value" in turn:
                return "sharegpt"
            if col == "messages" or "role" in turn:
                return "messages"
    if {"instruction", "output"} <= cols:
        return "alpaca"
    if {"prompt", "completion"} <= cols or prompt_template:
        return "prompt_completion"
    if text_field in cols:
        return "text"
    return None


def to_sft(
    ds,
    *,
    prompt_column: str | None = None,
    completion_column: str | None = None,
    messages_column: str | None = None,
    text_field: str = "text",
    dataset_format: str | None = None,
    prompt_template: str | None = None,
    role_map: str | None = None,
) -> tuple[object, Shaped]:
    """(records in TRL's columns, what they were): the format detected from the fields (or --dataset_format), mapped
    with the column flags, converted, and checked; bad records fail here in one line naming the record and the fix."""
    fmt = None if dataset_format in (None, "", "auto") else dataset_format
    if fmt is not None and fmt not in FORMATS:
        raise DataError(f"--dataset_format {dataset_format!r}: use auto or one of {', '.join(FORMATS)}")
    renames = {
        src: dst
        for src, dst in ((prompt_column, "prompt"), (completion_column, "completion"), (messages_column, "messages"))
        if src
    }
    missing = [src for src in renames if src not in ds.column_names]
    if missing:
        flags = [f"--{renames[src]}_column {src}" for src in missing]
        raise DataError(
            f"column(s) {', '.join(missing)} not in the dataset; its columns are {', '.join(ds.column_names)}: "
            f"give one of those to {', '.join(flags)}"
        )
    renames = {src: dst for src, dst in renames.items() if src != dst}
    if prompt_template:  # the template names the prompt's fields (a preset the completion's too)
        renames = {
            s: d for s, d in renames.items() if d != "prompt" and (d != "completion" or prompt_template not in PRESETS)
        }
    clash = [dst for src, dst in renames.items() if dst in ds.column_names]
    if clash:  # the field the flag names wins; the record's own field of that name is said, not dropped silently
        replaced = ", ".join(f"{dst} (by --{dst}_column {src})" for src, dst in renames.items() if dst in clash)
        ds = ds.remove_columns(clash)
    if renames:
        ds = ds.rename_columns(renames)
    first = ds[0]
    found = fmt or detect(ds.column_names, first, text_field=text_field, prompt_template=prompt_template)
    if found is None:
        raise DataError(
            f"dataset has columns {', '.join(sorted(ds.column_names))} but llmft needs 'text', 'prompt'+'completion', "
            "'messages', Alpaca's instruction/output or ShareGPT's conversations; map yours with "
            "--prompt_column/--completion_column, --messages_column or --dataset_text_field, or build the prompt "
            "with --prompt_template (e.g. --prompt_template gsm8k for question/answer records)"
        )
    if prompt_template and found not in ("prompt_completion", "alpaca"):
        raise DataError(
            f"--prompt_template applies to prompt/completion and Alpaca data; this dataset is {found}: drop it"
        )
    if found in ("messages", "sharegpt"):
        ds, used = _chat(ds, found, messages_column, role_map)
        shaped = Shaped(found, "messages")
    elif found == "alpaca" or prompt_template:
        ds, used, template = _templated(ds, found, prompt_template)
        shaped = Shaped(found, "prompt_completion", template)
    elif found == "prompt_completion":
        _strings(ds, ["prompt", "completion"])
        used = ["prompt", "completion"]
        shaped = Shaped(found, "prompt_completion")
    else:
        if text_field not in ds.column_names:
            raise DataError(
                f"--dataset_format text needs a {text_field!r} column (--dataset_text_field); its columns are {', '.join(ds.column_names)}"
            )
        _strings(ds, [text_field])
        used = [text_field]
        shaped = Shaped("text", "text")
    if clash:
        shaped.notes.append(f"warning: the records' own field(s) replaced by the column flags: {replaced}")
    unused = unused_fields_line(ds, used, shaped.format)
    if unused:
        shaped.notes.append(unused)
    if shaped.shape == "prompt_completion":
        glued = glued_line(ds)
        if glued:
            shaped.notes.append(glued)
    keep = ["messages"] if shaped.shape == "messages" else used if shaped.shape == "text" else ["prompt", "completion"]
    extra = [c for c in ds.column_names if c not in keep]
    if extra:
        ds = ds.remove_columns(extra)
    return ds, shaped


def _strings(ds, columns: list[str]) -> None:
    for col in columns:
        if col not in ds.column_names:
            raise DataError(f"column {col!r} not in the dataset; its columns are {', '.join(ds.column_names)}")
        if getattr(ds.features[col], "dtype", None) != "string":
            raise DataError(f"column {col!r} must hold strings, found {ds.features[col]}")
        nulls = sum(1 for v in ds[col] if v is None)
        if nulls:
            raise DataError(f"column {col!r} is empty in {nulls} record(s); remove them or fill the field")


def unused_fields_line(ds, used: list[str], fmt: str) -> str | None:
    """One line counting, per field the format does not train on, the records where it is not empty."""
    n = len(ds)
    counts = [(c, _count_nonempty(ds, c)) for c in ds.column_names if c not in used and not c.startswith("_llmft")]
    counts = [(c, k) for c, k in counts if k]
    if not counts:
        return None
    listing = ", ".join(f"{c} (non-empty in {k} of {n} records)" for c, k in counts)
    if fmt == "prompt_completion" and {"input", "instruction", "system"} & {c for c, _ in counts}:
        hint = "--dataset_format alpaca (or a --prompt_template naming them) puts them in the prompt"
    elif fmt in ("messages", "sharegpt", "text"):
        hint = "they are left out of training (remove them from the data to silence this)"
    else:
        hint = "name them in --prompt_template to train on them, or remove them from the data"
    return f"warning: field(s) the {fmt} format does not train on: {listing}; {hint}"


def glued_line(ds) -> str | None:
    """A warning counting prompts that end without whitespace before a completion that starts without it."""
    glued = sum(
        1 for p, c in zip(ds["prompt"], ds["completion"]) if p and c and not p[-1].isspace() and not c[0].isspace()
    )
    if not glued:
        return None
    return (
        f"warning: in {glued} of {len(ds)} records the prompt ends and the completion starts without whitespace, "
        "so they train glued together; give a --prompt_template (e.g. gsm8k, alpaca, or 'Question: {question}\\nAnswer: ') "
        "or end the prompts with a space or newline"
    )


def _templated(ds, found: str, prompt_template: str | None):
    """Prompt and completion built from the record's fields by a preset or a format string."""
    preset = PRESETS.get(prompt_template or ("alpaca" if found == "alpaca" else ""))
    name = prompt_template if prompt_template in PRESETS else ("alpaca" if preset else "custom")
    if found == "alpaca" and preset is None and prompt_template is None:
        preset = PRESETS["alpaca"]
    columns = set(ds.column_names)
    if preset is not None:
        needed = [f for f in preset.fields() if f not in (preset.optional, "system")]
        completion_of = preset.completion
    else:
        needed = template_fields(prompt_template)
        completion_field = next((c for c in ("completion", "output", "answer") if c in columns), None)
        if completion_field is None:
            raise DataError(
                f"--prompt_template builds the prompt, but the records have no completion field (columns: "
                f"{', '.join(sorted(columns))}): name it with --completion_column"
            )
        completion_of = "{" + completion_field + "}"
        needed = needed + [completion_field]
    absent = [f for f in dict.fromkeys(needed) if f not in columns]
    if absent:
        raise DataError(
            f"prompt template {name} names field(s) {', '.join(absent)}, not in the records (columns: "
            f"{', '.join(sorted(columns))}); write a --prompt_template over these fields"
            + (" (e.g. 'Question: {field}\\nAnswer:' and --completion_column)" if preset else "")
        )
    used = [f for f in ds.column_names if f in set(needed) | (preset.fields() if preset else set())]
    for col in dict.fromkeys(needed):
        nulls = sum(1 for v in ds[col] if v is None)
        if nulls:
            raise DataError(f"field {col!r} is empty in {nulls} record(s); remove them or fill the field")

    # "\n" and "\t" typed on a command line (where a newline is hard to type) stand for a newline and a tab
    custom = (prompt_template or "").replace("\\n", "\n").replace("\\t", "\t")

    def render(template: str, record: dict) -> str:
        values = {k: "" if v is None else v for k, v in record.items()}
        return template.format_map(values)

    def build(record):
        if preset is None:
            prompt = render(custom, record)
        else:
            optional = preset.optional
            with_optional = not optional or _nonempty(record.get(optional))
            prompt = render(preset.prompt if with_optional else preset.prompt_without, record)
            system = record.get("system")
            if preset.system_replaces and _nonempty(system):
                intro = _ALPACA_INTRO if with_optional else _ALPACA_INTRO_NO_INPUT
                prompt = str(system) + prompt[len(intro) :]
        return {"prompt": prompt, "completion": render(completion_of, record)}

    keep = [c for c in ds.column_names if c not in ("prompt", "completion")]
    mapped = ds.map(build, remove_columns=[c for c in ds.column_names if c in ("prompt", "completion")])
    return mapped.select_columns([*keep, "prompt", "completion"]), used + ["prompt", "completion"], name


def _chat(ds, found: str, messages_column: str | None, role_map: str | None):
    """Role/content messages from a messages or ShareGPT column, every turn checked."""
    col = "messages" if "messages" in ds.column_names else "conversations"
    given = messages_column or col
    if col not in ds.column_names:
        raise DataError(
            f"format {found} needs a messages or conversations column; its columns are {', '.join(ds.column_names)}: "
            "name yours with --messages_column"
        )
    feature = ds.features[col]
    if getattr(feature, "dtype", None) is not None and not hasattr(feature, "feature"):
        raise DataError(
            f"column {given!r} holds {feature.dtype} values, not a list of turns "
            '([{"role": ..., "content": ...}, ...]); point --messages_column at the conversation list, or use '
            "--prompt_column/--completion_column for question/answer fields"
        )
    names = dict(SHAREGPT_ROLES) if found == "sharegpt" else {r: r for r in CHAT_ROLES}
    names.update(parse_role_map(role_map))
    role_key, content_key = ("from", "value") if found == "sharegpt" else ("role", "content")
    empty = []
    for i, turns in enumerate(ds[col], 1):
        if turns is None or turns == []:
            empty.append(i)
            continue
        if not isinstance(turns, list):
            raise DataError(
                f"record {i}: column {given!r} holds a {type(turns).__name__}, not a list of turns; point --messages_column at the conversation list"
            )
        for j, turn in enumerate(turns, 1):
            if not isinstance(turn, dict) or turn.get(role_key) is None:
                raise DataError(
                    f"record {i}, turn {j} of {given!r} has no {role_key!r} (a {found} turn is "
                    f'{{"{role_key}": ..., "{content_key}": ...}}); fix the record or choose --dataset_format'
                )
            if turn[role_key] not in names:
                raise DataError(
                    f"record {i}, turn {j}: role {turn[role_key]!r} is not one llmft knows ({', '.join(sorted(names))}): "
                    f"map it with --role_map {turn[role_key]}=assistant (or user, system, tool)"
                )
            content = turn.get(content_key)
            if content is None:
                other = sorted(k for k, v in turn.items() if k != role_key and v is not None)
                raise DataError(
                    f"record {i}, turn {j} of {given!r} has no {content_key!r}"
                    + (f" (its fields: {', '.join(other)})" if other else "")
                    + f"; llmft trains on the text of each turn: fix the record or give it an empty {content_key!r}"
                )
            if not isinstance(content, str):
                raise DataError(
                    f"record {i}, turn {j}: {content_key!r} is a {type(content).__name__}, not text; llmft trains on text turns"
                )
    if empty:
        raise DataError(
            f"{len(empty)} record(s) have an empty conversation in {given!r} (first: record {empty[0]}); remove them"
        )

    def convert(record):
        return {"messages": [{"role": names[t[role_key]], "content": t[content_key]} for t in record[col]]}

    others = [c for c in ds.column_names if c not in (col, "messages")]
    mapped = ds.map(convert, remove_columns=[c for c in (col, "messages") if c in ds.column_names])
    return mapped.select_columns([*others, "messages"]), [col, "messages"]


def has_assistant(messages: list[dict]) -> bool:
    return any(t["role"] == "assistant" for t in messages)


def drop_without_assistant(ds) -> tuple[object, int]:
    """(the conversations with an assistant turn, how many had none): with the loss on assistant turns only, a
    conversation without one would train nothing (and TRL stops on it)."""
    keep = [i for i, m in enumerate(ds["messages"]) if has_assistant(m)]
    dropped = len(ds) - len(keep)
    return (ds.select(keep) if dropped else ds), dropped

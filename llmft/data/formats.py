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
from llmft.planning.methods import method as method_entry

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
    dropped: "Dropped | None" = None  # records dropped while shaping, by reason (preference data)

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
    refuse_preference_for_sft(ds, fmt)
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
    elif found == "prompt_completion" and conversational(ds):
        ds = _chat_prompt_completion(ds)
        used = ["prompt", "completion"]
        shaped = Shaped("conversational prompt_completion", "prompt_completion")
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
    if shaped.shape == "prompt_completion" and not conversational(ds):
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


def conversational(ds) -> bool:
    """Whether prompt/completion records hold conversations (lists of role/content messages, TRL's conversational
    prompt-completion shape) rather than text: the prompt column's Arrow type is a list."""
    feature = ds.features.get("prompt") if "prompt" in ds.column_names else None
    return feature is not None and (isinstance(feature, list) or hasattr(feature, "feature"))


def conversational_records(ds) -> bool:
    """Whether any of TRL's columns (prompt, chosen, rejected, completion, messages) holds lists of messages."""
    return any(
        isinstance(ds.features[c], list) or hasattr(ds.features[c], "feature")
        for c in ("prompt", "chosen", "rejected", "completion", "messages")
        if c in ds.column_names
    )


def _chat_prompt_completion(ds):
    """Conversational prompt/completion records checked turn by turn (TRL applies the chat template to the prompt and
    to prompt+completion, and the loss is on the completion's turns), kept as role/content messages only."""
    for col in ("prompt", "completion"):
        if col not in ds.column_names:
            raise DataError(f"column {col!r} not in the dataset; its columns are {', '.join(ds.column_names)}")
    empty = 0
    for i, record in enumerate(ds.select_columns(["prompt", "completion"]), 1):
        for col in ("prompt", "completion"):
            value = record[col]
            if value is None or value == []:
                empty += 1
                break
            if not isinstance(value, list):
                raise DataError(
                    f"record {i}: {col!r} is a {type(value).__name__} while other records hold conversations; "
                    "give every record's prompt and completion as lists of messages (or every one as text)"
                )
            _turns(i, col, value)
    if empty:
        raise DataError(f"{empty} record(s) have an empty prompt or completion conversation; remove them")

    def keep(record):
        return {c: [{"role": t["role"], "content": t["content"]} for t in record[c]] for c in ("prompt", "completion")}

    others = [c for c in ds.column_names if c not in ("prompt", "completion")]
    return ds.map(keep, remove_columns=["prompt", "completion"]).select_columns([*others, "prompt", "completion"])


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


# --------------------------------------------------------------------------------------------------
# Preference data (--method dpo, reward: pairs; kto: unpaired completions with a label)

PREFERENCE_FORMATS = ("preference", "unpaired_preference")
ALL_FORMATS = FORMATS + PREFERENCE_FORMATS

# Why a record is dropped, in the order the checks run; each is counted and named in the data-fit line.
DROP_REASONS = {
    "no_chosen": "no chosen side",
    "no_rejected": "no rejected side",
    "empty_side": "an empty side",
    "identical": "chosen equal to rejected",
    "no_shared_prefix": "no shared prefix",
    "not_turns": "text not in Human:/Assistant: turns",
    "empty_prompt": "an empty prompt conversation",
}

# Anthropic HH-RLHF's turns: "\n\nHuman: ...\n\nAssistant: ..."
HH_ROLES = {"Human": "user", "Assistant": "assistant"}
_HH_MARKER = None  # compiled on first use


@dataclass
class Dropped:
    """Records dropped while shaping, by reason (DROP_REASONS), out of `records` read."""

    records: int = 0
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def line(self, split: str = "train") -> str | None:
        """One line naming each count, or None when nothing was dropped."""
        if not self.total:
            return None
        reasons = ", ".join(f"{k} with {DROP_REASONS[r]}" for r, k in self.counts.items() if k)
        return (
            f"warning: {self.total} of {self.records} {split} records dropped before training ({reasons}); "
            "fix or remove them to train on them"
        )


def detect_preference(columns: list[str]) -> str | None:
    """'preference' for chosen/rejected records, 'unpaired_preference' for KTO's prompt/completion/label, else None."""
    cols = set(columns)
    if "chosen" in cols or "rejected" in cols:
        return "preference"
    if {"prompt", "completion", "label"} <= cols:
        return "unpaired_preference"
    return None


def refuse_preference_for_sft(ds, dataset_format: str | None) -> None:
    """A preference file given to SFT stops in one line naming the method that trains it: SFT on pairs would train on
    the rejected answers too, and on unpaired data on the undesirable completions (a `label` column counts as KTO's
    only when it holds booleans: a prompt/completion file may carry a label of its own)."""
    found = dataset_format if dataset_format in PREFERENCE_FORMATS else None
    if found is None and dataset_format in (None, "", "auto"):
        found = detect_preference(ds.column_names)
        if found == "unpaired_preference" and getattr(ds.features["label"], "dtype", None) != "bool":
            found = None
    if found == "preference":
        raise DataError(
            "this dataset holds preference pairs (chosen/rejected), which --method sft does not train on: "
            "use --method dpo (or --method reward for a reward model), or --method kto"
        )
    if found == "unpaired_preference":
        raise DataError(
            "this dataset holds unpaired preference records (prompt/completion/label), which --method sft does not "
            "train on: use --method kto (or drop the label column to fine-tune on every completion)"
        )


def _messages(value) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


def _blank(value) -> bool:
    """An empty side: None, "", whitespace, [] or turns whose contents are all blank."""
    if value is None:
        return True
    if isinstance(value, str):
        return not value.strip()
    if isinstance(value, list):
        return all(not str(t.get("content") or "").strip() for t in value) if value else True
    return False


def _turns(i: int, name: str, value) -> list[dict] | str:
    """A side as text or as role/content turns (only those two keys kept), every turn checked: one line otherwise."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise DataError(
            f"record {i}: {name!r} is a {type(value).__name__}; give text or a list of "
            '{"role": ..., "content": ...} messages'
        )
    out = []
    for j, turn in enumerate(value, 1):
        if (
            not isinstance(turn, dict)
            or turn.get("role") not in CHAT_ROLES
            or not isinstance(turn.get("content"), str)
        ):
            raise DataError(
                f"record {i}, turn {j} of {name!r} is not a message with a role ({', '.join(CHAT_ROLES)}) and text "
                'content; write it as {"role": "user", "content": "..."}'
            )
        out.append({"role": turn["role"], "content": turn["content"]})
    return out


def hh_turns(text: str) -> list[dict] | None:
    """Anthropic HH-RLHF text ("\\n\\nHuman: ...\\n\\nAssistant: ...") as user/assistant messages, each content stripped;
    None when the text does not start with a Human: or Assistant: turn."""
    import re

    global _HH_MARKER
    if _HH_MARKER is None:
        _HH_MARKER = re.compile(r"(?:^|\n\n)(Human|Assistant):[ \t]?")
    body = text.lstrip("\n")
    if not body.startswith(("Human:", "Assistant:")):
        return None
    parts = _HH_MARKER.split(body)  # ["", "Human", content, "Assistant", content, ...]
    if parts[0].strip():
        return None
    return [{"role": HH_ROLES[parts[k]], "content": parts[k + 1].strip()} for k in range(1, len(parts) - 1, 2)]


def shared_turns(chosen: list[dict], rejected: list[dict]) -> int:
    """How many leading messages the two conversations share (TRL's extract_prompt does this per message, but with
    a shorter side equal to the other's start it stops one message early)."""
    n = 0
    for a, b in zip(chosen, rejected):
        if a != b:
            break
        n += 1
    return n


def shared_text(chosen: str, rejected: str) -> int:
    """Where the prompt of two texts ends: their longest common prefix, cut back to the start of the word it ends
    in, and the space before that word left to the completions (as TRL's extract_prompt leaves it). TRL's cut only
    handles a prefix that ends right after a space: "Answer: blue" / "Answer: black" would give the prompt
    "Answer: bl"; here it is "Answer:" and the completions " blue" / " black"."""
    n = 0
    for a, b in zip(chosen, rejected):
        if a != b:
            break
        n += 1
    if n == min(len(chosen), len(rejected)) and n < max(len(chosen), len(rejected)):
        longer = chosen if len(chosen) > len(rejected) else rejected
        if longer[n].isspace():  # the shorter ends on a word boundary
            return n - 1 if n and chosen[n - 1] == " " else n
    while n and not chosen[n - 1].isspace():
        n -= 1
    if n and chosen[n - 1] == " ":
        n -= 1
    return n


def _implicit(chosen, rejected, hh: bool) -> tuple[object, object, object, str | None]:
    """(prompt, chosen, rejected, drop reason or None) of a pair whose prompt is the start both sides share."""
    if hh:
        chosen, rejected = hh_turns(chosen), hh_turns(rejected)
        if chosen is None or rejected is None:
            return None, None, None, "not_turns"
    if isinstance(chosen, list) != isinstance(rejected, list):
        return None, None, None, "no_shared_prefix"
    n = shared_turns(chosen, rejected) if isinstance(chosen, list) else shared_text(chosen, rejected)
    if n == 0:
        return None, None, None, "no_shared_prefix"
    return chosen[:n], chosen[n:], rejected[n:], None


def _explicit(prompt, chosen, rejected) -> tuple[object, object, object, str | None]:
    """(prompt, chosen, rejected, drop reason or None) with text and conversation sides made one kind: a text side
    beside conversations is an assistant message, a text prompt beside conversations that start with the user's
    turn is the implicit prompt's copy (TRL's maybe_extract_prompt) and the conversations' shared start is used."""
    conversational = any(isinstance(v, list) for v in (prompt, chosen, rejected))
    if not conversational:
        return prompt, chosen, rejected, None
    if not isinstance(prompt, list) and _messages(chosen) and chosen[0]["role"] != "assistant":
        return _implicit(chosen, rejected if isinstance(rejected, list) else [], False)
    if not isinstance(prompt, list):
        prompt = [{"role": "user", "content": prompt}]
    if not prompt:
        return None, None, None, "empty_prompt"
    chosen, rejected = (
        side if isinstance(side, list) else [{"role": "assistant", "content": side}] for side in (chosen, rejected)
    )
    return prompt, chosen, rejected, None


def pair_of(i: int, record: dict, hh: bool) -> tuple[dict | None, str | None]:
    """(the record in TRL's explicit-prompt shape {prompt, chosen, rejected}, None) or (None, why it is dropped)."""
    chosen, rejected = record.get("chosen"), record.get("rejected")
    if chosen is None:
        return None, "no_chosen"
    if rejected is None:
        return None, "no_rejected"
    chosen, rejected = _turns(i, "chosen", chosen), _turns(i, "rejected", rejected)
    if _blank(chosen) or _blank(rejected):
        return None, "empty_side"
    if chosen == rejected:
        return None, "identical"
    prompt = record.get("prompt")
    if prompt is None:
        prompt, chosen, rejected, why = _implicit(chosen, rejected, hh)
    else:
        prompt, chosen, rejected, why = _explicit(_turns(i, "prompt", prompt), chosen, rejected)
    if why:
        return None, why
    if _blank(chosen) or _blank(rejected):
        return None, "empty_side"
    if chosen == rejected:
        return None, "identical"
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}, None


def label_of(i: int, value) -> bool:
    """KTO's label: true (desirable) or false. JSON booleans, and 0/1 (as CSV and pandas write booleans); anything
    else (a string, 2, None) is one line: guessing which way "yes" or 0.5 points would train the wrong way."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise DataError(
        f"record {i}: label {value!r} is not a boolean; KTO's label says whether the completion is desirable: "
        "write true or false (or 1/0)"
    )


def unpaired_of(i: int, record: dict) -> tuple[dict | None, str | None]:
    """(the record in TRL's unpaired shape {prompt, completion, label}, None) or (None, why it is dropped). Beside a
    conversation, a text prompt is the user's message and a text completion the assistant's."""
    label = label_of(i, record.get("label"))
    completion = record.get("completion")
    if completion is None:
        return None, "no_chosen"
    prompt, completion = _turns(i, "prompt", record.get("prompt") or ""), _turns(i, "completion", completion)
    if _blank(completion):
        return None, "empty_side"
    if isinstance(completion, list) or isinstance(prompt, list):
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}] if prompt else []
        if not prompt:
            return None, "empty_prompt"
        if isinstance(completion, str):
            completion = [{"role": "assistant", "content": completion}]
    return {"prompt": prompt, "completion": completion, "label": label}, None


def _renames(ds, flags: dict[str, str | None]):
    """The column flags (--prompt_column, --chosen_column, ...) applied: FIELD -> its TRL name."""
    renames = {src: dst for dst, src in flags.items() if src and src != dst}
    missing = [src for src in renames if src not in ds.column_names]
    if missing:
        raise DataError(
            f"column(s) {', '.join(missing)} not in the dataset; its columns are {', '.join(ds.column_names)}"
        )
    clash = [dst for dst in renames.values() if dst in ds.column_names]
    if clash:
        ds = ds.remove_columns(clash)
    return ds.rename_columns(renames) if renames else ds


def shape_for_method(
    ds,
    method,
    *,
    dataset_format: str | None = None,
    prompt_column: str | None = None,
    completion_column: str | None = None,
    shaped: list | None = None,
    **sft_flags,
):
    """(records in TRL 1.16's columns for `method`, what they were: a `Shaped` whose `dropped` counts each record
    dropped by reason). `method` is a name or a llmft.planning.methods.Method; its `formats` say what it trains on.

    - sft: `to_sft` (text, prompt/completion, messages, Alpaca, ShareGPT); a preference file is one line naming
      --method dpo/reward/kto.
    - dpo, reward ("preference"): {prompt, chosen, rejected}, strings or message lists, always with an explicit prompt
      (an implicit one is extracted here, so TRL's extraction never runs); HH-RLHF text becomes user/assistant turns.
    - kto ("unpaired_preference"): {prompt, completion, label} with a boolean label.

    Drops (counted in `Shaped.dropped`, said by `Dropped.line`): DROP_REASONS. None left is one line."""
    entry = method if hasattr(method, "formats") else method_entry(method)
    fmt = None if dataset_format in (None, "", "auto") else dataset_format
    if fmt is not None and fmt not in ALL_FORMATS:
        raise DataError(f"--dataset_format {dataset_format!r}: use auto or one of {', '.join(ALL_FORMATS)}")
    if not set(entry.formats) & set(PREFERENCE_FORMATS):
        out, info = to_sft(
            ds, dataset_format=fmt, prompt_column=prompt_column, completion_column=completion_column, **sft_flags
        )
        info.dropped = Dropped(records=len(out))
        if shaped is not None:
            shaped.append(info)
        return out, info
    ds = _renames(ds, {"prompt": prompt_column, "completion": completion_column})
    found = fmt or detect_preference(ds.column_names)
    if found not in entry.formats:
        raise DataError(_wrong_data_line(entry, found, ds.column_names))
    needed = ("completion", "label") if found == "unpaired_preference" else ("chosen", "rejected")
    absent = [c for c in needed if c not in ds.column_names]
    if absent:
        raise DataError(
            f"--dataset_format {found} needs field(s) {', '.join(absent)}, not in the records (columns: "
            f"{', '.join(sorted(ds.column_names))})"
            + ("; label says whether the completion is desirable: true or false" if "label" in absent else "")
        )
    out, info = _shape_preference(ds, found)
    if shaped is not None:
        shaped.append(info)
    return out, info


def _wrong_data_line(entry, found: str | None, columns: list[str]) -> str:
    want = {
        "preference": '{"prompt", "chosen", "rejected"} or {"chosen", "rejected"} pairs',
        "unpaired_preference": '{"prompt", "completion", "label"} records (label true or false)',
    }[entry.formats[0]]
    if found is None:
        try:
            found = detect(columns, {}, text_field="text", prompt_template=None)
        except DataError:
            found = None
    what = f"{found} data" if found else f"columns {', '.join(sorted(columns))}"
    hint = (
        "; for SFT data use --method sft"
        if found in FORMATS
        else "; for pairs use --method dpo or --method reward"
        if found == "preference"
        else "; for prompt/completion/label records use --method kto"
        if found == "unpaired_preference"
        else ""
    )
    return f"--method {entry.name} trains on {want}; this dataset has {what}{hint}"


def _shape_preference(ds, found: str):
    """Each record shaped or dropped (counted by reason); one line when nothing is left."""
    n = len(ds)
    first_chosen = ds[0].get("chosen") if "chosen" in ds.column_names else None
    hh = found == "preference" and "prompt" not in ds.column_names and isinstance(first_chosen, str)
    hh = hh and hh_turns(first_chosen) is not None
    rows, counts = [], {}
    for i, record in enumerate(ds, 1):
        row, why = unpaired_of(i, record) if found == "unpaired_preference" else pair_of(i, record, hh)
        if why:
            counts[why] = counts.get(why, 0) + 1
        else:
            rows.append(row)
    dropped = Dropped(records=n, counts={r: counts[r] for r in DROP_REASONS if r in counts})
    if not rows:
        reasons = ", ".join(f"{k} with {DROP_REASONS[r]}" for r, k in dropped.counts.items())
        raise DataError(f"none of the {n} records is left to train on ({reasons}); fix the data")
    out = _dataset_of(rows)
    shape = "preference" if found == "preference" else "unpaired_preference"
    kind = "conversations" if any(isinstance(v, list) for v in rows[0].values()) else "text"
    info = Shaped(("hh-rlhf text" if hh else found), shape)
    info.notes.append(f"{found} records as {kind}" + (", Human:/Assistant: turns as chat messages" if hh else ""))
    info.dropped = dropped
    extra = [c for c in ds.column_names if c not in ("prompt", "chosen", "rejected", "completion", "label")]
    counted = [(c, _count_nonempty(ds, c)) for c in extra]
    counted = [(c, k) for c, k in counted if k]
    if counted:
        listing = ", ".join(f"{c} (non-empty in {k} of {n} records)" for c, k in counted)
        info.notes.append(f"warning: field(s) the {found} format does not train on: {listing}; they are left out")
    return out, info


def _dataset_of(rows: list[dict]):
    """A Dataset of the shaped rows (text or message lists, the same kind in every row, as Arrow needs)."""
    from datasets import Dataset

    kinds = {tuple(isinstance(v, list) for k, v in r.items() if k != "label") for r in rows}
    if len(kinds) > 1:
        raise DataError(
            "the records mix text and conversations (lists of messages); give every record's sides the same kind"
        )
    return Dataset.from_list(rows)

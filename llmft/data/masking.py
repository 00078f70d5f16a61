"""The loss on a chat record's assistant turns, for any chat template.

TRL (through transformers' `return_assistant_tokens_mask`) masks assistant turns only for templates that mark
them with `{% generation %}`; most models' templates do not, and TRL's own training versions cover a list of
known templates (llmft.data.cache.tokenise_chat uses those first). For any other template llmft renders each
conversation prefix with the tokenizer's own template:

    the text before assistant turn i  = render(messages[:i], add_generation_prompt=True)
    the text through assistant turn i = render(messages[:i + 1])

and the characters between the two (the turn's content and its end-of-turn token; trailing whitespace after it
is not something a model generates) carry the loss. The whole conversation is tokenised once with offsets, and
a token carries loss when it overlaps such a span. The result is `input_ids` + `assistant_masks`, the columns
TRL's own tokenisation produces, so TRL builds the labels, truncates and packs as it does for marked templates.

A template that renders a prefix differently from the start of the whole conversation (some drop earlier
reasoning, or date the system prompt) has no such spans: that is one line naming the fixes.
"""

from __future__ import annotations

from jinja2 import TemplateError

from llmft.data.loading import DataError


def template_refuses(error: Exception, messages: list[dict] | None = None) -> str:
    """The line for a conversation the chat template raises on (its own checks: roles must alternate, ...)."""
    roles = f" (roles: {', '.join(t['role'] for t in messages)})" if messages else ""
    return (
        f"the chat template refuses a conversation{roles}: {str(error).strip().splitlines()[0][:200]}; fix those "
        "records, or give a template that accepts them (--chat_template_path FILE.jinja)"
    )


def assistant_spans(
    tokenizer, messages: list[dict], chat_template: str | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered conversation, the character spans of its assistant turns)."""

    def render(turns, gen=False):
        try:
            return tokenizer.apply_chat_template(
                turns, tokenize=False, add_generation_prompt=gen, chat_template=chat_template
            )
        except TemplateError as e:  # the template's own check (roles must alternate, ...)
            raise DataError(template_refuses(e, messages)) from None

    full = render(messages)
    spans = []
    for i, turn in enumerate(messages):
        if turn["role"] != "assistant":
            continue
        try:
            before = render(messages[:i], gen=True)
        except Exception:  # templates that index messages[0] cannot render an empty conversation
            if i:
                raise
            before = ""
        through = render(messages[: i + 1])
        if not (full.startswith(through) and through.startswith(before)):
            raise DataError(
                "the chat template renders a conversation's beginning differently from the whole conversation, so "
                "llmft cannot find the assistant turns in it: give a template with {% generation %} markers around "
                "the assistant turns (--chat_template_path FILE.jinja), or train on every token (--assistant_only_loss false)"
            )
        end = len(through.rstrip())
        if end > len(before):
            spans.append((len(before), end))
    return full, spans


def tokenise_with_mask(tokenizer, messages: list[dict], chat_template: str | None = None) -> dict:
    """{"input_ids", "assistant_masks"}: the conversation tokenised as apply_chat_template tokenises it (the rendered
    text, no added special tokens), 1 for each token that overlaps an assistant span."""
    full, spans = assistant_spans(tokenizer, messages, chat_template)
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = enc["input_ids"]
        mask = [0] * len(ids)
        for t, (a, b) in enumerate(enc["offset_mapping"]):
            if any(a < end and b > start for start, end in spans):
                mask[t] = 1
    else:  # no offsets: the tokens of the text before and through each span (exact unless tokens merge across them)
        ids = tokenizer(full, add_special_tokens=False)["input_ids"]
        mask = [0] * len(ids)
        for start, end in spans:
            a = len(tokenizer(full[:start], add_special_tokens=False)["input_ids"])
            b = len(tokenizer(full[:end], add_special_tokens=False)["input_ids"])
            mask[a:b] = [1] * (b - a)
    return {"input_ids": ids, "assistant_masks": mask}


def tokenise_dataset(ds, tokenizer, name: str, num_proc: int | None = None):
    """The messages dataset as `input_ids` + `assistant_masks` (TRL then skips its own tokenisation)."""
    template = tokenizer.chat_template

    def fn(record):
        return tokenise_with_mask(tokenizer, record["messages"], template)

    return ds.map(
        fn,
        remove_columns=ds.column_names,
        num_proc=num_proc,
        desc=f"Tokenizing {name} conversations (assistant-only loss)",
    )

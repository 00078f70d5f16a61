"""Users' data as it comes (issue 29): Alpaca, ShareGPT, GSM8K and role/content chat records of their real shapes,
recognised from their fields, converted, masked where the loss belongs, and shown with `llmft prepare --show`.

Everything is in-process on the tiny tokenizer: records are written here, nothing is downloaded.
"""

from __future__ import annotations

import json

import pytest

from llmft.data import cache, formats
from llmft.data.formats import shape_for_sft
from llmft.data.loading import DataError, load_train_split

# Stanford Alpaca (alpaca_data.json's records), FastChat ShareGPT, GSM8K (openai/gsm8k main), role/content chat
ALPACA = [
    {"instruction": "Give three tips for staying healthy.", "input": "", "output": "1. Eat well. 2. Sleep. 3. Move."},
    {"instruction": "Identify the odd one out.", "input": "Twitter, Instagram, Telegram", "output": "Telegram"},
    {"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour", "system": "You translate."},
]
SHAREGPT = [
    {
        "id": "QWJhYvA_0",
        "conversations": [
            {"from": "human", "value": "Capital of France?"},
            {"from": "gpt", "value": "Paris."},
            {"from": "human", "value": "And of Spain?"},
            {"from": "gpt", "value": "Madrid."},
        ],
    },
    {
        "id": "i6IyJda_0",
        "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"}],
    },
]
GSM8K = [
    {
        "question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?",
        "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10",
    },
    {"question": "What is 4 plus 8?", "answer": "4 + 8 = 12\n#### 12"},
]
CHAT = [
    {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another?"},
            {"role": "assistant", "content": "Green."},
        ]
    },
    {"messages": [{"role": "user", "content": "Count to two."}, {"role": "assistant", "content": "One, two."}]},
]

# A real chat template of the ChatML family (Qwen2.5's, less its tool calls), without and with {% generation %} markers
CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHATML_MARKED = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def trl_template(name: str) -> str:
    """A real model's chat template as TRL ships it (trl/chat_templates: Qwen2.5's, and TRL's training version)."""
    from pathlib import Path

    import trl

    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text()


def write(tmp_path, rows, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def shaped_of(tmp_path, rows, **options):
    found: list = []
    ds, shape = shape_for_sft(load_train_split(str(write(tmp_path, rows))), shaped=found, **options)
    return ds, found[0]


@pytest.fixture(scope="module")
def tok(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def sft_args(tmp_path_factory):
    from trl import SFTConfig

    return SFTConfig(
        output_dir=str(tmp_path_factory.mktemp("o")),
        report_to="none",
        use_cpu=True,
        bf16=False,
        activation_checkpointing=False,
        max_length=256,
    )


def prepared(tmp_path, tok, args, rows, **opts):
    lines: list[str] = []
    out = cache.prepare(
        cache.DataOptions(dataset_name=str(write(tmp_path, rows)), **opts),
        tok,
        args,
        log=lines.append,
        root=tmp_path / "cache",
    )
    return out, lines


def loss_spans(tok, row) -> list[str]:
    """The decoded runs of tokens whose label is not -100, computed here from the labels alone."""
    spans, run = [], []
    for token, label in zip(row["input_ids"], row["labels"]):
        if label != -100:
            run.append(token)
        elif run:
            spans.append(tok.decode(run))
            run = []
    if run:
        spans.append(tok.decode(run))
    return spans


# ---------------------------------------------------------------------------------------------------------- formats


def test_alpaca_is_recognised_and_prompted_with_its_own_template(tmp_path):
    ds, info = shaped_of(tmp_path, ALPACA)
    assert (info.format, info.shape, info.template) == ("alpaca", "prompt_completion", "alpaca")
    assert ds.column_names == ["prompt", "completion"]
    assert ds[0]["prompt"] == formats.PRESETS["alpaca"].prompt_without.format(instruction=ALPACA[0]["instruction"])
    assert ds[1]["prompt"].endswith("### Input:\nTwitter, Instagram, Telegram\n\n### Response:\n")
    assert ds[1]["prompt"].startswith("Below is an instruction that describes a task, paired with an input")
    assert ds[2]["prompt"].startswith(
        "You translate.\n\n### Instruction:\nTranslate to French."
    )  # system replaces the intro
    assert ds[1]["completion"] == "Telegram" and info.notes == []
    assert info.describe() == "alpaca -> prompt_completion, prompt template alpaca"


def test_alpaca_through_column_flags_counts_the_input_it_leaves_out(tmp_path):
    ds, info = shaped_of(tmp_path, ALPACA, prompt_column="instruction", completion_column="output")
    assert info.format == "prompt_completion" and ds[1]["prompt"] == "Identify the odd one out."
    unused = [n for n in info.notes if "does not train on" in n]
    assert unused and "input (non-empty in 2 of 3 records)" in unused[0] and "system (non-empty in 1 of 3" in unused[0]
    assert "--dataset_format alpaca" in unused[0]
    glued = [n for n in info.notes if "without whitespace" in n]
    assert glued and glued[0].startswith("warning: in 3 of 3 records the prompt ends")


def test_sharegpt_is_converted_to_role_content_turns(tmp_path):
    ds, info = shaped_of(tmp_path, SHAREGPT)
    assert (info.format, info.shape) == ("sharegpt", "messages") and ds.column_names == ["messages"]
    assert [t["role"] for t in ds[0]["messages"]] == ["user", "assistant", "user", "assistant"]
    assert ds[0]["messages"][1] == {"role": "assistant", "content": "Paris."}
    assert [t["role"] for t in ds[1]["messages"]] == ["system", "user"]
    assert any("id (non-empty in 2 of 2 records)" in n for n in info.notes)


def test_gsm8k_preset_is_the_format_llmft_eval_prompts_with(tmp_path):
    ds, info = shaped_of(tmp_path, GSM8K, prompt_template="gsm8k")
    assert info.template == "gsm8k" and info.notes == []
    same, _ = shaped_of(tmp_path, GSM8K, prompt_template="gsm8k", prompt_column="question", completion_column="answer")
    assert same[:] == ds[:]  # the column flags beside a preset change nothing
    assert ds[1]["prompt"] == "Question: What is 4 plus 8?\nAnswer:" and ds[1]["completion"] == " 4 + 8 = 12\n#### 12"
    # the harness's gsm8k task (what `llmft eval --tasks gsm8k` runs): doc_to_text, target_delimiter, doc_to_target
    import yaml
    from lm_eval import tasks

    task_yaml = next(p for p in (tasks.__path__[0] + "/gsm8k/gsm8k.yaml",))
    cfg = yaml.safe_load(open(task_yaml).read().replace("!function", ""))
    assert cfg["doc_to_text"] == "Question: {{question}}\nAnswer:"
    assert cfg.get("target_delimiter", " ") == " " and cfg["doc_to_target"].startswith("{{answer")


def test_a_custom_template_and_the_glue_warning(tmp_path):
    ds, info = shaped_of(tmp_path, GSM8K, prompt_template="Q: {question}\nA: ", completion_column="answer")
    assert ds[1]["prompt"] == "Q: What is 4 plus 8?\nA: " and ds[1]["completion"] == "4 + 8 = 12\n#### 12"
    typed, _ = shaped_of(tmp_path, GSM8K, prompt_template=r"Q: {question}\nA: ", completion_column="answer")
    assert typed[:] == ds[:]  # a \n typed in a shell's single quotes is a newline
    assert info.template == "custom" and info.notes == []
    ds, info = shaped_of(tmp_path, GSM8K, prompt_column="question", completion_column="answer")
    assert info.template is None and any(
        n.startswith("warning: in 2 of 2 records the prompt ends") for n in info.notes
    )
    with pytest.raises(DataError, match=r"prompt template custom names field\(s\) query, not in the records"):
        shaped_of(tmp_path, GSM8K, prompt_template="Q: {query}\n", completion_column="answer")


def test_chat_messages_are_passed_through(tmp_path):
    ds, info = shaped_of(tmp_path, CHAT)
    assert (info.format, info.shape, info.notes) == ("messages", "messages", [])
    assert ds[1]["messages"] == CHAT[1]["messages"]


def test_dataset_format_forces_the_format(tmp_path):
    rows = [{"text": "plain words", "messages": CHAT[1]["messages"]}]
    ds, info = shaped_of(tmp_path, rows)
    assert info.format == "messages"
    ds, info = shaped_of(tmp_path, rows, dataset_format="text")
    assert (info.format, ds.column_names) == ("text", ["text"])
    assert any("messages (non-empty in 1 of 1 records)" in n for n in info.notes)


# --------------------------------------------------------------------------------------------- bad chat data, lines


@pytest.mark.parametrize(
    "rows, options, message",
    [
        (GSM8K, {"messages_column": "question"}, r"column 'question' holds string values, not a list of turns"),
        (CHAT, {"messages_column": "dialog"}, r"column\(s\) dialog not in the dataset; its columns are messages"),
        (
            [{"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "hello"}]}],
            {},
            r"record 1, turn 2: role 'bot' is not one llmft knows .*: map it with --role_map bot=assistant",
        ),
        (
            [CHAT[0], {"messages": []}, {"messages": []}],
            {},
            r"2 record\(s\) have an empty conversation in 'messages' \(first: record 2\); remove them",
        ),
        ([{"messages": [{"speaker": "user", "text": "hi"}]}], {}, r"record 1, turn 1 of 'messages' has no 'role'"),
        (
            [{"messages": [{"role": "user", "text": "hi"}]}],
            {},
            r"record 1, turn 1 of 'messages' has no 'content' \(its fields: text\)",
        ),
    ],
)
def test_bad_chat_data_is_one_line(tmp_path, rows, options, message):
    with pytest.raises(DataError, match=message) as e:
        shaped_of(tmp_path, rows, **options)
    assert "\n" not in str(e.value)


def test_role_map_maps_other_speaker_names(tmp_path):
    rows = [{"conversations": [{"from": "person", "value": "hi"}, {"from": "bot", "value": "hello"}]}]
    ds, _ = shaped_of(tmp_path, rows, role_map="bot=assistant,person=user")
    assert [t["role"] for t in ds[0]["messages"]] == ["user", "assistant"]


def test_a_jsonl_line_that_is_not_an_object_is_refused_before_datasets_reads_it(tmp_path):
    path = tmp_path / "arrays.jsonl"
    path.write_text('["What is 1+1?", "2"]\n["What is 2+2?", "4"]\n')  # datasets reads this as data
    with pytest.raises(DataError, match=r"arrays.jsonl: line 1 is a JSON list, not an object"):
        load_train_split(str(path))
    from llmft.eval import EvalError, first_record

    with pytest.raises(EvalError, match=r"arrays.jsonl: line 1 is a JSON list, not an object"):
        first_record(path)


# --------------------------------------------------------------------------------------------------------- the masks


@pytest.mark.parametrize(
    "template, mask_by",
    [
        ("default", "llmft"),  # llmft's default template: no markers, unknown to TRL
        ("chatml", "llmft"),  # a ChatML template of our own: no markers, unknown to TRL
        ("chatml_marked", "markers"),  # its {% generation %} version: transformers' mask
        ("qwen2_5", "trl"),  # Qwen2.5's real template: no markers, TRL's training version of it
        ("qwen2_5_training", "markers"),
    ],
)
def test_chat_loss_is_on_the_assistant_turns_for_any_template(tmp_path, tok, sft_args, template, mask_by):
    import copy

    tok = copy.deepcopy(tok)
    tok.chat_template = {"default": None, "chatml": CHATML, "chatml_marked": CHATML_MARKED}.get(template) or (
        trl_template(template) if template.startswith("qwen") else None
    )
    end = tok.eos_token if template == "default" else "<|im_end|>"
    # TRL's Qwen2.5 training template marks the newline after the turn's header and after its end too
    before, after = ("\n", "\n") if template.startswith("qwen") else ("", "")
    rows = CHAT + [{"messages": [{"role": "user", "content": "No reply here."}]}]
    out, lines = prepared(tmp_path, tok, sft_args, rows)
    assert any("1 train conversation(s) have no assistant turn and were dropped" in line for line in lines)
    assert any("(messages; loss on the assistant turns)" in line for line in lines)
    # independently: the loss spans are exactly each assistant reply and its end-of-turn token, in order
    for row, record in zip(out.train, CHAT):
        expected = [before + t["content"] + end + after for t in record["messages"] if t["role"] == "assistant"]
        assert loss_spans(tok, row) == expected
        # and the whole sequence is the template's rendering of the conversation
        assert tok.decode(row["input_ids"]) == tok.apply_chat_template(record["messages"], tokenize=False)


def test_assistant_only_loss_false_trains_every_token(tmp_path, tok, sft_args):
    import copy

    tok = copy.deepcopy(tok)
    tok.chat_template = CHATML
    out, _ = prepared(tmp_path, tok, sft_args, CHAT, assistant_only_loss=False)
    assert all(label != -100 for row in out.train for label in row["labels"])


def test_the_mask_matches_transformers_generation_markers(tok):
    """llmft's prefix-rendering mask of the unmarked template equals transformers' mask of the marked one."""
    import copy

    from llmft.data.masking import tokenise_with_mask

    marked = copy.deepcopy(tok)
    marked.chat_template = CHATML_MARKED
    qwen = trl_template("qwen2_5")  # a real template: llmft's mask is each reply and its end-of-turn token
    for record in CHAT:
        ours = tokenise_with_mask(tok, record["messages"], qwen)
        spans = loss_spans(
            tok,
            {
                "input_ids": ours["input_ids"],
                "labels": [t if m else -100 for t, m in zip(ours["input_ids"], ours["assistant_masks"])],
            },
        )
        assert spans == [t["content"] + "<|im_end|>" for t in record["messages"] if t["role"] == "assistant"]
        assert tok.decode(ours["input_ids"]) == tok.apply_chat_template(
            record["messages"], tokenize=False, chat_template=qwen
        )
    for record in CHAT:
        theirs = marked.apply_chat_template(
            record["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ours = tokenise_with_mask(tok, record["messages"], CHATML)
        assert ours["input_ids"] == list(theirs["input_ids"])
        assert ours["assistant_masks"] == list(theirs["assistant_masks"])


def test_a_template_that_renders_prefixes_differently_is_one_line_naming_the_fixes(tok):
    from llmft.data.masking import tokenise_with_mask

    last_differs = CHATML.replace("'<|im_end|>' + '\n'", "('<|im_end|>' if loop.last else '<|im_end|>\n')")
    assert last_differs != CHATML
    with pytest.raises(
        DataError, match=r"renders a conversation's beginning differently .*--assistant_only_loss false"
    ):
        tokenise_with_mask(tok, CHAT[1]["messages"], last_differs)


def test_a_template_that_refuses_a_conversation_is_one_line(tmp_path, tok, sft_args):
    import copy

    strict = "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }}{% endfor %}"
    for marked in (False, True):  # llmft's mask, and TRL tokenising (a template with generation markers)
        tok = copy.deepcopy(tok)
        tok.chat_template = (
            strict.replace("{{ m['content'] }}", "{% generation %}{{ m['content'] }}{% endgeneration %}")
            if marked
            else strict
        )
        with pytest.raises(DataError, match=r"the chat template refuses a conversation.*System role not supported"):
            (tmp_path / str(marked)).mkdir()
            prepared(tmp_path / str(marked), tok, sft_args, CHAT)


def test_prompt_completion_and_alpaca_train_on_the_completion(tmp_path, tok, sft_args):
    out, lines = prepared(tmp_path, tok, sft_args, ALPACA)
    assert any("(alpaca -> prompt_completion, prompt template alpaca; loss on the completion)" in x for x in lines)
    assert loss_spans(tok, out.train[1]) == ["Telegram" + tok.eos_token]


# ---------------------------------------------------------------------------------------------- over-long records


def test_drop_long_records_drops_and_counts_instead_of_truncating(tmp_path, tok, sft_args):
    import dataclasses

    short = dataclasses.replace(sft_args, max_length=64)  # GSM8K's first record is about 210 tokens, its second 36
    out, lines = prepared(tmp_path, tok, short, GSM8K, prompt_template="gsm8k", drop_long_records=True)
    fit = next(x for x in lines if x.startswith("train data:"))
    assert fit.startswith("train data: 1 of 2 records kept, 0 truncated, 1 dropped (1 longer than max_length")
    assert "tokens in dropped records" in fit
    assert len(out.train) == 1 and out.train[0]["input_ids"][-1] == tok.eos_token_id  # kept whole, not cut
    assert any("1 of 2 train records are dropped as longer than max_length" in x for x in lines)
    truncating, lines = prepared(tmp_path, tok, short, GSM8K, prompt_template="gsm8k")
    fit = next(x for x in lines if x.startswith("train data:"))  # without the flag: its completion is cut away
    assert "1 dropped; completion cut in 1 (1 entirely)" in fit and "longer than max_length" not in fit


# ------------------------------------------------------------------------------------------ llmft prepare --show


def test_llmft_prepare_show_prints_the_loss_between_guillemets(tiny_model, tmp_path, capsys, monkeypatch):
    from llmft.cli import main

    monkeypatch.setenv("LLMFT_CACHE", str(tmp_path / "cache"))
    base = ["prepare", "--model_name_or_path", str(tiny_model), "--output_dir", str(tmp_path / "o")]
    chat = [*base, "--dataset_name", str(write(tmp_path, SHAREGPT, "sharegpt.jsonl")), "--show", "1"]
    assert main(chat) == 0
    out = capsys.readouterr().out
    assert "(sharegpt -> messages; loss on the assistant turns)" in out
    assert "1 train conversation(s) have no assistant turn and were dropped" in out
    assert "prepared now (none was cached for these flags); the loss is on the text between « and »" in out
    assert "<|user|>\nCapital of France?<|endoftext|>\n<|assistant|>\n«Paris.<|endoftext|>»\n<|user|>\n" in out
    assert main(chat) == 0 and "read from the cache" in capsys.readouterr().out
    gsm = [*base, "--dataset_name", str(write(tmp_path, GSM8K, "gsm.jsonl")), "--prompt_template", "gsm8k"]
    assert main([*gsm, "--show", "2"]) == 0
    out = capsys.readouterr().out
    assert "Question: What is 4 plus 8?\nAnswer:« 4 + 8 = 12\n#### 12<|endoftext|>»" in out
    assert "--- record 2 of 2:" in out


@pytest.mark.parametrize(
    "rows, extra, message",
    [
        (GSM8K, ["--messages_column", "question"], "column 'question' holds string values, not a list of turns"),
        (SHAREGPT, ["--dataset_format", "chat"], "--dataset_format 'chat': use auto or one of text"),
        (ALPACA, ["--assistant_only_loss", "true"], "--assistant_only_loss needs chat data"),
        (SHAREGPT, ["--role_map", "bot"], "--role_map 'bot': give NAME=ROLE pairs"),
    ],
)
def test_llmft_prepare_refuses_bad_data_in_one_line(tiny_model, tmp_path, capsys, monkeypatch, rows, extra, message):
    from llmft.cli import main

    monkeypatch.setenv("LLMFT_CACHE", str(tmp_path / "cache"))
    argv = ["prepare", "--model_name_or_path", str(tiny_model), "--output_dir", str(tmp_path / "o")]
    assert main([*argv, "--dataset_name", str(write(tmp_path, rows)), *extra]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line.lower()]  # (datasets' progress bars go there too)
    assert len(errors) == 1 and errors[0].startswith("llmft prepare: error: ") and message in errors[0], err
    assert "Traceback" not in err


# ------------------------------------------------------------------------------------------------------- mixtures


def test_every_mixture_source_is_recognised_as_its_own_format(tmp_path):
    import yaml

    def mix(sources):
        path = tmp_path / "mix.yaml"
        path.write_text(yaml.safe_dump({"datasets": sources}))
        found: list = []
        train, _, shape = cache.load_records(
            cache.DataOptions(dataset_name=None, dataset_mixture=str(path)), None, found
        )
        return train, shape, found

    alpaca, gsm = str(write(tmp_path, ALPACA, "alpaca.jsonl")), str(write(tmp_path, GSM8K, "gsm.jsonl"))
    train, shape, found = mix(
        [{"path": alpaca, "weight": "all"}, {"path": gsm, "prompt_template": "gsm8k", "weight": "all"}]
    )
    assert shape == "prompt_completion" and len(train) == 5
    assert [f.describe() for f in found] == [
        "alpaca -> prompt_completion, prompt template alpaca",
        "prompt_completion, prompt template gsm8k",
    ]
    assert "Question: What is 4 plus 8?\nAnswer:" in train["prompt"]
    assert (
        cache.describe_formats(found)
        == "alpaca -> prompt_completion, prompt template alpaca; prompt_completion, prompt template gsm8k"
    )

    sharegpt, chat = str(write(tmp_path, SHAREGPT, "sg.jsonl")), str(write(tmp_path, CHAT, "chat.jsonl"))
    train, shape, found = mix([{"path": sharegpt, "weight": "all"}, {"path": chat, "weight": "all"}])
    assert shape == "messages" and [f.format for f in found] == ["sharegpt", "messages"]
    assert found[0].notes and found[0].notes[0].startswith(f"--dataset_mixture source {sharegpt}: warning: field(s)")
    with pytest.raises(DataError, match=r"--dataset_mixture lists the datasets: drop --prompt_template"):
        cache.check_options(
            cache.DataOptions(dataset_name=None, dataset_mixture=str(tmp_path / "mix.yaml"), prompt_template="gsm8k")
        )


def test_llmft_prepare_show_works_for_a_mixture(tiny_model, tmp_path, capsys, monkeypatch):
    """--show on a --dataset_mixture: each source in its own format, the loss of each where that format puts it."""
    import yaml

    from llmft.cli import main

    monkeypatch.setenv("LLMFT_CACHE", str(tmp_path / "cache"))
    spec = tmp_path / "mix.yaml"
    sources = [
        {"path": str(write(tmp_path, ALPACA, "alpaca.jsonl")), "weight": "all"},
        {"path": str(write(tmp_path, GSM8K, "gsm.jsonl")), "prompt_template": "gsm8k", "weight": "all"},
    ]
    spec.write_text(yaml.safe_dump({"datasets": sources}))
    argv = ["prepare", "--model_name_or_path", str(tiny_model), "--output_dir", str(tmp_path / "o")]
    assert main([*argv, "--dataset_mixture", str(spec), "--show", "5"]) == 0
    out = capsys.readouterr().out
    assert "prepared now (none was cached for these flags); the loss is on the text between « and »" in out
    assert "--- record 5 of 5:" in out
    assert "### Input:\nTwitter, Instagram, Telegram\n\n### Response:\n«Telegram<|endoftext|>»" in out  # Alpaca's
    assert "Question: What is 4 plus 8?\nAnswer:« 4 + 8 = 12\n#### 12<|endoftext|>»" in out  # GSM8K's
    records = out.split("--- record 1 of 5:", 1)[1]
    assert records.count("«") == records.count("»") == 5  # one completion each: nothing else carries loss


def test_a_mixtures_sources_are_checked_once_on_rank_0(tmp_path, monkeypatch):
    """A source whose lines are not objects stops rank 0 before any model loads; the other ranks do not read every
    source again (they hear of it through rank 0's exit)."""
    import yaml

    spec = tmp_path / "mix.yaml"
    arrays = tmp_path / "arrays.jsonl"
    arrays.write_text('["a", "b"]\n')
    spec.write_text(yaml.safe_dump({"datasets": [{"path": str(arrays), "weight": "all"}]}))
    opts = cache.DataOptions(dataset_name=None, dataset_mixture=str(spec))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(DataError, match=r"arrays.jsonl: line 1 is a JSON list, not an object"):
        cache.check_options(opts)
    monkeypatch.setenv("RANK", "1")
    cache.check_options(opts)  # the YAML read, no source

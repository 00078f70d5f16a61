"""Preference data as it comes (issue 43, item 2): explicit and implicit prompts, as texts or conversations,
Anthropic HH-RLHF text, KTO's unpaired records; each dropped record counted by its reason; `llmft prepare --method
dpo|kto|reward --show` marking exactly the completions; conversational prompt/completion records trained under SFT.

Records are written here; the tokenizer is llmft's tiny one (llmft.data.synthetic, llmft's default chat template).
"""

from __future__ import annotations

import json
import re

import pytest
from conftest import PYTHON, run
from datasets import Dataset

from llmft.data import formats, pairs
from llmft.data.loading import DataError
from llmft.planning.methods import method


def shaped(rows, name="dpo", **flags):
    return formats.shape_for_method(Dataset.from_list(rows), name, **flags)


def msgs(*turns):
    return [{"role": r, "content": c} for r, c in turns]


def write(tmp_path, rows, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tok(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


# -------------------------------------------------------------------------------------------- shapes into TRL's


def test_explicit_prompt_pairs_keep_trl_shape_as_text_and_as_conversations():
    text = [{"prompt": "The sky is", "chosen": " blue.", "rejected": " green.", "id": 7}]
    ds, info = shaped(text)
    assert ds.column_names == ["prompt", "chosen", "rejected"]
    assert ds[0] == {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}
    assert info.shape == "preference" and info.dropped.total == 0
    assert any("field(s) the preference format does not train on: id" in n for n in info.notes)

    chat = [
        {
            "prompt": msgs(("user", "What color is the sky?")),
            "chosen": msgs(("assistant", "Blue.")),
            "rejected": msgs(("assistant", "Green.")),
        }
    ]
    ds, _ = shaped(chat)
    assert ds[0] == chat[0]
    # text sides beside a conversational prompt become the assistant's message
    ds, _ = shaped([{"prompt": msgs(("user", "Sky?")), "chosen": "Blue.", "rejected": "Green."}])
    assert ds[0]["chosen"] == msgs(("assistant", "Blue.")) and ds[0]["prompt"] == msgs(("user", "Sky?"))


def test_implicit_prompt_conversations_share_their_leading_messages_as_the_prompt():
    shared = msgs(("system", "Be brief."), ("user", "Capital of France?"))
    rows = [
        {"chosen": shared + msgs(("assistant", "Paris.")), "rejected": shared + msgs(("assistant", "Lyon."))},
        # a text prompt copied beside full conversations (as some datasets carry it) is the conversations' own start
        {
            "prompt": "Capital of France?",
            "chosen": shared + msgs(("assistant", "Paris.")),
            "rejected": shared + msgs(("assistant", "Nice.")),
        },
    ]
    ds, info = shaped(rows[:1])
    assert ds[0] == {
        "prompt": shared,
        "chosen": msgs(("assistant", "Paris.")),
        "rejected": msgs(("assistant", "Lyon.")),
    }
    ds, _ = shaped(rows[1:])
    assert ds[0]["prompt"] == shared and ds[0]["rejected"] == msgs(("assistant", "Nice."))


def test_implicit_prompt_texts_are_cut_back_to_a_word_boundary():
    """TRL's extract_prompt would give the prompt "Answer: bl" (it only handles a prefix ending in a space)."""
    from trl.data_utils import extract_prompt

    pair = {"chosen": "Q: the sky?\nAnswer: blue sky", "rejected": "Q: the sky?\nAnswer: black sky"}
    assert extract_prompt(pair)["prompt"].endswith("Answer: bl")
    ds, _ = shaped([pair, {"chosen": "Say it: yes", "rejected": "Say it: no"}])
    assert ds[0] == {"prompt": "Q: the sky?\nAnswer:", "chosen": " blue sky", "rejected": " black sky"}
    assert ds[1] == {"prompt": "Say it:", "chosen": " yes", "rejected": " no"}


def test_hh_rlhf_text_becomes_chat_turns_and_the_shared_turns_the_prompt():
    """Anthropic HH-RLHF's records as published: "\\n\\nHuman: ...\\n\\nAssistant: ..." text, multi-turn."""
    head = "\n\nHuman: What are some fruits?\n\nAssistant: Apples and pears.\n\nHuman: Which is sweeter?"
    rows = [
        {
            "chosen": head + "\n\nAssistant: Pears are usually sweeter.",
            "rejected": head + "\n\nAssistant: I don't know.",
        }
    ]
    ds, info = shaped(rows)
    assert info.format == "hh-rlhf text" and info.shape == "preference"
    assert ds[0]["prompt"] == msgs(
        ("user", "What are some fruits?"), ("assistant", "Apples and pears."), ("user", "Which is sweeter?")
    )
    assert ds[0]["chosen"] == msgs(("assistant", "Pears are usually sweeter."))
    assert ds[0]["rejected"] == msgs(("assistant", "I don't know."))
    assert formats.hh_turns("no turns here") is None


def test_kto_unpaired_records_and_their_labels():
    rows = [
        {"prompt": "2+2=", "completion": " 4", "label": True},
        {"prompt": "2+2=", "completion": " 5", "label": False},
    ]
    ds, info = shaped(rows, "kto")
    assert ds.to_list() == rows and info.shape == "unpaired_preference"
    ds, _ = shaped([{**r, "label": int(r["label"])} for r in rows], "kto")  # 1/0 as CSV and pandas write booleans
    assert ds["label"] == [True, False]
    chat = [{"prompt": msgs(("user", "2+2?")), "completion": msgs(("assistant", "4")), "label": True}]
    assert shaped(chat, "kto")[0][0] == chat[0]


@pytest.mark.parametrize("label", ["yes", 2, 0.5, None])
def test_a_label_that_is_not_boolean_is_one_line(label):
    rows = [{"prompt": "a", "completion": "b", "label": label}, {"prompt": "a", "completion": "c", "label": label}]
    with pytest.raises(DataError, match=r"^record 1: label .* is not a boolean; .* write true or false \(or 1/0\)$"):
        shaped(rows, "kto")


# ------------------------------------------------------------------------------------------------------- drops


DIRTY = [
    {"chosen": "Say it: yes", "rejected": "Say it: no"},  # kept
    {"chosen": None, "rejected": "Say it: no"},  # no chosen side
    {"chosen": "Say it: yes", "rejected": None},  # no rejected side
    {"chosen": "Say it: yes", "rejected": ""},  # an empty side
    {"chosen": "Say it: same", "rejected": "Say it: same"},  # chosen equal to rejected
    {"chosen": "Blue.", "rejected": "Green."},  # no shared prefix
    {"chosen": "Say it: yes", "rejected": "Say it: no"},  # kept
]


def test_each_drop_reason_is_counted_and_named_in_the_data_fit_line(tok):
    ds, info = shaped(DIRTY)
    assert len(ds) == 2
    assert info.dropped.records == 7 and info.dropped.counts == {
        "no_chosen": 1,
        "no_rejected": 1,
        "empty_side": 1,
        "identical": 1,
        "no_shared_prefix": 1,
    }
    line = info.dropped.line("train")
    assert line.startswith("warning: 5 of 7 train records dropped before training (")
    fit = pairs.pair_fit(pairs.tokenise(ds, tok, "dpo"), method("dpo"), 64, info.dropped)
    fit_line = pairs.pair_fit_line("train", fit)
    assert fit_line.startswith("train data: 2 of 7 pairs kept, 0 truncated, 5 dropped (")
    for named in ("1 with no chosen side", "1 with no rejected side", "1 with an empty side",
                  "1 with chosen equal to rejected", "1 with no shared prefix"):  # fmt: skip
        assert named in line and named in fit_line
    # the trainer's own filter (a prompt filling max_length) is counted too, not left silent as TRL leaves it
    short = pairs.pair_fit(pairs.tokenise(ds, tok, "dpo"), method("dpo"), 2, info.dropped)
    assert short["kept"] == 0 and "2 too long for max_length" in pairs.pair_fit_line("train", short)


def test_an_empty_side_after_the_shared_prompt_is_dropped_and_hh_turns_count_too():
    rows = [
        {"chosen": "\n\nHuman: hi\n\nAssistant: hello", "rejected": "\n\nHuman: hi\n\nAssistant:"},
        {"chosen": "\n\nHuman: hi\n\nAssistant: hello", "rejected": "not a conversation"},
        {"chosen": "\n\nHuman: hi\n\nAssistant: hello", "rejected": "\n\nHuman: hi\n\nAssistant: bye"},
    ]
    ds, info = shaped(rows)
    assert len(ds) == 1 and info.dropped.counts == {"empty_side": 1, "not_turns": 1}


def test_none_left_stops_with_one_line():
    with pytest.raises(DataError, match=r"^none of the 2 records is left to train on \(1 with no chosen side, 1 with chosen equal to rejected\); fix the data$"):  # fmt: skip
        shaped([DIRTY[1], DIRTY[4]])


def test_data_for_another_method_is_one_line_naming_the_method():
    with pytest.raises(DataError, match=r"preference pairs .* use --method dpo \(or --method reward"):
        shaped(DIRTY[:1], "sft")
    with pytest.raises(DataError, match=r"unpaired preference records .* use --method kto"):
        shaped([{"prompt": "a", "completion": "b", "label": True}], "sft")
    with pytest.raises(DataError, match=r"--method dpo trains on .* this dataset has prompt_completion data; for SFT data use --method sft"):  # fmt: skip
        shaped([{"prompt": "a", "completion": "b"}], "dpo")
    with pytest.raises(DataError, match=r"--method kto trains on .*; for pairs use --method dpo or --method reward"):
        shaped(DIRTY[:1], "kto")
    with pytest.raises(DataError, match=r"--dataset_format unpaired_preference needs field\(s\) label, not in the"):
        shaped([{"prompt": "a", "completion": "b"}], "kto", dataset_format="unpaired_preference")
    # a prompt/completion file with a label of its own (not booleans) is SFT data
    ds, _ = shaped([{"prompt": "a ", "completion": "b", "label": "math"}], "sft")
    assert ds.column_names == ["prompt", "completion"]


# ---------------------------------------------------------------------------------------- llmft prepare --show


def prepare_argv(tiny_model, tmp_path, data, *extra):
    return ["prepare", "--model_name_or_path", str(tiny_model), "--output_dir", str(tmp_path / "o"),
            "--dataset_name", str(data), *extra]  # fmt: skip


def between(out: str) -> list[str]:
    """The spans --show marks as carrying loss, in the records it prints (after its line naming the marks)."""
    shown = out.split("the loss is on the text between « and »:", 1)[1]
    return re.findall("«(.*?)»", shown, flags=re.S)


def test_prepare_show_marks_exactly_the_completions_for_dpo_kto_and_reward(tiny_model, tmp_path, capsys, monkeypatch):
    from llmft.cli import main

    monkeypatch.setenv("LLMFT_CACHE", str(tmp_path / "cache"))
    hh = [
        {"chosen": "\n\nHuman: Name a fruit.\n\nAssistant: An apple.", "rejected": "\n\nHuman: Name a fruit.\n\nAssistant: A rock."},
        {"chosen": "\n\nHuman: hi\n\nAssistant: hello", "rejected": "\n\nHuman: hi\n\nAssistant: hello"},
    ]  # fmt: skip
    for name in ("dpo", "reward"):
        assert main(prepare_argv(tiny_model, tmp_path, write(tmp_path, hh), "--method", name, "--show", "2")) == 0
        out = capsys.readouterr().out
        assert "1 of 2 pairs kept, 0 truncated, 1 dropped (1 with chosen equal to rejected)" in out
        assert "--- record 1 of 1: prompt 32 tokens, chosen 6, rejected 8 ---" in out and "--- record 2" not in out
        assert "prompt: <|user|>\nName a fruit.<|endoftext|>\n<|assistant|>\n\n" in out
        assert between(out) == ["An apple.<|endoftext|>\n", "A rock.<|endoftext|>\n"]
    kto = [{"prompt": "2+2=", "completion": " 4", "label": True}, {"prompt": "2+2=", "completion": " 5", "label": 0}]
    assert (
        main(prepare_argv(tiny_model, tmp_path, write(tmp_path, kto, "k.jsonl"), "--method", "kto", "--show", "2"))
        == 0
    )
    out = capsys.readouterr().out
    assert "prompt: 2+2=\ncompletion (label true): « 4<|endoftext|>»" in out
    assert "completion (label false): « 5<|endoftext|>»" in out and between(out) == [
        " 4<|endoftext|>",
        " 5<|endoftext|>",
    ]


@pytest.mark.parametrize(
    "rows, extra, message",
    [
        (DIRTY[:1], [], "this dataset holds preference pairs (chosen/rejected), which --method sft does not train on"),
        ([{"prompt": "a", "completion": "b"}], ["--method", "dpo"], "--method dpo trains on"),
        ([{"prompt": "a", "completion": "b", "label": "yes"}], ["--method", "kto"], "record 1: label 'yes' is not a boolean"),
        ([DIRTY[1], DIRTY[4]], ["--method", "dpo"], "none of the 2 records is left to train on"),
        (DIRTY[:1], ["--method", "ppo"], "--method 'ppo' is not a training method"),
        (DIRTY[:1], ["--method", "dpo", "--prompt_template", "gsm8k"], "--prompt_template shape(s) SFT data; --method dpo"),
    ],
)  # fmt: skip
def test_llmft_prepare_refuses_in_one_line(tiny_model, tmp_path, capsys, monkeypatch, rows, extra, message):
    from llmft.cli import main

    monkeypatch.setenv("LLMFT_CACHE", str(tmp_path / "cache"))
    assert main(prepare_argv(tiny_model, tmp_path, write(tmp_path, rows), *extra)) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("llmft prepare: error: ") and message in errors[0], err
    assert "Traceback" not in err


# ------------------------------------------------------------------------ conversational prompt/completion, SFT

CONVERSATIONAL = [
    {
        "prompt": msgs(("user", f"What is {a} plus {b}?")),
        "completion": msgs(("assistant", f"{a} plus {b} is {a + b}.")),
    }
    for a in range(4)
    for b in range(4)
]


def test_conversational_prompt_completion_trains_under_sft(tiny_model, tmp_path):
    """Refused before ("column 'prompt' must hold strings"); TRL trains it: the loss on the completion's turns.
    One real short `llmft train` run (one process)."""
    ds, info = shaped(CONVERSATIONAL, "sft")
    assert info.format == "conversational prompt_completion" and info.shape == "prompt_completion"
    assert ds[0] == CONVERSATIONAL[0]
    data = write(tmp_path, CONVERSATIONAL)
    out = tmp_path / "run"
    proc = run(
        [PYTHON, "-m", "llmft.train", "--model_name_or_path", str(tiny_model), "--dataset_name", str(data),
         "--output_dir", str(out), "--report_to", "none", "--logging_steps", "1", "--disable_tqdm", "true",
         "--max_steps", "2", "--per_device_train_batch_size", "2", "--global_batch_size", "2", "--max_length", "64"],
        check=True,
        timeout=600,
    )  # fmt: skip
    assert "conversational prompt_completion" in proc.stdout and "loss on the completion" in proc.stdout
    assert "llmft: step 2/2 loss" in proc.stdout
    record = json.loads((out / "llmft_data.json").read_text())
    assert record["shape"] == "prompt_completion" and record["records"]["train"] == 16


def test_conversational_prompt_completion_is_masked_to_the_completion(tiny_model, tmp_path, capsys, monkeypatch):
    from llmft.cli import main

    monkeypatch.setenv("LLMFT_CACHE", str(tmp_path / "cache"))
    assert main(prepare_argv(tiny_model, tmp_path, write(tmp_path, CONVERSATIONAL[:2]), "--show", "1")) == 0
    out = capsys.readouterr().out
    assert "<|user|>\nWhat is 0 plus 0?<|endoftext|>\n<|assistant|>\n«0 plus 0 is 0.<|endoftext|>\n»" in out


def test_pairs_the_trainer_would_filter_out_entirely_stop_with_one_line(tok, tmp_path):
    from llmft.data.cache import DataOptions

    opts = DataOptions(dataset_name=str(write(tmp_path, DIRTY)))
    lines: list[str] = []
    kept = pairs.prepare_method_data(opts, "dpo", tok, 64, log=lines.append)
    assert len(kept.train) == 2 and kept.fit["train"]["kept"] == 2
    assert any(x.startswith("warning: 5 of 7 train records dropped before training") for x in lines)
    with pytest.raises(
        DataError, match=r"^no train records left: every one is too long for max_length 2 .*--max_length"
    ):
        pairs.prepare_method_data(opts, "dpo", tok, 2, log=lines.append)


def test_the_shaped_records_train_under_trls_own_trainers(tiny_model, tmp_path, tok):
    """What shape_for_method returns is what TRL 1.16's DPO, KTO and reward trainers take, untouched: two steps each
    (the DPO loss starts at ln 2, the policy being its own reference)."""
    import math

    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer, RewardConfig, RewardTrainer

    head = "\n\nHuman: Name a fruit."
    hh = [{"chosen": f"{head}\n\nAssistant: An apple {i}.", "rejected": f"{head}\n\nAssistant: A rock {i}."} for i in range(4)]  # fmt: skip
    common = dict(output_dir=str(tmp_path / "o"), report_to="none", use_cpu=True, max_steps=2, logging_steps=1,
                  per_device_train_batch_size=2, bf16=False, max_length=64, disable_tqdm=True)  # fmt: skip
    dpo = DPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model),
        args=DPOConfig(**common),
        train_dataset=shaped(hh, "dpo")[0],
        processing_class=tok,
    )
    dpo.train()
    assert math.isclose(dpo.state.log_history[0]["loss"], math.log(2), abs_tol=1e-3)
    kto_rows = [{"prompt": "2+2=", "completion": f" {k}", "label": k % 2 == 0} for k in range(4)]
    kto = KTOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model),
        args=KTOConfig(**common),
        train_dataset=shaped(kto_rows, "kto")[0],
        processing_class=tok,
    )
    assert kto.train().global_step == 2
    scorer = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1)
    scorer.config.pad_token_id = tok.pad_token_id
    reward = RewardTrainer(
        model=scorer, args=RewardConfig(**common), train_dataset=shaped(hh, "reward")[0], processing_class=tok
    )
    assert reward.train().global_step == 2

"""Dataset loading and shaping: the formats users bring, and one clear error for each kind of bad data."""

import json

import pytest

from llmft.data.formats import shape_for_sft
from llmft.data.loading import DataError, ensure_chat_template, load_train_split, take_percentage
from llmft.data.synthetic import as_format, make_examples, write_jsonl


def jsonl(tmp_path, rows, name="d.jsonl"):
    return write_jsonl(rows, tmp_path / name)


@pytest.mark.parametrize(
    "fmt, shape, columns",
    [
        ("text", "text", ["text"]),
        ("prompt_completion", "prompt_completion", ["prompt", "completion"]),
        ("messages", "messages", ["messages"]),
    ],
)
def test_the_three_trl_shapes_are_recognised(tmp_path, fmt, shape, columns):
    ds = load_train_split(str(jsonl(tmp_path, as_format(make_examples(10), fmt))))
    shaped, found = shape_for_sft(ds)
    assert found == shape and shaped.column_names == columns and len(shaped) == 10


def test_question_answer_fields_map_to_prompt_completion(tmp_path):
    ds = load_train_split(str(jsonl(tmp_path, as_format(make_examples(5), "question_answer"))))
    shaped, shape = shape_for_sft(ds, prompt_column="question", completion_column="answer")
    assert shape == "prompt_completion"
    assert shaped[0]["prompt"] == ds[0]["question"] and shaped[0]["completion"] == ds[0]["answer"]


@pytest.mark.parametrize("suffix", ["parquet", "csv"])
def test_parquet_and_csv_files_and_directories_load(tmp_path, suffix):
    from datasets import Dataset

    ds = Dataset.from_list(as_format(make_examples(7), "prompt_completion"))
    (tmp_path / "dir").mkdir()
    path = tmp_path / "dir" / f"train.{suffix}"
    ds.to_parquet(str(path)) if suffix == "parquet" else ds.to_csv(str(path), index=False)
    assert len(load_train_split(str(path))) == 7
    assert len(load_train_split(str(tmp_path / "dir"))) == 7


def test_malformed_line_is_reported_with_its_number(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"text": "ok"}\n{"text": "broken\n{"text": "ok"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl: line 3 is not valid JSON .*fix or delete that line"):
        load_train_split(str(path))


def test_non_object_line_is_reported(tmp_path):
    path = tmp_path / "list.jsonl"
    path.write_text('{"text": "ok"}\n["a", "b"]\n')
    with pytest.raises(DataError, match=r"line 2 is a JSON list, not an object"):
        load_train_split(str(path))


def test_a_json_lines_file_named_json_gets_the_line_number_too(tmp_path):
    path = tmp_path / "arrays.json"
    path.write_text('{"text": "ok"}\n["What is 1+1?", "2"]\n')
    with pytest.raises(DataError, match=r"arrays.json: line 2 is a JSON list, not an object"):
        load_train_split(str(path))
    whole = tmp_path / "whole.json"  # one JSON document (a list of records) still loads
    whole.write_text('[\n {"text": "a"},\n {"text": "b"}\n]\n')
    assert load_train_split(str(whole))["text"] == ["a", "b"]


def test_missing_file_and_empty_file(tmp_path):
    with pytest.raises(DataError, match=r"dataset file ./nope.jsonl not found"):
        load_train_split("./nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match=r"empty.jsonl is empty"):
        load_train_split(str(tmp_path / "empty.jsonl"))


def test_dataset_without_expected_fields_lists_its_columns_and_the_fix(tmp_path):
    ds = load_train_split(str(jsonl(tmp_path, as_format(make_examples(3), "question_answer"))))
    with pytest.raises(DataError, match=r"columns answer, question but llmft needs .*--prompt_column"):
        shape_for_sft(ds)
    with pytest.raises(DataError, match=r"column\(s\) query not in the dataset"):
        shape_for_sft(ds, prompt_column="query", completion_column="answer")


def test_null_fields_are_refused(tmp_path):
    path = tmp_path / "nulls.jsonl"
    path.write_text(
        json.dumps({"prompt": "a", "completion": "b"}) + "\n" + json.dumps({"prompt": "a", "completion": None}) + "\n"
    )
    with pytest.raises(DataError, match=r"column 'completion' is empty in 1 record"):
        shape_for_sft(load_train_split(str(path)))


def test_percentage_is_deterministic_and_bounded(tmp_path):
    ds = load_train_split(str(jsonl(tmp_path, as_format(make_examples(200), "text"))))
    ten = take_percentage(ds, 10, seed=1)
    assert len(ten) == 20 and ten["text"] == take_percentage(ds, 10, seed=1)["text"]
    assert len(take_percentage(ds, 0.01)) == 1 and len(take_percentage(ds, 100)) == 200
    for bad in (0, -5, 101, float("nan")):
        with pytest.raises(DataError, match=r"--data_percentage must be in \(0, 100\]"):
            take_percentage(ds, bad)


def test_tokenizer_without_chat_template_gets_a_working_default(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = None
    assert ensure_chat_template(tok) is True
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|user|>\nhi<|endoftext|>\n<|assistant|>\n"
    assert ensure_chat_template(tok) is False  # an existing template is kept


def test_content_fingerprint_follows_the_bytes_not_the_path(tmp_path):
    from llmft.data.loading import content_fingerprint

    rows = as_format(make_examples(8), "prompt_completion")
    a = write_jsonl(rows, tmp_path / "a" / "train.jsonl")
    b = write_jsonl(rows, tmp_path / "b" / "train.jsonl")
    assert content_fingerprint(str(a)) == content_fingerprint(str(b))  # same bytes, same name: same data
    assert content_fingerprint(str(a.parent)) == content_fingerprint(str(b.parent))  # directories too
    b.write_text(b.read_text().replace("plus", "plus ", 1))
    assert content_fingerprint(str(a)) != content_fingerprint(str(b))  # one byte changes it
    assert content_fingerprint(str(a.parent)) != content_fingerprint(str(b.parent))
    assert content_fingerprint("trl-lib/Capybara") != content_fingerprint("trl-lib/Capybara", revision="abc123")


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".txt"])
def test_text_that_is_not_utf8_is_named_by_line_and_byte_before_loading(tmp_path, suffix):
    """pyarrow loads Latin-1 bytes into string columns without a word (JSON) or fails without naming them (CSV, text)."""
    rows = {
        ".jsonl": b'{"text": "ok"}\n{"text": "caf\xe9"}\n',
        ".csv": b"text\nok\ncaf\xe9\n",
        ".txt": b"ok\nfine\ncaf\xe9\n",
    }
    path = tmp_path / f"latin1{suffix}"
    path.write_bytes(rows[suffix])
    line = 2 if suffix == ".jsonl" else 3
    with pytest.raises(
        DataError,
        match=rf"latin1{suffix}: line {line} is not UTF-8 \(byte 0xe9 at offset \d+\); re-save the file as UTF-8",
    ):
        load_train_split(str(path))


def test_utf8_check_finds_the_byte_across_its_read_blocks(tmp_path):
    from llmft.data.loading import check_utf8

    path = tmp_path / "big.txt"
    block = 1 << 20
    head = b"ok\n" + b"a" * (block - 4)  # a two-byte character split across the first two 1 MiB blocks is fine ...
    path.write_bytes(head + "é".encode() + b"\nx\xff\n")  # ... the 0xff after it is not
    with pytest.raises(DataError, match=rf"line 3 is not UTF-8 \(byte 0xff at offset {block + 3}\)"):
        check_utf8(path)
    path.write_bytes(head + b"\xc3")  # the file ends inside a character
    with pytest.raises(DataError, match="line 2 ends in the middle of a UTF-8 sequence"):
        check_utf8(path)
    path.write_bytes(head + "é\n".encode() * 3)
    check_utf8(path)


def test_the_dataset_is_hashed_once_for_every_rank_and_again_after_any_write(tmp_path):
    """content_fingerprint: the first process hashes under a lock in the shared llmft cache, the others (started at
    the same time, as a job's ranks are) wait and read its result; a later call reads it too. A write that keeps the
    size and puts the mtime back (rsync --times) still changes ctime, so the data is hashed again."""
    import os
    import subprocess
    import sys

    from llmft.data.loading import content_fingerprint

    data = tmp_path / "train.jsonl"
    data.write_text("".join(f'{{"text": "record {i}"}}\n' for i in range(2000)))
    env = {**os.environ, "LLMFT_CACHE": str(tmp_path / "cache")}
    code = (
        "import sys; from llmft.data.loading import content_fingerprint; print('fp', content_fingerprint(sys.argv[1]))"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(data)], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    text = "".join(outs)
    assert text.count(f"llmft: hashed dataset {data}: 1 file(s), {data.stat().st_size} bytes") == 1, text
    fingerprints = {line.split()[1] for line in text.splitlines() if line.startswith("fp ")}
    assert len(fingerprints) == 1
    [first] = fingerprints
    said = []
    assert content_fingerprint(str(data), env=env, log=said.append) == first and said == []
    stat = data.stat()
    data.write_text(data.read_text().replace("record 1", "record 7", 1))  # same size
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    again = content_fingerprint(str(data), env=env, log=said.append)
    assert len(said) == 1 and "hashed dataset" in said[0]
    assert again == content_fingerprint(str(data), env={"LLMFT_CACHE": str(tmp_path / "other")}, log=said.append)
    assert again != first and len(said) == 2  # another cache hashes for itself

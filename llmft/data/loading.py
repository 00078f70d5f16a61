"""Training data: load a local file/directory or a hub dataset and check it, before anything large loads.

TRL trains on three shapes: text ({"text": ...}), prompt/completion ({"prompt": ..., "completion": ...}, loss on the
completion) and chat ({"messages": [{"role": ..., "content": ...}, ...]}, through the tokenizer's chat template).
llmft.data.formats recognises the formats users bring (those three, Alpaca, ShareGPT; other field names mapped
with the column flags or a --prompt_template) and converts them to these shapes.

Everything here runs before the model is loaded, so bad data fails in seconds; a malformed JSONL line is
reported with its number: a line that is not a {...} object is found by a byte scan before `datasets` reads the
file (it would read arrays as data), a line that is not JSON by parsing the file after `datasets` failed to read it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from pathlib import Path
from typing import Callable, Mapping

from llmft.errors import LlmftError

# Suffix -> datasets builder for local files.
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}

# The held-out evaluation split (--eval_split_ratio) uses its own fixed seed, so it stays the same
# across --seed and --data_percentage sweeps: runs that differ only in those are scored on the same records.
EVAL_SPLIT_SEED = 1234

# A minimal chat template for tokenizers that ship none (tiny ones, most base models).
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


class DataError(LlmftError, ValueError):
    """The dataset cannot be used as given; the message names the problem and the fix."""


def looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or Path(name).suffix.lower() in BUILDERS


def check_jsonl(path: Path) -> int:
    """Parse every line of a JSON Lines file; return the number of records. Fails on the first bad line."""
    count = 0
    with open(path, encoding="utf-8", errors="strict") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            json_object_line(path, lineno, line)
            count += 1
    return count


def json_object_line(path: Path, lineno: int, line: str) -> dict:
    """Line `lineno` of a JSON Lines file as its record, or the DataError naming it: not JSON, or not an object."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(
            f"{path}: line {lineno} is not valid JSON ({e.msg} at column {e.colno}); fix or delete that line"
        ) from None
    if not isinstance(record, dict):
        raise DataError(
            f"{path}: line {lineno} is a JSON {type(record).__name__}, not an object; each line must be one {{...}} record"
        )
    return record


TEXT_SUFFIXES = (".jsonl", ".json", ".csv", ".txt")

_NOT_AN_OBJECT = None  # compiled on first use: a line whose first non-blank byte is not "{"


def check_jsonl_objects(path: Path) -> None:
    """Refuse a JSON Lines file with a line that is not a {...} object, naming the line, before `datasets` reads it:
    `datasets` reads a file of arrays or strings as data and trains on it. A byte scan for lines not starting
    with "{" (a regular expression at C speed, about as fast as reading the file), so it runs on every load;
    only a line it flags is parsed."""
    import re

    global _NOT_AN_OBJECT
    if _NOT_AN_OBJECT is None:
        _NOT_AN_OBJECT = re.compile(rb"(?m)^[ \t\r\f\v]*[^{\s]")
    lines_before, carry = 0, b""
    with open(path, "rb") as f:
        if f.read(3) != b"\xef\xbb\xbf":  # a UTF-8 byte-order mark before the first record is not a bad line
            f.seek(0)
        for block in iter(lambda: f.read(1 << 22), b""):
            block = carry + block
            cut = block.rfind(b"\n") + 1
            whole, carry = block[:cut], block[cut:]
            hit = _NOT_AN_OBJECT.search(whole)
            if hit:
                _describe_line(path, lines_before + whole.count(b"\n", 0, hit.start()) + 1)
            lines_before += whole.count(b"\n")
    if carry and _NOT_AN_OBJECT.search(carry):
        _describe_line(path, lines_before + 1)


def _describe_line(path: Path, lineno: int) -> None:
    """Raise the DataError for line `lineno` of a JSON Lines file: not JSON, or JSON that is not an object."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, start=1):
            if n == lineno:
                break
    json_object_line(path, lineno, line)
    raise DataError(f"{path}: line {lineno} does not start with '{{'; each line must be one {{...}} record")


def check_utf8(path: Path) -> None:
    """Fail with the line and byte of the first invalid UTF-8 sequence. pyarrow loads such bytes into string
    columns without complaint and fails (or trains on mojibake) later; this pass costs about 1% of a load."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, lines = 0, 1
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            pending = len(decoder.getstate()[0])  # bytes of a sequence split across blocks, decoded with this one
            try:
                decoder.decode(block)
            except UnicodeDecodeError as e:
                bad = offset - pending + e.start
                with open(path, "rb") as g:
                    head = g.read(bad + 1)
                line = head.count(b"\n") + 1
                raise DataError(
                    f"{path}: line {line} is not UTF-8 (byte 0x{head[-1]:02x} at offset {bad}); "
                    "re-save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
                ) from None
            offset += len(block)
            lines += block.count(b"\n")
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise DataError(
                f"{path}: line {lines} ends in the middle of a UTF-8 sequence; re-save the file as UTF-8"
            ) from None


def data_files(name: str) -> list[Path]:
    """The local files a dataset name stands for (a file, or the data files under a directory); [] for hub names."""
    path = Path(name).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(
            p for p in path.rglob("*") if p.is_file() and (p.suffix.lower() in BUILDERS or p.suffix == ".arrow")
        )
    return []


def content_fingerprint(
    name: str,
    config_name: str | None = None,
    revision: str | None = None,
    env: Mapping[str, str] | None = None,
    log: Callable[[str], None] | None = None,
) -> str:
    """A short hash of what a dataset holds: the bytes of its local files (names relative to it, then
    contents), or for a hub dataset its name, config and revision. Equal fingerprints mean equal data;
    one edited byte changes it. Used to key prepared data and to tell whether a rerun is the same run.

    The data is read once, not by every rank twice: the hash is kept in the llmft cache ($LLMFT_CACHE, which
    run_llm.slurm puts where every node sees it) under a key of each file's path, size, inode, mtime and ctime
    (`stat_key`). The first process to need it hashes the files under a lock; the others wait for it and read
    the result, and so do later runs on the same files. Any write to a file changes its ctime (which no tool
    can set back), so edited data is always hashed again. One line says when the data was hashed."""
    files = data_files(name)
    if not files:
        return _hash_files(name, files, config_name, revision)
    cache = cache_root(env) / "fingerprints"
    key = stat_key(name, files, config_name, revision)
    entry = cache / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"
    found = _read_fingerprint(entry, key)
    if found:
        return found
    try:
        cache.mkdir(parents=True, exist_ok=True)
        from filelock import FileLock

        lock = FileLock(str(entry) + ".lock")
        lock.acquire()
    except OSError:  # a read-only or missing cache: hash here, keep nothing
        return _hash_files(name, files, config_name, revision)
    try:
        found = _read_fingerprint(entry, key)  # hashed by another process while this one waited
        if found:
            return found
        started = time.perf_counter()
        fingerprint = _hash_files(name, files, config_name, revision)
        size = sum(f.stat().st_size for f in files)
        tmp = entry.with_name(f".{entry.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "fingerprint": fingerprint}) + "\n")
        os.replace(tmp, entry)
        (log or (lambda m: print(m, flush=True)))(
            f"llmft: hashed dataset {name}: {len(files)} file(s), {size} bytes in {time.perf_counter() - started:.1f}s "
            f"(fingerprint {fingerprint}); kept in {entry} for every rank and later runs"
        )
        return fingerprint
    finally:
        lock.release()


def cache_root(env: Mapping[str, str] | None = None) -> Path:
    """$LLMFT_CACHE, else `llmft/` under the Hugging Face cache home ($HF_HOME, ~/.cache/huggingface)."""
    env = os.environ if env is None else env
    if env.get("LLMFT_CACHE"):
        return Path(env["LLMFT_CACHE"]).expanduser()
    hf_home = env.get("HF_HOME") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return Path(hf_home).expanduser() / "llmft"


def stat_key(name: str, files: list[Path], config_name: str | None, revision: str | None) -> str:
    """What decides whether a kept fingerprint still holds: each file's absolute path, size, inode, mtime and
    ctime (ctime changes on every write, and nothing sets it back), and the config and revision."""
    parts = [f"{name}|{config_name or ''}|{revision or ''}"]
    for f in files:
        st = f.stat()
        parts.append(f"{f.resolve()}|{st.st_size}|{st.st_ino}|{st.st_mtime_ns}|{st.st_ctime_ns}")
    return "\n".join(parts)


def _read_fingerprint(entry: Path, key: str) -> str | None:
    try:
        kept = json.loads(entry.read_text())
    except (OSError, ValueError):
        return None
    return kept.get("fingerprint") if isinstance(kept, dict) and kept.get("key") == key else None


def _hash_files(name: str, files: list[Path], config_name: str | None, revision: str | None) -> str:
    h = hashlib.sha256()
    if not files:
        h.update(f"hub:{name}:{config_name or ''}:{revision or ''}".encode())
    root = Path(name).expanduser()
    for f in files:
        h.update(str(f.relative_to(root) if root.is_dir() else f.name).encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()[:16]


def load_train_split(name: str, config_name: str | None = None, split: str = "train"):
    """Load the training split from a local file, a local directory, or (with internet) the hub."""
    from datasets import load_dataset, load_from_disk

    path = Path(name).expanduser()
    if path.is_file():
        builder = BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise DataError(
                f"unsupported dataset file type {path.suffix!r} for {path}; use one of {', '.join(BUILDERS)}"
            )
        if path.stat().st_size == 0:
            raise DataError(f"dataset {path} is empty; it needs at least one record")
        if path.suffix.lower() in TEXT_SUFFIXES:
            check_utf8(path)
        if path.suffix.lower() == ".jsonl":
            check_jsonl_objects(path)
        ds = _load_or_explain([path], lambda: load_dataset(builder, data_files=str(path), split="train"))
    elif path.is_dir():
        if (path / "dataset_info.json").is_file() or (path / "state.json").is_file():
            ds = load_from_disk(str(path))
            ds = ds[split] if hasattr(ds, "keys") else ds
        else:
            files = sorted(p for p in path.rglob("*") if p.suffix.lower() in BUILDERS)
            if not files:
                raise DataError(f"dataset directory {path} holds no {', '.join(BUILDERS)} files")
            for f in files:
                if f.suffix.lower() in TEXT_SUFFIXES:
                    check_utf8(f)
                if f.suffix.lower() == ".jsonl":
                    check_jsonl_objects(f)
            ds = _load_or_explain(files, lambda: load_dataset(str(path), split=split))
    elif looks_like_path(name):
        raise DataError(
            f"dataset file {name} not found; pass an existing .jsonl/.json/.parquet/.csv file or directory, or a hub dataset name"
        )
    else:
        ds = load_dataset(name, name=config_name, split=split)  # hub dataset (users with internet)
    if len(ds) == 0:
        raise DataError(f"dataset {name} is empty; it needs at least one record")
    return ds


def _load_or_explain(files: list[Path], load):
    """Load with `datasets`; only if that fails, parse the JSONL files line by line to name the bad line.

    Checking first would cost ~80% of the load time on every rank (bench/bench_data_check.py).
    """
    try:
        return load()
    except Exception as e:  # pyarrow/json parser messages are long and name no line: find the line ourselves
        for f in files:
            if f.suffix.lower() == ".jsonl" or f.suffix.lower() == ".json" and not _one_json_document(f):
                if (
                    check_jsonl(f) == 0
                ):  # a .json file that is not one document is read as JSON Lines, as datasets does
                    raise DataError(f"dataset {f} is empty; it needs at least one record") from None
        reason = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise DataError(f"cannot read {', '.join(map(str, files[:3]))}: {reason}; check the file's format") from None


def _one_json_document(path: Path) -> bool:
    """Whether a .json file parses as one JSON document (else it is JSON Lines, or broken)."""
    try:
        with open(path, encoding="utf-8") as f:
            json.load(f)
        return True
    except (ValueError, OSError):
        return False


def check_percentage(percentage: float) -> None:
    """--data_percentage must be in (0, 100]; checked before any data is read."""
    if not (0 < percentage <= 100) or math.isnan(percentage):
        raise DataError(f"--data_percentage must be in (0, 100], got {percentage}")


def take_percentage(ds, percentage: float, seed: int = 42):
    """A deterministic random `percentage`% of the split (at least one record), the same on every rank and rerun."""
    check_percentage(percentage)
    if percentage == 100:
        return ds
    k = max(1, round(len(ds) * percentage / 100))
    return ds.shuffle(seed=seed).select(range(k))


def check_eval_split_ratio(ratio: float) -> None:
    """--eval_split_ratio must be in (0, 1); checked before any data is read."""
    if not (0 < ratio < 1) or math.isnan(ratio):
        raise DataError(f"--eval_split_ratio must be in (0, 1), e.g. 0.05 for 5% of the training split; got {ratio}")


def held_out_split(ds, ratio: float, seed: int = EVAL_SPLIT_SEED):
    """(train, eval): a deterministic `ratio` of the records held out for evaluation (at least one), the rest
    kept for training in their original order. The same on every rank, rerun and --seed."""
    check_eval_split_ratio(ratio)
    n = len(ds)
    k = max(1, round(n * ratio))
    if k >= n:
        raise DataError(
            f"--eval_split_ratio {ratio} of {n} record(s) leaves nothing to train on; use a smaller ratio or more data"
        )
    held = sorted(random.Random(seed).sample(range(n), k))
    held_set = set(held)
    return ds.select([i for i in range(n) if i not in held_set]), ds.select(held)


def ensure_chat_template(tokenizer) -> bool:
    """Give a tokenizer without a chat template llmft's simple default; returns True when it did."""
    if getattr(tokenizer, "chat_template", None):
        return False
    tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    return True

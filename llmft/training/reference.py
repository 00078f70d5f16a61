"""The reference model of a preference method (DPO, KTO): which one, built how, and its log-probs kept across jobs.

Three ways, each chosen by one function here and named in one log line (`choose_reference`):

- LoRA: the policy with its adapter disabled is the reference (TRL's own behaviour when `ref_model=None` and the
  model is a PEFT model): no second copy. When the run starts from an SFT LoRA adapter, the reference must be that
  SFT model, never the bare base (LLaMA-Factory #8459, #8974): `sft_adapter_source` recognises such a start and
  `merged_sft_model` merges the SFT adapter into the base weights once, into llmft's cache, so the run loads the
  merged SFT model as its base. The new DPO adapter then trains on top of it and "adapter disabled" is the SFT model.
- Full fine-tuning: TRL loads a second copy and wraps it with `trl.models.prepare_deepspeed`: under ZeRO-3 the copy is
  sharded like the policy (zero.Init while loading, then an inference engine with the run's ZeRO-3 config minus its
  optimizer, scheduler and optimizer offload; a parameter offload stays, so the reference is offloaded too); under
  ZeRO-0/1/2 it is a stage-0 replica on every rank. Checked against llmft's configs (TRL 1.16): the config TRL copies
  is the one llmft resolved, with no "auto" left; TRL's ZeRO-3 bucket and persistence sizes are set as dotted
  top-level keys ("zero_optimization.reduce_bucket_size"), which DeepSpeed ignores, but llmft's resolution gave the
  same values already (hidden^2, 0.9 hidden^2, 10 hidden: llmft.planning.ds_config.resolve). `describe_engine` logs
  the stage and this rank's share of the copy it got.
- `--precompute_ref_log_probs`: one pass before training (TRL's `_precompute_ref_logps`, run inside the trainer's
  constructor in TRL 1.16), kept in llmft's cache under `ref_logps/<key>/` (`ReferenceStore`). The key is the
  tokenised data's bytes, the reference weights' files (`weights_fingerprint`), max_length, the chat template and what
  else changes a log-prob (the TRL trainer, dtype, quantization, ld_alpha). A requeued, resumed or rerun job and a
  sweep's other elements find it there; it is written into a `.partial` directory and renamed into place once
  complete, so a job preempted after the pass never computes it again, and one preempted during it leaves nothing
  that a later job would take as complete.

Why the SFT adapter is merged rather than loaded as a second adapter: TRL can keep the SFT adapter as a frozen "ref"
adapter beside a trained copy (`model.add_adapter("ref", ...)` when a PeftModel arrives without a peft_config), but
that trains the SFT adapter itself further (the user's --lora_r/--lora_target_modules would be ignored) and copies
adapter weights with `param.data.copy_` before DeepSpeed sees the model, which under ZeRO-3 copies partitions of
parameters that zero.Init did or did not partition depending on when PEFT created them. Merging once on the CPU, in a
separate step before any DeepSpeed engine exists, gives a plain model directory: every ZeRO stage loads it as it loads
any base model (zero.Init partitions it under ZeRO-3), the reference is exact in every stage, and the merged weights
are content-keyed in the cache so every rank, job and sweep element shares one copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from llmft.checkpoint import loader
from llmft.checkpoint.run_dir import CheckpointError
from llmft.data.loading import cache_root
from llmft.errors import TrainError

STORE_VERSION = 1  # bump when what a stored reference holds changes
MARKER = "llmft_ref_logps.json"
MERGED_MARKER = "llmft_merged.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
STALE_PARTIAL_S = 24 * 3600  # a precompute's .partial directory untouched this long was left by a killed job
WAIT_S = 3600  # a rank waits this long for rank 0's merge of an SFT adapter


class ReferenceError(TrainError):
    """A reference that cannot be built as asked."""


# --------------------------------------------------------------------------------------------------
# Which reference


@dataclass(frozen=True)
class Reference:
    strategy: str  # "", "adapter_disabled", "sharded_copy", "replica", "precomputed"
    line: str  # the log line naming it ("" when the method has no reference)


def choose_reference(
    needs_reference: bool, *, use_peft: bool, zero_stage: int, precompute: bool, sft_model: str | None = None
) -> Reference:
    """The reference strategy, decided by the method (does it have a reference), LoRA, ZeRO stage and
    --precompute_ref_log_probs, with the log line that names it. Precomputing wins: no reference model is in
    memory while training (TRL frees it). Then LoRA's disabled adapter (no copy), then a copy: sharded under ZeRO-3,
    a stage-0 replica under ZeRO-0/1/2 (TRL's prepare_deepspeed)."""
    if not needs_reference:
        return Reference("", "")
    what = f"the SFT model {sft_model} (base + SFT adapter, merged)" if sft_model else None
    if precompute:
        source = what or ("the base model (LoRA adapter disabled)" if use_peft else "the initial policy weights")
        return Reference(
            "precomputed",
            f"reference: log-probs of {source} precomputed in one pass before training and kept in llmft's cache; "
            "no reference model in memory while training",
        )
    if use_peft:
        return Reference(
            "adapter_disabled",
            f"reference: the policy with its LoRA adapter disabled, i.e. {what or 'the base model'}; no second copy",
        )
    if zero_stage >= 3:
        return Reference(
            "sharded_copy",
            f"reference: a second copy of {what or 'the model'}, sharded for inference under ZeRO-3 like the policy "
            "(forward only: no gradients or optimizer state)",
        )
    return Reference(
        "replica",
        f"reference: a second copy of {what or 'the model'} on every rank (a stage-0 replica under ZeRO-{zero_stage}, "
        "forward only); --zero_stage 3 shards it, --precompute_ref_log_probs or LoRA drops it",
    )


def describe_engine(ref_model) -> str | None:
    """One line on the reference copy DeepSpeed built (TRL's prepare_deepspeed): its ZeRO stage and how much of it
    this rank holds, so a log shows the copy is sharded (ZeRO-3) or whole (stage 0); None without a copy."""
    stage = getattr(ref_model, "zero_optimization_stage", None)
    if not callable(stage):
        return None
    params = list(ref_model.module.parameters())
    total = sum(getattr(p, "ds_numel", p.numel()) for p in params)
    here = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params)
    return f"reference engine: ZeRO-{stage()}, {here} of its {total} parameters held on this rank"


def check_precompute(precompute: bool, trainer_class) -> None:
    """--precompute_ref_log_probs needs a trainer with TRL's precompute pass (DPO and KTO in TRL 1.16 have
    `_precompute_ref_logps`); anything else is refused in one line rather than ignored."""
    if precompute and not hasattr(trainer_class, "_precompute_ref_logps"):
        raise ReferenceError(
            f"--precompute_ref_log_probs: {trainer_class.__name__} has no reference log-probs to precompute; drop the flag"
        )


# --------------------------------------------------------------------------------------------------
# Starting from an SFT LoRA adapter


def sft_adapter_source(name: str) -> Path | None:
    """The directory of an SFT LoRA adapter the run starts from, or None for a plain model. Recognised as llmft
    export and llmft eval recognise one: a directory with adapter_config.json and no config.json (an SFT run's
    output, an exported adapter, a checkpoint-N), or an SFT run directory whose newest checkpoint holds an adapter."""
    path = Path(name).expanduser()
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    if (path / "adapter_config.json").is_file():
        return path
    try:
        tag, _ = loader.resolve_checkpoint([str(path)])
    except CheckpointError:
        return None
    return path if (tag.parent / "adapter_config.json").is_file() else None


def _file_digest(path: Path, memo: Path | None) -> str:
    """sha256 of a file's bytes. A Hugging Face hub snapshot's file links to a blob named by that sha256 (LFS), so it
    is read off the name; otherwise the digest is kept in `memo` under the file's path, size, inode, mtime and ctime
    (any write changes its ctime), so a rerun does not read an 8B model's weights again."""
    real = path.resolve()
    if path.is_symlink() and len(real.name) == 64 and all(c in "0123456789abcdef" for c in real.name):
        return real.name
    st = real.stat()
    key = f"{real}|{st.st_size}|{st.st_ino}|{st.st_mtime_ns}|{st.st_ctime_ns}"
    entry = memo / hashlib.sha256(key.encode()).hexdigest()[:32] if memo else None
    if entry is not None and entry.is_file():
        return entry.read_text().strip()
    h = hashlib.sha256()
    with open(real, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    digest = h.hexdigest()
    if entry is not None:
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            tmp = entry.with_name(f".{entry.name}.{os.getpid()}")
            tmp.write_text(digest + "\n")
            os.replace(tmp, entry)
        except OSError:  # a read-only cache: the digest is still right, only not kept
            pass
    return digest


def weights_fingerprint(directory: str | Path, memo: Path | None = None) -> str:
    """A hash of the weights a model directory holds: each weight file's name and bytes (`_file_digest`) and its
    config.json. Equal for copies of the same model (a node-local copy, a hub snapshot), different after any change
    to any weight. Checkpoint folders inside a run directory are not weights of the model and are left out."""
    root = Path(directory).expanduser()
    if not root.is_dir():
        raise ReferenceError(f"cannot hash the reference weights: {root} is not a directory")
    h = hashlib.sha256()
    files = sorted(
        p for p in root.iterdir() if p.is_file() and (p.suffix in WEIGHT_SUFFIXES or p.name.endswith("config.json"))
    )
    if not any(p.suffix in WEIGHT_SUFFIXES for p in files):
        raise ReferenceError(f"cannot hash the reference weights: no weight files in {root}")
    for p in files:
        h.update(p.name.encode() + b"\0" + _file_digest(p, memo).encode() + b"\0")
    return h.hexdigest()[:16]


def adapter_fingerprint(adapter: Path, memo: Path | None = None) -> str:
    """A hash of an SFT adapter's weights: its adapter files, or, when they live in the newest checkpoint's ZeRO
    shards, that checkpoint's shard files."""
    h = hashlib.sha256()
    files = [p for p in sorted(adapter.iterdir()) if p.is_file() and p.name.startswith("adapter_")]
    if not any(p.suffix in WEIGHT_SUFFIXES for p in files):
        tag, _ = loader.resolve_checkpoint([str(adapter)])
        files = [*files, *sorted(p for p in tag.rglob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES)]
    for p in files:
        h.update(p.name.encode() + b"\0" + _file_digest(p, memo).encode() + b"\0")
    return h.hexdigest()[:16]


def _adapter_base(adapter: Path) -> str:
    """The base model the adapter names (adapter_config.json's base_model_name_or_path)."""
    config = adapter / "adapter_config.json"
    if not config.is_file():  # a run directory: the adapter config is in its newest checkpoint
        tag, _ = loader.resolve_checkpoint([str(adapter)])
        config = tag.parent / "adapter_config.json"
    base = json.loads(config.read_text()).get("base_model_name_or_path")
    if not base:
        raise ReferenceError(f"{config} names no base_model_name_or_path: the SFT adapter's base model is unknown")
    return base


def _load_merged(adapter: Path, trust: bool):
    """The SFT model, base + adapter merged, in fp32 on the CPU: from the adapter files with PEFT, else from the
    checkpoint's ZeRO shards as llmft infer/eval read them (llmft.checkpoint.loader, exact fp32 masters)."""
    import torch

    if any((adapter / f).is_file() for f in ("adapter_model.safetensors", "adapter_model.bin")):
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        base_name = _adapter_base(adapter)
        base = AutoModelForCausalLM.from_pretrained(base_name, dtype=torch.float32, trust_remote_code=trust)
        model = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
        tok_dir = adapter if (adapter / "tokenizer_config.json").is_file() else base_name
        return model, AutoTokenizer.from_pretrained(str(tok_dir))
    loaded = loader.load_model(str(adapter), None, "cpu", torch.float32, trust)
    return loaded.model, loaded.tokenizer


def merged_sft_model(adapter: Path, *, trust: bool, rank0: bool, log: Callable[[str], None]) -> Path:
    """The SFT model (base + SFT adapter merged) as a model directory in llmft's cache, `sft_merged/<key>/`, keyed
    by the adapter's and the base's weights: rank 0 merges once (written as `.partial`, renamed when complete), the
    other ranks wait for it, and every later job, requeue and sweep element reuses it. Saved in the base's dtype."""
    memo = cache_root() / "file_hashes"
    base = _adapter_base(adapter)
    base_dir = Path(base).expanduser()
    base_key = weights_fingerprint(base_dir, memo) if base_dir.is_dir() else f"hub:{base}"
    key = hashlib.sha256(f"{STORE_VERSION}|{base_key}|{adapter_fingerprint(adapter, memo)}".encode()).hexdigest()[:16]
    final = cache_root() / "sft_merged" / key
    if (final / MERGED_MARKER).is_file():
        log(f"SFT adapter {adapter} merged into {base}: reusing {final}")
        return final
    if not rank0:
        deadline = time.time() + WAIT_S
        while not (final / MERGED_MARKER).is_file():
            if time.time() > deadline:
                raise ReferenceError(
                    f"waited {WAIT_S}s for rank 0 to merge the SFT adapter into {final}: is $LLMFT_CACHE on storage "
                    "every node sees?"
                )
            time.sleep(1)
        return final
    started = time.perf_counter()
    model, tokenizer = _load_merged(adapter, trust)
    partial = final.with_name(f"{key}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    dtype = getattr(model.config, "dtype", None) or getattr(model.config, "torch_dtype", None)
    if dtype is not None and not isinstance(dtype, str):
        model = model.to(dtype)
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    (partial / MERGED_MARKER).write_text(json.dumps({"adapter": str(adapter), "base": base, "key": key}) + "\n")
    try:
        os.rename(partial, final)
    except OSError:  # another job merged it first: the same bytes
        shutil.rmtree(partial, ignore_errors=True)
    log(f"SFT adapter {adapter} merged into {base} in {time.perf_counter() - started:.1f}s: {final}")
    return final


def merged_from(model_dir: str) -> str | None:
    """The SFT adapter a merged model directory of `merged_sft_model` was made from, or None for any other model."""
    marker = Path(model_dir) / MERGED_MARKER
    return json.loads(marker.read_text()).get("adapter") if marker.is_file() else None


# --------------------------------------------------------------------------------------------------
# Precomputed reference log-probs


def data_fingerprint(dataset) -> str:
    """A hash of the tokenised rows as the trainer will see them (TRL's prepared dataset: token ids after truncation,
    so max_length and the chat template are in it already), serialised column by column with Arrow's IPC format."""
    import pyarrow as pa

    table = dataset.with_format(None).data.table
    if getattr(dataset, "_indices", None) is not None:
        table = dataset.flatten_indices().data.table
    h = hashlib.sha256(json.dumps([table.num_rows, sorted(table.column_names)]).encode())
    for name in sorted(table.column_names):
        column = table.column(name)
        h.update(name.encode() + b"\0")
        for chunk in column.chunks:
            sink = pa.BufferOutputStream()
            batch = pa.record_batch([chunk], names=[name])
            with pa.ipc.new_stream(sink, batch.schema) as writer:
                writer.write_batch(batch)
            h.update(sink.getvalue().to_pybytes())
    return h.hexdigest()[:16]


@dataclass
class ReferenceStore:
    """Where precomputed reference log-probs live: `<root>/<key>/ref_logps.arrow` with a marker. `base_key` holds
    what is the same for every dataset of the run (reference weights, max_length, template, trainer, dtype...);
    `record` is what run_summary.json reports (computed or reused, seconds, bytes)."""

    root: Path
    base_key: dict
    weights_dir: str  # the directory the reference's weights load from
    log: Callable[[str], None]
    record: dict = field(default_factory=lambda: {"computed": 0, "reused": 0, "seconds": 0.0, "bytes": 0})

    def key(self, name: str, data: str) -> str:
        """The key of one dataset's log-probs; the weights are hashed here, on the rank that decides (rank 0), once."""
        if "weights" not in self.base_key:
            self.base_key["weights"] = weights_fingerprint(self.weights_dir, cache_root() / "file_hashes")
        blob = json.dumps({**self.base_key, "dataset": name, "data": data}, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def path(self, key: str) -> Path:
        return self.root / key

    def complete(self, key: str) -> bool:
        return (self.path(key) / MARKER).is_file()

    def partial(self, key: str, attempt: str) -> Path:
        """A fresh directory the pass writes into; renamed to the key's directory by `publish`. What a job killed
        during its pass left (a `.partial` untouched for STALE_PARTIAL_S) is removed first; a live pass is younger."""
        now = time.time()
        for old in self.root.glob("*.partial-*") if self.root.is_dir() else ():
            try:
                if now - old.stat().st_mtime > STALE_PARTIAL_S:
                    shutil.rmtree(old, ignore_errors=True)
            except OSError:  # removed by another job meanwhile
                pass
        p = self.root / f"{key}.partial-{attempt}"
        shutil.rmtree(p, ignore_errors=True)
        p.mkdir(parents=True)
        return p

    def publish(self, partial: Path, key: str, info: dict) -> Path:
        """Marker last, then one rename: a directory under the key's name is always complete. A concurrent job
        (a sweep's other element) that published first wins; this copy is dropped (the same values)."""
        (partial / MARKER).write_text(json.dumps(info, indent=2) + "\n")
        final = self.path(key)
        try:
            os.rename(partial, final)
        except OSError:
            shutil.rmtree(partial, ignore_errors=True)
        return final

    def size(self, key: str) -> int:
        return sum(p.stat().st_size for p in self.path(key).iterdir() if p.is_file())

    def note(self, name: str, key: str, computed: bool, seconds: float, rows: int) -> None:
        """The log line and run_summary.json's counters for one dataset's reference log-probs."""
        size = self.size(key)
        self.record["computed" if computed else "reused"] += 1
        self.record["seconds"] = round(self.record["seconds"] + seconds, 3)
        self.record["bytes"] += size
        self.record.setdefault("keys", {})[name] = key
        self.log(
            f"reference log-probs for {name} ({rows} rows, {size} bytes): "
            + (f"computed in {seconds:.1f}s, kept in" if computed else "reused from")
            + f" {self.path(key)}"
        )


def reference_store(
    *, weights_dir: str, trainer_class, args, tokenizer, dtype, quantized: bool, log: Callable[[str], None]
) -> ReferenceStore:
    """The store of this run's precomputed reference log-probs, keyed by everything but the data: the reference
    weights (`weights_fingerprint` of the directory the reference loads from), max_length, the chat template, the
    trainer, the weights' dtype and quantization, and the loss settings that change a reference log-prob."""
    root = cache_root() / "ref_logps"
    base_key = {
        "version": STORE_VERSION,
        "max_length": getattr(args, "max_length", None),
        "max_prompt_length": getattr(args, "max_prompt_length", None),
        "max_completion_length": getattr(args, "max_completion_length", None),
        "truncation_mode": getattr(args, "truncation_mode", None),
        "chat_template": hashlib.sha256(str(getattr(tokenizer, "chat_template", None)).encode()).hexdigest()[:16],
        "trainer": getattr(trainer_class, "__name__", str(trainer_class)),
        "dtype": str(dtype),
        "quantized": quantized,
        "ld_alpha": getattr(args, "ld_alpha", None),
        "use_logits_to_keep": getattr(args, "use_logits_to_keep", None),
    }
    return ReferenceStore(root, base_key, weights_dir, log)


def _first_path(dataset, target: str):
    """The dataset's cache-path function with its first answer replaced by `target`: TRL asks it once, first, for the
    file its pass writes; later calls (a map flattening an indices mapping) keep the dataset's own paths."""
    original, asked = dataset._get_cache_file_path, []

    def path(fingerprint):
        if asked:
            return original(fingerprint)
        asked.append(fingerprint)
        return target

    return path


def precompute_kept(trainer_class, store: ReferenceStore):
    """`trainer_class` with TRL's precompute pass (`_precompute_ref_logps`, called from its constructor in TRL
    1.16) routed through llmft's cache: on a hit the stored columns are added and TRL's pass is skipped; on a miss
    TRL computes them, writing straight into a `.partial` directory of the store on the shared cache (TRL's own
    location, beside the dataset's cache files, is a per-process temporary directory for data held in memory, which
    other ranks cannot read), then rank 0 publishes it and every rank reads the one published file."""

    class PrecomputeKept(trainer_class):
        def _precompute_ref_logps(self, dataset, name, batch_size):
            from accelerate.utils import broadcast_object_list
            from datasets import Dataset, concatenate_datasets

            acc = self.accelerator
            decided = [None]
            if acc.is_main_process:
                store.base_key["kl"] = getattr(self, "calculate_KL", None)  # KTO: the KL completions' log-probs too
                key = store.key(name, data_fingerprint(dataset))
                hit = store.complete(key)
                decided = [(key, hit, None if hit else store.partial(key, f"{os.getpid()}-{time.time_ns()}"))]
            broadcast_object_list(decided, from_process=0)  # one decision, every rank
            key, hit, partial = decided[0]
            started = time.perf_counter()
            if not hit:
                dataset._get_cache_file_path = _first_path(dataset, str(Path(partial) / "ref_logps.arrow"))
                try:
                    super()._precompute_ref_logps(dataset, name, batch_size)
                finally:
                    del dataset._get_cache_file_path
                acc.wait_for_everyone()  # every rank read the partial file: rank 0 may rename it
                if acc.is_main_process:
                    store.publish(Path(partial), key, {"dataset": name, "rows": len(dataset), **store.base_key})
                acc.wait_for_everyone()
            stored = store.path(key) / "ref_logps.arrow"
            if not stored.is_file():
                raise ReferenceError(
                    f"precomputed reference log-probs {stored} are not visible on this rank: put $LLMFT_CACHE on "
                    "storage every node sees"
                )
            if acc.is_main_process:
                store.note(name, key, not hit, time.perf_counter() - started, len(dataset))
            return concatenate_datasets([dataset, Dataset.from_file(str(stored))], axis=1)

    PrecomputeKept.__name__ = trainer_class.__name__
    PrecomputeKept.__qualname__ = trainer_class.__qualname__
    return PrecomputeKept

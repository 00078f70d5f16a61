"""Did the model get better? Perplexity on reference answers and exact match of the final answer.

```bash
llmft eval runs/x --dataset_name gsm8k_test.jsonl --prompt_column question --completion_column answer
llmft eval runs/x/checkpoint-100 runs/x/checkpoint-200 runs/y exported/ --dataset_name test.jsonl --limit 200
python -m llmft.eval runs/x --dataset_name openai/gsm8k --dataset_config main --prompt_column question \
    --completion_column answer --max_new_tokens 256 --batch_size 16 --output gsm8k.json
torchrun --nproc_per_node 4 -m llmft.eval runs/x --dataset_name test.jsonl   # records split over 4 GPUs
```

A checkpoint is a ZeRO `global_stepN` directory, a `checkpoint-N` directory or a run directory (its newest
complete checkpoint), read by llmft's inference loader without a DeepSpeed engine, or an exported Hugging
Face model directory. The data takes the formats and column mapping of training: prompt/completion (the
completion is the reference), chat (the last assistant message is the reference, the messages before it
the prompt) or plain text (perplexity only).

Metrics, as lm-evaluation-harness reports them for GSM8K:
  - perplexity: exp of the mean negative log-likelihood of the reference tokens given the prompt, tokenised
    exactly as training tokenises them (TRL's preparation, end-of-sequence token included);
  - exact_match_strict: the number after `####` in the output (`--answer_pattern` changes the extractor);
  - exact_match_flexible: the last number in the output;
both compared with the reference's answer after the harness's normalisation (commas, `$`, a trailing period
and case ignored). Generation is greedy, in left-padded batches, and stops at the end-of-sequence token.
One JSON per checkpoint (default: `eval-<data>-step<N>.json` in its run directory, where `llmft report`
finds it); several checkpoints also print a comparison table.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from llmft.checkpoint.loader import DTYPES, Model, generate, load_model, pick_device, pick_dtype
from llmft.checkpoint.zero import CheckpointError
from llmft.command import command_parser
from llmft.data import loading as data
from llmft.data.cache import attempt_id, trl_prepare
from llmft.data.loading import DataError
from llmft.errors import LlmftError
from llmft.planning.model_shape import model_positions
from llmft.training.metrics import perplexity

STRICT_PATTERN = r"#### (\-?[0-9\.\,]+)"  # lm-evaluation-harness gsm8k "strict-match"
FLEXIBLE_PATTERN = r"(-?[$0-9.,]{2,})|(-?[0-9]+)"  # gsm8k "flexible-extract", last match
IGNORE_REGEXES = (",", r"\$", r"(?s).*#### ", r"\.$")  # gsm8k exact_match regexes_to_ignore (ignore_case: true)


class EvalError(LlmftError, ValueError):
    """Evaluation cannot run as asked; the message names the problem and the fix."""


# --------------------------------------------------------------------------------------------------
# Scoring (pure)


def extract(pattern: str | re.Pattern, text: str, select: int = 0) -> str | None:
    """The harness's regex filter: all matches, the `select`-th (0 first, -1 last), the first non-empty group."""
    matches = re.findall(pattern, text)
    if not matches:
        return None
    match = matches[select]
    if isinstance(match, tuple):
        match = next((m for m in match if m), "")
    return match.strip()


def normalize(answer: str) -> str:
    """The harness's exact_match for GSM8K: drop the ignored regexes, then compare case-insensitively."""
    for regex in IGNORE_REGEXES:
        answer = re.sub(regex, "", answer)
    return answer.lower()


def reference_answer(reference: str, pattern: str = STRICT_PATTERN) -> str:
    """The answer a reference states: what the extractor finds in it, else its last number, else all of it."""
    found = extract(pattern, reference, 0)
    if found is None:
        found = extract(FLEXIBLE_PATTERN, reference, -1)
    return normalize(found if found is not None else reference)


def score(prediction: str, reference: str, pattern: str = STRICT_PATTERN) -> tuple[bool, bool]:
    """(strict, flexible) exact match of one prediction."""
    target = reference_answer(reference, pattern)
    strict = extract(pattern, prediction, 0)
    flexible = extract(FLEXIBLE_PATTERN, prediction, -1)
    return (strict is not None and normalize(strict) == target, flexible is not None and normalize(flexible) == target)








# --------------------------------------------------------------------------------------------------
# Data: prompts and references from the training formats


@dataclass
class Example:
    prompt: object  # a string, or the chat messages before the reference
    reference: object  # a string, or the reference assistant message
    prompt_text: str | None  # what generation starts from (None: plain text, nothing to generate)
    reference_text: str


def load_examples(args, tokenizer) -> tuple[list[Example], str]:
    """Records in one of the training shapes, mapped with the training column options, first --limit of them."""
    ds = data.load_train_split(args.dataset_name, args.dataset_config, args.dataset_split)
    ds, shape = data.shape_for_sft(ds, prompt_column=args.prompt_column, completion_column=args.completion_column,
                                   messages_column=args.messages_column, text_field=args.dataset_text_field)
    if args.limit is not None:
        ds = ds.select(range(min(args.limit, len(ds))))
    if shape == "messages":
        data.ensure_chat_template(tokenizer)
    examples = []
    for i, row in enumerate(ds):
        if shape == "prompt_completion":
            examples.append(Example(row["prompt"], row["completion"], row["prompt"], row["completion"]))
        elif shape == "messages":
            messages = row["messages"]
            if not messages or messages[-1].get("role") != "assistant" or len(messages) < 2:
                raise EvalError(f"record {i} of {args.dataset_name} does not end with an assistant message after a prompt: "
                                "the last assistant message is the reference answer")
            prompt_text = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
            examples.append(Example(messages[:-1], messages[-1], prompt_text, messages[-1]["content"]))
        else:
            examples.append(Example(None, row[args.dataset_text_field], None, row[args.dataset_text_field]))
    return examples, shape


def scoring_dataset(examples: list[Example], shape: str, text_field: str):
    """The examples as TRL prompt/completion (or text) records: the loss mask then covers the reference only."""
    from datasets import Dataset

    if shape == "text":
        return Dataset.from_dict({text_field: [e.reference for e in examples]})
    if shape == "messages":
        return Dataset.from_list([{"prompt": e.prompt, "completion": [e.reference]} for e in examples])
    return Dataset.from_dict({"prompt": [e.prompt for e in examples], "completion": [e.reference for e in examples]})


def tokenise_for_scoring(examples: list[Example], shape: str, tokenizer, text_field: str, max_length: int | None):
    """input_ids and labels per example, by TRL's own preparation (as training tokenises), without packing,
    truncated to `max_length` (the model's positions) from the end."""
    import tempfile

    from trl import SFTConfig


    if not examples:
        return []
    with tempfile.TemporaryDirectory() as tmp, _quiet_datasets():
        # max_length None here: TRL would drop examples truncation leaves without a scored token; they stay, scoring 0.
        args = SFTConfig(output_dir=tmp, report_to="none", activation_checkpointing=False, bf16=False, use_cpu=True, max_length=None,
                         dataset_text_field=text_field, packing=False, completion_only_loss=True)
        prepared = trl_prepare(scoring_dataset(examples, shape, text_field), tokenizer, args, packing=False, name="eval",
                               completion_only=True)
    cut = slice(None, max_length)
    return [(row["input_ids"][cut], row["labels"][cut]) for row in prepared]


@contextlib.contextmanager
def _quiet_datasets():
    import datasets

    enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if enabled:
            datasets.enable_progress_bars()


# --------------------------------------------------------------------------------------------------
# Model: ZeRO checkpoint (llmft's inference loader) or an exported directory












# --------------------------------------------------------------------------------------------------
# Evaluation


def nll_per_example(model, tokenizer, scored: list[tuple[list[int], list[int]]], batch_size: int) -> list[tuple[float, int]]:
    """(sum of negative log-likelihoods, tokens) over each example's labelled tokens: teacher forcing, right padding."""
    import torch
    import torch.nn.functional as F

    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = []
    for start in range(0, len(scored), batch_size):
        batch = scored[start : start + batch_size]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (x, y) in enumerate(batch):
            ids[i, : len(x)] = torch.tensor(x)
            labels[i, : len(y)] = torch.tensor(y)
            mask[i, : len(x)] = 1
        ids, labels, mask = ids.to(device), labels.to(device), mask.to(device)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
        shift_logits, shift_labels = logits[:, :-1], labels[:, 1:]
        loss = F.cross_entropy(shift_logits.transpose(1, 2), shift_labels, ignore_index=-100, reduction="none")
        counted = shift_labels != -100
        for i in range(len(batch)):
            out.append((float(loss[i][counted[i]].sum()), int(counted[i].sum())))
    return out


def stop_at_eos(model, tokenizer) -> list[int]:
    """Generation stops at the tokenizer's end-of-sequence token as well as the model's own (chat models often
    end a turn with a token the bare config does not name); returns the ids."""
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    model.generation_config.eos_token_id = ids
    return ids


def evaluate_examples(m: Model, examples: list[Example], shape: str, args, pattern: str) -> list[dict]:
    """Per example: prompt, reference, prediction, strict/flexible correctness, and its NLL and token count."""

    tokenizer = m.tokenizer
    positions = model_positions(m.model.config)
    scored = tokenise_for_scoring(examples, shape, tokenizer, args.dataset_text_field, positions)
    nll = nll_per_example(m.model, tokenizer, scored, args.batch_size)
    predictions: list[str | None] = [None] * len(examples)
    stop_at_eos(m.model, tokenizer)
    todo = [i for i, e in enumerate(examples) if e.prompt_text is not None]
    too_long = []
    if positions and args.max_new_tokens >= positions:
        raise EvalError(f"--max_new_tokens {args.max_new_tokens} exceeds the model's {positions} positions: lower --max_new_tokens")
    if positions:  # a prompt with no room for --max_new_tokens is not generated for (counted), the others are
        lengths = {i: len(tokenizer(examples[i].prompt_text)["input_ids"]) for i in todo}
        too_long = [i for i in todo if lengths[i] + args.max_new_tokens > positions]
        todo = [i for i in todo if i not in set(too_long)]
        if too_long:
            print(f"llmft eval: {len(too_long)} of {len(examples)} records skipped for generation: their prompt "
                  f"(up to {max(lengths[i] for i in too_long)} tokens) + --max_new_tokens {args.max_new_tokens} exceeds the "
                  f"model's {positions} positions (their perplexity still counts); lower --max_new_tokens to score more",
                  file=sys.stderr, flush=True)
    for start in range(0, len(todo), args.batch_size):
        chunk = todo[start : start + args.batch_size]
        gens = generate(m.model, tokenizer, [examples[i].prompt_text for i in chunk], max_new_tokens=args.max_new_tokens)
        for i, g in zip(chunk, gens):
            predictions[i] = g["completion"]
    results = []
    for e, pred, (loss, tokens) in zip(examples, predictions, nll):
        strict, flexible = score(pred, e.reference_text, pattern) if pred is not None else (None, None)
        results.append({"prompt": e.prompt_text if e.prompt_text is not None else "", "reference": e.reference_text,
                        "prediction": pred, "correct_strict": strict, "correct_flexible": flexible, "_nll": loss, "_tokens": tokens})
    for i in too_long:
        results[i]["skipped"] = "prompt too long"
    return results


def summarise(checkpoint: str, step: int | None, results: list[dict]) -> dict:
    """The output document: metrics over all examples, then the examples (without the scoring internals)."""
    tokens = sum(r["_tokens"] for r in results)
    generated = [r for r in results if r["prediction"] is not None]
    def rate(key):
        return sum(bool(r[key]) for r in generated) / len(generated) if generated else None
    metrics = {"perplexity": perplexity(sum(r["_nll"] for r in results), tokens), "exact_match_strict": rate("correct_strict"),
               "exact_match_flexible": rate("correct_flexible"), "n": len(results),
               "skipped_too_long": sum(1 for r in results if r.get("skipped"))}
    examples = [{k: v for k, v in r.items() if not k.startswith("_")} for r in results]
    return {"checkpoint": checkpoint, "step": step, "metrics": metrics, "examples": examples}


# --------------------------------------------------------------------------------------------------
# Several processes: each scores every world-th record, rank 0 merges (files, no process group)


def shard(n: int, rank: int, world: int) -> list[int]:
    return list(range(rank, n, world))


def ranks(env) -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun, else from srun's task variables, else a world of one."""
    def get(names, default):
        return int(next((env[n] for n in names if env.get(n, "").strip()), default))
    return (get(("RANK", "SLURM_PROCID"), 0), get(("WORLD_SIZE", "SLURM_NTASKS"), 1), get(("LOCAL_RANK", "SLURM_LOCALID"), 0))


def _fresh_part(path: Path, since: float) -> dict | None:
    """A rank's results written by this launch (not a leftover of an earlier, failed one)."""
    try:
        part = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return part["results"] if part.get("time", 0) >= since - 10 else None


def _wait_for_parts(parts: list[Path], since: float, timeout: float) -> list[dict]:
    deadline = time.time() + timeout
    while True:
        found = [_fresh_part(p, since) for p in parts]
        if all(f is not None for f in found):
            return found
        if time.time() > deadline:
            missing = next(str(p) for p, f in zip(parts, found) if f is None)
            raise EvalError(f"waited {timeout:.0f}s for the other ranks' results ({missing} missing): "
                            "did a rank fail, or is the output on storage every node shares?")
        time.sleep(0.5)


# --------------------------------------------------------------------------------------------------
# CLI


def make_parser(subparsers=None):

    parser = command_parser(subparsers, "eval", "Perplexity and exact match of one or more checkpoints on a dataset.")
    parser.add_argument("checkpoint", nargs="+", help="global_stepN dir, checkpoint-N dir, run dir or exported model dir (several: compared)")
    parser.add_argument("--dataset_name", required=True, help="a .jsonl/.json/.parquet/.csv file or directory, or a hub dataset")
    parser.add_argument("--dataset_config", default=None, help="hub dataset configuration (e.g. main for openai/gsm8k)")
    parser.add_argument("--dataset_split", default="test", help="split of a hub dataset or a directory (default test)")
    parser.add_argument("--prompt_column", default=None, help="field holding the prompt (e.g. question)")
    parser.add_argument("--completion_column", default=None, help="field holding the reference answer (e.g. answer)")
    parser.add_argument("--messages_column", default=None, help="field holding chat messages")
    parser.add_argument("--dataset_text_field", default="text", help="field holding plain text (perplexity only)")
    parser.add_argument("--limit", type=int, default=None, help="evaluate the first N records")
    parser.add_argument("--max_new_tokens", type=int, default=256)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--answer_pattern", default=STRICT_PATTERN,
                        help=f"regex whose first group is the final answer, for exact_match_strict (default GSM8K: {STRICT_PATTERN!r})")
    parser.add_argument("--output", type=Path, default=None,
                        help="JSON file (one checkpoint) or directory (several); default: eval-<data>-step<N>.json in each run directory")
    parser.add_argument("--model_name", "--model_name_or_path", dest="model_name", default=None,
                        help="base model for config and tokenizer (plain DeepSpeed checkpoints)")
    parser.add_argument("--device", default=None, help="cuda:<local rank> when available, else cpu")
    parser.add_argument("--dtype", default="auto", help="auto: bf16 on Ampere+ GPUs, fp16 on older ones, fp32 on CPU")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds rank 0 waits for the other ranks' results")
    parser.add_argument("--trust_checkpoint", action="store_true", help="unpickle shards with full pickle (only for checkpoints you trust)")
    parser.set_defaults(func=main)
    return parser


def check_args(args) -> None:
    """Bad numbers and patterns, before any model loads."""
    if args.limit is not None and args.limit < 1:
        raise EvalError(f"--limit must be at least 1, got {args.limit}")
    if args.max_new_tokens < 1:
        raise EvalError(f"--max_new_tokens must be at least 1, got {args.max_new_tokens}")
    if args.batch_size < 1:
        raise EvalError(f"--batch_size must be at least 1, got {args.batch_size}")
    try:
        re.compile(args.answer_pattern)
    except re.error as e:
        raise EvalError(f"--answer_pattern {args.answer_pattern!r} is not a valid regular expression ({e})") from None

    if args.dtype != "auto" and args.dtype not in DTYPES:
        raise EvalError(f"--dtype {args.dtype}: use auto, float32, bfloat16 or float16")
    if args.output is not None and len(args.checkpoint) > 1 and args.output.suffix == ".json":
        raise EvalError(f"--output {args.output}: with {len(args.checkpoint)} checkpoints it names a directory (one JSON each), not a .json file")


def output_path(args, m: Model, index: int) -> Path:
    data_name = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(args.dataset_name.rstrip("/")).stem or "data")
    name = f"eval-{data_name}" + (f"-step{m.step}" if m.step is not None else "") + ".json"
    if args.output is None:
        return m.run_dir / name
    if len(args.checkpoint) == 1:
        return args.output
    return args.output / f"{index:02d}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', m.run_dir.name)}-{name}"


def table(rows: list[dict]) -> str:
    """The comparison of several checkpoints, one line each."""
    def fmt(v, pct=False):
        return "-" if v is None else (f"{100 * v:.1f}%" if pct else f"{v:.3f}")
    lines = [f"{'checkpoint':<60} {'step':>6} {'perplexity':>11} {'strict':>8} {'flexible':>9} {'n':>5}"]
    for r in rows:
        m = r["metrics"]
        lines.append(f"{r['checkpoint'][-60:]:<60} {str(r['step']):>6} {fmt(m['perplexity']):>11} "
                     f"{fmt(m['exact_match_strict'], True):>8} {fmt(m['exact_match_flexible'], True):>9} {m['n']:>5}")
    return "\n".join(lines)


def run(args, env=None) -> list[dict]:
    """Evaluate each checkpoint; returns the documents rank 0 wrote (other ranks: [])."""

    env = os.environ if env is None else env
    rank, world, local_rank = ranks(env)
    since = time.time()
    say = (lambda msg: print(f"llmft eval: {msg}", file=sys.stderr, flush=True)) if rank == 0 else (lambda msg: None)
    check_args(args)
    device = pick_device(args.device or (f"cuda:{local_rank}" if _cuda() else None))
    dtype = pick_dtype(args.dtype if args.dtype != "auto" else None, device, exporting=False)
    documents = []
    for index, path in enumerate(args.checkpoint):
        t0 = time.time()
        try:
            m = load_model(path, args.model_name, device, dtype, args.trust_checkpoint)
            examples, shape = load_examples(args, m.tokenizer)
        except (CheckpointError, DataError) as e:
            raise EvalError(str(e)) from None
        mine = shard(len(examples), rank, world)
        say(f"{m.checkpoint} (step {m.step}): {len(examples)} {shape} records on {device}"
            + (f", {world} ranks" if world > 1 else ""))
        results = evaluate_examples(m, [examples[i] for i in mine], shape, args, args.answer_pattern)
        out = output_path(args, m, index)
        if world > 1:
            tag = attempt_id(env) + env.get("SLURM_STEP_ID", "")
            parts = [out.with_name(f".{out.name}.{tag}.part{r}-of-{world}") for r in range(world)]
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = parts[rank].with_name(parts[rank].name + ".tmp")
            tmp.write_text(json.dumps({"time": time.time(), "results": dict(zip(map(str, mine), results))}))
            os.replace(tmp, parts[rank])
            if rank != 0:
                continue
            merged = {}
            for part in _wait_for_parts(parts, since, args.timeout):
                merged.update(part)
            results = [merged[str(i)] for i in range(len(examples))]
            for p in parts:
                p.unlink(missing_ok=True)
        doc = summarise(m.checkpoint, m.step, results)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=2) + "\n")
        mt = doc["metrics"]
        say(f"perplexity {_fmt(mt['perplexity'])} exact_match strict {_fmt(mt['exact_match_strict'])} flexible "
            f"{_fmt(mt['exact_match_flexible'])} n {mt['n']} in {time.time() - t0:.1f}s -> {out}")
        documents.append(doc)
        del m
    if rank == 0 and len(documents) > 1:
        print(table(documents), flush=True)
    return documents


def _fmt(v):
    return "-" if v is None else f"{v:.4f}"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(args) -> int:

    try:
        run(args)
    except (EvalError, CheckpointError) as e:
        if ranks(os.environ)[0] == 0:
            print(f"llmft eval: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    return 0


if __name__ == "__main__":
    sys.exit(main(make_parser().parse_args()))

"""The GPU measurement in one prepared run (issue 31): the numbers that matter most first, each kept as soon as it exists.

    python bench/gpu_suite.py --out runs/gpu_suite               # on the GPU machine: about 9 minutes (--budget_s)
    python bench/gpu_suite.py --dry_run --out /tmp/gpu_suite     # the same code path on CPU, tiny model (a test runs it)

In order of priority, each a real `llmft train` (one process, this machine's GPU) or the plain TRL + DeepSpeed script
(bench/plain_trl_sft.py, with the DeepSpeed config llmft wrote for the same setting, so the ZeRO stage, batch numbers
and optimizer are the same), on the same model, data, batch numbers and steps:

1. default:  llmft's default path (padding-free where a varlen kernel runs) vs plain TRL, padded;
2. packed:   llmft --packing vs plain TRL packing=True;
3. levers:   on the packed run (Liger's kernels on by default where installed): no recomputation, Liger off,
             all levers at once (no recomputation and torch.compile), micro-batch 16 against 8;
4. 8b-lora:  a Llama-3.1-8B-shaped model, LoRA r=16 on every linear layer, sequence 4096, packed, gradient
             checkpointing: tokens/s per GPU and peak memory against `llmft plan`'s estimate; then without
             recomputation at micro-batch 1 (the same 8 sequences an optimizer step), then that with torch.compile;
5. startup:  llmft's install step (`llmft prebuild`: DeepSpeed reinstalled from source with FusedAdam and CPUAdam
             built in), timed, then a default run whose op cache is empty (a fresh node after that install step):
             its start-up phases, against the 67 s (40 of them building FusedAdam) measured on an H100 before. The
             first run of the suite (default) is the job before the install step: it compiles FusedAdam itself.

The 1-4 model is Llama-3.2-1B's shape (1.24B parameters, vocabulary 128,256, tied embeddings), built from its config
with random bf16 weights. The data is GSM8K's training split (7,473 problems, bench/data/gsm8k_train.jsonl.gz: the
file openai/grade-school-math publishes under the MIT licence, the same records as the hub's openai/gsm8k `main`
train split) as prompt/completion records. Its tokenizer is a byte-level BPE trained on that text (at most 32,000
tokens; the text has merges for 23,424) with Llama 3's pre-tokenizer split (words, numbers in groups of up to 3
digits), because Llama 3's own tokenizer comes from the hub, which the GPU machine cannot reach: a problem is 156
tokens on average and 458 at most (1.58 tokens a word, the calculator annotations included), a real tokenizer's
counts, not exactly Llama 3's.
Sequence 2048, micro-batch 8 x accumulation 4 (the 2026-11-24 measurement's numbers), --steps optimizer steps.

Each run prints and appends to OUT/results.jsonl: non-padding tokens/s, MFU, peak allocated GPU memory, and
`llmft plan`'s estimate for the same setting; rates leave out the first optimizer step (warm-up: llmft's
run_summary.json does; the plain script's --summary measures the same window). OUT/table.md is rewritten after each
run, ratios side by side. A run past --budget_s is not started; one that fails is recorded with its error and the
suite goes on. On a machine without CUDA only --dry_run runs (a tiny Llama, the first 200 problems and a 512-token
BPE, sequence 256, 3 steps; Liger absent
on CPU is a row that says so, and the start-up run uses the warm op cache: a cold build is a minute of CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchlib import PYTHON, REPO, environment, run

SHAPES = {  # published configs (their hub ids are what users train); random weights are built from them
    "llama-3.2-1b": dict(  # meta-llama/Llama-3.2-1B
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=128256,
        tie_word_embeddings=True,
        rope_theta=500000.0,
    ),
    "llama-3.1-8b": dict(  # meta-llama/Llama-3.1-8B
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        tie_word_embeddings=False,
        rope_theta=500000.0,
    ),
    "tiny-llama": dict(  # --dry_run
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=512,
        tie_word_embeddings=True,
    ),
}
PREBUILD_S = 360  # the install step's least time: on an H200 machine it was still compiling after 134 s (2026-11-27)
STARTUP_BEFORE_S = 67  # an H100's first job on a fresh node, 40 s of it building FusedAdam (issue 31)


@dataclass
class Setting:
    """One row: who trains (llmft or plain), on what, with which flags."""

    name: str
    who: str  # "llmft" | "plain" | "prebuild" (the install step, timed)
    model: str  # a SHAPES key
    max_length: int
    micro_batch: int
    grad_accum: int
    packing: bool = False
    flags: list[str] = field(default_factory=list)  # more llmft train flags
    env: dict = field(default_factory=dict)
    requires: str | None = None  # a module the setting needs (liger_kernel)
    pair: str | None = None  # the llmft row a plain row is compared with


def settings(dry: bool) -> list[Setting]:
    """The suite's runs in order of priority (--dry_run: the same list on the tiny model and small numbers)."""
    small = "tiny-llama" if dry else "llama-3.2-1b"
    big = "tiny-llama" if dry else "llama-3.1-8b"
    seq, big_seq = (256, 512) if dry else (2048, 4096)
    mb, acc = (2, 2) if dry else (8, 4)
    lora = ["--use_peft", "--lora_r", "16", "--lora_alpha", "32", "--lora_target_modules", "all-linear"]

    def lever(name: str, *flags: str, requires: str | None = None) -> Setting:
        return Setting(name, "llmft", small, seq, mb, acc, True, list(flags), requires=requires, pair="packed")

    return [
        Setting("default", "llmft", small, seq, mb, acc),
        Setting("default-plain", "plain", small, seq, mb, acc, pair="default"),
        Setting("packed", "llmft", small, seq, mb, acc, packing=True),
        Setting("packed-plain", "plain", small, seq, mb, acc, packing=True, pair="packed"),
        # the MFU levers, each a variant of the packed run:
        lever("packed-no-ckpt", "--gradient_checkpointing", "false"),  # TRL's default recomputes every layer
        # Liger is on by default where it runs (llmft.planning.hardware.choose_liger): its gain
        lever("packed-no-liger", "--use_liger_kernel", "false", requires="liger_kernel"),
        lever("packed-fast", "--gradient_checkpointing", "false", "--torch_compile", "true"),  # all at once
        Setting("packed-micro16", "llmft", small, seq, 2 * mb, acc // 2, True, pair="packed"),
        Setting("8b-lora", "llmft", big, big_seq, 1 if dry else 2, acc, True, [*lora, "--gradient_checkpointing"]),
        Setting(  # no recomputation: `llmft plan` puts micro-batch 1 at 56 GiB on an H100, micro-batch 2 over 80
            "8b-lora-no-ckpt",
            "llmft",
            big,
            big_seq,
            1,
            2 * acc if not dry else acc,
            True,
            [*lora, "--gradient_checkpointing", "false"],
            pair="8b-lora",
        ),
        Setting(  # and torch.compile: the lever not yet measured at 8B (1.30x on the 1B packed run)
            "8b-lora-fast",
            "llmft",
            big,
            big_seq,
            1,
            2 * acc if not dry else acc,
            True,
            [*lora, "--gradient_checkpointing", "false", "--torch_compile", "true"],
            pair="8b-lora-no-ckpt",
        ),
        Setting("prebuild", "prebuild", small, seq, mb, acc),  # llmft's install step: `llmft prebuild`
        Setting("startup", "llmft", small, seq, mb, acc, env={"cold_op_cache": "1"}),
    ]


def build_model(root: Path, name: str, tokenizer, device: str) -> Path:
    """A Llama of SHAPES[name] with random bf16 weights (fp32 for the CPU dry run) and the local tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = root / "models" / name
    if (out / "config.json").is_file():
        return out
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config = LlamaConfig(
        **SHAPES[name],
        max_position_embeddings=8192,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype=str(dtype).replace("torch.", ""),
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    return out


GSM8K = Path(__file__).parent / "data" / "gsm8k_train.jsonl.gz"
# Llama 3's pre-tokenizer split (its tokenizer.json): contractions, words, 1-3 digit numbers, punctuation, spaces
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def gsm8k(path: Path, n: int | None = None) -> Path:
    """GSM8K's training split as prompt/completion records ("Question: ...\\nAnswer:" and the worked answer ending in
    "#### N"), the first n problems (None: all 7,473)."""
    import gzip

    from llmft.data.synthetic import write_jsonl

    with gzip.open(GSM8K, "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f][:n]
    rows = [{"prompt": f"Question: {p['question']}\nAnswer:", "completion": f" {p['answer']}"} for p in problems]
    return write_jsonl(rows, path)


def gsm8k_tokenizer(data: Path, vocab_size: int):
    """A byte-level BPE of vocab_size tokens trained on the records' text, split as Llama 3 splits before BPE."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [r["prompt"] + r["completion"] for r in map(json.loads, data.read_text().splitlines())]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")


def llmft_command(s: Setting, model: Path, data: Path, out: Path, steps: int) -> list[str]:
    return [
        PYTHON,
        "-m",
        "llmft.train",
        "--model_name_or_path",
        str(model),
        "--dataset_name",
        str(data),
        "--output_dir",
        str(out),
        "--max_length",
        str(s.max_length),
        "--per_device_train_batch_size",
        str(s.micro_batch),
        "--global_batch_size",
        str(s.micro_batch * s.grad_accum),
        "--max_steps",
        str(steps),
        "--zero_stage",
        "2",
        "--save_strategy",
        "no",
        "--logging_steps",
        "1",
        "--learning_rate",
        "1e-4",
        "--report_to",
        "none",
        "--disable_tqdm",
        "true",
        *(["--packing", "true"] if s.packing else []),
        *s.flags,
    ]


def plain_command(s: Setting, model: Path, data: Path, out: Path, steps: int, ds_config: Path) -> list[str]:
    """The plain script as a user starts it: under torchrun (alone, DeepSpeed looks for MPI)."""
    return [
        PYTHON,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "1",
        str(REPO / "bench" / "plain_trl_sft.py"),
        str(model),
        str(data),
        str(out),
        str(ds_config),
        "--micro_batch",
        str(s.micro_batch),
        "--grad_accum",
        str(s.grad_accum),
        "--max_steps",
        str(steps),
        "--learning_rate",
        "1e-4",
        "--logging_steps",
        "1",
        "--max_length",
        str(s.max_length),
        *(["--packing"] if s.packing else []),
        "--summary",
        str(out / "plain_summary.json"),
    ]


def plan_estimate(s: Setting, model: Path) -> float | None:
    """`llmft plan`'s per-GPU allocated estimate for the setting (GiB): model states + activations + loss buffers
    + phase (the peak is the larger of the backward and ZeRO-2's optimizer step, not the sum)."""
    import subprocess

    cmd = [PYTHON, "-m", "llmft.plan", "--model", str(model), "--nproc_per_node", "1", "--nnodes", "1"]
    cmd += [
        "--zero_stage",
        "2",
        "--per_device_train_batch_size",
        str(s.micro_batch),
        "--max_length",
        str(s.max_length),
    ]
    cmd += ["--global_batch_size", str(s.micro_batch * s.grad_accum), "--json"]
    cmd += ["--gradient_checkpointing", checkpointing(s.flags)]
    if "--use_peft" in s.flags:
        cmd += ["--use_peft", "--lora_target_modules", "all-linear"]
    if "--use_liger_kernel" in s.flags:  # else the plan counts Liger's kernels as llmft train turns them on
        cmd += ["--use_liger_kernel", s.flags[s.flags.index("--use_liger_kernel") + 1]]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    try:
        row = json.loads(proc.stdout)["recommended"]
        return row["model_states_gib"] + row["activations_gib"] + row["loss_buffers_gib"] + row["phase_gib"]
    except (ValueError, KeyError, TypeError):
        print(f"gpu_suite: no plan estimate for {s.name}: {(proc.stderr or proc.stdout).strip()[-300:]}", flush=True)
        return None


def checkpointing(flags: list[str]) -> str:
    """The run's gradient checkpointing, as `llmft plan` takes it: on (TRL's SFTConfig default, which llmft train
    keeps) unless the flags turn it off."""
    if "--gradient_checkpointing" in flags:
        i = flags.index("--gradient_checkpointing")
        value = flags[i + 1] if i + 1 < len(flags) and not flags[i + 1].startswith("--") else "true"
        return "false" if value.lower() == "false" else "true"
    return "true"


def free_disk(out: Path, models: Path, needed: set[str]) -> None:
    """Weights and checkpoints a measured run wrote, and the models no later setting trains, removed: a lent GPU
    machine's disk held the 8B model (16 GB) and the 1B runs' saves only until the 2026-11-27 call filled it."""
    import shutil

    for path in sorted(out.rglob("*"), reverse=True):
        if path.is_file() and path.stat().st_size > 50 * 2**20:
            path.unlink()
    for model in models.iterdir() if models.is_dir() else ():
        if model.name not in needed:
            shutil.rmtree(model)


def measured(s: Setting, out: Path) -> dict:
    """The rates a finished run wrote: llmft's run_summary.json, or the plain script's --summary."""
    summary = json.loads((out / ("plain_summary.json" if s.who == "plain" else "run_summary.json")).read_text())
    keys = ("tokens_per_second", "padded_tokens_per_second", "tflops_per_gpu", "mfu", "peak_gpu_memory_gib")
    row = {k: summary.get(k) for k in keys}
    if s.who == "llmft":
        row["startup_seconds"] = summary.get("startup_seconds")
    return row


def reserved_peak(stdout: str) -> float | None:
    """Rank 0's torch.cuda.max_memory_reserved from llmft's end-of-run line (llmft.training.host_memory): what the
    allocator held beyond the allocated peak is what the planner's 10% fragmentation allowance must cover."""
    import re

    found = re.search(r"GPU memory peak: rank 0 [\d.]+ GiB allocated, ([\d.]+) GiB reserved", stdout)
    return float(found.group(1)) if found else None


def table(rows: list[dict], head: str) -> str:
    """The markdown table of the rows so far, each plain row and lever beside the llmft row it is compared with."""
    by_name = {r["name"]: r for r in rows}
    lines = [
        head,
        "",
        "| run | tokens/s | MFU | peak GiB (allocated / reserved) | plan GiB (allocated) | vs | ratio | start-up s | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("error") or r["who"] == "prebuild":
            said = r.get("error") or (r["said"][-1] if r["said"] else "")
            lines.append(f"| {r['name']} | {said} | | | | | | | {r.get('wall', 0):.0f} |")
            continue
        base = by_name.get(r.get("pair") or "")
        ratio = ""
        if base and not base.get("error") and base.get("tokens_per_second"):
            # plain rows: llmft / plain (>= 1.0 is the goal); levers: lever / packed
            ratio = (
                f"{base['tokens_per_second'] / r['tokens_per_second']:.2f}x (llmft / plain)"
                if r["who"] == "plain"
                else f"{r['tokens_per_second'] / base['tokens_per_second']:.2f}x"
            )
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "n/a"
        peak = f"{r['peak_gpu_memory_gib']:.1f}" if r.get("peak_gpu_memory_gib") is not None else "n/a"
        if r.get("reserved_gib") is not None:
            peak += f" / {r['reserved_gib']:.1f}"
        plan = f"{r['plan_gib']:.1f}" if r.get("plan_gib") is not None else "n/a"
        startup = sum((r.get("startup_seconds") or {}).values())
        lines.append(
            f"| {r['name']} | {r['tokens_per_second']:.0f} | {mfu} | {peak} | {plan} | {r.get('pair') or ''} | {ratio} "
            f"| {startup:.0f} | {r['wall']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "runs" / "gpu_suite", help="models, data and runs (gigabytes)")
    p.add_argument(
        "--results",
        type=Path,
        default=None,
        help="where results.jsonl, table.md, log.txt and each run's summary go as they come (default: --out); a "
        "device call's $OUT, which brings back what is there even when the call is cut short",
    )
    p.add_argument("--dry_run", action="store_true", help="the same code path on CPU with a tiny Llama")
    p.add_argument("--budget_s", type=float, default=540, help="start no run past this many seconds")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 12; dry run 3)")
    p.add_argument("--only", nargs="+", default=None, help="run only these settings (names from the table)")
    a = p.parse_args()
    unknown = sorted(set(a.only or ()) - {s.name for s in settings(a.dry_run)})
    if unknown:
        p.error(f"--only {' '.join(unknown)}: no such setting; known: {' '.join(s.name for s in settings(a.dry_run))}")
    if a.dry_run:  # on CPU even on a GPU machine: this process and every run it starts
        os.environ["CUDA_VISIBLE_DEVICES"] = ""

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not a.dry_run:
        print("bench/gpu_suite.py: needs CUDA (run it on a GPU machine), or --dry_run for the CPU check")
        return 2
    start = time.perf_counter()
    steps = a.steps or (3 if a.dry_run else 12)
    a.out.mkdir(parents=True, exist_ok=True)
    kept = a.results or a.out
    (kept / "summaries").mkdir(parents=True, exist_ok=True)
    data = gsm8k(a.out / "gsm8k_train.jsonl", 200 if a.dry_run else None)
    tokenizer = gsm8k_tokenizer(data, 512 if a.dry_run else 32000)
    head = (
        f"{environment()}\n{'DRY RUN (CPU, tiny Llama): ' if a.dry_run else ''}one process, ZeRO-2, {steps} "
        f"optimizer steps a run (rates from step 2 on), GSM8K train ({len(data.read_text().splitlines()):,} problems, "
        f"{len(tokenizer):,}-token BPE trained on them)"
    )
    print(head, flush=True)
    results, rows = kept / "results.jsonl", []
    results.write_text("")
    chosen = [s for s in settings(a.dry_run) if not a.only or s.name in a.only]
    for i, s in enumerate(chosen):
        row = {"name": s.name, "who": s.who, "pair": s.pair}
        elapsed = time.perf_counter() - start
        if elapsed > a.budget_s:
            row["error"] = f"not run: past --budget_s {a.budget_s:.0f}"
        elif s.requires and not _importable(s.requires):
            row["error"] = f"not run: {s.requires} is not installed here"
        else:
            model = build_model(a.out, s.model, tokenizer, device)
            out = a.out / "runs" / s.name
            env = dict(s.env)
            if env.pop("cold_op_cache", None) and not a.dry_run:
                env["TORCH_EXTENSIONS_DIR"] = str(out.parent / "empty-op-cache")  # a fresh node's
            if s.who == "prebuild":
                cmd = [PYTHON, "-m", "llmft.prebuild"]
            elif s.who == "plain":
                ds_config = a.out / "runs" / s.pair / "ds_config.json"  # what llmft resolved for the same setting
                env.update(plain_arch_list(os.environ))
                env.setdefault("TORCH_EXTENSIONS_DIR", str(llmft_op_cache()))  # the FusedAdam llmft's run built
                cmd = plain_command(s, model, data, out, steps, ds_config)
            else:
                cmd = llmft_command(s, model, data, out, steps)
            out.mkdir(parents=True, exist_ok=True)  # benchlib.run empties it first
            r = run(
                s.name,
                cmd,
                out,
                check=False,
                timeout=max(PREBUILD_S if s.who == "prebuild" else 60.0, a.budget_s - elapsed + 120),
                log=kept / "log.txt",
                **env,
            )
            row["wall"] = r.wall
            failure = {
                "llmft": r.failure,
                "plain": lambda: plain_failure(r, out),
                "prebuild": lambda: exit_failure(r),
            }[s.who]()
            if failure:
                row["error"] = f"failed ({failure})"
            elif s.who == "prebuild":
                row["said"] = [line for line in r.stdout.splitlines() if line.startswith("llmft prebuild:")]
            else:
                summary = out / ("plain_summary.json" if s.who == "plain" else "run_summary.json")
                (kept / "summaries" / f"{s.name}.json").write_bytes(summary.read_bytes())
                row.update(measured(s, out))
                row["reserved_gib"] = reserved_peak(r.stdout)
                row["plan_gib"] = plan_estimate(s, model)
            free_disk(out, a.out / "models", {later.model for later in chosen[i + 1 :]})
        rows.append(row)
        with open(results, "a") as f:
            f.write(json.dumps(row) + "\n")
        (kept / "table.md").write_text(table(rows, head))
        print(table(rows, head).splitlines()[-1], flush=True)
    print("\n" + table(rows, head))
    print(f"before: a fresh H100 node's first job started in {STARTUP_BEFORE_S} s (40 s of it building FusedAdam)")
    return 0


def plain_arch_list(environ) -> dict:
    """The plain script's TORCH_CUDA_ARCH_LIST: GPU images set targets like 9.0a, on which DeepSpeed 0.19 cannot build
    FusedAdam (llmft rewrites them itself: llmft.planning.op_prebuild.deepspeed_arch_list); a user of the plain
    script has to do the same by hand, so the suite does it for them."""
    from llmft.planning.op_prebuild import deepspeed_arch_list

    fixed = deepspeed_arch_list(environ.get("TORCH_CUDA_ARCH_LIST"))
    return {"TORCH_CUDA_ARCH_LIST": fixed} if fixed else {}


def llmft_op_cache() -> Path:
    """Where `llmft train` keeps this environment's DeepSpeed ops (llmft.training.upstream_noise): the plain runs
    load the FusedAdam the llmft run before them built instead of building it again (the same compile flags)."""
    from importlib.metadata import version

    import torch

    from llmft.training import upstream_noise
    from llmft.training.build_locks import extensions_root

    keyed = upstream_noise.keyed_extensions_dir(
        os.environ, sys.prefix, torch.__version__, version("deepspeed"), extensions_root()
    )
    return keyed if keyed is not None else extensions_root()


def plain_failure(r, out: Path) -> str | None:
    """None for a plain run that finished with its --summary; else its exit status and last line."""
    if r.returncode == 0 and not (out / "plain_summary.json").is_file():
        return "exit 0 without its --summary"
    return exit_failure(r)


def exit_failure(r) -> str | None:
    """None for a command that exited 0; else its exit status and last line."""
    if r.returncode == 0:
        return None
    return f"exit {r.returncode}: {r.error_line()}"


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


if __name__ == "__main__":
    sys.exit(main())

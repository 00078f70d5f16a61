"""The GPU measurement in one prepared run (issues 31 and 45): the numbers that matter most first, each kept as soon as
it exists.

    python bench/gpu_suite.py --out runs/gpu_suite               # on the GPU machine (--budget_s, --call_s)
    python bench/gpu_suite.py --dry_run --out /tmp/gpu_suite     # the same code path on CPU, tiny model (a test runs it)
    python bench/gpu_suite.py --predict                          # the planner's long-context answer, H100 and H200

In order of priority, each a real `llmft train` (one process, this machine's GPU) or the plain TRL + DeepSpeed script
(bench/plain_trl_sft.py, with the DeepSpeed config llmft wrote for the same setting, so the ZeRO stage, batch numbers
and optimizer are the same), on the same model, data, batch numbers and steps:

1. long context (issue 45): a Llama-3.1-8B shape, one sequence of about 32k, 64k and 128k tokens a step, LoRA with
             the tiled MLP, activation offload and recomputation; then a doubling search (the planner's longest length
             first, then one step at each doubling until a run fails, the jobs' memory check refuses a length, or its
             step would not end within --call_s); then full fine-tuning under ZeRO-3 with CPU offload where the host
             RAM holds it. Each row keeps the GPU and host peaks beside the planner's;
2. MFU:      the packed 1B run, and all its levers at once (`packed-fast`: Liger, no recomputation, torch.compile),
             profiled (--profile_step: the top 10 kernels by GPU time, printed when MFU is short of 45%);
3. 8b-lora:  a Llama-3.1-8B-shaped model, LoRA r=16 on every linear layer, sequence 4096, packed: with recomputation
             at micro-batch 2, without it at micro-batch 1 and 2, and compiled (profiled);
4. startup:  llmft's install step (`llmft prebuild`: DeepSpeed reinstalled from source with FusedAdam and CPUAdam
             built in), timed, then a default run whose op cache is empty (a fresh node after that install step);
5. issue 31: llmft's default path (its own defaults, nothing pinned) vs plain TRL, padded; packed vs plain TRL
             packing=True; each lever alone (no recomputation, Liger off, micro-batch 16 against 8).

Every row but `default` pins TRL's defaults (recomputation on, no compile) unless its flags say otherwise: llmft
decides both itself where they are not given (llmft.planning.speed_defaults), which would change what a lever row
measures. A row the planner says does not fit this GPU and host is recorded as not run (the doubling search runs
them to find out).

The 1B model is Llama-3.2-1B's shape (1.24B parameters, vocabulary 128,256, tied embeddings), built from its config
with random bf16 weights. The data is GSM8K's training split (7,473 problems, bench/data/gsm8k_train.jsonl.gz: the
file openai/grade-school-math publishes under the MIT licence, the same records as the hub's openai/gsm8k `main`
train split) as prompt/completion records; the long rows join its problems into text records of the row's length.
Its tokenizer is a byte-level BPE trained on that text (at most 32,000 tokens; the text has merges for 23,424) with
Llama 3's pre-tokenizer split (words, numbers in groups of up to 3 digits), because Llama 3's own tokenizer comes from
the hub, which the GPU machine cannot reach: a problem is 156 tokens on average and 458 at most (1.58 tokens a word,
the calculator annotations included), a real tokenizer's counts, not exactly Llama 3's.
Sequence 2048, micro-batch 8 x accumulation 4 (the 2026-11-24 measurement's numbers), --steps optimizer steps.

Each run prints and appends to OUT/results.jsonl: non-padding tokens/s, MFU, peak allocated GPU memory, peak host
RSS, and the planner's estimate for the same setting; rates leave out the first optimizer step (warm-up: llmft's
run_summary.json does; the plain script's --summary measures the same window). OUT/table.md is rewritten after each
run, ratios side by side. A run past --budget_s is not started; one that fails is recorded with its error and the
suite goes on. On a machine without CUDA only --dry_run runs (a tiny Llama, the first 200 problems and a 512-token
BPE, sequence 256, 3 steps, long rows of 512 to 8192 tokens without activation offload, which needs a GPU; Liger
absent on CPU is a row that says so, and the start-up run uses the warm op cache: a cold build is a minute of CPU).
"""

from __future__ import annotations

import argparse
import functools
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
    who: str  # "llmft" | "plain" | "prebuild" (the install step, timed) | "search" (the long-context doubling search)
    model: str  # a SHAPES key
    max_length: int
    micro_batch: int
    grad_accum: int
    packing: bool = False
    flags: list[str] = field(default_factory=list)  # more llmft train flags
    env: dict = field(default_factory=dict)
    requires: str | None = None  # a module the setting needs (liger_kernel)
    pair: str | None = None  # the llmft row a plain row is compared with
    zero_stage: int = 2
    offload: bool = False  # --offload (ZeRO-3: the optimizer and the parameters)
    data: str = "gsm8k"  # "gsm8k": the problems as prompt/completion; "long": records of about max_length tokens
    steps: int | None = None  # optimizer steps (None: --steps)
    pinned: bool = (
        True  # TRL's recomputation (on) and no torch.compile unless the flags say: the levers measure against it
    )
    profile: bool = False  # --profile_step on a step after the compile: where the step's time goes
    gated: bool = True  # not run where the planner says it does not fit (the doubling search runs to find out)
    method: str | None = None  # llmft train --method (issue 43's rows: dpo); None: its default, sft
    goal: float | None = None  # the least tokens/s ratio to its pair the issue asks for


LONG_LENGTHS = (32768, 65536, 131072)  # issue 45's fixed long-context rows; the doubling search goes on from the last
LONG_LENGTHS_DRY = (512, 1024, 2048)
DRY_DOUBLINGS = 2  # the dry run's search stops after this many lengths (a CPU run is not a GPU's memory limit)
MFU_GOAL = 0.45
LOAD_S = 90  # an 8B run's start: loading 16 GB of weights and DeepSpeed's set-up (bench/README.md: 38-77 s measured)


def long_name(length: int) -> str:
    return f"long-{length // 1024}k" if length % 1024 == 0 else f"long-{length}"


def long_settings(dry: bool) -> list[Setting]:
    """Issue 45's long-context rows: a Llama-3.1-8B shape on one GPU, LoRA with the tiled MLP and activation offload
    (ALST's recipe less its tiled loss, which Liger's fused linear cross-entropy stands in for), one sequence a step;
    then the doubling search; then full fine-tuning under ZeRO-3 with CPU offload where the host RAM allows it. A step
    at 128k takes about a minute on an H100 (the planner's estimate), so these rows train 2 steps up to 64k and 1 beyond
    (that row's rate includes the warm-up)."""
    big = "tiny-llama" if dry else "llama-3.1-8b"
    lora = ["--use_peft", "--lora_r", "16", "--lora_alpha", "32", "--lora_target_modules", "all-linear"]
    savers = ["--tiled_mlp", "true", "--gradient_checkpointing", "true"]
    if not dry:  # refused without a GPU: CPU processes hold their activations in host memory already
        savers += ["--activation_offloading", "true"]
    lengths = LONG_LENGTHS_DRY if dry else LONG_LENGTHS
    rows = [
        Setting(long_name(n), "llmft", big, n, 1, 1, flags=[*lora, *savers], data="long", steps=2 if i < 2 else 1)
        for i, n in enumerate(lengths)
    ]
    rows.append(Setting("long-doubling", "search", big, 2 * lengths[-1], 1, 1, flags=[*lora, *savers], data="long"))
    rows.append(
        Setting(
            "long-full-z3-offload",
            "llmft",
            big,
            lengths[0],
            1,
            1,
            flags=savers,
            zero_stage=3,
            offload=not dry,  # CPU processes have nothing to offload to: the dry run trains ZeRO-3 alone
            data="long",
            steps=2,
        )
    )
    return rows


def preference_settings(dry: bool) -> list[Setting]:
    """Issue 43's rows: DPO of a Llama-3.1-8B shape with LoRA r=16 on every linear layer at sequence 2048, against
    llmft's LoRA SFT in the same call on the same tokens a step (4 pairs of 2 sequences against 8 sequences, each
    prompt + completion about 2048 tokens, GSM8K's problems); recomputation on in all three (TRL's default). With the
    reference precomputed (its pass before training is not in the training window's rate) the goal is 0.9x SFT's
    tokens/s, with the adapter disabled as a live reference (one more forward a micro-batch) 0.65x."""
    big = "tiny-llama" if dry else "llama-3.1-8b"
    seq, acc = (512, 2) if dry else (2048, 4)
    lora = ["--use_peft", "--lora_r", "16", "--lora_alpha", "32", "--lora_target_modules", "all-linear"]
    sft = Setting("dpo-sft-lora", "llmft", big, seq, 2, acc, flags=list(lora), data="preference-sft")
    return [
        sft,
        Setting(
            "dpo-precomputed",
            "llmft",
            big,
            seq,
            1,
            acc,
            flags=[*lora, "--precompute_ref_log_probs", "true"],
            data="preference",
            method="dpo",
            pair=sft.name,
            goal=0.9,
        ),
        Setting(
            "dpo-live",
            "llmft",
            big,
            seq,
            1,
            acc,
            flags=list(lora),
            data="preference",
            method="dpo",
            pair=sft.name,
            goal=0.65,
        ),
    ]


def settings(dry: bool) -> list[Setting]:
    """The suite's runs in order of priority (--dry_run: the same list on the tiny model and small numbers): issue
    45's long context, its MFU combination, 8B LoRA and the fresh node; then issue 31's comparisons with plain TRL."""
    small = "tiny-llama" if dry else "llama-3.2-1b"
    big = "tiny-llama" if dry else "llama-3.1-8b"
    seq, big_seq = (256, 512) if dry else (2048, 4096)
    mb, acc = (2, 2) if dry else (8, 4)
    lora = ["--use_peft", "--lora_r", "16", "--lora_alpha", "32", "--lora_target_modules", "all-linear"]

    def lever(name: str, *flags: str, requires: str | None = None, profile: bool = False) -> Setting:
        return Setting(
            name, "llmft", small, seq, mb, acc, True, list(flags), requires=requires, pair="packed", profile=profile
        )

    return [
        *long_settings(dry),
        Setting("packed", "llmft", small, seq, mb, acc, packing=True),
        # all the levers at once (Liger on by default where it runs): the 45% MFU candidate, profiled after its compile
        lever("packed-fast", "--gradient_checkpointing", "false", "--torch_compile", "true", profile=True),
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
            profile=True,
        ),
        Setting(  # twice the micro-batch: fewer, larger launches (fits an H200, not an H100: the planner decides)
            "8b-lora-no-ckpt-micro2",
            "llmft",
            big,
            big_seq,
            2 if not dry else 1,
            acc,
            True,
            [*lora, "--gradient_checkpointing", "false"],
            pair="8b-lora-no-ckpt",
        ),
        Setting("prebuild", "prebuild", small, seq, mb, acc),  # llmft's install step: `llmft prebuild`
        Setting("startup", "llmft", small, seq, mb, acc, env={"cold_op_cache": "1"}),
        # issue 31's comparisons: llmft's default path (its own defaults: nothing pinned) and packing against plain TRL
        Setting("default", "llmft", small, seq, mb, acc, pinned=False),
        Setting("default-plain", "plain", small, seq, mb, acc, pair="default"),
        Setting("packed-plain", "plain", small, seq, mb, acc, packing=True, pair="packed"),
        lever("packed-no-ckpt", "--gradient_checkpointing", "false"),  # each lever alone
        lever("packed-no-liger", "--use_liger_kernel", "false", requires="liger_kernel"),
        Setting("packed-micro16", "llmft", small, seq, 2 * mb, acc // 2, True, pair="packed"),
        *preference_settings(dry),  # issue 43: run them with --only dpo-sft-lora dpo-precomputed dpo-live
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
        max_position_embeddings=2**21,  # the long-context rows' doubling search; no buffer grows with it
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


def long_records(path: Path, tokenizer, length: int, n: int) -> Path:
    """n text records of about `length` tokens each (99% of it, so that none is truncated), GSM8K's problems one after
    another, from the start again when they run out: one sequence as long as the row trains."""
    import gzip

    from llmft.data.synthetic import write_jsonl

    with gzip.open(GSM8K, "rt", encoding="utf-8") as f:
        texts = [f"Question: {p['question']}\nAnswer: {p['answer']}\n\n" for p in map(json.loads, f)]
    counts = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    target, i, rows = int(length * 0.99) - 8, 0, []
    for _ in range(n):
        parts, total = [], 0
        while total + counts[i % len(texts)] <= target:
            parts.append(texts[i % len(texts)])
            total += counts[i % len(texts)]
            i += 1
        rows.append({"text": "".join(parts)})
    return write_jsonl(rows, path)


def preference_records(path: Path, tokenizer, length: int, n: int, sft: bool) -> Path:
    """n preference records of about `length` tokens a side (99% of it): a prompt of GSM8K's worked problems to about
    half of it, the chosen completion the next problems' answers to the rest, the rejected one answers from far
    away in the split (a mismatched answer); `sft`: the same prompts and chosen completions as prompt/completion
    records, for the SFT row beside them."""
    import gzip

    from llmft.data.synthetic import write_jsonl

    with gzip.open(GSM8K, "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f]
    texts = [f"Question: {p['question']}\nAnswer: {p['answer']}\n\n" for p in problems]
    answers = [f" {p['answer']}\n\n" for p in problems]
    text_counts = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    answer_counts = [len(ids) for ids in tokenizer(answers, add_special_tokens=False)["input_ids"]]
    half = (int(length * 0.99) - 8) // 2

    def take(pieces, counts, start):
        out, total, i = [], 0, start
        while total + counts[i % len(pieces)] <= half:
            out.append(pieces[i % len(pieces)])
            total += counts[i % len(pieces)]
            i += 1
        return "".join(out), i

    rows, i = [], 0
    for _ in range(n):
        prompt, i = take(texts, text_counts, i)
        chosen, i = take(answers, answer_counts, i)
        rejected, _ = take(answers, answer_counts, i + len(problems) // 2)
        rows.append(
            {"prompt": prompt, "completion": chosen}
            if sft
            else {"prompt": prompt, "chosen": chosen, "rejected": rejected}
        )
    return write_jsonl(rows, path)


def llmft_command(s: Setting, model: Path, data: Path, out: Path, steps: int) -> list[str]:
    pinned = []
    if s.pinned:  # TRL's defaults, given: llmft's own (llmft.planning.speed_defaults) would change what a row measures
        if "--gradient_checkpointing" not in s.flags:
            pinned += ["--gradient_checkpointing", "true"]
        if "--torch_compile" not in s.flags:
            pinned += ["--torch_compile", "false"]
    if s.profile:  # a step after the first (compiling) one, with steps after it for the rates
        pinned += ["--profile_step", str(profile_step(steps))]
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
        str(s.zero_stage),
        *(["--offload"] if s.offload else []),
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
        *(["--method", s.method] if s.method else []),
        *s.flags,
        *pinned,
    ]


def profile_step(steps: int) -> int:
    """The step --profile_step profiles: the third (torch.compile compiles in the first, and the rates need steps
    after it), or the last but one of a shorter run."""
    return max(1, min(3, steps - 1))


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


def planned(s: Setting, model: Path, length: int | None = None, hardware=None) -> dict:
    """The planner's answer for a setting on this machine's GPU and host RAM, in this process (the long rows and the
    doubling search ask it at many lengths): the allocated estimate (model states + activations + loss buffers +
    phase, as plan_estimate), the per-GPU total with overhead, host RAM, the step time, whether it fits and why not."""
    from llmft.planning import memory
    from llmft.planning.ds_config import load_config, offload_mode, template_path
    from llmft.planning.run_plan import memory_job, planned_liger, resolve_hardware
    from llmft.planning.world import World

    hardware = hardware or resolve_hardware()
    config, shape = _shape(str(model), "--use_peft" in s.flags)
    job = memory_job(
        shape,
        hardware,
        World(1, 1, "arguments"),
        max_length=length or s.max_length,
        precision="bf16" if hardware.gpu is not None else "fp32",
        global_batch=s.micro_batch * s.grad_accum,
        micro_batch=s.micro_batch,
        grad_accum=s.grad_accum,
        gradient_checkpointing=checkpointing(s.flags) == "true",
        zero_stage=s.zero_stage,
        offload=offload_mode(load_config(template_path(s.zero_stage, s.offload))),
        tiled_mlp=flag_value(s.flags, "--tiled_mlp") == "true",
        activation_offloading=flag_value(s.flags, "--activation_offloading") == "true",
        liger=planned_liger(_bool_flag(s.flags, "--use_liger_kernel"), hardware.gpu, config.model_type),
        method=s.method or "sft",
        precompute_ref_log_probs=flag_value(s.flags, "--precompute_ref_log_probs") == "true",
    )
    est = memory.plan_memory(job).candidates[0]
    gib = 2**30
    return {  # a preference row's reference (its weights, its forward) counts as the other terms do
        "plan_gib": (est.model_states + est.activations + est.loss_buffers + est.reference + est.phase) / gib,
        "plan_total_gib": est.gpu_total / gib,
        "plan_host_gib": est.host["peak"] / gib,
        "plan_step_s": None if est.time is None else est.time.step_s,
        "plan_fits": est.fits,
        "plan_why": est.why,
    }


@functools.lru_cache(maxsize=None)
def _shape(model: str, lora: bool):
    """The config and the planner's shape of a model (built on the meta device once: the searches ask many lengths)."""
    from llmft.planning.model_shape import load_model_config, model_shape

    config = load_model_config(model)
    return config, model_shape(config, use_peft=lora, lora_r=16, lora_target_modules=["all-linear"] if lora else None)


def planned_longest(s: Setting, model: Path, unit: int, hardware=None) -> tuple[int, str]:
    """The longest length, in multiples of `unit` tokens, that the planner says fits this GPU and host (bisection
    over lengths up to the model's 2M positions), and what limits the next unit up."""
    lo, hi = 0, 2**21 // unit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if planned(s, model, mid * unit, hardware)["plan_fits"]:
            lo = mid
        else:
            hi = mid - 1
    if lo == 2**21 // unit:
        return lo * unit, "no limit below the model's 2,097,152 positions"
    return lo * unit, planned(s, model, (lo + 1) * unit, hardware)["plan_why"]


PREDICT_GPUS = ("H100-80GB", "H200")
PREDICT_HOST_GIB = 128  # the lent GPU machines' host RAM


def predictions(root: Path) -> str:
    """The planner's answer for the long-context rows on an H100 80GB and an H200, each with the lent machine's 128 GiB
    of host RAM, without a GPU: what bench/README.md records as predictions for the GPU run to check."""
    from transformers import LlamaConfig

    from llmft.planning.run_plan import resolve_hardware

    model = root / "llama-3.1-8b-config"
    LlamaConfig(**SHAPES["llama-3.1-8b"], max_position_embeddings=2**21).save_pretrained(model)
    rows = [s for s in long_settings(dry=False) if s.who != "search"]
    search = next(s for s in long_settings(dry=False) if s.who == "search")
    lines = [
        "| GPU (128 GiB host) | row | tokens | plan GiB (allocated / total) | plan host GiB | plan step s | fits |",
        "|---|---|---|---|---|---|---|",
    ]
    for gpu in PREDICT_GPUS:
        hardware = resolve_hardware(gpu, None, None, PREDICT_HOST_GIB)
        lengths = [(s, s.max_length) for s in rows if s.zero_stage == 2]
        lengths += [(search, search.max_length * 2**k) for k in range(4)]
        lengths += [(s, s.max_length) for s in rows if s.zero_stage == 3]
        for s, n in lengths:
            p = planned(s, model, n, hardware)
            name = s.name if s.who != "search" else f"doubling: {long_name(n)}"
            step = "n/a" if p["plan_step_s"] is None else f"{p['plan_step_s']:.0f}"
            lines.append(
                f"| {gpu} | {name} | {n:,} | {p['plan_gib']:.1f} / {p['plan_total_gib']:.1f} | {p['plan_host_gib']:.1f} "
                f"| {step} | {'yes' if p['plan_fits'] else 'no: ' + p['plan_why']} |"
            )
        longest, beyond = planned_longest(search, model, 1024, hardware)
        lines.append(f"| {gpu} | the planner's longest (LoRA) | {longest:,} | | | | next 1,024 up: {beyond} |")
    return "\n".join(lines) + "\n"


def _bool_flag(flags: list[str], name: str) -> bool | None:
    value = flag_value(flags, name)
    return None if value is None else value == "true"


def flag_value(flags: list[str], name: str) -> str | None:
    """The value a flag is given in a row's flags, the last time it is given ("true" for a flag standing alone), None
    when absent."""
    if name not in flags:
        return None
    i = len(flags) - 1 - flags[::-1].index(name)
    return flags[i + 1].lower() if i + 1 < len(flags) and not flags[i + 1].startswith("--") else "true"


def checkpointing(flags: list[str]) -> str:
    """The run's gradient checkpointing, as `llmft plan` takes it: on (TRL's SFTConfig default, which the suite pins
    on its rows) unless the flags turn it off."""
    return "false" if flag_value(flags, "--gradient_checkpointing") == "false" else "true"


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


def host_peak(stdout: str) -> float | None:
    """Rank 0's peak resident host memory (GiB), from llmft's end-of-run line (llmft.training.host_memory): the
    long-context rows set it beside the planner's host RAM (activation offload keeps every layer's input there)."""
    import re

    found = re.search(r"host memory peak: rank 0 ([\d.]+) GiB", stdout)
    return float(found.group(1)) if found else None


def table(rows: list[dict], head: str) -> str:
    """The markdown tables of the rows so far: each plain row and lever beside the llmft row it is compared with;
    the long-context rows with host RAM and the planner's answer beside what happened; the profiled steps."""
    by_name = {r["name"]: r for r in rows}
    lines = [
        head,
        "",
        "| run | tokens/s | MFU | peak GiB (allocated / reserved) | plan GiB (allocated) | vs | ratio | start-up s | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("long"):
            continue
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
            if r.get("goal"):
                ratio += f" (goal {r['goal']:.2f}x)"
        startup = sum((r.get("startup_seconds") or {}).values())
        lines.append(
            f"| {r['name']} | {r['tokens_per_second']:.0f} | {_pct(r.get('mfu'))} | {_peak(r)} | {_num(r.get('plan_gib'))} "
            f"| {r.get('pair') or ''} | {ratio} | {startup:.0f} | {r['wall']:.0f} |"
        )
    long_rows = [r for r in rows if r.get("long")]
    if long_rows:
        lines += [
            "",
            "Long context (one sequence a step): the planner's answer beside what happened",
            "",
            "| run | tokens | tokens/s | MFU | GPU peak GiB (allocated / reserved) | plan GiB (allocated / total) "
            "| host peak GiB | plan host GiB | plan fits | trained | as planned | wall s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in long_rows:
            if "planned_longest" in r:
                lines.append(
                    f"| {r['name']} | the planner's longest: {r['planned_longest']:,} ({r['beyond']}) "
                    "| | | | | | | | | | |"
                )
                continue
            trained = "error" not in r
            said = "yes" if trained else r["error"]
            plan = f"{_num(r.get('plan_gib'))} / {_num(r.get('plan_total_gib'))}"
            as_planned = "" if r.get("plan_fits") is None or r.get("skipped") else str(r["plan_fits"] == trained)
            lines.append(
                f"| {r['name']} | {r['length']:,} | {_num(r.get('tokens_per_second'), 0)} | {_pct(r.get('mfu'))} "
                f"| {_peak(r)} | {plan} | {_num(r.get('host_gib'))} | {_num(r.get('plan_host_gib'))} "
                f"| {r.get('plan_fits')} | {said} | {as_planned} | {r.get('wall', 0):.0f} |"
            )
    for r in rows:
        if r.get("profile"):
            mfu = r.get("mfu")
            short = mfu is not None and mfu < MFU_GOAL
            lines += ["", f"Where {r['name']}'s step went" + (f" ({_pct(mfu)} MFU, short of 45%):" if short else ":")]
            lines += ["", "```", r["profile"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def _num(value, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _pct(value) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def _peak(r: dict) -> str:
    peak = _num(r.get("peak_gpu_memory_gib"))
    return peak + (f" / {r['reserved_gib']:.1f}" if r.get("reserved_gib") is not None else "")


@dataclass
class Suite:
    """What every run of one suite shares: where things go, the tokenizer and data, the clock and budget."""

    out: Path
    kept: Path
    data: Path
    tokenizer: object
    device: str
    steps: int
    budget_s: float
    dry: bool
    call_s: float = (
        600.0  # the device call's own limit: a doubling-search run that would not end by then is not started
    )
    start: float = field(default_factory=time.perf_counter)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def row_data(self, s: Setting, steps: int) -> Path:
        if s.data.startswith("preference"):  # the SFT row and the DPO rows train on the same prompts and sides
            n = s.micro_batch * s.grad_accum * steps
            path = self.out / f"{s.data}-{s.max_length}x{n}.jsonl"
            sft = s.data == "preference-sft"
            return path if path.is_file() else preference_records(path, self.tokenizer, s.max_length, n, sft)
        if s.data != "long":
            return self.data
        path = self.out / f"long-{s.max_length}x{steps}.jsonl"
        return path if path.is_file() else long_records(path, self.tokenizer, s.max_length, steps)


def run_setting(suite: Suite, s: Setting, later_models: set[str]) -> dict:
    """One row: run the setting (or say why not) and read what it measured."""
    row = {"name": s.name, "who": s.who, "pair": s.pair}
    if s.method:
        row.update(method=s.method, goal=s.goal)
    if s.data == "long":
        row.update(long=True, length=s.max_length)
    if suite.elapsed() > suite.budget_s:
        row["error"] = f"not run: past --budget_s {suite.budget_s:.0f}"
        return row
    if s.requires and not _importable(s.requires):
        row["error"] = f"not run: {s.requires} is not installed here"
        return row
    model = build_model(suite.out, s.model, suite.tokenizer, suite.device)
    steps = s.steps or suite.steps
    if s.who == "llmft":
        row.update(planned(s, model))
        if s.gated and not row["plan_fits"]:
            row.update(error=f"not run: the planner says it does not fit ({row['plan_why']})", skipped=True)
            return row
    out = suite.out / "runs" / s.name
    env = dict(s.env)
    if env.pop("cold_op_cache", None) and not suite.dry:
        env["TORCH_EXTENSIONS_DIR"] = str(out.parent / "empty-op-cache")  # a fresh node's
    if s.who == "prebuild":
        cmd = [PYTHON, "-m", "llmft.prebuild"]
    elif s.who == "plain":
        ds_config = suite.out / "runs" / s.pair / "ds_config.json"  # what llmft resolved for the same setting
        env.update(plain_arch_list(os.environ))
        env.setdefault("TORCH_EXTENSIONS_DIR", str(llmft_op_cache()))  # the FusedAdam llmft's run built
        cmd = plain_command(s, model, suite.data, out, steps, ds_config)
    else:
        cmd = llmft_command(s, model, suite.row_data(s, steps), out, steps)
    out.mkdir(parents=True, exist_ok=True)  # benchlib.run empties it first
    left = suite.budget_s - suite.elapsed()
    r = run(
        s.name,
        cmd,
        out,
        check=False,
        timeout=max(PREBUILD_S if s.who == "prebuild" else 60.0, left + 120),
        log=suite.kept / "log.txt",
        **env,
    )
    row["wall"] = r.wall
    failure = {"llmft": r.failure, "plain": lambda: plain_failure(r, out), "prebuild": lambda: exit_failure(r)}[
        s.who
    ]()
    if failure:
        row["error"] = f"failed ({failure})"
        row["host_gib"] = host_peak(r.stdout)
    elif s.who == "prebuild":
        row["said"] = [line for line in r.stdout.splitlines() if line.startswith("llmft prebuild:")]
    else:
        summary = out / ("plain_summary.json" if s.who == "plain" else "run_summary.json")
        (suite.kept / "summaries" / f"{s.name}.json").write_bytes(summary.read_bytes())
        row.update(measured(s, out))
        row["reserved_gib"] = reserved_peak(r.stdout)
        row["host_gib"] = host_peak(r.stdout)
        if s.who == "plain" or not s.pinned:  # as it ran: llmft's own recomputation choice on an unpinned row
            chose_off = "gradient checkpointing off (auto" in r.stdout
            row.update(
                planned(s, model) if not chose_off else planned(_with(s, "--gradient_checkpointing", "false"), model)
            )
        profile = out / f"profile_step_{profile_step(steps)}.txt"
        if s.profile and profile.is_file():
            row["profile"] = profile.read_text()
            (suite.kept / "summaries" / f"{s.name}.profile.txt").write_text(row["profile"])
    free_disk(out, suite.out / "models", later_models)  # before the next run: the 8B rows' disk
    return row


def _with(s: Setting, flag: str, value: str) -> Setting:
    """The setting with one more flag (the last one given wins, as in argparse and flag_value)."""
    from dataclasses import replace

    return replace(s, flags=[*s.flags, flag, value])


def doubling_search(suite: Suite, s: Setting, record) -> None:
    """From twice the last fixed length: one step at each doubling until a run fails, the time budget is spent (or
    the planner's step time would overrun it), or, in the dry run, DRY_DOUBLINGS lengths; each row keeps the planner's
    answer beside what happened. First, the planner's own longest length (1,024-token resolution) is recorded."""
    from dataclasses import replace

    model = build_model(suite.out, s.model, suite.tokenizer, suite.device)
    longest, beyond = planned_longest(replace(s, who="llmft"), model, 1024)
    record(
        {"name": "long-planned-longest", "who": "search", "long": True, "planned_longest": longest, "beyond": beyond}
    )
    length, tried = s.max_length, 0
    while not (suite.dry and tried >= DRY_DOUBLINGS):
        step = replace(s, name=long_name(length), who="llmft", max_length=length, steps=1, gated=False)
        plan = planned(step, model)
        if not plan["plan_fits"]:  # what a user's job gets: its memory check refuses it before any GPU time
            record({"name": step.name, "who": "llmft", "long": True, "length": length, **plan, **refusal(step, model)})
            return
        left = suite.call_s - suite.elapsed() - LOAD_S
        if suite.elapsed() > suite.budget_s or (plan["plan_step_s"] is not None and plan["plan_step_s"] > left):
            why = (
                f"past --budget_s {suite.budget_s:.0f}"
                if suite.elapsed() > suite.budget_s
                else f"its step, {plan['plan_step_s']:.0f} s by the planner, would not end within --call_s"
            )
            record(
                {
                    "name": step.name,
                    "who": "llmft",
                    "long": True,
                    "length": length,
                    **plan,
                    "skipped": True,
                    "error": f"not run: {why}",
                }
            )
            return
        row = run_setting(suite, step, {s.model})
        record(row)
        tried += 1
        if "error" in row:
            return
        length *= 2


def refusal(s: Setting, model: Path) -> dict:
    """The job scripts' memory check (`llmft plan --check_memory`, what run_llm.slurm and run_llm.pbs run before
    training) for a setting: {"error": its one line} when it refuses, {"checked": its line} when it passes."""
    import subprocess

    cmd = [PYTHON, "-m", "llmft.plan", "--model", str(model), "--check_memory", "--nproc_per_node", "1"]
    cmd += [
        "--per_device_train_batch_size",
        str(s.micro_batch),
        "--global_batch_size",
        str(s.micro_batch * s.grad_accum),
    ]
    cmd += ["--zero_stage", str(s.zero_stage), "--max_length", str(s.max_length)]
    cmd += ["--gradient_checkpointing", checkpointing(s.flags)]
    for flag in ("--tiled_mlp", "--activation_offloading"):
        if flag_value(s.flags, flag) is not None:
            cmd += [flag, flag_value(s.flags, flag)]
    if s.offload:
        cmd += ["--offload"]
    if "--use_peft" in s.flags:
        cmd += ["--use_peft", "--lora_target_modules", "all-linear"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    last = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or [f"exit {proc.returncode}"]
    return {"error": f"refused: {last[0]}"} if proc.returncode else {"checked": last[0]}


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
    p.add_argument(
        "--call_s",
        type=float,
        default=600,
        help="the device call's limit: the long-context doubling search starts no length whose step (by the planner) "
        "would end past it",
    )
    p.add_argument(
        "--predict",
        action="store_true",
        help="print the planner's answer for the long-context rows on an H100 80GB and an H200 (no GPU needed)",
    )
    a = p.parse_args()
    if a.predict:
        a.out.mkdir(parents=True, exist_ok=True)
        print(predictions(a.out), end="")
        return 0
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
    a.out.mkdir(parents=True, exist_ok=True)
    kept = a.results or a.out
    (kept / "summaries").mkdir(parents=True, exist_ok=True)
    data = gsm8k(a.out / "gsm8k_train.jsonl", 200 if a.dry_run else None)
    tokenizer = gsm8k_tokenizer(data, 512 if a.dry_run else 32000)
    steps = a.steps or (3 if a.dry_run else 12)
    suite = Suite(a.out, kept, data, tokenizer, device, steps, a.budget_s, a.dry_run, a.call_s)
    head = (
        f"{environment()}\n{'DRY RUN (CPU, tiny Llama): ' if a.dry_run else ''}one process, ZeRO-2 unless a row says "
        f"otherwise, {steps} optimizer steps a run (rates from step 2 on), GSM8K train "
        f"({len(data.read_text().splitlines()):,} problems, {len(tokenizer):,}-token BPE trained on them)"
    )
    print(head, flush=True)
    results, rows = kept / "results.jsonl", []
    results.write_text("")

    def record(row: dict) -> None:
        rows.append(row)
        with open(results, "a") as f:
            f.write(json.dumps(row) + "\n")
        (kept / "table.md").write_text(table(rows, head))
        print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)

    chosen = [s for s in settings(a.dry_run) if not a.only or s.name in a.only]
    for i, s in enumerate(chosen):
        later = {after.model for after in chosen[i + 1 :]}
        if s.who != "search":
            record(run_setting(suite, s, later))
        elif suite.elapsed() > suite.budget_s:
            past = f"not run: past --budget_s {suite.budget_s:.0f}"
            record(
                {"name": s.name, "who": "search", "long": True, "length": s.max_length, "error": past, "skipped": True}
            )
        else:
            doubling_search(suite, s, record)
        # every run's weights and checkpoints, and each model no later row trains, whether this row ran or not
        free_disk(suite.out / "runs", suite.out / "models", later)
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

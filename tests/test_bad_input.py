"""The catalogue of bad input: every mistake a user can make ends with one line naming the problem, a non-zero
exit (2 for llmft's commands), no traceback, and nothing written.

One row per case. A row names the command, the arguments (built from a workspace of good and bad input
files), the text the one error line must hold, and optionally environment variables. Commands run in-process
through their own entry points where they are Python (train, infer, plan), as subprocesses where they are
shell (slurm/run_llm.slurm outside Slurm, manage_cluster.sh with fake cloud CLIs). Adding a command is one
RUNNERS entry; adding a case is one CASES row.
"""

from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from llmft.data.synthetic import as_format, make_examples, write_jsonl


class Workspace:
    """Input files for the cases, made on demand under root/inputs; outputs would go under root/out."""

    def __init__(self, root: Path, tiny_model: Path, tiny_data: Path):
        self.root, self.model, self.data = root, tiny_model, tiny_data
        self.inputs = root / "inputs"
        self.inputs.mkdir(parents=True)
        self.out = root / "out"

    def file(self, name: str, content: str | bytes) -> str:
        path = self.inputs / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return str(path)

    def dir(self, name: str) -> str:
        (self.inputs / name).mkdir(parents=True, exist_ok=True)
        return str(self.inputs / name)

    def qa(self) -> str:
        return str(write_jsonl(as_format(make_examples(4), "question_answer"), self.inputs / "qa.jsonl"))

    def run_dir(self, complete: bool = True, shard: bytes = b"not a torch file") -> str:
        """An llmft run directory with one checkpoint (its shard need not be a real one: the cases fail before)."""
        from llmft.checkpoint.run_dir import mark_complete

        run = self.inputs / "run"
        tag = run / "checkpoint-4" / "global_step4"
        tag.mkdir(parents=True)
        (tag / "mp_rank_00_model_states.pt").write_bytes(shard)
        (tag.parent / "latest").write_text("global_step4")
        (run / "llmft_run.json").write_text("{}\n")
        if complete:
            mark_complete(tag.parent, 1, 2)
        return str(run)


def qlora_run(w: Workspace) -> str:
    """A LoRA run trained on a 4-bit base (llmft_run.json records the quantization)."""
    run = Path(w.run_dir())
    (run / "llmft_run.json").write_text('{"quantization": "4bit"}\n')
    (run / "checkpoint-4" / "adapter_config.json").write_text(f'{{"base_model_name_or_path": "{w.model}"}}\n')
    return str(run)


@dataclass
class Case:
    command: str
    name: str
    args: Callable[[Workspace], list]
    message: str  # what the one error line must say
    env: dict = field(default_factory=dict)


def _lines(*rows: str) -> str:
    return "".join(f"{r}\n" for r in rows)


CASES = [
    # ---------------------------------------------------------------- llmft train
    Case(
        "train",
        "auto_with_zero_stage",
        lambda w: ["--auto", "--zero_stage", "3"],
        "--auto chooses the ZeRO stage and offload itself: drop --zero_stage/--offload/--deepspeed, or --auto",
    ),
    Case(
        "train",
        "save_consolidated_on_zero2",
        lambda w: ["--save_consolidated", "--zero_stage", "2"],
        "--save_consolidated gathers a ZeRO-3 model at the end; under ZeRO-2 the final model is written whole already",
    ),
    Case(
        "train",
        "save_consolidated_with_lora",
        lambda w: ["--save_consolidated", "--zero_stage", "3", "--use_peft"],
        "a LoRA run saves its adapter",
    ),
    Case(
        "train",
        "dataset_name_with_dataset_mixture",  # else the mixture would train while the log named the dataset
        lambda w: ["--dataset_mixture", w.file("mix.yaml", f"datasets:\n  - path: {w.data}\n    weight: 1\n")],
        "--dataset_mixture lists the datasets: drop --dataset_name (per source in the mixture YAML: path, config, "
        "columns, format, prompt_template, percentage)",
    ),
    Case(  # argparse would have run it as --max_steps 4
        "train",
        "flag_prefix",
        lambda w: ["--max_step", "4"],
        "unknown flag --max_step: did you mean --max_steps? (flags match only by their full name)",
    ),
    Case(
        "train",
        "model_path_missing",
        lambda w: ["--model_name_or_path", "/nonexistent/model"],
        "model directory /nonexistent/model not found",
    ),
    Case(
        "train",
        "model_dir_without_config",
        lambda w: ["--model_name_or_path", w.dir("not_a_model")],
        "is not a model directory (no config.json in it)",
    ),
    Case(
        "train",
        "data_not_utf8",
        lambda w: ["--dataset_name", w.file("latin1.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n')],
        "latin1.jsonl: line 2 is not UTF-8 (byte 0xe9 at offset 28)",
    ),
    Case(
        "train",
        "jsonl_lines_are_arrays",
        lambda w: ["--dataset_name", w.file("arrays.jsonl", '["a", "b"]\n["c", "d"]\n')],
        "arrays.jsonl: line 1 is a JSON list, not an object",
    ),
    Case(
        "train",
        "jsonl_line_is_a_number",
        lambda w: ["--dataset_name", w.file("num.jsonl", '{"text": "a"}\n3\n')],
        "num.jsonl: line 2 is a JSON int, not an object",
    ),
    Case(
        "train",
        "jsonl_line_not_json",
        lambda w: ["--dataset_name", w.file("bad.jsonl", '{"text": "a"}\n{"text": "b"}\n{"text": \n')],
        "bad.jsonl: line 3 is not valid JSON",
    ),
    Case("train", "data_file_empty", lambda w: ["--dataset_name", w.file("empty.jsonl", "")], "empty.jsonl is empty"),
    Case(  # FastChat's ShareGPT, its turns' text in a string column by mistake
        "train",
        "messages_column_is_a_string",
        lambda w: [
            "--dataset_name",
            w.file("qa.jsonl", '{"question": "2+2?", "answer": "4"}\n'),
            "--messages_column",
            "question",
        ],
        "column 'question' holds string values, not a list of turns",
    ),
    Case(
        "train",
        "chat_role_unknown",
        lambda w: [
            "--dataset_name",
            w.file(
                "sg.jsonl", '{"conversations": [{"from": "human", "value": "Hi"}, {"from": "bot", "value": "Yo"}]}\n'
            ),
        ],
        "record 1, turn 2: role 'bot' is not one llmft knows",
    ),
    Case(
        "train",
        "chat_conversation_empty",
        lambda w: [
            "--dataset_name",
            w.file(
                "chat.jsonl",
                '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}\n{"messages": []}\n',
            ),
        ],
        "1 record(s) have an empty conversation in 'messages' (first: record 2); remove them",
    ),
    Case(
        "train",
        "messages_column_missing",
        lambda w: ["--messages_column", "dialog"],
        "column(s) dialog not in the dataset",
    ),
    Case(
        "train",
        "data_file_missing",
        lambda w: ["--dataset_name", str(w.inputs / "missing.jsonl")],
        "missing.jsonl not found",
    ),
    Case(
        "train",
        "data_file_type_unknown",
        lambda w: ["--dataset_name", w.file("data.xlsx", "x")],
        "unsupported dataset file type '.xlsx'",
    ),
    Case(
        "train",
        "data_columns_unknown",
        lambda w: ["--dataset_name", w.qa()],
        "dataset has columns answer, question but llmft needs",
    ),
    Case(
        "train",
        "mapped_column_missing",
        lambda w: ["--prompt_column", "question"],
        "column(s) question not in the dataset",
    ),
    Case(
        "train",
        "deepspeed_json_does_not_parse",
        lambda w: ["--deepspeed", w.file("ds.json", '{"zero_optimization": {"stage": 2},,}')],
        "ds.json is not valid JSON (line 1: Expecting property name enclosed in double quotes); fix the file",
    ),
    Case(
        "train",
        "deepspeed_json_not_an_object",
        lambda w: ["--deepspeed", w.file("list.json", "[1, 2]")],
        "list.json must hold a JSON object",
    ),
    Case(
        "train",
        "deepspeed_json_missing",
        lambda w: ["--deepspeed", str(w.inputs / "nope.json")],
        "nope.json not found",
    ),
    Case("train", "zero_stage_unknown", lambda w: ["--zero_stage", "7"], "unknown ZeRO stage 7"),
    Case(
        "train",
        "zero_stage_and_deepspeed",
        lambda w: ["--zero_stage", "3", "--deepspeed", w.file("z.json", '{"zero_optimization": {}}')],
        "give either --zero_stage or --deepspeed, not both",
    ),
    Case(
        "train",
        "deepspeed_json_without_zero_section",
        lambda w: ["--deepspeed", w.file("z.json", '{"train_batch_size": "auto"}')],
        'z.json has no "zero_optimization" section',
    ),
    Case(
        "train", "offload_on_zero1", lambda w: ["--zero_stage", "1", "--offload"], "--offload needs ZeRO stage 2 or 3"
    ),
    Case(
        "train",
        "output_dir_is_a_file",
        lambda w: ["--output_dir", w.file("a_file", "x")],
        "a_file is a file, not a directory",
    ),
    Case(
        "train",
        "global_batch_not_divisible",
        lambda w: ["--global_batch_size", "7", "--per_device_train_batch_size", "2"],
        "global batch 7 is not divisible by micro-batch 2 x world size 1 = 2; use global batch 6 or 8",
    ),
    Case(
        "train",
        "micro_batch_zero",
        lambda w: ["--per_device_train_batch_size", "0"],
        "micro-batch must be a positive integer, got 0",
    ),
    Case(
        "train",
        "data_percentage_out_of_range",
        lambda w: ["--data_percentage", "150"],
        "--data_percentage must be in (0, 100], got 150",
    ),
    Case(
        "train",
        "fp16_without_gpu",
        lambda w: ["--precision", "fp16"],
        "fp16 mixed precision needs a GPU and none is visible here",
    ),
    Case("train", "precision_unknown", lambda w: ["--precision", "fp8"], "unknown precision 'fp8'"),
    Case("train", "bf16_and_fp16", lambda w: ["--bf16", "true", "--fp16"], "--bf16 and --fp16 contradict each other"),
    Case(
        "train",
        "qlora_without_cuda",
        lambda w: ["--use_peft", "--load_in_4bit"],
        "--load_in_4bit (QLoRA) needs a CUDA GPU",
    ),
    Case(
        "train",
        "optimizer_deepspeed_cannot_run",
        lambda w: ["--optim", "adamw_bnb_8bit"],
        "--optim adamw_bnb_8bit is not supported with DeepSpeed in llmft",
    ),
    Case(
        "train",
        "lora_flag_without_use_peft",
        lambda w: ["--lora_r", "8"],
        "--lora_r is a LoRA setting but --use_peft is not given",
    ),
    Case(
        "train",
        "streaming_refused",
        lambda w: ["--dataset_streaming", "true"],
        "--dataset_streaming True is not supported",
    ),
    Case(
        "train",
        "resume_checkpoint_missing",
        lambda w: ["--resume_from_checkpoint", str(w.inputs / "ckpt")],
        "ckpt not found",
    ),
    Case("train", "config_yaml_missing", lambda w: ["--config", str(w.inputs / "run.yaml")], "cannot read"),
    Case(
        "train",
        "config_yaml_invalid",
        lambda w: ["--config", w.file("run.yaml", "zero_stage: [2\n")],
        "the --config file is not valid YAML",
    ),
    Case(
        "train",
        "unknown_flag",
        lambda w: ["--golbal_batch_size", "8"],
        "unknown flag --golbal_batch_size: did you mean --global_batch_size?",
    ),
    Case("train", "zero_epochs", lambda w: ["--num_train_epochs", "0"], "--num_train_epochs 0 trains nothing"),
    Case(
        "train",
        "max_length_zero",
        lambda w: ["--max_length", "0"],
        "--max_length 0 must be a positive number of tokens",
    ),
    Case(
        "train",
        "attention_unknown",
        lambda w: ["--attn_implementation", "flash3"],
        "unknown --attn_implementation 'flash3'",
    ),
    Case(
        "train",
        "flash_attention_without_gpu",
        lambda w: ["--attn_implementation", "flash_attention_2"],
        "--attn_implementation flash_attention_2 needs a CUDA GPU and none is visible here; use sdpa (or auto)",
    ),
    Case(
        "train", "liger_without_gpu", lambda w: ["--use_liger_kernel", "true"], "--use_liger_kernel needs a CUDA GPU"
    ),
    Case(
        "train",
        "packing_wrapped_mixes_samples",
        lambda w: ["--packing", "--packing_strategy", "wrapped"],
        "--packing_strategy wrapped concatenates samples so that they attend to each other",
    ),
    Case(
        "train",
        "world_size_env_garbage",
        lambda w: [],
        "WORLD_SIZE='two' is not a positive integer",
        env={"WORLD_SIZE": "two"},
    ),
    # ---------------------------------------------------------------- llmft infer
    Case(
        "infer",
        "checkpoint_missing",
        lambda w: [str(w.inputs / "nope"), "--prompt", "hi"],
        "nope does not exist: check the path",
    ),
    Case(
        "infer",
        "glob_matched_nothing",
        lambda w: [str(w.inputs / "nope" / "global_step*"), "--prompt", "hi"],
        "no checkpoint matched",
    ),
    Case(
        "infer",
        "dir_without_checkpoint",
        lambda w: [w.dir("empty"), "--prompt", "hi"],
        "holds no DeepSpeed checkpoint",
    ),
    Case(
        "infer",
        "latest_names_missing_tag",
        lambda w: [str(Path(w.file("ck/latest", "global_step9")).parent), "--prompt", "hi"],
        "names 'global_step9', which is not in",
    ),
    Case(
        "infer",
        "all_checkpoints_half_written",
        lambda w: [w.run_dir(complete=False), "--prompt", "hi"],
        "holds no complete checkpoint",
    ),
    Case("infer", "corrupt_shard", lambda w: [w.run_dir(), "--prompt", "hi"], "is truncated or corrupt"),
    Case(
        "infer",
        "prompt_file_missing",
        lambda w: [w.run_dir(), "--prompt_file", str(w.inputs / "p.txt")],
        "p.txt does not exist",
    ),
    Case(
        "infer",
        "prompt_file_empty",
        lambda w: [w.run_dir(), "--prompt_file", w.file("p.txt", "\n\n")],
        "p.txt is empty",
    ),
    Case(
        "infer",
        "prompt_file_not_utf8",
        lambda w: [w.run_dir(), "--prompt_file", w.file("p.txt", b"hello\ncaf\xe9\n")],
        "p.txt: line 2 is not UTF-8 (byte 0xe9",
    ),
    Case(
        "infer",
        "prompt_jsonl_line_is_array",
        lambda w: [w.run_dir(), "--prompt_file", w.file("p.jsonl", '{"prompt": "a"}\n["b"]\n')],
        "p.jsonl line 2 is a JSON list, not an object",
    ),
    Case(
        "infer",
        "prompt_jsonl_not_json",
        lambda w: [w.run_dir(), "--prompt_file", w.file("p.jsonl", '{"prompt": "a"\n')],
        "p.jsonl line 1 is not valid JSON",
    ),
    Case(
        "infer",
        "prompt_jsonl_no_prompt_field",
        lambda w: [w.run_dir(), "--prompt_file", w.file("p.jsonl", '{"input": "a"}\n')],
        "p.jsonl line 1 has no prompt, text, question or messages field",
    ),
    Case(
        "infer",
        "max_new_tokens_zero",
        lambda w: [w.run_dir(), "--prompt", "hi", "--max_new_tokens", "0"],
        "--max_new_tokens must be at least 1",
    ),
    Case(
        "infer",
        "nothing_to_do",
        lambda w: [w.run_dir()],
        "nothing to do: give --prompt or --prompt_file",
    ),
    Case(
        "infer",
        "cuda_device_without_cuda",
        lambda w: [w.run_dir(), "--prompt", "hi", "--device", "cuda:0"],
        "--device cuda:0 but CUDA is not available",
    ),
    Case(
        "infer",
        "export_moved",
        lambda w: [w.run_dir(), "--export", w.file("model.safetensors", "x")],
        "--export moved to its own command: llmft export {inputs}/run --out {inputs}/model.safetensors",
    ),
    Case(
        "export",
        "out_onto_a_file",
        lambda w: [w.run_dir(), "--out", w.file("model.safetensors", "x")],
        "--out {inputs}/model.safetensors is a file: give a new or empty directory",
    ),
    Case(
        "export",
        "out_not_empty",
        lambda w: [w.run_dir(), "--out", w.dir("exported")] if w.file("exported/a.txt", "mine") else [],
        "--out {inputs}/exported is a directory that is not empty: give a new or empty directory",
    ),
    Case(
        "export",
        "all_checkpoints_half_written",
        lambda w: [w.run_dir(complete=False), "--out", str(w.out)],
        "holds no complete checkpoint",
    ),
    Case(
        "export",
        "lora_on_a_full_fine_tune",
        lambda w: [w.run_dir(), "--model_name", str(w.model), "--out", str(w.out), "--lora", "adapter"],
        "--lora adapter but {inputs}/run/checkpoint-4 is a full fine-tune (no adapter_config.json): drop --lora",
    ),
    Case(
        "export",
        "shard_size_unparsed",
        lambda w: [w.run_dir(), "--out", str(w.out), "--max_shard_size", "5 gigs"],
        "--max_shard_size '5 gigs' is not a size: give a number with a unit, such as 5GB",
    ),
    Case(
        "export",
        "qlora_merge",
        lambda w: [qlora_run(w), "--out", str(w.out)],
        "the run trained its adapter against a 4bit base (QLoRA), so the merge dequantizes that base first, and "
        "its llmft_run.json does not record how",
    ),
    Case(
        "export",
        "hub_name_not_org_name",
        lambda w: [w.run_dir(), "--out", str(w.out), "--push_to_hub", "my-model"],
        "--push_to_hub 'my-model' is not ORG/NAME",
    ),
    Case(
        "infer",
        "dtype_unknown",
        lambda w: [w.run_dir(), "--prompt", "hi", "--dtype", "int4"],
        "argument --dtype: invalid choice: 'int4'",
    ),
    # ---------------------------------------------------------------- llmft eval
    Case(
        "eval",
        "checkpoint_missing",
        lambda w: [str(w.inputs / "nope"), "--tasks", "gsm8k", "--task_data", f"gsm8k={w.qa()}", "--num_fewshot", "0"],
        "nope does not exist: check the path",
    ),
    Case(
        "eval",
        "task_unknown",
        lambda w: [w.run_dir(), "--tasks", "gsm9k"],
        "unknown task 'gsm9k' in lm-evaluation-harness (close: gsm8k",
    ),
    Case(
        "eval",
        "task_data_not_a_pair",
        lambda w: [w.run_dir(), "--tasks", "gsm8k", "--task_data", "gsm8k"],
        "--task_data 'gsm8k': use TASK=FILE, TASK:SPLIT=FILE or TASK=DIR",
    ),
    Case(
        "eval",
        "task_data_lines_are_arrays",
        lambda w: [
            w.run_dir(),
            "--tasks",
            "gsm8k",
            "--num_fewshot",
            "0",
            "--task_data",
            "gsm8k=" + w.file("a.jsonl", "[1, 2]\n"),
        ],
        "a.jsonl: line 1 is a JSON list, not an object",
    ),
    Case(
        "eval",
        "task_data_missing_file",
        lambda w: [w.run_dir(), "--tasks", "gsm8k", "--task_data", f"gsm8k={w.inputs / 'no.jsonl'}"],
        "no.jsonl does not exist: check the path",
    ),
    Case(
        "eval",
        "task_data_fewshot_split_missing",
        lambda w: [w.run_dir(), "--tasks", "gsm8k", "--task_data", f"gsm8k={w.qa()}"],
        "gsm8k draws its 5 few-shot examples from its 'train' split: add --task_data gsm8k:train=FILE, or pass --num_fewshot 0",
    ),
    Case(
        "eval",
        "task_data_wrong_columns",
        lambda w: [w.run_dir(), "--tasks", "gsm8k", "--num_fewshot", "0", "--task_data", f"gsm8k={w.data}"],
        "train.jsonl's records lack answer, question (the fields gsm8k's prompts read: answer, question); they have prompt, completion",
    ),
    Case(
        "eval",
        "task_data_unknown_split",
        lambda w: [w.run_dir(), "--tasks", "gsm8k", "--task_data", f"gsm8k:dev={w.qa()}"],
        "--task_data gsm8k:dev: gsm8k has no split 'dev'; its splits are test, train",
    ),
    Case(
        "eval",
        "task_data_for_a_group",
        lambda w: [w.run_dir(), "--tasks", "minerva_math", "--task_data", f"minerva_math={w.qa()}"],
        "minerva_math is a group of tasks; give data for each of its tasks",
    ),
    Case(
        "eval", "limit_zero", lambda w: [w.run_dir(), "--tasks", "gsm8k", "--limit", "0"], "--limit must be at least 1"
    ),
    Case(
        "eval",
        "batch_size_zero",
        lambda w: [
            w.run_dir(),
            "--tasks",
            "gsm8k",
            "--num_fewshot",
            "0",
            "--task_data",
            f"gsm8k={w.qa()}",
            "--batch_size",
            "0",
        ],
        "--batch_size 0: give a positive number or auto",
    ),
    Case(
        "eval",
        "dtype_unknown",
        lambda w: [w.run_dir(), "--tasks", "gsm8k", "--dtype", "int4"],
        "--dtype int4: use auto, float32, bfloat16 or float16",
    ),
    Case(
        "eval",
        "launched_on_two_ranks",
        lambda w: [w.run_dir(), "--tasks", "gsm8k"],
        "llmft eval runs in one process",
        env={"WORLD_SIZE": "2"},
    ),
    Case(
        "eval",
        "corrupt_shard",
        lambda w: [w.run_dir(), "--tasks", "gsm8k", "--num_fewshot", "0", "--task_data", f"gsm8k={w.qa()}"],
        "is truncated or corrupt",
    ),
    Case(
        "eval",
        "half_written_checkpoint",
        lambda w: [
            w.run_dir(complete=False),
            "--tasks",
            "gsm8k",
            "--num_fewshot",
            "0",
            "--task_data",
            f"gsm8k={w.qa()}",
        ],
        "holds no complete checkpoint",
    ),
    Case("eval", "tasks_missing", lambda w: [w.run_dir()], "the following arguments are required: --tasks"),
    # ---------------------------------------------------------------- llmft plan
    Case(
        "plan",
        "global_batch_not_divisible",
        lambda w: [
            "--global_batch_size",
            "30",
            "--per_device_train_batch_size",
            "2",
            "--nnodes",
            "1",
            "--nproc_per_node",
            "4",
        ],
        "global batch 30 is not divisible by micro-batch 2 x world size 4 = 8; use global batch 24 or 32",
    ),
    # ---------------------------------------------------------------- llmft report
    Case(
        "report",
        "missing_run_dir",
        lambda w: [str(w.root / "nope")],
        "nope is not a directory: pass a run's --output_dir",
    ),
    Case("report", "file_not_dir", lambda w: [str(w.data)], "is not a directory: pass a run's --output_dir"),
    Case("report", "empty_dir", lambda w: [w.dir("empty")], "holds no trainer_state.json, run_summary.json or eval"),
    Case(
        "report",
        "unrelated_dir",
        lambda w: [str(Path(w.file("notes/readme.txt", "hello")).parent)],
        "holds no trainer_state.json, run_summary.json or eval",
    ),
    Case(
        "report",
        "second_run_missing",
        lambda w: [str(Path(w.file("run_a/run_summary.json", "{}")).parent), str(w.root / "gone")],
        "is not a directory: pass a run's --output_dir",
    ),
    Case("plan", "zero_stage_unknown", lambda w: ["--zero_stage", "5"], "unknown ZeRO stage 5"),
    Case(  # argparse would have taken the prefix for --global_batch_size
        "plan",
        "flag_prefix",
        lambda w: ["--global_batch", "8"],
        "unknown flag --global_batch: did you mean --global_batch_size? (flags match only by their full name)",
    ),
    Case(
        "plan",
        "check_model_without_config",
        lambda w: ["--model", w.dir("not_a_model"), "--check_model"],
        "not_a_model: no config.json in that directory; point it at a model directory",
    ),
    Case(
        "plan",
        "deepspeed_json_does_not_parse",
        lambda w: ["--deepspeed", w.file("ds.json", "{")],
        "ds.json is not valid JSON (line 1",
    ),
    Case(
        "plan",
        "nnodes_zero",
        lambda w: ["--nnodes", "0", "--nproc_per_node", "0"],
        "--nnodes and --nproc_per_node must be positive",
    ),
    Case(
        "plan", "offload_on_zero1", lambda w: ["--zero_stage", "1", "--offload"], "--offload needs ZeRO stage 2 or 3"
    ),
    Case("plan", "precision_unknown", lambda w: ["--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
    Case(
        "plan",
        "micro_batch_zero",
        lambda w: ["--per_device_train_batch_size", "0"],
        "micro-batch must be a positive integer, got 0",
    ),
    # llmft plan --model (the memory plan): unknown hardware, impossible numbers, contradictions
    Case(
        "plan",
        "memory_model_missing",
        lambda w: ["--model", str(w.inputs / "nope"), "--node_type", "g2-standard-4"],
        "no such directory",
    ),
    Case(
        "plan",
        "memory_node_type_unknown",
        lambda w: ["--model", str(w.model), "--node_type", "g9.huge"],
        "unknown node type 'g9.huge'; known: g2-standard-4",
    ),
    Case(
        "plan",
        "memory_gpu_unknown",
        lambda w: ["--model", str(w.model), "--gpu", "RTX-9090", "--host_ram_gb", "64"],
        "unknown GPU 'RTX-9090'; known: ",
    ),
    Case(
        "plan",
        "memory_gpu_memory_zero",
        lambda w: ["--model", str(w.model), "--gpu_memory_gb", "0", "--host_ram_gb", "64"],
        "GPU memory must be a positive number of GiB, got 0.0",
    ),
    Case(
        "plan",
        "memory_host_ram_negative",
        lambda w: ["--model", str(w.model), "--node_type", "g6.xlarge", "--host_ram_gb", "-8"],
        "host RAM must be a positive number of GiB, got -8.0",
    ),
    Case(
        "plan",
        "memory_max_length_zero",
        lambda w: ["--model", str(w.model), "--node_type", "g6.xlarge", "--max_length", "0"],
        "--max_length must be a positive integer, got 0",
    ),
    Case(
        "plan",
        "memory_lora_r_zero",
        lambda w: ["--model", str(w.model), "--node_type", "g6.xlarge", "--use_peft", "--lora_r", "0"],
        "--lora_r must be a positive integer, got 0",
    ),
    Case(
        "plan",
        "memory_global_batch_not_divisible",
        lambda w: [
            "--model",
            str(w.model),
            "--node_type",
            "g6.12xlarge",
            "--global_batch_size",
            "30",
            "--per_device_train_batch_size",
            "2",
        ],
        "global batch 30 is not divisible by micro-batch 2 x world size 4 = 8; use global batch 24 or 32",
    ),
    Case(
        "plan",
        "memory_mfu_above_one",
        lambda w: ["--model", str(w.model), "--node_type", "g6.xlarge", "--mfu", "35"],
        "--mfu must be in (0, 1], got 35.0",
    ),
    Case(
        "plan",
        "memory_write_bandwidth_zero",
        lambda w: ["--model", str(w.model), "--node_type", "g6.xlarge", "--write_mb_s", "0"],
        "--write_mb_s must be positive, got 0.0",
    ),
    Case(
        "plan",
        "memory_json_with_print_launch",
        lambda w: ["--model", str(w.model), "--node_type", "g6.xlarge", "--json", "--print_launch"],
        "--print_launch adds a text line that --json output cannot hold",
    ),
    Case(
        "plan",
        "memory_flag_without_model",
        lambda w: ["--node_type", "g2-standard-4"],
        "--node_type needs --model (a memory plan)",
    ),
    Case(
        "plan",
        "slurm_gpu_spec_garbage",
        lambda w: [],
        "cannot read a GPU count from 'gpu:a100:x!'",
        env={"SLURM_NNODES": "1", "SLURM_GPUS_PER_NODE": "gpu:a100:x!"},
    ),
    # ---------------------------------------------------------------- slurm/run_llm.slurm, run outside Slurm
    Case("slurm", "epochs_not_a_number", lambda w: ["EPOCHS=abc"], "EPOCHS=abc is not a positive number"),
    Case("slurm", "unknown_knob", lambda w: ["--export=ALL,EPOCH=3"], "unknown knob 'EPOCH'"),
    Case("slurm", "zero_stage_unknown", lambda w: ["ZERO_STAGE=7"], "ZERO_STAGE=7 is not a ZeRO stage"),
    Case("slurm", "data_percentage_zero", lambda w: ["DATA_PERCENTAGE=0"], "0 < DATA_PERCENTAGE <= 100"),
    Case("slurm", "global_batch_zero", lambda w: ["GLOBAL_BATCH=0"], "GLOBAL_BATCH=0 is not a positive integer"),
    Case("slurm", "ds_config_missing", lambda w: [f"DS_CONFIG={w.inputs / 'ds.json'}"], "ds.json: no such file"),
    Case("slurm", "offload_on_zero1", lambda w: ["OFFLOAD=1", "ZERO_STAGE=1"], "OFFLOAD=1 needs ZERO_STAGE=2 or 3"),
    Case("slurm", "nccl_profile_unknown", lambda w: ["NCCL_PROFILE=azure"], "NCCL_PROFILE=azure is unknown"),
    Case(
        "slurm",
        "extra_args_two_lines",
        lambda w: ["EXTRA_ARGS=--seed 1\n--max_steps 2"],
        "EXTRA_ARGS must be one line",
    ),
    Case(  # a real job stops here too, on the batch host before any srun (tests/test_slurm.py BAD)
        "slurm",
        "dataset_missing",
        lambda w: [f"DATASET={w.inputs / 'missing.jsonl'}", "DRY_RUN=1"],
        "missing.jsonl: no such file or directory",
    ),
    Case(
        "slurm",
        "model_dir_missing",
        lambda w: [f"MODEL={w.inputs / 'no_model'}", "DRY_RUN=1"],
        "no_model: no such directory",
    ),
    Case(
        "slurm",
        "batch_does_not_divide_the_sbatch_world",
        lambda w: ["GLOBAL_BATCH=20", "MICRO_BATCH=8", "DRY_RUN=1"],
        "GLOBAL_BATCH=20 is not a multiple of MICRO_BATCH=8 x 2 processes (the #SBATCH lines: --nodes=2, "
        "--gpus-per-node=1) = 16; use GLOBAL_BATCH=32 or 16, or another MICRO_BATCH",
    ),
    Case(
        "slurm",
        "not_inside_slurm",
        lambda w: ["EPOCHS=1"],
        "not inside a Slurm job (SLURM_JOB_ID is unset); submit with: sbatch",
    ),
    # ---------------------------------------------------------------- manage_cluster.sh (fake cloud CLIs)
    Case("manage_cluster", "unknown_command", lambda w: ["deploy"], "unknown command 'deploy'"),
    Case(
        "manage_cluster", "unknown_provider", lambda w: ["--provider", "azure", "create"], "unknown provider 'azure'"
    ),
    Case("manage_cluster", "unsafe_cluster_name", lambda w: ["create", "$(id)"], "invalid cluster name"),
    Case(
        "manage_cluster",
        "gcp_project_missing",
        lambda w: ["create", "llmft-test"],
        "PROJECT_ID is not set",
        env={"PROJECT_ID": ""},
    ),
    Case(
        "manage_cluster",
        "aws_variables_missing",
        lambda w: ["--provider", "aws", "create", "llmft-test"],
        "missing environment variables: HEAD_SUBNET_ID COMPUTE_SUBNET_ID S3_BUCKET",
        env={
            "AWS_REGION": "us-east-1",
            "KEY_NAME": "k",
            "HEAD_SUBNET_ID": "",
            "COMPUTE_SUBNET_ID": "",
            "S3_BUCKET": "",
        },
    ),
    Case(
        "manage_cluster",
        "aws_subnet_malformed",
        lambda w: ["--provider", "aws", "create", "llmft-test"],
        "is not a valid",
        env={"HEAD_SUBNET_ID": "subnet-xyz; rm -rf /"},
    ),
]


# ------------------------------------------------------------------ how each command runs


def _in_process(fn, *args) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            rc = fn(*args)
        except SystemExit as e:  # argparse usage errors
            rc = e.code
    return rc, err.getvalue()


def run_train(w: Workspace, args: list[str], env: dict) -> tuple[int, str]:
    from llmft.train import cli, make_parser

    base = [
        "--model_name_or_path",
        str(w.model),
        "--dataset_name",
        str(w.data),
        "--output_dir",
        str(w.out),
        "--report_to",
        "none",
    ]
    return _in_process(cli, make_parser(), [*base, *args])


def run_infer(w: Workspace, args: list[str], env: dict) -> tuple[int, str]:
    from llmft.infer import main, make_parser

    return _in_process(lambda: main(make_parser().parse_args(args)))


def run_export(w: Workspace, args: list[str], env: dict) -> tuple[int, str]:
    from llmft.export import main, make_parser

    return _in_process(lambda: main(make_parser().parse_args(args)))


def run_eval(w: Workspace, args: list[str], env: dict) -> tuple[int, str]:
    from llmft.eval import main, make_parser

    return _in_process(lambda: main(make_parser().parse_args(args)))


def run_plan(w: Workspace, args: list[str], env: dict) -> tuple[int, str]:
    from llmft.plan import main, make_parser

    return _in_process(lambda: main(make_parser().parse_args(args)))


def run_report(w: Workspace, args: list[str], env: dict) -> tuple[int, str]:
    from llmft.report import main, make_parser

    return _in_process(lambda: main(make_parser().parse_args([*args, "--output", str(w.out / "report")])))


def run_slurm(w: Workspace, args: list[str], env: dict) -> tuple[int, str]:
    from test_slurm_script import run_script

    proc = run_script(f"CHECKPOINT_DIR={w.out}", *args, **env)
    return proc.returncode, proc.stderr


def run_manage_cluster(w: Workspace, args: list[str], env: dict) -> tuple[int, str]:
    from conftest import AWS_PLACEHOLDER_ENV
    from test_manage_cluster import GCP_ENV

    proc = w.cli.run(*args, **{**GCP_ENV, **AWS_PLACEHOLDER_ENV, "POLL_SECONDS": "0", **env})
    return proc.returncode, proc.stderr


@dataclass
class Runner:
    run: Callable[[Workspace, list, dict], tuple[int, str]]
    prog: str  # the error line starts with "<prog>: error:"
    in_process: bool  # env goes through monkeypatch (in-process) or to the subprocess
    exit_code: int | None = 2  # None: any non-zero


RUNNERS = {
    "train": Runner(run_train, "llmft train", True),
    "infer": Runner(run_infer, "llmft infer", True),
    "export": Runner(run_export, "llmft export", True),
    "eval": Runner(run_eval, "llmft eval", True),
    "plan": Runner(run_plan, "llmft plan", True),
    "report": Runner(run_report, "llmft report", True),
    "slurm": Runner(run_slurm, "run_llm.slurm", False),
    "manage_cluster": Runner(run_manage_cluster, "manage_cluster.sh", False, exit_code=None),
}


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def test_the_catalogue_is_large_and_covers_every_command():
    per_command = {c: sum(case.command == c for case in CASES) for c in RUNNERS}
    assert len(CASES) >= 30 and min(per_command.values()) >= 5, per_command
    assert len({(c.command, c.name) for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[f"{c.command}-{c.name}" for c in CASES])
def test_bad_input_is_one_line_a_nonzero_exit_no_traceback_and_nothing_written(
    case, tiny_model, tiny_data, tmp_path, monkeypatch
):
    runner = RUNNERS[case.command]
    w = Workspace(tmp_path / "ws", tiny_model, tiny_data)
    if case.command == "manage_cluster":
        from test_manage_cluster import Cli

        (tmp_path / "ws" / "mc").mkdir()
        w.cli = Cli(tmp_path / "ws" / "mc")
        (w.cli.repo / "deployments").mkdir()
    args = case.args(w)
    env = dict(case.env)
    if runner.in_process:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        env_before = dict(os.environ)
    before = _snapshot(w.root)

    rc, err = runner.run(w, [str(a) for a in args], env)

    errors = [line for line in err.splitlines() if line.startswith(f"{runner.prog}: error:")]
    assert len(errors) == 1, err[-3000:]
    assert case.message.replace("{inputs}", str(w.inputs)) in errors[0], err[-3000:]
    assert rc == runner.exit_code if runner.exit_code is not None else rc not in (0, None), (rc, err[-2000:])
    assert "Traceback" not in err
    assert (
        _snapshot(w.root) == before
    )  # nothing written: no output dir, no checkpoint dir, no deployment, no cloud call log
    assert not w.out.exists()
    if runner.in_process:
        # failed before any distributed set-up; libraries set these on their first import: lm_eval its hub download
        # mode, scikit-learn (an lm-eval dependency, which transformers then imports too) KMP_DUPLICATE_LIB_OK
        set_on_import = {"HF_XET_HIGH_PERFORMANCE", "KMP_DUPLICATE_LIB_OK"}
        env_after = dict(os.environ)
        assert {k: v for k, v in env_after.items() if k not in set_on_import} == {
            k: v for k, v in env_before.items() if k not in set_on_import
        }


def _missing_data_flags(w: Workspace) -> tuple[list[str], str]:
    """Flags of a 2-process run on the tiny model whose dataset file does not exist, and the line it must print."""
    missing = w.inputs / "missing.jsonl"
    flags = [
        "--model_name_or_path",
        str(w.model),
        "--dataset_name",
        str(missing),
        "--output_dir",
        str(w.out),
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "1",
        "--report_to",
        "none",
        "--zero_stage",
        "2",
    ]
    return flags, str(missing)


def _nonempty_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_llmft_train_nproc_per_node_turns_a_bad_input_into_one_line_under_a_real_torchrun(
    tiny_model, tiny_data, tmp_path
):
    """`llmft train --nproc_per_node 2`: torchrun's agent in llmft's process (gloo, 2 ranks); stderr is llmft's line
    first and last (no ChildFailedError traceback, no failure table), exit code 2, nothing written."""
    from conftest import PYTHON, run

    w = Workspace(tmp_path / "ws", tiny_model, tiny_data)
    flags, missing = _missing_data_flags(w)
    before = _snapshot(w.root)
    proc = run([PYTHON, "-m", "llmft.cli", "train", "--nproc_per_node", "2", *flags], timeout=300)
    lines = _nonempty_lines(proc.stderr)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert lines and lines[0] == lines[-1], proc.stderr[-3000:]
    assert lines[0].startswith("llmft train: error: ") and missing in lines[0], proc.stderr[-3000:]
    assert sum(line.startswith("llmft train: error:") for line in lines) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr
    assert _snapshot(w.root) == before and not w.out.exists()


def test_plain_torchrun_shows_llmfts_line_as_the_root_cause_instead_of_a_link(tiny_model, tiny_data, tmp_path):
    """Plain `torchrun -m llmft.train` still prints its own traceback (its process, not llmft's), but the failure
    table it prints names llmft's line as the root cause (written to TORCHELASTIC_ERROR_FILE), not a docs link."""
    from conftest import PYTHON, run

    w = Workspace(tmp_path / "ws", tiny_model, tiny_data)
    flags, missing = _missing_data_flags(w)
    proc = run(
        [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "llmft.train", *flags],
        timeout=300,
    )
    assert proc.returncode != 0
    root_cause = proc.stderr.split("Root Cause (first observed failure):", 1)[1]
    assert "traceback : llmft train: error: " in root_cause and missing in root_cause, proc.stderr[-3000:]
    assert "To enable traceback see" not in proc.stderr


@pytest.mark.parametrize(
    "argv, nproc, rest, problem",
    [
        (["--nproc_per_node", "4", "--output_dir", "x"], 4, ["--output_dir", "x"], None),
        (["--output_dir", "x", "--nproc_per_node=2"], 2, ["--output_dir", "x"], None),
        (["--output_dir", "x"], None, ["--output_dir", "x"], None),
        (["--nproc_per_node", "four"], None, [], "'four' is not a number of processes"),
        (["--nproc_per_node", "0"], None, [], "'0' is not a number of processes"),
        (["--output_dir", "x", "--nproc_per_node"], None, ["--output_dir", "x", "--nproc_per_node"], "needs a number"),
    ],
)
def test_nproc_per_node_is_taken_off_the_training_flags(argv, nproc, rest, problem):
    from llmft.training.launcher import take_nproc_per_node

    got_nproc, got_rest, got_problem = take_nproc_per_node(argv)
    assert (got_nproc, got_rest) == (nproc, rest)
    assert (problem is None and got_problem is None) or problem in got_problem

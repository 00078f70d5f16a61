"""The whole path on a laptop CPU: tiny model + data, a 2-process ZeRO-2 fine-tune, generation from the checkpoint.

    python -m llmft.demo --out runs/demo            # what `make demo` runs
    python -m llmft.demo --out runs/demo --nproc 1 --zero_stage 3

Everything is offline: the model is built from a config, the tokenizer is trained locally and the
data is generated in code. Rerunning with the same --out resumes the finished run (nothing is
retrained or overwritten) and generates again.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from llmft.checkpoint.run_dir import choose_checkpoint, tag_dir
from llmft.command import command_parser
from llmft.data.synthetic import as_format, make_examples, make_model_dir, write_jsonl

PROMPTS = ["What is 2 plus 3?", "Spell garden backwards."]


def run(cmd: list[str]) -> None:
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})


def newest_tag_dir(output_dir: Path) -> Path:
    """The checkpoint training would resume from (llmft.checkpoint.run_dir.choose_checkpoint), as a tag directory."""

    ckpt, _ = choose_checkpoint(output_dir)
    tag = tag_dir(ckpt) if ckpt is not None else None
    if tag is None:
        raise SystemExit(f"llmft demo: no complete checkpoint in {output_dir}")
    return tag


def make_parser(subparsers=None):
    description = "Tiny offline fine-tune (torchrun, DeepSpeed ZeRO on CPU) and inference from its checkpoint."
    parser = command_parser(subparsers, "demo", description)
    parser.add_argument("--out", type=Path, default=Path("runs/demo"))
    parser.add_argument("--nproc", type=int, default=2, help="processes for torchrun")
    parser.add_argument("--zero_stage", type=int, default=2)
    parser.add_argument(
        "--epochs", type=float, default=12, help="12 (about 2 minutes on 2 CPU cores) is enough for correct answers"
    )
    parser.set_defaults(func=main)
    return parser


def main(args) -> int:
    out = args.out
    model_dir, data = out / "tiny-model", out / "data.jsonl"
    if not (model_dir / "config.json").is_file():
        make_model_dir(model_dir, n_layer=2, n_embd=128, n_head=4)
        write_jsonl(as_format(make_examples(1024), "prompt_completion"), data)
        print(f"llmft demo: tiny model in {model_dir}, 1024 generated examples in {data}")
    run_dir = out / "run"
    run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(args.nproc),
            "-m",
            "llmft.train",
            "--model_name_or_path",
            str(model_dir),
            "--dataset_name",
            str(data),
            "--output_dir",
            str(run_dir),
            "--zero_stage",
            str(args.zero_stage),
            "--global_batch_size",
            "32",
            "--per_device_train_batch_size",
            "8",
            "--num_train_epochs",
            str(args.epochs),
            "--learning_rate",
            "3e-3",
            "--lr_scheduler_type",
            "cosine",
            "--warmup_steps",
            "5",
            "--logging_steps",
            "10",
            "--save_steps",
            "40",
            "--save_total_limit",
            "2",
            "--report_to",
            "none",
            "--disable_tqdm",
            "true",
        ]
    )
    tag = newest_tag_dir(run_dir)
    cmd = [sys.executable, "-m", "llmft.infer", str(tag), "--max_new_tokens", "16"]
    for p in PROMPTS:
        cmd += ["--prompt", p + "\n"]
    run(cmd)
    return 0


if __name__ == "__main__":
    sys.exit(main(make_parser().parse_args()))

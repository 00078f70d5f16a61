"""The baseline for bench_overhead.py: TRL's SFTTrainer on DeepSpeed with nothing of llmft, as a user would write it.

    torchrun --nproc_per_node 2 bench/plain_trl_sft.py MODEL DATA.jsonl OUT DS_CONFIG.json \
        --micro_batch 8 --grad_accum 2 --max_steps 30 --learning_rate 3e-3 --logging_steps 10

Only what TRL + DeepSpeed need to run at all on a CPU machine is added (use_cpu, fp32, a gloo process group),
the same three settings llmft makes; everything else is TRL's default.
"""

import argparse

import deepspeed
import torch
from datasets import load_dataset
from transformers import AutoTokenizer
from trl import SFTConfig, SFTTrainer

p = argparse.ArgumentParser()
for name in ("model", "data", "out", "ds_config"):
    p.add_argument(name)
p.add_argument("--micro_batch", type=int, required=True)
p.add_argument("--grad_accum", type=int, required=True)
p.add_argument("--max_steps", type=int, required=True)
p.add_argument("--learning_rate", type=float, required=True)
p.add_argument("--logging_steps", type=int, required=True)
a = p.parse_args()

cuda = torch.cuda.is_available()
args = SFTConfig(
    output_dir=a.out,
    deepspeed=a.ds_config,
    per_device_train_batch_size=a.micro_batch,
    gradient_accumulation_steps=a.grad_accum,
    max_steps=a.max_steps,
    learning_rate=a.learning_rate,
    logging_steps=a.logging_steps,
    report_to="none",
    disable_tqdm=True,
    bf16=cuda,
    use_cpu=not cuda,
    dataloader_pin_memory=cuda,
)
_ = args.device
deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
trainer = SFTTrainer(
    model=a.model,
    args=args,
    train_dataset=load_dataset("json", data_files=a.data, split="train"),
    processing_class=AutoTokenizer.from_pretrained(a.model),
)
trainer.train()
trainer.save_model(a.out)
trainer.end()  # destroys the process group before exit (see tests/test_zero_checkpoint.py)

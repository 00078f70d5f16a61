"""Weights & Biases settings for a Slurm or PBS job, printed for the job script to export (llmft.training.wandb_env).

python -m llmft.tracking slurm-env --output_dir CHECKPOINT_DIR    # prints WANDB_*=... lines, nothing else
python -m llmft.tracking job-env --output_dir CHECKPOINT_DIR      # the same, for a Slurm or a PBS job
"""

from __future__ import annotations

import os
import socket
import sys

from llmft.command import command_parser
from llmft.training.wandb_env import reachable, server_url, slurm_wandb_env


def make_parser(subparsers=None):
    parser = command_parser(subparsers, "tracking", "W&B settings for a Slurm job (used by slurm/run_llm.slurm).")
    sub = parser.add_subparsers(dest="action", required=True)
    for name in ("slurm-env", "job-env"):  # job-env: the same for a Slurm or a PBS job (llmft.launch.pbs)
        job = sub.add_parser(name, help="print this job's WANDB_* variables, one KEY=VALUE per line")
        job.add_argument("--output_dir", required=True, help="the run's output directory (W&B writes under it)")
        job.add_argument("--timeout", type=float, default=3.0, help="seconds the connectivity check may take")
    parser.set_defaults(func=main)
    return parser


def main(args) -> int:
    env = os.environ
    online = None
    if not env.get("WANDB_MODE"):
        url = server_url(env)
        online = reachable(url, args.timeout)
        print(
            f"llmft tracking: W&B server {url} {'answered' if online else f'did not answer within {args.timeout:g}s'} "
            f"from {socket.gethostname()}",
            file=sys.stderr,
        )
    try:
        values = slurm_wandb_env(env, args.output_dir, online)
    except ValueError as e:
        raise SystemExit(f"llmft tracking: error: {e}") from None
    for key, value in values.items():
        if "\n" in value:
            raise SystemExit(f"llmft tracking: error: {key} would hold a newline")
        print(f"{key}={value}")
    return 0


if __name__ == "__main__":
    sys.exit(main(make_parser().parse_args()))

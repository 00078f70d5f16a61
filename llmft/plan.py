"""The run plan: world, micro-batch, accumulation, global batch, ZeRO config and precision, before any model loads.

`llmft train` computes it in every process; `llmft plan` prints it on a login node or in a batch
script's first lines, so a user sees (and a bad knob fails) before GPUs are spent.

    llmft plan --global_batch_size 32 --per_device_train_batch_size 2 --nnodes 2 --nproc_per_node 4
    llmft plan --global_batch_size 32 --per_device_train_batch_size 2 --zero_stage 3 --offload   # world from Slurm/torchrun env
    llmft plan --global_batch_size 32 --per_device_train_batch_size 2 --print_launch   # + the line slurm/run_llm.slurm launches from
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from llmft.batch import BatchError, BatchPlan, plan_batch
from llmft.cli import command_parser
from llmft.ds_config import (
    DSConfigError,
    load_config,
    offloads,
    template_path,
    zero_stage_of,
)
from llmft.hardware import AUTO_PRECISION, PRECISIONS
from llmft.launch_env import CpuSplit, LaunchEnvError, World, cpu_split, discover_cpus, discover_world



class PlanError(ValueError):
    """Any reason a run cannot start; its message says what to change."""


@dataclass(frozen=True)
class RunPlan:
    world: World
    batch: BatchPlan
    ds_template: Path
    zero_stage: int
    offload: bool
    precision: str
    output_dir: str

    def lines(self) -> list[str]:
        b = self.batch
        return [
            f"llmft plan: {self.world.describe()}",
            f"llmft plan: micro-batch {b.micro_batch} per process",
            f"llmft plan: gradient accumulation {b.grad_accum}",
            f"llmft plan: global batch {b.global_batch} = micro-batch {b.micro_batch} x accumulation {b.grad_accum} x world size {b.world_size}",
            f"llmft plan: ZeRO stage {self.zero_stage}{' with CPU offload' if self.offload else ''} ({self.ds_template})",
            f"llmft plan: precision {self.precision}",
            f"llmft plan: checkpoint dir {self.output_dir or '(not set)'}",
        ]


def make_plan(
    *,
    micro_batch: int,
    global_batch: int | None = None,
    grad_accum: int | None = None,
    zero_stage: int | None = None,
    offload: bool = False,
    deepspeed: str | None = None,
    precision: str = "fp32",
    output_dir: str = "",
    world: World | None = None,
) -> RunPlan:
    """Check everything that can be checked without a model; raise PlanError naming the fix."""
    try:
        world = world or discover_world()
        batch = plan_batch(world.world_size, micro_batch, global_batch, grad_accum)
        path = template_path(zero_stage, offload, deepspeed)
        config = load_config(path)
    except (BatchError, DSConfigError, LaunchEnvError) as e:
        raise PlanError(str(e)) from None
    return RunPlan(world, batch, path, zero_stage_of(config), offloads(config), precision, output_dir)


def make_parser(subparsers=None):
    description = "Print the resolved run plan (world, batch math, ZeRO config) without loading a model."
    parser = command_parser(subparsers, "plan", description)
    parser.add_argument("--global_batch_size", type=int, default=None)
    parser.add_argument("--per_device_train_batch_size", type=int, default=8, help="micro-batch per process (HF default 8)")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=None)
    parser.add_argument("--nnodes", type=int, default=None, help="default: from Slurm/torchrun variables")
    parser.add_argument("--nproc_per_node", type=int, default=None, help="default: GPUs Slurm gave the node, or local GPUs")
    parser.add_argument("--zero_stage", type=int, default=None)
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--deepspeed", default=None)
    parser.add_argument("--precision", default="auto", choices=PRECISIONS)
    parser.add_argument("--output_dir", default="")
    parser.add_argument("--print_launch", action="store_true",
                        help="also print the world and CPU split as one 'llmft launch: key=value ...' line (read by slurm/run_llm.slurm)")
    parser.set_defaults(func=main)
    return parser


def main(args) -> int:
    try:
        world = discover_world()
        if args.nnodes is not None or args.nproc_per_node is not None:
            nnodes = world.nnodes if args.nnodes is None else args.nnodes  # 0 is a mistake to report, not "unset"
            procs = world.procs_per_node if args.nproc_per_node is None else args.nproc_per_node
            world = World(nnodes, procs, "arguments")
        if world.nnodes < 1 or world.procs_per_node < 1:
            raise PlanError("--nnodes and --nproc_per_node must be positive")
        # Planning on a login node: say what the GPU nodes will pick (llmft.hardware.choose_precision's rule).
        precision = AUTO_PRECISION if args.precision == "auto" else args.precision
        plan = make_plan(
            micro_batch=args.per_device_train_batch_size,
            global_batch=args.global_batch_size,
            grad_accum=args.gradient_accumulation_steps,
            zero_stage=args.zero_stage,
            offload=args.offload,
            deepspeed=args.deepspeed,
            precision=precision,
            output_dir=args.output_dir,
            world=world,
        )
        cpus, source = discover_cpus()
    except (PlanError, LaunchEnvError) as e:
        print(f"llmft plan: error: {e}", file=sys.stderr)
        return 2
    print("\n".join(plan.lines()))
    if source == "slurm" or args.print_launch:
        split = cpu_split(cpus, plan.world.procs_per_node, source)
        print(f"llmft plan: {split.describe()}")
        if split.warning():
            print(f"llmft plan: warning: {split.warning()}")
        if args.print_launch:
            print(launch_line(plan.world, split))
    return 0


def launch_line(world: World, split: CpuSplit) -> str:
    """The launch decisions as one machine-readable line, so the Slurm script never recomputes them."""
    return (f"llmft launch: nnodes={world.nnodes} nproc_per_node={world.procs_per_node} cpus_per_node={split.cpus_per_node} "
            f"omp_num_threads={split.threads_per_process} dataloader_num_workers={split.dataloader_workers} "
            f"dataset_num_proc={split.dataset_num_proc}")


if __name__ == "__main__":
    sys.exit(main(make_parser().parse_args()))

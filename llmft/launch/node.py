"""The per-node wrapper of both schedulers' jobs: one on each node, around torchrun (or a probe of the node).

    python -m llmft.launch.node --job run_llm.slurm --failures DIR -- torchrun ...          # Slurm: srun, one per node
    python -m llmft.launch.node --job run_llm.pbs --env_file F --failures DIR --node n1 -- enroot start ... torchrun ...

Slurm starts it with `srun` (inside the job's pyxis container when there is one: the container's Python runs it);
PBS with `pbsdsh -n INDEX` on the host, since pbsdsh passes only the job's own variables: the environment the job
decided comes from `--env_file`, and the command starts the node's enroot container itself. What it does is the same:

- it says where it starts, then runs the command with both streams passing through it (PBS closes a task's output
  when the job is signalled, and a rank printing to it then would die of a broken pipe before its stop checkpoint);
- it outlives the command through SIGTERM and SIGINT (the scheduler signals every process of the node's task; the
  ranks still write their stop checkpoint, and torchrun passes the signal on) and ignores SIGUSR1 (a PBS job's
  `qsig` reaches every process of the job: the launcher acts on it, and the ranks handle it once their own handler is
  in place; ignored through exec until then);
- when the command fails, it writes the node's report (`node-<node rank>.json`, llmft.launch.failure_blame:
  torchrun's stderr and the node's kernel log) to the failures directory: a node that writes none counts as dead;
- it records its exit status (`exit-<node>`), which PBS's launcher reads because pbsdsh returns 0 whatever its task
  did; Slurm's takes srun's status, and the record is there alike.

`--out FILE` runs a probe instead: its output to FILE on success, else to FILE.failed with its exit status.
`--create ENROOT IMAGE NAME` makes the node's enroot container afresh before the command; `--remove ...` removes it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from llmft.launch import failure_blame
from llmft.launch.job import container_gpu_variables


def node_facts(env: Mapping[str, str], given_name: str = "") -> tuple[str, str, str]:
    """(node name, node rank, 'G GPU(s) and C CPU(s)') from the scheduler's variables on the node: Slurm's srun sets
    SLURMD_NODENAME, SLURM_NODEID, SLURM_GPUS_ON_NODE and SLURM_CPUS_ON_NODE; PBS's task manager sets PBS_NODENUM
    and NCPUS, and the PBS launcher passes the node's name (`--node`: PBS's, since all nodes may share one hostname)
    and its GPUs (LLMFT_NODE_GPUS)."""
    name = given_name or env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    rank = env.get("SLURM_NODEID") or env.get("PBS_NODENUM") or "0"
    gpus = env.get("SLURM_GPUS_ON_NODE") or env.get("LLMFT_NODE_GPUS") or "0"
    cpus = env.get("SLURM_CPUS_ON_NODE") or env.get("NCPUS") or "?"
    return name, rank, f"{gpus} GPU(s) and {cpus} CPU(s)"


def container_gpu_env(command: Sequence[str], env: Mapping[str, str]) -> dict[str, str]:
    """What a node's `enroot start` passes for its GPUs: this node's GPUs of the job (the CUDA_VISIBLE_DEVICES PBS's
    cgroups hook sets, else every GPU the node lets the job open) and compute,utility (CUDA and nvidia-smi), each
    unless the site set it; nothing for a command that passes no GPUs."""
    if "NVIDIA_VISIBLE_DEVICES" not in command:
        return {}
    # CUDA_VISIBLE_DEVICES stays outside (the launcher never passes it in): inside, the mounted GPUs count from 0
    return container_gpu_variables(env, env.get("CUDA_VISIBLE_DEVICES") or "all")


def forward(stream, to, copy) -> None:
    """Every line of `stream` to `to` while it takes them (PBS may close a task's output as the job ends: the lines
    then go on being read, so the writer never blocks or breaks), and to `copy` always."""
    echo = True
    for line in stream:
        if copy is not None:
            copy.write(line)
        if echo:
            try:
                to.write(line)
                to.flush()
            except (OSError, ValueError):
                echo = False


def container(action: str, enroot: str, image: str, name: str, env: Mapping[str, str]) -> int:
    """This node's enroot container of the job: `--create` makes it afresh from the image (a container of that name
    left by an earlier run of this job that was killed before its removal is removed first: a rerun starts from the
    image, not from what the killed run wrote), `--remove` removes it when there."""
    listed = subprocess.run([enroot, "list"], capture_output=True, text=True, env=dict(env))
    steps = [[enroot, "remove", "-f", name]] if name in listed.stdout.split() else []
    if action == "--create":
        steps.append([enroot, "create", "--name", name, image])
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, env=dict(env))
        if done.returncode != 0:
            last = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or [""]
            print(f"{' '.join(step)} failed (exit {done.returncode}): {last[0]}", flush=True)
            return 2
    return 0


def probe(command: Sequence[str], env: Mapping[str, str], out_file: Path) -> int:
    """A probe of the node: its output to `out_file` on success, else to `<file>.failed` with its exit status and
    output (a task's own output goes to the job's, and the launcher must read each node's apart)."""
    proc = subprocess.run(list(command), env=dict(env), stdout=subprocess.PIPE, text=True)
    tmp = Path(f"{out_file}.tmp")  # per node (with_suffix would give both nodes one name)
    tmp.write_text(proc.stdout if proc.returncode == 0 else f"exit {proc.returncode}: {proc.stdout.strip()}")
    tmp.replace(out_file if proc.returncode == 0 else Path(f"{out_file}.failed"))
    return proc.returncode


def run_through(command: Sequence[str], env: Mapping[str, str], err_path: Path) -> int:
    """The command with its stdout and stderr passing through this process (stderr also copied to `err_path`, for
    the failure report); its exit status as a shell gives it (128 + N for a command killed by signal N), as the
    scheduler records a task's."""
    with open(err_path, "w") as err:
        proc = subprocess.Popen(
            list(command), env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        out = threading.Thread(target=forward, args=(proc.stdout, sys.stdout, None), daemon=True)
        out.start()
        forward(proc.stderr, sys.stderr, err)
        rc = proc.wait()
        out.join(timeout=10)
    return 128 - rc if rc < 0 else rc


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def failure_report(node: str, rc: int, err_path: Path, since: float) -> str:
    """The node's report (llmft.launch.failure_blame.node_report), or one that says it could not be made: a report
    is always written, since a node without one counts as dead."""
    try:
        stderr = err_path.read_text(errors="replace") if err_path.exists() else ""
        return json.dumps(failure_blame.node_report(node, rc, stderr, since))
    except Exception as e:  # noqa: BLE001 - whatever failed, the node reports its exit status
        print(f"node {node}: llmft.launch.failure_blame could not write the report of this node: {e}", file=sys.stderr)
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", node)
        return json.dumps({"node": safe, "rc": rc, "cause": "no report: llmft.launch.failure_blame failed"})


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m llmft.launch.node", description=__doc__.split("\n")[0], allow_abbrev=False
    )
    parser.add_argument("--job", default="llmft", help="the job script's name, said before each line")
    parser.add_argument(
        "--env_file", type=Path, help="JSON of the variables the job decided (PBS: pbsdsh passes none)"
    )
    parser.add_argument("--failures", type=Path, help="where a failing node writes its report and every node its exit")
    parser.add_argument("--node", default="", help="this node's name (default: SLURMD_NODENAME, else the hostname)")
    parser.add_argument("--out", type=Path, help="a probe: its output to this file (FILE.failed on a failure)")
    for action in ("--create", "--remove"):
        parser.add_argument(action, nargs=3, metavar=("ENROOT", "IMAGE", "NAME"), help=f"{action[2:]} the container")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args, command = make_parser().parse_args(argv[:split]), argv[split + 1 :]
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    env = dict(os.environ)
    if args.env_file is not None:
        env.update(json.loads(args.env_file.read_text()))
    os.environ.update(env)  # the failure report reads the node's variables (the tests' kernel-log hook among them)
    name, rank, resources = node_facts(env, args.node)
    env["LLMFT_NODE_NAME"] = name  # the node's name in the scheduler (llmft.planning.allocation prints it)
    if args.remove:
        return container("--remove", *args.remove, env)
    if args.create and container("--create", *args.create, env) != 0:
        return 2
    env.update(container_gpu_env(command, env))
    if args.out is not None:
        return probe(command, env, args.out)
    print(f"{args.job}: node {name} (node rank {rank}): torchrun with {resources}", flush=True)
    for sig in (signal.SIGTERM, signal.SIGINT):  # outlive the command: it passes the signal on and the ranks save
        signal.signal(sig, lambda *_: None)
    started = time.time()
    err_path = Path(env.get("TMPDIR") or "/tmp") / f"llmft-torchrun-err-{os.getpid()}"
    try:
        rc = run_through(command, env, err_path)
        if rc != 0 and args.failures is not None:
            write_atomically(args.failures / f"node-{rank}.json", failure_report(name, rc, err_path, started))
    finally:
        err_path.unlink(missing_ok=True)
    if args.failures is not None:  # PBS's launcher waits for this, not for pbsdsh
        write_atomically(args.failures / f"exit-{name}", f"{rc}\n")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())

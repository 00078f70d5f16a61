"""Test hook (tests/test_slurm.py, tests/test_pbs.py): on PYTHONPATH, it fails the training rank on node
$LLMFT_TEST_KILL_NODE (Slurm's SLURMD_NODENAME, or the PBS node name llmft.launch.pbs gives LLMFT_NODE_NAME) once the
file $LLMFT_TEST_KILL_AFTER exists (a checkpoint's marker: a known step), once (in a job's first attempt, before any
rank wrote $LLMFT_TEST_KILL_RECORD), and writes that rank and the time to $LLMFT_TEST_KILL_RECORD.
$LLMFT_TEST_KILL_SIGNAL says how: KILL (the default) SIGKILLs it; HANG makes its next all_reduce never return, like a
rank stuck before a collective (a kernel, a read, a deadlock), so its peers wait in theirs; OOM makes its next
all_reduce raise torch.OutOfMemoryError, as a CUDA allocation that does not fit would (an application failure). With
$LLMFT_TEST_KERNEL_LOG_DIR set, KILL and HANG first write an Xid 79 (the GPU fell off the bus) to that node's test
kernel log, $LLMFT_TEST_KERNEL_LOG_DIR/<node>, which llmft.launch.failure_blame then reads instead of the kernel's:
evidence against the node. Every other process is left alone."""

import os

_NODE = os.environ.get("SLURMD_NODENAME") or os.environ.get("LLMFT_NODE_NAME")


def _record() -> None:
    import time

    with open(os.environ["LLMFT_TEST_KILL_RECORD"], "w") as f:
        f.write(f"{os.environ['RANK']} {time.time()}\n")
    kernel_log = os.environ.get("LLMFT_TEST_KERNEL_LOG_DIR")
    if kernel_log and os.environ.get("LLMFT_TEST_KILL_SIGNAL", "KILL") in ("KILL", "HANG"):
        os.makedirs(kernel_log, exist_ok=True)
        with open(os.path.join(kernel_log, _NODE), "a") as f:
            f.write(f"NVRM: Xid (PCI:0000:3b:00): 79, pid={os.getpid()}, GPU has fallen off the bus.\n")


def _kill_when_there(path: str) -> None:
    import signal
    import time

    while not os.path.exists(path):
        time.sleep(0.1)
    _record()
    os.kill(os.getpid(), signal.SIGKILL)


def _fail_at_next_all_reduce(path: str, how: str) -> None:
    import time

    import torch
    import torch.distributed as dist

    real = dist.all_reduce

    def all_reduce(*args, **kwargs):
        if os.path.exists(path):
            _record()
            if how == "OOM":
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (tests/kill_hook)")
            while True:
                time.sleep(3600)
        return real(*args, **kwargs)

    dist.all_reduce = all_reduce


if (
    os.environ.get("LLMFT_TEST_KILL_AFTER")
    and "RANK" in os.environ
    and "LOCAL_RANK" in os.environ
    and _NODE == os.environ.get("LLMFT_TEST_KILL_NODE")
    and os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
    and not os.path.exists(os.environ.get("LLMFT_TEST_KILL_RECORD", ""))
):
    if os.environ.get("LLMFT_TEST_KILL_SIGNAL") in ("HANG", "OOM"):
        _fail_at_next_all_reduce(os.environ["LLMFT_TEST_KILL_AFTER"], os.environ["LLMFT_TEST_KILL_SIGNAL"])
    else:
        import threading

        threading.Thread(target=_kill_when_there, args=(os.environ["LLMFT_TEST_KILL_AFTER"],), daemon=True).start()

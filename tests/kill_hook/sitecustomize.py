"""Test hook (tests/test_slurm.py): on PYTHONPATH, it SIGKILLs the training rank on node $LLMFT_TEST_KILL_NODE once
the file $LLMFT_TEST_KILL_AFTER exists (a checkpoint's marker: a known step), in a job's first attempt only, and
writes that rank and the time to $LLMFT_TEST_KILL_RECORD. Every other process is left alone."""

import os

if (
    os.environ.get("LLMFT_TEST_KILL_AFTER")
    and "RANK" in os.environ
    and "LOCAL_RANK" in os.environ
    and os.environ.get("SLURMD_NODENAME") == os.environ.get("LLMFT_TEST_KILL_NODE")
    and os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
):
    import signal
    import threading
    import time

    def _kill_when_there(path: str) -> None:
        while not os.path.exists(path):
            time.sleep(0.1)
        with open(os.environ["LLMFT_TEST_KILL_RECORD"], "w") as f:
            f.write(f"{os.environ['RANK']} {time.time()}\n")
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=_kill_when_there, args=(os.environ["LLMFT_TEST_KILL_AFTER"],), daemon=True).start()

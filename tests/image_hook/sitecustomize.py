"""Test hook (tests/test_container_jobs.py): on PYTHONPATH, each training rank (a process torchrun started: RANK is
set) writes where it runs to $LLMFT_TEST_IMAGE_RECORD/rank-<RANK>-<pid>.json: its interpreter, that interpreter's
real path and version, the text of /etc/llmft-test-image, a file only the test image has (None where there is none),
and where squeue is (None: no Slurm client there). Every other process is left alone."""

import os

if os.environ.get("LLMFT_TEST_IMAGE_RECORD") and os.environ.get("RANK") and os.environ.get("LOCAL_RANK"):
    import json
    import shutil
    import sys

    _marker = "/etc/llmft-test-image"
    _record = {
        "rank": int(os.environ["RANK"]),
        "executable": sys.executable,
        "real_executable": os.path.realpath(sys.executable),
        "version": sys.version.split()[0],
        "image": open(_marker).read() if os.path.isfile(_marker) else None,
        "squeue": shutil.which("squeue"),
    }
    _path = os.path.join(os.environ["LLMFT_TEST_IMAGE_RECORD"], f"rank-{_record['rank']}-{os.getpid()}.json")
    with open(_path, "w") as _f:
        json.dump(_record, _f)

"""How a PBS run goes on after its job ends early: a chained job, submitted by the job itself.

Slurm's job requeues itself (`scontrol requeue`, the same job id). PBS lets only operators and managers requeue a
job (`qrerun`), so a user's job cannot; instead it submits its continuation, `qsub -W depend=afterany:<this job>`,
which starts once this one has ended and resumes from the newest complete checkpoint. `-r y` (pbs/run_llm.pbs's
default) still lets PBS itself rerun the job after a node failure, and an operator's `qrerun` works as on any job.

The continuation is the same job: the same script (copied into the run directory when the job starts), resources
(select, place, walltime, and every other `-l` resource the job was submitted with, read from `qstat -f`'s
Submit_arguments), account (`-A`), project (`-P`), group list (`-W group_list`), name, queue and output options,
its Python (VENV: the knob, else the virtual environment the launcher itself runs in, so a `qsub -V` submission's
continuation does not fall back to python3), and the same variables, which travel in a JSON file in
the run directory (`qsub -v` cannot carry values with commas safely) and are read back as data, never as shell.
It trains in the same run directory (a sweep element: its variant's, with the variant's flags), and logs to the
same W&B run.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Mapping
from pathlib import Path

CONTINUE_ENV = "LLMFT_CONTINUE"  # the JSON file of variables a continuation starts with
RESTARTS_ENV = "LLMFT_FAILURE_RESTARTS"  # how many times the run was continued after a failure
PASSED_ON = ("WANDB_NAME", "WANDB_RUN_ID", "WANDB_RUN_GROUP", "WANDB_MODE", "LLMFT_SWEEP_VARIANT")


def load(env: Mapping[str, str]) -> dict[str, str]:
    """The job's environment with a continuation's variables applied (they win over the job's own)."""
    path = env.get(CONTINUE_ENV)
    if not path:
        return dict(env)
    values = json.loads(Path(path).read_text())
    return {**env, **{str(k): str(v) for k, v in values.items()}}


def variables(
    job: Mapping, env: Mapping[str, str], run_dir: Path, extra_args: list[str], node_env: Mapping[str, str]
) -> dict[str, str]:
    """The variables the continuation runs with: this job's (`qsub -v`, and a continuation's before it), its run
    directory fixed, a sweep element's flags folded into EXTRA_ARGS, and the W&B run it logs to."""
    given = {k: str(v) for k, v in job.get("Variable_List", {}).items() if not k.startswith("PBS_")}
    if env.get(CONTINUE_ENV):
        given.update(json.loads(Path(env[CONTINUE_ENV]).read_text()))
    given.pop(CONTINUE_ENV, None)
    given["CHECKPOINT_DIR"] = str(run_dir)
    if given.pop("SWEEP", None) is not None:
        given["EXTRA_ARGS"] = " ".join(extra_args)
    for name in PASSED_ON:
        if node_env.get(name):
            given[name] = node_env[name]
    return given


def qsub_command(
    job: Mapping, job_id: str, script: Path, variables_file: Path, attempt: int, venv: str = "", pythonpath: str = ""
) -> list[str]:
    """`qsub` for the continuation, as an argument list (no shell): after this job ends (afterany), with its
    resources (kept_resources), account, project, group list, name, queue and output options. An output file the
    user named gets `.<attempt>` so the logs of the earlier jobs are kept; PBS's default name carries the new job's id
    anyway."""
    cmd = ["qsub", "-W", f"depend=afterany:{job_id}", "-N", str(job.get("Job_Name", "llmft"))]
    if job.get("queue"):
        cmd += ["-q", str(job["queue"])]
    for key, value in kept_resources(job):
        cmd += ["-l", f"{key}={value}"]
    if job.get("Account_Name"):
        cmd += ["-A", str(job["Account_Name"])]
    if job.get("project") and job["project"] != DEFAULT_PROJECT:
        cmd += ["-P", str(job["project"])]
    if job.get("group_list"):
        cmd += ["-W", f"group_list={job['group_list']}"]
    cmd += ["-r", "y" if str(job.get("Rerunable", "True")).lower() in ("true", "y") else "n"]
    if job.get("Join_Path") and job["Join_Path"] != "n":
        cmd += ["-j", str(job["Join_Path"])]
    seq = job_id.split(".")[0]
    for flag, key in (("-o", "Output_Path"), ("-e", "Error_Path")):
        path = str(job.get(key, ""))
        path = path.split(":", 1)[1] if ":" in path else path
        if path and not re.search(rf"\.[oe]{re.escape(seq)}$", path):
            base = re.sub(r"[.]\d+$", "", path)  # the first job's name, without an earlier continuation's number
            cmd += [flag, f"{base}.{attempt}"]
    # VENV and PYTHONPATH too, where they can travel in -v: pbs/run_llm.pbs picks its Python, and the launcher imports
    # llmft, before the file is read (a continuation would otherwise run another llmft than the job's).
    passed = f"{CONTINUE_ENV}={variables_file}"
    for name, value in (("VENV", venv), ("PYTHONPATH", pythonpath)):
        passed += f",{name}={value}" if value and "," not in value else ""
    cmd += ["-v", passed, str(script)]
    return cmd


DEFAULT_PROJECT = "_pbs_project_default"  # what qstat -f names a job submitted without -P


def user_resources(submit_arguments: str) -> dict[str, str]:
    """The `-l` resources in a job's Submit_arguments (qstat -f), as given: `-l a=1,b=2`, `-la=1`; read as data."""
    try:
        words = shlex.split(submit_arguments)
    except ValueError:
        return {}
    out: dict[str, str] = {}
    for i, word in enumerate(words):
        if word == "-l" and i + 1 < len(words):
            given = words[i + 1]
        elif word.startswith("-l") and len(word) > 2:
            given = word[2:]
        else:
            continue
        for item in given.split(","):
            key, sep, value = item.partition("=")
            if sep and key:
                out[key] = value
    return out


def kept_resources(job: Mapping) -> list[tuple[str, str]]:
    """The resources the continuation asks for: select, place and walltime as the job has them (its #PBS lines
    included), then every other `-l` resource it was submitted with, as PBS holds it (Resource_List). A chunk resource
    the select statement carries already (ncpus, mem, ...), and `nodes` beside a select, are left to the select: PBS
    turned them into it, and refuses both."""
    resources = job.get("Resource_List", {})
    kept = [(key, str(resources[key])) for key in ("select", "place", "walltime") if resources.get(key)]
    select = str(resources.get("select", ""))
    in_select = set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=", select)) | ({"nodes"} if select else set())
    for key, value in user_resources(str(job.get("Submit_arguments", ""))).items():
        if key in ("select", "place", "walltime") or key in in_select:
            continue
        kept.append((key, str(resources.get(key, value))))
    return kept


def write_variables(path: Path, values: Mapping[str, str]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(values), indent=1) + "\n")
    os.replace(tmp, path)

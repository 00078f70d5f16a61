"""Weights & Biases inside Slurm jobs: one run per job, resumed by its requeues, offline where nodes have no internet.

The batch script (slurm/run_llm.slurm) asks for the job's W&B settings (`slurm_wandb_env`, printed by llmft.tracking) and exports them:

    python -m llmft.tracking slurm-env --output_dir CHECKPOINT_DIR    # prints WANDB_*=... lines, nothing else

  - WANDB_NAME `<job-name>-<job-id>` (array tasks: `<job-name>-<array-job-id>_<task-id>`);
  - WANDB_RUN_GROUP the job name (array tasks: `<job-name>-<array-job-id>`, one group per sweep);
  - WANDB_RUN_ID derived from the job id (plus a hash of the cluster name and the output directory, so a
    recycled job id elsewhere never resumes someone else's run) with WANDB_RESUME=allow: a requeued job (same
    id) continues the same run; offline, each attempt writes its own directory with that id, and
    `wandb sync --id ID` uploads them into the one run, in order;
  - WANDB_MODE offline when the W&B server cannot be reached from the node (one TCP connection with a short
    bound on DNS and connect, never a hang), unless WANDB_MODE is set;
  - WANDB_DIR the output directory (shared storage), so offline runs sit beside the checkpoints.

Values already in the environment win. HF's WandbCallback logs from global rank 0 only. The API key is
never read or printed here.

W&B's service process (wandb-core) is a child of rank 0, so Slurm's SIGTERM (a requeue, a preemption)
ends it together with the job step while the ranks finish their step and checkpoint. Two settings keep
that from costing more than a few seconds of metrics: the offline run file is flushed every
FLUSH_INTERVAL_S seconds (W&B's default is 15 s, and nothing reaches the file before), and
`guard_wandb` stops a dead service from ending the run before its checkpoint is written.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from typing import Mapping

DEFAULT_BASE_URL = "https://api.wandb.ai"
FLUSH_INTERVAL_S = "2"


def server_url(env: Mapping[str, str]) -> str:
    """The W&B server (WANDB_BASE_URL, e.g. a self-hosted one; default https://api.wandb.ai)."""
    return env.get("WANDB_BASE_URL") or DEFAULT_BASE_URL


def reachable(url: str, timeout: float = 3.0) -> bool:
    """Whether the server answers an HTTP(S) request within `timeout` seconds (any status counts; proxies from
    HTTPS_PROXY are used as W&B would use them). A TCP connection alone proves little: intercepting proxies
    accept any. The attempt runs in a thread abandoned at the deadline, since name resolution has no timeout."""
    import urllib.error
    import urllib.request

    result: list[bool] = []

    def attempt():
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout):
                result.append(True)
        except urllib.error.HTTPError:  # the server answered (401, 404, ...): it is there
            result.append(True)
        except (OSError, ValueError):
            result.append(False)

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(result and result[0])


def _safe(text: str, limit: int = 48) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-")[:limit] or "job"


def job_identity(env: Mapping[str, str]) -> tuple[str, str, str | None, str | None, str]:
    """(job id, job name, array job, array index, cluster) of this Slurm or PBS job. PBS ids lose their server
    suffix ('12.head' -> '12'; an array element '12[2].head' -> '12[2]')."""
    if env.get("SLURM_JOB_ID", "").strip():
        return (
            env["SLURM_JOB_ID"].strip(),
            env.get("SLURM_JOB_NAME") or "job",
            env.get("SLURM_ARRAY_JOB_ID"),
            env.get("SLURM_ARRAY_TASK_ID"),
            env.get("SLURM_CLUSTER_NAME", ""),
        )
    if env.get("PBS_JOBID", "").strip():
        array = env.get("PBS_ARRAY_ID", "").split("[")[0] or None
        return (
            env["PBS_JOBID"].strip().split(".")[0],
            env.get("PBS_JOBNAME") or "job",
            array,
            env.get("PBS_ARRAY_INDEX") if array else None,
            env.get("PBS_SERVER", ""),
        )
    raise ValueError("not inside a Slurm job or a PBS job (SLURM_JOB_ID and PBS_JOBID are unset)")


def slurm_wandb_env(env: Mapping[str, str], output_dir: str, online: bool | None = None) -> dict[str, str]:
    """The W&B variables for this Slurm or PBS job (values already set in `env` are kept). `online`: whether the
    server is reachable; None means the mode is already decided (WANDB_MODE set) and is not checked. A sweep's
    element (LLMFT_SWEEP_VARIANT, set by the job script) is named by its variant."""
    job_id, name, array_job, array_task, cluster = job_identity(env)
    job_name = _safe(name)
    shown_id = f"{array_job}_{array_task}" if array_job and array_task else _safe(job_id)
    place = hashlib.sha256(f"{cluster}|{os.path.abspath(output_dir)}".encode()).hexdigest()[:8]
    variant = _safe(env.get("LLMFT_SWEEP_VARIANT", ""), 64) if env.get("LLMFT_SWEEP_VARIANT") else ""
    wanted = {
        "WANDB_NAME": f"{job_name}-{variant}-{shown_id}" if variant else f"{job_name}-{shown_id}",
        "WANDB_RUN_GROUP": f"{job_name}-{array_job}" if array_job else job_name,
        "WANDB_RUN_ID": f"{job_name}-{_safe(job_id)}-{place}",
        "WANDB_RESUME": "allow",
        "WANDB_DIR": os.path.abspath(output_dir),
        "WANDB_JOB_TYPE": "train",
        "WANDB__TRANSACTION_LOG_FLUSH_INTERVAL": FLUSH_INTERVAL_S,  # x_transaction_log_flush_interval
    }
    if not env.get("WANDB_MODE"):
        wanted["WANDB_MODE"] = "online" if online else "offline"
    return {k: v for k, v in wanted.items() if not env.get(k)}


def guard_wandb(trainer, log) -> bool:
    """Wrap the trainer's W&B callback so that a W&B service that died (SIGTERM to the job step) is reported
    once and skipped, instead of raising out of the training loop before the stop's checkpoint is saved.
    Returns whether there was a W&B callback to guard."""
    try:
        import wandb.errors
        from transformers.integrations import WandbCallback
    except ImportError:
        return False
    errors = (OSError, wandb.errors.Error)
    callbacks = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, WandbCallback)]
    for cb in callbacks:
        state = {"dead": False}
        for name in ("on_log", "on_save", "on_evaluate", "on_predict", "on_train_end"):
            original = getattr(cb, name)

            def guarded(*args, _original=original, **kwargs):
                if state["dead"]:
                    return None
                try:
                    return _original(*args, **kwargs)
                except errors as e:
                    state["dead"] = True
                    log(
                        f"W&B stopped logging ({type(e).__name__}: {e}; its service process ended, e.g. on SIGTERM); "
                        "training goes on, and what was logged before is in the run's files"
                    )
                    return None

            setattr(cb, name, guarded)
    return bool(callbacks)


# --------------------------------------------------------------------------------------------------
# CLI (for the batch script)

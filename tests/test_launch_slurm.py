"""llmft.launch.slurm without a scheduler: the job's arguments, its launch line, its network settings, and what
follows the training. The job on a real Slurm cluster is tests/test_slurm.py's."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from llmft.launch import job, knobs, slurm


def test_export_lists_split_at_commas_outside_quotes_as_sbatch_splits_them():
    assert slurm.split_export("ALL,A='x,y',B=\"1,2\",C=3") == ["ALL", "A='x,y'", 'B="1,2"', "C=3"]
    assert slurm.split_export("") == [""]


def test_arguments_are_read_in_order_and_the_first_bad_one_is_named():
    given, world, wants_help = slurm.read_arguments(["--export=ALL,EPOCHS=2,VENV", "LORA=1", "--nodes=2"], False)
    assert given == {"EPOCHS": "2", "LORA": "1"} and world == ["--nodes=2"] and not wants_help
    assert slurm.read_arguments(["EPOCHS=1", "--help", "EPOCH=3"], False)[2]  # help before a later bad argument
    cases = [
        (
            ["--export=ALL,EPOCH=3"],
            "unknown knob 'EPOCH' in '--export=ALL,EPOCH=3'; did you mean EPOCHS? known knobs: EPOCHS ",
        ),
        (["--export=ALL,HF_TOKEN"], "unknown knob 'HF_TOKEN' in '--export=ALL,HF_TOKEN'; known knobs: "),
        (
            ["--export=ALL,CONTAINER_MOUNTS=/a:/a,/b:/b"],
            "'/b:/b' in '--export=ALL,CONTAINER_MOUNTS=/a:/a,/b:/b' is not",
        ),
        (["--epochs", "3"], "cannot read argument '--epochs'; pass knobs as KEY=VALUE or --export=ALL,KEY=VALUE"),
        (["--nodes=0"], "'--nodes=0': a dry run checks the batch for one number of nodes and of GPUs per node"),
    ]
    for args, message in cases:
        with pytest.raises(slurm.SlurmJobError) as e:
            slurm.read_arguments(args, False)
        assert str(e.value).startswith(message), (args, str(e.value))
    with pytest.raises(slurm.SlurmJobError, match="after the script reaches the script, not Slurm"):
        slurm.read_arguments(["--nodes=2"], True)  # inside a job, sbatch's options after the script were lost


@pytest.mark.parametrize(
    "arg", ["--seed", "~x", "a~b#c", "#x", "/runs/a b", "it's", "x;touch y", "$(id)", "", "a,b=c:d", "é"]
)
def test_the_launch_line_quotes_each_argument_as_bash_printf_q_does(arg):
    bash = subprocess.run(["bash", "-c", 'printf "%q" "$1"', "q", arg], capture_output=True, text=True).stdout
    if arg.isascii():
        assert slurm.bash_quoted(arg) == bash
    assert (
        subprocess.run(["bash", "-c", f"printf %s {slurm.bash_quoted(arg)}"], capture_output=True, text=True).stdout
        == arg
    )


def test_a_network_profile_sets_what_the_user_did_not_and_says_each(tmp_path, monkeypatch, capsys):
    for name in (
        "NCCL_NET",
        "NCCL_IB_DISABLE",
        "NCCL_SOCKET_IFNAME",
        "TORCH_FR_BUFFER_SIZE",
        "TORCH_FR_DUMP_TEMP_FILE",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ens4")  # yours wins
    env = job.network_environment("gcp-g2", tmp_path, "42", os.environ, slurm.say)
    assert env["NCCL_NET"] == "Socket" and env["NCCL_SOCKET_IFNAME"] == "ens4"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == f"{tmp_path}/nccl_trace/42_rank_"
    out = capsys.readouterr().out
    assert "run_llm.slurm: nccl NCCL_SOCKET_IFNAME=ens4\n" in out and "run_llm.slurm: nccl NCCL_IB_DISABLE=1\n" in out


@dataclass
class Attempt:
    job: slurm.SlurmJob
    run_dir: Path
    files: dict[str, Path]
    stop: job.Stop


def attempt(run_dir: Path, signal: str = "") -> Attempt:
    files = {n: run_dir / f".llmft-{n}-7" for n in ("stop", "requeue", "job-end")}
    stop = job.Stop(files["stop"], slurm.ME)
    stop.signal = signal
    k = knobs.resolve({}, [])
    return Attempt(slurm.SlurmJob(k, {"SLURM_JOB_ID": "7", "SLURM_SUBMIT_DIR": str(run_dir)}), run_dir, files, stop)


def after_training(a: Attempt, rc: int) -> int | None:
    """What the Slurm job does once its srun step ended (llmft.launch.scheduler.train_and_follow): how the training
    ended (llmft.launch.job.how_it_ended), then SlurmJob.follow; None for a failure (failure_blame decides)."""
    ended = job.how_it_ended(a.run_dir, rc, a.stop, a.files["requeue"])
    return None if ended.kind == "failed" else a.job.follow(ended, a.run_dir)


def test_what_follows_the_training_is_decided_from_the_run_directory_and_the_signal(tmp_path, monkeypatch, capsys):
    """Done; llmft's own stop before the time limit and a USR1 requeue the job; after a SIGTERM Slurm decides; an
    exit 0 without llmft_done.json is said; a failure goes to failure_blame (None here)."""
    requeued = []
    monkeypatch.setattr(
        slurm, "run", lambda cmd, timeout=None: requeued.append(cmd) or subprocess.CompletedProcess(cmd, 0)
    )
    a = attempt(tmp_path)
    a.files["stop"].touch()
    assert after_training(a, 1) is None and not a.files["stop"].exists() and not requeued  # a failure
    a.files["requeue"].touch()
    assert after_training(a, 0) == 0 and requeued == [["scontrol", "requeue", "7"]]
    assert (
        "llmft stopped for its final save before the time limit (exit 0); requeueing job 7" in capsys.readouterr().out
    )
    assert not a.files["requeue"].exists()
    a.files["requeue"].touch()
    assert after_training(attempt(tmp_path, "TERM"), 143) == 0 and len(requeued) == 1  # Slurm decides
    assert "a preempted or requeued job resumes from it, a cancelled one ends here" in capsys.readouterr().out
    assert after_training(attempt(tmp_path, "USR1"), 0) == 0 and len(requeued) == 2
    assert after_training(attempt(tmp_path), 0) == 0
    assert "warning: training exited 0 but" in capsys.readouterr().out
    (tmp_path / "llmft_done.json").write_text("{}")
    assert after_training(attempt(tmp_path, "TERM"), 0) == 0 and len(requeued) == 2
    assert "training finished (exit 0)" in capsys.readouterr().out


def test_a_dry_run_checks_the_batch_for_the_scripts_world_or_the_one_given(tmp_path, capsys):
    script = tmp_path / "run_llm.slurm"
    script.write_text("#SBATCH --nodes=2\n#SBATCH --gpus-per-node=4\n")
    k = knobs.resolve({}, ["GLOBAL_BATCH=64", "MICRO_BATCH=4"])
    slurm.dry_run_checks(k, [], str(script))
    assert (
        "batch: GLOBAL_BATCH=64 = MICRO_BATCH 4 x 8 processes (the #SBATCH lines: --nodes=2, --gpus-per-node=4) x accumulation 2"
        in capsys.readouterr().out
    )
    with pytest.raises(
        slurm.SlurmJobError, match=r"not a multiple of MICRO_BATCH=4 x 12 processes \(given: --nodes=3"
    ):
        slurm.dry_run_checks(k, ["--nodes=3"], str(script))
    sp = knobs.resolve({}, ["GLOBAL_BATCH=8", "MICRO_BATCH=1", "SEQUENCE_PARALLEL=4"])
    slurm.dry_run_checks(sp, [], str(script))
    assert "MICRO_BATCH 1 x 2 data-parallel groups of SEQUENCE_PARALLEL=4" in capsys.readouterr().out
    with pytest.raises(slurm.SlurmJobError, match="SEQUENCE_PARALLEL=3 does not divide the 8 processes"):
        slurm.dry_run_checks(knobs.resolve({}, ["SEQUENCE_PARALLEL=3"]), [], str(script))


def test_a_run_directory_that_cannot_be_made_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", os.environ.get("PATH", ""))  # the job adds /usr/sbin:/sbin; restored after
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.chdir(tmp_path)
    assert slurm.main(["CHECKPOINT_DIR=/proc/llmft-no-such/ckpt", "DATASET=org/data"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("run_llm.slurm: error: ") and "/proc/llmft-no-such" in err, err

"""torchrun's shutdown timeout follows Slurm's KillWait and a preemption's GraceTime (llmft.launch.kill_chain)."""

from __future__ import annotations

import pytest

from llmft.launch.kill_chain import kill_chain, partition_grace, shutdown_timeout, slurm_seconds

CONFIG = (
    "Configuration data as of 2026-11-26T18:00:00\nKillOnBadExit = 0\nKillWait = 30 sec\nLaunchType = launch/slurm\n"
)
PARTITION = "PartitionName=gpu AllowGroups=ALL Default=YES QoS=N/A DefaultTime=NONE GraceTime=600 Hidden=NO\n"


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("600", 600),
        ("0", 0),
        ("00:10:00", 600),
        ("1-00:00:30", 86430),
        ("10:00", 600),
        ("2-01:00:00\n", 176400),
        ("", None),
        ("UNLIMITED", None),
        ("1-10", None),
        ("ten", None),
    ],
)
def test_slurm_durations_are_seconds_or_days_hours_minutes_seconds(text, seconds):
    assert slurm_seconds(text) == seconds


def test_the_timeout_is_past_killwait_and_past_a_grace_time_plus_killwait():
    assert shutdown_timeout(30, []) == 60  # no grace time: KillWait + 30 s, as before
    assert shutdown_timeout(30, [0]) == 60
    # PreemptMode=REQUEUE with GraceTime=600: Slurm allows 600 + KillWait for the stop save; torchrun waits past it.
    assert shutdown_timeout(30, [600]) == 660
    assert shutdown_timeout(10, [600, 120]) == 640  # the larger of the partition's and the QOS's


def test_the_partition_and_qos_grace_times_are_read_and_named():
    timeout, line = kill_chain(CONFIG, "gpu", PARTITION, "normal", "00:15:00\n")
    assert timeout == 15 * 60 + 30 + 30
    assert line == (
        "kill chain: Slurm's KillWait 30 s, partition gpu GraceTime 600 s, QOS normal GraceTime 900 s; a preempted "
        "job's ranks may save for up to 930 s after the SIGTERM; torchrun waits 960 s for its ranks "
        "(TORCH_ELASTIC_SHUTDOWN_TIMEOUT)"
    )
    assert partition_grace(PARTITION.replace("GraceTime=600", "GraceTime=0")) == 0


def test_no_accounting_storage_means_the_partition_only_and_says_so():
    timeout, line = kill_chain(
        CONFIG, "gpu", PARTITION, "normal", None, "sacctmgr: You are not running a supported accounting_storage plugin"
    )
    assert timeout == 660
    assert "partition gpu GraceTime 600 s, QOS normal GraceTime not read (sacctmgr: You are not running" in line
    assert "partition only" in line
    timeout, line = kill_chain(CONFIG, "gpu", PARTITION, "normal", None, "no sacctmgr on n1")
    assert timeout == 660 and "(no sacctmgr on n1): partition only" in line


def test_what_slurm_does_not_say_falls_back_to_killwait_and_is_named():
    timeout, line = kill_chain("", "", None, "", None)
    assert timeout == 60
    assert line.startswith("kill chain: KillWait unknown (30 s assumed), no partition, no QOS;")
    timeout, line = kill_chain(CONFIG, "gpu", None, "", None)
    assert timeout == 60 and "partition gpu's GraceTime unknown" in line

"""Checkpoint bookkeeping: half-written checkpoints are never resumed from or passed off as complete."""

import json

import pytest

from llmft.checkpoints import (
    DONE_MARKER,
    CheckpointError,
    latest_complete,
    mark_complete,
    mark_done,
    resolve_resume,
)


def fake_checkpoint(root, step, ranks=2, complete=True, zero_stage=2):
    ckpt = root / f"checkpoint-{step}"
    tag = ckpt / f"global_step{step}"
    tag.mkdir(parents=True)
    for r in range(ranks):
        (tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(b"x" * (100 + r))
    (ckpt / "latest").write_text(f"global_step{step}")
    if complete:
        mark_complete(ckpt, ranks, zero_stage)
    return ckpt


def test_newest_complete_checkpoint_wins_over_a_newer_interrupted_one(tmp_path):
    fake_checkpoint(tmp_path, 10)
    good = fake_checkpoint(tmp_path, 20)
    fake_checkpoint(tmp_path, 30, complete=False)
    assert latest_complete(tmp_path) == good
    assert resolve_resume(tmp_path, None) == good
    assert resolve_resume(tmp_path, "latest") == good


def test_truncated_or_missing_shard_makes_a_checkpoint_incomplete(tmp_path):
    older = fake_checkpoint(tmp_path, 10)
    newer = fake_checkpoint(tmp_path, 20)
    shard = newer / "global_step20" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard.write_bytes(b"x" * 7)
    assert latest_complete(tmp_path) == older
    with pytest.raises(CheckpointError, match=r"has 7 bytes, 101 were written; resume from .*checkpoint-10 instead"):
        resolve_resume(tmp_path, str(newer))
    shard.unlink()
    with pytest.raises(CheckpointError, match=r"is missing global_step20/zero_pp_rank_1"):
        resolve_resume(tmp_path, str(newer))


def test_explicit_resume_points_are_checked(tmp_path):
    with pytest.raises(CheckpointError, match=r"checkpoint .*nope not found"):
        resolve_resume(tmp_path, str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match=r"no complete checkpoint"):
        resolve_resume(tmp_path, "latest")
    assert resolve_resume(tmp_path, None) is None  # a fresh run


def test_done_marker(tmp_path):
    assert not (tmp_path / DONE_MARKER).exists()
    mark_done(tmp_path, 42)
    assert json.loads((tmp_path / DONE_MARKER).read_text())["global_step"] == 42

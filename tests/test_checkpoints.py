"""Checkpoint bookkeeping: half-written checkpoints are never resumed from or passed off as complete."""

import json
import shutil

import pytest

from llmft.checkpoint.run_dir import (
    DONE_MARKER,
    CheckpointError,
    choose_checkpoint,
    incomplete_reason,
    latest_complete,
    mark_complete,
    mark_done,
    nothing_left_to_train,
    owner_rank,
    rank_report,
    resolve_resume,
    rotate,
    set_aside_incomplete,
    steps_to_delete,
    tag_dir,
)


def fake_checkpoint(root, step, ranks=2, complete=True, zero_stage=2):
    ckpt = root / f"checkpoint-{step}"
    tag = ckpt / f"global_step{step}"
    tag.mkdir(parents=True)
    for r in range(ranks):
        (tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(b"x" * (100 + r))
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"m" * 50)
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


def test_a_run_resumed_at_its_last_step_trains_nothing(tmp_path):
    """A job resubmitted after its run finished (seen: a scancel that landed during the last step, then `sbatch
    --nodes=1`) resumed checkpoint-8 under --max_steps 8 and trained a step 9 over the finished model."""
    last = fake_checkpoint(tmp_path, 8)
    assert nothing_left_to_train(tmp_path, fake_checkpoint(tmp_path, 6), 8) is None  # steps left: train on
    assert nothing_left_to_train(tmp_path, last, 12) is None  # --max_steps raised: train on
    assert nothing_left_to_train(tmp_path, last, -1) is None  # epochs: transformers counts the steps
    assert nothing_left_to_train(tmp_path, None, 8) is None  # a fresh run
    with pytest.raises(
        CheckpointError,
        match=r"checkpoint-8 already reached --max_steps 8, but the run's final save "
        r"did not finish: write its model with `llmft export .*checkpoint-8 --out DIR`",
    ):
        nothing_left_to_train(tmp_path, last, 8)
    mark_done(tmp_path, 8)
    assert nothing_left_to_train(tmp_path, last, 8) == (
        f"{tmp_path} is already complete at step 8 (--max_steps 8): nothing to train; raise --max_steps to train further"
    )


def test_an_epochs_run_resumed_at_its_last_step_trains_nothing_and_keeps_its_results(tmp_path):
    """Epochs only: the Trainer ends at the step count it saved in the checkpoint, for the same --num_train_epochs.
    Resumed there it trains no step but would write the final model and run_summary.json (0 steps) again."""
    last = fake_checkpoint(tmp_path, 8)
    (last / "trainer_state.json").write_text(json.dumps({"global_step": 8, "max_steps": 8, "num_train_epochs": 2}))
    earlier = fake_checkpoint(tmp_path, 4)
    (earlier / "trainer_state.json").write_text(json.dumps({"global_step": 4, "max_steps": 8, "num_train_epochs": 2}))
    assert nothing_left_to_train(tmp_path, earlier, -1, 2) is None  # steps left
    assert nothing_left_to_train(tmp_path, last, -1, 3) is None  # more epochs asked: the Trainer counts them
    assert nothing_left_to_train(tmp_path, last, -1, 2) is None  # final save cut off: the resumed run writes it
    mark_done(tmp_path, 8)
    assert nothing_left_to_train(tmp_path, last, -1, 2) == (
        f"{tmp_path} is already complete at step 8 (--num_train_epochs 2, 8 steps): nothing to train; "
        "raise --num_train_epochs to train further"
    )
    (last / "trainer_state.json").write_text("{")  # unreadable: the Trainer decides, as before
    assert nothing_left_to_train(tmp_path, last, -1, 2) is None


def test_each_checkpoint_file_belongs_to_the_rank_that_writes_it():
    assert owner_rank("global_step5/zero_pp_rank_3_mp_rank_00_optim_states.pt") == 3
    assert owner_rank("global_step5/bf16_zero_pp_rank_12_mp_rank_00_optim_states.pt") == 12
    assert owner_rank("global_step5/zero_pp_rank_1_mp_rank_00_model_states.pt") == 1  # ZeRO-3 parameters
    assert owner_rank("rng_state_7.pth") == 7
    for shared in (
        "global_step5/mp_rank_00_model_states.pt",
        "rng_state.pth",
        "model.safetensors",
        "latest",
        "trainer_state.json",
        "scheduler.pt",
        "adapter_model.safetensors",
    ):
        assert owner_rank(shared) == 0, shared


def test_the_marker_lists_what_each_rank_wrote_even_where_rank_0_cannot_see_it_yet(tmp_path):
    """Two nodes' views of one checkpoint on a network filesystem: rank 1's node sees the shard it just wrote,
    rank 0's node does not yet. A marker from rank 0's own listing would leave the shard out (and a checkpoint
    that never got it would pass as complete); the marker from the ranks' reports lists it with its size."""
    node0 = fake_checkpoint(tmp_path / "node0", 10, ranks=1, complete=False)
    (node0 / "rng_state_0.pth").write_bytes(b"r" * 30)
    node1 = tmp_path / "node1" / "checkpoint-10"
    shutil.copytree(node0, node1)
    shard = "global_step10/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    (node1 / shard).write_bytes(b"x" * 101)
    (node1 / "rng_state_1.pth").write_bytes(b"r" * 31)

    reports = [rank_report(node0, 0), rank_report(node1, 1)]
    assert sorted(reports[1]) == [shard, "rng_state_1.pth"]
    marker = json.loads(mark_complete(node0, 2, 2, reports).read_text())
    assert marker["files"][shard] == 101 and marker["files"]["rng_state_1.pth"] == 31
    assert marker["files"]["global_step10/zero_pp_rank_0_mp_rank_00_optim_states.pt"] == 100
    assert marker["reported_by_rank"]["1"] == [shard, "rng_state_1.pth"]
    # Until rank 1's files reach rank 0's view the checkpoint is incomplete there, never silently "complete".
    assert f"is missing {shard}" in incomplete_reason(node0)
    shutil.copy(node1 / shard, node0 / shard)
    shutil.copy(node1 / "rng_state_1.pth", node0 / "rng_state_1.pth")
    assert incomplete_reason(node0) is None
    assert latest_complete(node0.parent) == node0


def test_no_marker_when_a_rank_reports_nothing(tmp_path):
    ckpt = fake_checkpoint(tmp_path, 10, ranks=1, complete=False)
    assert mark_complete(ckpt, 2, 2, [rank_report(ckpt, 0), rank_report(ckpt, 1)]) is None
    assert mark_complete(ckpt, 2, 2, [rank_report(ckpt, 0)]) is None  # a report short
    assert incomplete_reason(ckpt) is not None and latest_complete(tmp_path) is None


def test_training_inference_and_the_demo_pick_the_same_checkpoint(tmp_path, capsys):
    """One decision (checkpoints.choose_checkpoint): resume, `llmft infer RUN_DIR` and the demo agree."""
    from llmft.checkpoint.loader import resolve_checkpoint
    from llmft.demo import newest_tag_dir

    fake_checkpoint(tmp_path, 10)
    good = fake_checkpoint(tmp_path, 20)
    fake_checkpoint(tmp_path, 30, complete=False)  # a job killed while saving
    assert resolve_resume(tmp_path, None) == good
    assert resolve_checkpoint([str(tmp_path)]) == (good / "global_step20", None)
    assert (
        capsys.readouterr().err
        == f"llmft infer: skipping {tmp_path / 'checkpoint-30'} has no llmft_complete.json: it was interrupted while saving\n"
    )
    assert newest_tag_dir(tmp_path) == good / "global_step20"
    assert choose_checkpoint(tmp_path) == (
        good,
        [f"skipping {tmp_path / 'checkpoint-30'} has no llmft_complete.json: it was interrupted while saving"],
    )


def test_inference_refuses_a_run_whose_checkpoints_are_all_incomplete_and_reads_foreign_runs(tmp_path):
    from llmft.checkpoint.loader import resolve_checkpoint

    fake_checkpoint(tmp_path / "a", 10, complete=False)
    (tmp_path / "a" / "llmft_run.json").write_text(
        "{}"
    )  # llmft started this run: its unmarked checkpoint is half-written
    with pytest.raises(
        CheckpointError, match=r"holds no complete checkpoint \(.*checkpoint-10 has no llmft_complete.json"
    ):
        resolve_checkpoint([str(tmp_path / "a")])
    fake_checkpoint(tmp_path / "hf", 10, complete=False)
    fake_checkpoint(tmp_path / "hf", 20, complete=False)  # written by a plain HF Trainer: nobody marks anything
    assert choose_checkpoint(tmp_path / "hf", unmarked_ok=True)[0] == tmp_path / "hf" / "checkpoint-20"
    assert choose_checkpoint(tmp_path / "hf")[0] is None  # training never resumes from unverified state


def test_tag_dir_follows_latest_and_refuses_a_dangling_one(tmp_path):
    ckpt = fake_checkpoint(tmp_path, 10)
    assert tag_dir(ckpt) == ckpt / "global_step10"
    (ckpt / "latest").write_text("global_step99")
    with pytest.raises(CheckpointError, match="names 'global_step99', which is not in"):
        tag_dir(ckpt)
    (ckpt / "latest").unlink()
    (ckpt / "global_step9").mkdir()
    assert tag_dir(ckpt) == ckpt / "global_step10"  # the highest step, not the last in name order


def test_rotation_counts_only_complete_checkpoints_and_keeps_the_newest_and_the_best():
    assert steps_to_delete([2, 4, 6], 2) == [2]
    assert steps_to_delete([2, 4], 2) == []
    assert steps_to_delete([2, 4, 6, 8], 1) == [2, 4, 6]
    assert steps_to_delete([2, 4, 6], 2, protected={2}) == [4]  # the best model and the newest, as transformers keeps
    assert steps_to_delete([2, 4, 6], 1, protected={2}) == [4]
    assert steps_to_delete([2, 4, 6], None) == steps_to_delete([2, 4, 6], 0) == []  # no limit: keep all


def test_rotate_never_counts_or_deletes_an_incomplete_checkpoint(tmp_path):
    for step in (2, 4):
        fake_checkpoint(tmp_path, step)
    fake_checkpoint(tmp_path, 5, complete=False)  # a stop save cut off
    assert rotate(tmp_path, 2) == []  # 5 is not counted: 2 and 4 are the two complete ones
    fake_checkpoint(tmp_path, 6)
    assert rotate(tmp_path, 2) == [tmp_path / "checkpoint-2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4", "checkpoint-5", "checkpoint-6"]


def test_a_rerun_moves_incomplete_checkpoints_aside_in_its_own_run_only(tmp_path):
    fake_checkpoint(tmp_path, 4)
    fake_checkpoint(tmp_path, 5, complete=False)
    assert set_aside_incomplete(tmp_path) == []  # no llmft run record: not llmft's checkpoints to move
    (tmp_path / "llmft_run.json").write_text("{}")
    (tmp_path / "incomplete" / "checkpoint-5").mkdir(parents=True)  # an older cut-off save of the same step
    [line] = set_aside_incomplete(tmp_path)
    assert line == (
        f"moved checkpoint-5 aside to {tmp_path / 'incomplete' / 'checkpoint-5'}: checkpoint-5 has no "
        "llmft_complete.json: it was interrupted while saving; never resumed from, delete it to free its space"
    )
    assert [p.name for p in tmp_path.glob("checkpoint-*")] == ["checkpoint-4"]
    assert (tmp_path / "incomplete" / "checkpoint-5" / "global_step5").is_dir()
    assert latest_complete(tmp_path) == tmp_path / "checkpoint-4"


@pytest.mark.parametrize(
    "zero_stage, rank1_writes, missing",
    [
        # ZeRO-2: rank 1 wrote its RNG state, not its optimizer shard (its background write failed)
        (2, ["rng_state_1.pth"], ["rank 1: its ZeRO-2 optim_states shard (zero_pp_rank_1_*_optim_states.pt)"]),
        # ZeRO-3: every rank writes its module shard too
        (
            3,
            ["global_step4/zero_pp_rank_1_mp_rank_00_optim_states.pt", "rng_state_1.pth"],
            ["rank 1: its ZeRO-3 model_states shard (zero_pp_rank_1_*_model_states.pt)"],
        ),
        # what rank 0 wrote for itself, rank 1 writes for itself (here: the Trainer's RNG state)
        (2, ["global_step4/zero_pp_rank_1_mp_rank_00_optim_states.pt"], ["rank 1: rng_state_1.pth"]),
        (2, ["global_step4/zero_pp_rank_1_mp_rank_00_optim_states.pt", "rng_state_1.pth"], []),
        (
            3,
            [f"global_step4/zero_pp_rank_1_mp_rank_00_{k}_states.pt" for k in ("optim", "model")]
            + ["rng_state_1.pth"],
            [],
        ),
    ],
)
def test_a_rank_that_reported_some_files_but_not_all_it_writes_leaves_the_checkpoint_unpublished(
    tmp_path, zero_stage, rank1_writes, missing
):
    from llmft.checkpoint.run_dir import missing_rank_files

    ckpt = tmp_path / "checkpoint-4"
    rank0 = ["global_step4/zero_pp_rank_0_mp_rank_00_optim_states.pt", "rng_state_0.pth"]
    rank0 += ["global_step4/zero_pp_rank_0_mp_rank_00_model_states.pt"] if zero_stage == 3 else []
    rank0 += ["global_step4/mp_rank_00_model_states.pt"] if zero_stage < 3 else []
    for rel in rank0 + rank1_writes:
        (ckpt / rel).parent.mkdir(parents=True, exist_ok=True)
        (ckpt / rel).write_bytes(b"x")
    reports = [rank_report(ckpt, 0), rank_report(ckpt, 1)]
    assert missing_rank_files(reports, zero_stage) == missing
    marker = mark_complete(ckpt, 2, zero_stage, reports)
    assert (marker is None) == bool(missing)
    assert (latest_complete(tmp_path) is None) == bool(missing)

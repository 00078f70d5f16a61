"""Elastic resume: a checkpoint written on 2 ranks continues on 1 and back on 2 (ZeRO-1, 2, 3), real torchrun + DeepSpeed.

Per stage, one chain of runs over the same 6 steps: an uninterrupted 2-rank run (checkpoints 2, 4, 6); its
checkpoint-2 resumed on 1 rank (which writes checkpoint-4 with 1 rank); that checkpoint-4 resumed on 2 ranks.
The model has no dropout, so with the same samples per step the runs agree to float rounding with the
uninterrupted one: a resume that lost the optimizer moments, the schedule or the data position does not.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from pathlib import Path

import pytest
from conftest import PYTHON, REPO, run

from llmft.checkpoint.run_dir import RUN_RECORD, CheckpointError, mark_complete
from llmft.planning.batch import BatchPlan
from llmft.training import elastic

PROBE = str(REPO / "tests" / "train_probe.py")
STEP_RE = re.compile(r"llmft: step (\d+)/(\d+) loss ([\d.]+) lr ([\d.e+-]+)")
TOTAL, EVERY = 6, 2
CHAIN = {"2to1": ("w2", 2, 1), "1to2": ("2to1", 4, 2)}  # run: (run whose checkpoint it resumes, that step, its world)
ACCUM = {1: 4, 2: 2}  # global batch 8 = micro-batch 2 x accumulation x world
# The same samples and state give the same losses up to float rounding (identical at the 4 printed decimals here).
# A resume whose Adam moments restarted from zero (the failure this guards against) misses by far more: measured
# and asserted in test_the_tolerance_separates_a_resume_whose_optimizer_restarted_from_zero.
LOSS_TOL = 5e-4


def losses(stdout: str) -> dict[int, tuple[float, float]]:
    return {int(s): (float(loss), float(lr)) for s, _, loss, lr in STEP_RE.findall(stdout)}


def train(model, data, out: Path, nproc: int, stage: int, *extra, check=True):
    launcher = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)] if nproc > 1 else [PYTHON]
    cmd = launcher + [
        PROBE,
        "--model_name_or_path",
        str(model),
        "--dataset_name",
        str(data),
        "--output_dir",
        str(out),
        "--report_to",
        "none",
        "--logging_steps",
        "1",
        "--disable_tqdm",
        "true",
        "--zero_stage",
        str(stage),
        "--max_steps",
        str(TOTAL),
        "--save_steps",
        str(EVERY),
        "--global_batch_size",
        "8",
        "--per_device_train_batch_size",
        "2",
        "--learning_rate",
        "5e-3",
        *map(str, extra),
    ]
    return run(cmd, check=check, LLMFT_PROBE_DIR=str(out / "probe"))


def resume_copy(src: Path, step: int, dest: Path) -> Path:
    """src's run record and checkpoint-{step} only: what a job interrupted after that step leaves."""
    dest.mkdir(parents=True)
    shutil.copytree(src / f"checkpoint-{step}", dest / f"checkpoint-{step}")
    shutil.copy2(src / RUN_RECORD, dest / RUN_RECORD)  # the same run: another world size is not another experiment
    return dest


@pytest.fixture(scope="module")
def nodrop_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny model without dropout: runs on different world sizes then do the same arithmetic."""
    from transformers import AutoConfig

    out = tmp_path_factory.mktemp("nodrop") / "model"
    shutil.copytree(tiny_model, out)
    config = AutoConfig.from_pretrained(out)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    config.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def matrix(nodrop_model, tiny_data, tmp_path_factory):
    """runs(stage) -> {'w2': the uninterrupted run, '2to1', '1to2': the chain of resumes} as (dir, stdout), cached."""
    done: dict[int, dict] = {}

    def runs(stage: int) -> dict:
        if stage not in done:
            root = tmp_path_factory.mktemp(f"zero{stage}")
            r = {"w2": (root / "w2", train(nodrop_model, tiny_data, root / "w2", 2, stage).stdout)}
            for name, (src, step, world) in CHAIN.items():
                out = resume_copy(r[src][0], step, root / name)
                r[name] = (out, train(nodrop_model, tiny_data, out, world, stage).stdout)
            done[stage] = r
        return done[stage]

    return runs


def test_a_step_trains_the_same_samples_on_any_world_size(matrix, nodrop_model, tiny_data, tmp_path):
    """The data position claim itself: with the global batch fixed, step s of an uninterrupted 1-rank run and of a
    2-rank run see the same samples (accelerate hands the micro-batches round-robin to the ranks), so their losses
    agree step by step."""
    two = matrix(2)["w2"][1]
    one = train(nodrop_model, tiny_data, tmp_path / "w1", 1, 2, "--save_steps", 100).stdout
    assert "gradient accumulation 4" in one and "gradient accumulation 2" in two
    one, two = losses(one), losses(two)
    assert sorted(one) == sorted(two) == list(range(1, TOTAL + 1))
    for s in one:
        assert one[s][0] == pytest.approx(two[s][0], abs=LOSS_TOL), (s, one, two)
    assert one[TOTAL][0] < 0.9 * one[1][0]  # it trained


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("direction", ["2to1", "1to2"])
def test_resume_on_another_world_size_continues_the_uninterrupted_run(matrix, stage, direction):
    r = matrix(stage)
    src, step, after = CHAIN[direction]
    before = 3 - after
    out, text = r[direction]
    reference = losses(r["w2"][1])
    ckpt = out / f"checkpoint-{step}"

    # The log says what changed.
    line = next(line for line in text.splitlines() if line.startswith("llmft: resuming"))
    how = re.search(r"\((converted in \d+ s)\)", line)
    assert how and line == (
        f"llmft: resuming checkpoint-{step} written by {before} ranks on {after} ranks: universal checkpoint "
        f"{ckpt / f'universal_step{step}'} ({how.group(1)}), accumulation {ACCUM[before]} -> {ACCUM[after]}, global batch 8 kept"
    ), line
    assert f"llmft plan: gradient accumulation {ACCUM[after]}" in text
    assert json.loads((out / "ds_config.json").read_text())["checkpoint"] == {"load_universal": True}
    assert elastic.conversion_problem(ckpt) is None

    # The remaining steps only, on the uninterrupted schedule and within LOSS_TOL of the uninterrupted run's losses.
    resumed = losses(text)
    assert sorted(resumed) == list(range(step + 1, TOTAL + 1)), text[-3000:]
    for s, (loss, lr) in resumed.items():
        assert lr == pytest.approx(reference[s][1], rel=1e-6)
        assert loss == pytest.approx(reference[s][0], abs=LOSS_TOL), (s, resumed, reference)

    # The Adam moments the engine holds right after the resume are the ones saved, tensor by tensor.
    import torch

    saved = torch.load(r[src][0] / "probe" / f"moments-saved-{step}.pt")
    loaded = torch.load(out / "probe" / f"moments-resumed-{step}.pt")
    assert sorted(saved) == sorted(loaded) and len(saved) >= 10
    for name in saved:
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(saved[name][key], loaded[name][key]), (name, key)
    assert any(bool(m["exp_avg_sq"].ne(0).any()) for m in saved.values())

    # It goes on as a run on the new world: its own shards, a complete checkpoint, done.
    marker = json.loads((out / f"checkpoint-{TOTAL}" / "llmft_complete.json").read_text())
    assert marker["world_size"] == after and marker["batch"]["grad_accum"] == ACCUM[after]
    assert json.loads((out / "llmft_done.json").read_text())["global_step"] == TOTAL


def test_only_the_checkpoint_resumed_on_another_world_is_converted(matrix):
    """Saving, and resuming on the same world (test_train's stop-and-resume), leave checkpoints as DeepSpeed wrote them."""
    for stage in (1, 2, 3):
        r = matrix(stage)
        assert "universal" not in r["w2"][1]
        assert not list(r["w2"][0].rglob("*universal*"))
        for name, (_, step, _) in CHAIN.items():
            out = r[name][0]
            assert [p.relative_to(out) for p in out.glob("checkpoint-*/universal_step*")] == [
                Path(f"checkpoint-{step}/universal_step{step}")
            ]


def test_the_tolerance_separates_a_resume_whose_optimizer_restarted_from_zero(
    matrix, nodrop_model, tiny_data, tmp_path
):
    """The same resume with the Adam moments and step zeroed in the universal checkpoint (what a conversion that
    'resumes as if from scratch' amounts to) misses the uninterrupted losses by far more than LOSS_TOL."""
    import torch

    r = matrix(2)
    out = resume_copy(r["2to1"][0], 2, tmp_path / "restarted")
    universal = out / "checkpoint-2" / "universal_step2"
    zeroed = 0
    for f in universal.glob("zero/*/*.pt"):
        if f.name in ("exp_avg.pt", "exp_avg_sq.pt"):
            state = torch.load(f)  # {"param": tensor, "cat_dim": 0}
            torch.save({**state, "param": torch.zeros_like(state["param"])}, f)
            zeroed += 1
        elif f.name == "step.pt":
            torch.save(0, f)
    assert zeroed >= 20
    marker = universal / elastic.UNIVERSAL_MARKER  # list the files again so the edited cache is used as it is
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "files": elastic._files(universal)}))
    text = train(nodrop_model, tiny_data, out, 1, 2).stdout
    assert "(cached)" in text
    restarted, reference, resumed = losses(text), losses(r["w2"][1]), losses(r["2to1"][1])
    assert sorted(restarted) == sorted(resumed) == [3, 4, 5, 6]
    gap = max(abs(restarted[s][0] - reference[s][0]) for s in restarted)
    good = max(abs(resumed[s][0] - reference[s][0]) for s in resumed)
    print(
        f"loss gap to the uninterrupted run, steps 3-6: resumed {good:.1e}, optimizer restarted {gap:.1e}, tolerance {LOSS_TOL:.0e}"
    )
    assert good <= LOSS_TOL < gap / 10


def test_resume_from_a_zero1_checkpoint_under_zero2_on_another_world(matrix, nodrop_model, tiny_data, tmp_path):
    """ZeRO-1 and ZeRO-2 share one optimizer format: a stage change between them goes through the same conversion."""
    r = matrix(1)
    out = resume_copy(r["w2"][0], 2, tmp_path / "restaged")
    text = train(nodrop_model, tiny_data, out, 1, 2, "--resume_from_checkpoint", out / "checkpoint-2").stdout
    assert re.search(
        r"resuming checkpoint-2 written by 2 ranks on 1 ranks: universal checkpoint .* ZeRO stage 1 -> 2, "
        r"accumulation 2 -> 4, global batch 8 kept",
        text,
    ), text
    assert "continuing on purpose with new settings: ZeRO stage" in text  # the run record: a stage change is asked for
    resumed, reference = losses(text), losses(r["w2"][1])
    assert sorted(resumed) == [3, 4, 5, 6]
    for s in resumed:
        assert resumed[s][0] == pytest.approx(reference[s][0], abs=LOSS_TOL)


# ---- the decision, without training ------------------------------------------------------------------


def fake_checkpoint(root: Path, step: int, world: int, stage: int, micro: int = 2, accum: int = 2) -> Path:
    ckpt = root / f"checkpoint-{step}"
    (ckpt / f"global_step{step}").mkdir(parents=True)
    (ckpt / "latest").write_text(f"global_step{step}")
    mark_complete(ckpt, world, stage, batch=BatchPlan(micro, accum, world))
    return ckpt


def test_the_resume_decision(tmp_path):
    ckpt = fake_checkpoint(tmp_path, 400, world=16, stage=3, micro=2, accum=2)  # global batch 64

    same = elastic.plan_resume(ckpt, 16, 3, BatchPlan(2, 2, 16), global_batch_given=True)
    assert not same.universal and same.describe() == f"resuming from {ckpt}"

    # 8 ranks, the global batch given again (the Slurm script passes GLOBAL_BATCH): accumulation already follows.
    moved = elastic.plan_resume(ckpt, 8, 3, BatchPlan(2, 4, 8), global_batch_given=True)
    assert moved.universal and moved.batch == BatchPlan(2, 4, 8)
    assert moved.describe("converted in 12 s") == (
        f"resuming checkpoint-400 written by 16 ranks on 8 ranks: universal checkpoint {ckpt / 'universal_step400'} "
        "(converted in 12 s), accumulation 2 -> 4, global batch 64 kept"
    )
    # No --global_batch_size: the checkpoint's global batch is kept rather than micro x accumulation x the new world,
    # and that is the global batch the run record (llmft.training.run_identity) compares, so the rerun is the same run.
    kept = elastic.plan_resume(ckpt, 8, 3, BatchPlan(2, 1, 8), global_batch_given=False)
    assert kept.batch == BatchPlan(2, 4, 8)
    assert elastic.kept_global_batch(ckpt, 16, global_batch_given=False) == 64
    assert elastic.kept_global_batch(ckpt, 16, global_batch_given=True) == 16
    assert elastic.kept_global_batch(None, 16, global_batch_given=False) == 16
    # ... and when the new world cannot keep it, the nearest valid values are named before any model loads.
    with pytest.raises(
        CheckpointError,
        match=r"checkpoint-400 was trained with global batch 64 \(micro-batch 2 x accumulation 2 x 16 "
        r"ranks\), which 12 ranks cannot keep with micro-batch 2; use 8 or 16 ranks, or "
        r"--global_batch_size 48 or 72 to change the global batch$",
    ):
        elastic.plan_resume(ckpt, 12, 3, BatchPlan(2, 1, 12), global_batch_given=False)
    with pytest.raises(
        CheckpointError,
        match=r"which 32 ranks cannot keep with micro-batch 4; use --per_device_train_batch_size 1 or 2"
        r", or 16 ranks, or --global_batch_size 128 to change the global batch$",
    ):
        elastic.plan_resume(ckpt, 32, 3, BatchPlan(4, 1, 32), global_batch_given=False)
    # An explicit, different global batch is the user's choice, and the log says so.
    asked = elastic.plan_resume(ckpt, 8, 3, BatchPlan(2, 8, 8), global_batch_given=True)
    assert "global batch 64 -> 128" in asked.describe()

    # The same world with another micro-batch and no --global_batch_size: no conversion, the global batch is kept.
    smaller = elastic.plan_resume(ckpt, 16, 3, BatchPlan(1, 1, 16), global_batch_given=False)
    assert not smaller.universal and smaller.batch == BatchPlan(1, 4, 16)
    assert smaller.describe() == f"resuming from {ckpt}: accumulation 2 -> 4, micro-batch 2 -> 1, global batch 64 kept"

    # ZeRO-0 holds no partitions: any world loads it as is.
    stage0 = fake_checkpoint(tmp_path / "s0", 10, world=2, stage=0)
    assert not elastic.plan_resume(stage0, 1, 0, BatchPlan(2, 4, 1), True).universal


@pytest.mark.parametrize(
    "saved,now,ok",
    [(1, 2, True), (2, 1, True), (2, 3, False), (3, 2, False), (3, 1, False), (0, 2, False), (2, 0, False)],
)
def test_stage_changes_go_through_the_conversion_or_are_refused_with_the_way_out(tmp_path, saved, now, ok):
    ckpt = fake_checkpoint(tmp_path, 10, world=2, stage=saved)
    if ok:
        r = elastic.plan_resume(ckpt, 2, now, BatchPlan(2, 2, 2), True)
        assert r.universal and f"ZeRO stage {saved} -> {now}" in r.describe()
    else:
        with pytest.raises(
            CheckpointError,
            match=rf"written with ZeRO stage {saved}, this run uses stage {now}: .*; resume with "
            rf"--zero_stage {saved}, or export the weights \(llmft export .*checkpoint-10 --out DIR --dtype float32\)",
        ):
            elastic.plan_resume(ckpt, 2, now, BatchPlan(2, 2, 2), True)


# ---- the cached conversion: complete or redone ----------------------------------------------------


@pytest.fixture
def two_rank_checkpoint(matrix, tmp_path) -> Path:
    """A copy of a real ZeRO-2 checkpoint written by 2 ranks, not yet converted."""
    return resume_copy(matrix(2)["w2"][0], 2, tmp_path / "run") / "checkpoint-2"


def resume_of(ckpt: Path) -> elastic.Resume:
    return elastic.plan_resume(ckpt, 1, 2, BatchPlan(2, 4, 1), True)


def test_a_conversion_killed_half_way_is_never_used_and_is_redone(two_rank_checkpoint):
    """SIGKILL in the middle of ds_to_universal (after the fragments, before the optimizer state): no universal
    checkpoint appears under its final name and latest_universal is not written; the next resume converts again."""
    ckpt = two_rank_checkpoint
    killer = (
        "import os, signal, sys; from pathlib import Path\n"
        "from deepspeed.checkpoint import ds_to_universal as d\n"
        "d._save_optimizer_state = lambda *a: os.kill(os.getpid(), signal.SIGKILL)\n"
        "from llmft.training.elastic import convert; convert(Path(sys.argv[1]))\n"
    )
    proc = run([PYTHON, "-c", killer, str(ckpt)])
    assert proc.returncode == -9, proc.stderr[-2000:]
    leftovers = list(ckpt.glob(".llmft-universal-*"))
    assert leftovers and list(leftovers[0].rglob("fp32.pt")), "the kill should leave a half-written conversion behind"
    assert not (ckpt / "universal_step2").exists() and not (ckpt / "latest_universal").exists()
    assert "does not exist" in elastic.conversion_problem(ckpt)

    how = elastic.prepare(resume_of(ckpt), is_first_rank=True, log=lambda msg: None)
    assert how.startswith("converted in")
    assert elastic.conversion_problem(ckpt) is None and not list(ckpt.glob(".llmft-universal-*"))
    assert elastic.prepare(resume_of(ckpt), is_first_rank=True) == "cached"


def test_a_damaged_conversion_is_detected_and_redone(two_rank_checkpoint):
    ckpt = two_rank_checkpoint
    resume = resume_of(ckpt)
    elastic.prepare(resume, is_first_rank=True, log=lambda msg: None)
    universal = ckpt / "universal_step2"
    fp32 = next(universal.glob("zero/*/exp_avg.pt"))

    def damage_and_redo(expected: str) -> None:
        assert re.search(expected, elastic.conversion_problem(ckpt)), elastic.conversion_problem(ckpt)
        how = elastic.prepare(resume, is_first_rank=True, log=lambda msg: None)
        assert re.search(rf"converted in \d+ s; redone: .*{expected}", how), how
        assert elastic.conversion_problem(ckpt) is None

    fp32.write_bytes(fp32.read_bytes()[:-7])  # truncated
    damage_and_redo(r"exp_avg.pt has \d+ bytes, \d+ were written")
    next(universal.glob("zero/*/fp32.pt")).unlink()
    damage_and_redo(r"is missing zero/.*/fp32.pt")
    (universal / elastic.UNIVERSAL_MARKER).unlink()  # e.g. a copy that stopped before its last file
    damage_and_redo(r"has no llmft_universal.json: its conversion was interrupted")
    (universal / elastic.UNIVERSAL_MARKER).write_text("{not json")
    damage_and_redo(r"llmft_universal.json is unreadable")
    (ckpt / "latest_universal").write_text("universal_step999")
    damage_and_redo(r"latest_universal does not name universal_step2")


def test_other_ranks_wait_for_the_first_ranks_conversion(two_rank_checkpoint):
    ckpt = two_rank_checkpoint
    resume = resume_of(ckpt)
    finished = []
    waiter = threading.Thread(
        target=lambda: finished.append(elastic.prepare(resume, is_first_rank=False, poll_s=0.05))
    )
    waiter.start()
    time.sleep(0.5)
    assert not finished  # nothing converted yet: a non-first rank never converts, and never loads a partial result
    elastic.prepare(resume, is_first_rank=True, log=lambda msg: None)
    waiter.join(timeout=30)
    assert finished == ["cached"]


def test_a_conversion_that_cannot_be_done_is_one_clear_error(tmp_path, monkeypatch):
    ckpt = fake_checkpoint(tmp_path, 10, world=2, stage=2)
    (ckpt / "global_step10" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"not a torch file")
    resume = elastic.plan_resume(ckpt, 1, 2, BatchPlan(2, 4, 1), True)
    with pytest.raises(
        CheckpointError, match=rf"converting {ckpt} to a universal checkpoint failed \(.+\); log: .*conversion.log$"
    ):
        elastic.prepare(resume, is_first_rank=True, log=lambda msg: None)
    assert elastic.conversion_problem(ckpt) is not None and not (ckpt / "latest_universal").exists()

    def denied(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", denied)
    with pytest.raises(
        CheckpointError,
        match=rf"cannot write a universal conversion into {ckpt} \(Permission denied\); make it "
        rf"writable, or copy {ckpt} into this run's --output_dir and resume from the copy",
    ):
        elastic.prepare(resume, is_first_rank=True, log=lambda msg: None)


def test_llmft_train_refuses_an_unsupported_stage_change_before_any_model_loads(
    tiny_model, tiny_data, tmp_path, capsys
):
    from llmft.train import cli, make_parser

    out = tmp_path / "run"
    ckpt = fake_checkpoint(out, 10, world=1, stage=3)
    argv = [
        "--model_name_or_path",
        str(tiny_model),
        "--dataset_name",
        str(tiny_data),
        "--output_dir",
        str(out),
        "--report_to",
        "none",
        "--zero_stage",
        "2",
    ]
    assert cli(make_parser(), argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("llmft train: error:")]
    assert errors == [
        f"llmft train: error: {ckpt} was written with ZeRO stage 3, this run uses stage 2: DeepSpeed's ZeRO-3 and ZeRO-1/2 loaders "
        f"do not read each other's universal checkpoints; resume with --zero_stage 3, "
        f"or export the weights (llmft export {ckpt} --out DIR --dtype float32) and start a new run from DIR"
    ]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-10"]  # nothing written, nothing converted

"""The README's main job, `make demo`, end to end: tiny model, 2-process ZeRO-2 fine-tune, inference."""

from conftest import PYTHON, run


def test_demo_trains_with_two_processes_and_generates_from_its_checkpoint(tmp_path):
    proc = run([PYTHON, "-m", "llmft.cli", "demo", "--out", str(tmp_path / "demo"), "--epochs", "1"], check=True)
    assert "llmft plan: world size 2 (1 nodes x 2 processes, from torchrun)" in proc.stdout
    assert "ZeRO stage 2" in proc.stdout
    tag = tmp_path / "demo" / "run" / "checkpoint-32" / "global_step32"
    assert sorted(p.name for p in tag.glob("zero_pp_rank_*")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    assert f"llmft infer: loaded {tag}" in proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    for prompt in ("What is 2 plus 3?", "Spell garden backwards."):
        answer = lines[lines.index(prompt) + 1]  # the generation follows its prompt
        assert answer.strip(), f"no text generated for {prompt!r}"

"""Long context beyond Ulysses: the planner's sequence dimension (per-rank activations with N and tiling, the
all-to-all traffic, host RAM for offloaded activations, the smallest N that fits), measured against what autograd
keeps on CPU ranks, DeepSpeed's TiledMLP under `--tiled_mlp`, and TRL's activation offload's CPU refusal.

Activation offload (TRL's, ALST's checkpoint offload) needs a CUDA GPU: on CPU the activations are in host memory
already, so it is refused there and only its planning is tested here.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import PYTHON, run

from llmft import plan as plan_command
from llmft.planning import comm, memory
from llmft.planning.hardware import GPUS
from llmft.planning.memory import Job, Setting, plan_long_context, plan_with_savers
from llmft.planning.model_shape import model_shape

sys.path.insert(0, str(Path(__file__).parent))
import activation_probe  # noqa: E402


@pytest.fixture(scope="module")
def llama8b():
    from published_shapes import llama_3_1_8b

    return model_shape(llama_3_1_8b(max_position_embeddings=1_048_576), use_peft=True, lora_r=16)


def h100_node(shape, max_length, **kw) -> Job:
    node = comm.NETWORKS["a3-highgpu-8g"]
    return Job(
        shape,
        GPUS["H100-80GB"],
        1872,
        1,
        8,
        max_length,
        "bf16",
        global_batch=8,
        network=node,
        tiled_mlps=(False, True),
        activation_offloads=(False, True),
        **kw,
    )


# ---- the planner's per-rank activations, measured ---------------------------------------------------------------


def probe(nproc: int, *extra: str) -> dict[int, int]:
    import socket

    with socket.socket() as s:  # a port of its own: another torchrun on the machine may hold torch's default 29500
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(port)]
    launcher = launcher if nproc > 1 else [PYTHON]
    proc = run(launcher + ["tests/activation_probe.py", "--lengths", "512", "2048", *extra], check=True, timeout=300)
    [line] = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    result = json.loads(line)
    assert result["world"] == nproc
    return {int(k): v for k, v in result["bytes"].items()}


@pytest.mark.parametrize("nproc, tiled", [(1, False), (2, False), (2, True)])
def test_planned_activations_per_rank_match_what_autograd_keeps_at_two_lengths(nproc, tiled):
    """What one rank's forward saves for the backward (a 4-layer Llama in fp32, SDPA; under 2 ranks DeepSpeed's own
    Ulysses attention, each rank holding half the sequence; with --tiled_mlp DeepSpeed's TiledMLP) is the planner's
    activation term within 5% at 512 and 2,048 tokens. The backward-time buffers the planner adds for the tiled MLP
    (its input gradient and one shard) are not saved tensors, so they are left out of the comparison."""
    shape = model_shape(activation_probe.config())
    measured = probe(nproc, *(["--tiled_mlp"] if tiled else []))
    for length, got in measured.items():
        planned = memory.activation_bytes(
            shape, 1, length, False, "fp32", "sdpa", sequence_parallel=nproc, tiled_mlp=tiled
        )
        if tiled:
            planned -= memory.tiled_mlp_backward_bytes(shape, 1, length // nproc, "fp32")
        assert got == pytest.approx(planned, rel=0.05), (length, got, planned)
    assert measured[2048] == pytest.approx(4 * measured[512], rel=0.02)  # linear in the sequence: no s^2 term


def test_each_rank_keeps_half_the_activations_under_two_way_sequence_parallelism():
    one, two = probe(1), probe(2)
    for length in one:
        assert two[length] / one[length] == pytest.approx(0.5, abs=0.05), (length, one, two)


# ---- the planner: the sequence dimension ------------------------------------------------------------------------


def test_sequence_parallelism_divides_activations_and_the_loss_but_not_the_model_states(llama8b):
    one = memory.estimate(h100_node(llama8b, 131072), Setting(2, "none", 1, 8, True))
    four = memory.estimate(h100_node(llama8b, 131072, sequence_parallel=4), Setting(2, "none", 1, 2, True))
    assert four.activations == pytest.approx(one.activations / 4, rel=0.01)
    assert four.model_states == one.model_states  # ZeRO partitions over all 8 ranks either way
    assert one.sequence_bytes == 0
    # q, k, v and the output in (2 x 4096 + 2 x 1024) bf16 values a token, 3/4 of each rank's 32,768 tokens leaving
    # it, over 32 layers, forward + backward + the recomputed forward, for 2 micro-batches
    assert four.sequence_bytes == 3 / 4 * 32768 * 2 * (2 * 4096 + 2 * 1024) * 32 * 3 * 2
    bytes_s, link = comm.ulysses_link(comm.NETWORKS["a3-highgpu-8g"], 4, 8)
    assert link == "NVLink inside the node" and four.time.sequence_s == pytest.approx(four.sequence_bytes / bytes_s)
    assert four.time.step_s > four.time.compute_s + four.time.sequence_s * 0.999
    _, across = comm.ulysses_link(comm.NETWORKS["a3-highgpu-8g"], 16, 8)
    assert across == "200 Gbps network shared by 8 GPUs"  # a group larger than a node crosses the network


def test_tiling_and_offload_keep_less_on_the_gpu_and_offload_costs_host_ram(llama8b):
    job = h100_node(llama8b, 131072)
    plain, tiled, offloaded = (
        memory.estimate(job, Setting(2, "none", 1, 8, True, t, o))
        for t, o in ((False, False), (True, False), (True, True))
    )
    assert tiled.activations < plain.activations and offloaded.activations < tiled.activations
    assert plain.host["activations"] == tiled.host["activations"] == 0
    # every layer's input, 131,072 tokens x 4096 x 2 bytes = 1 GiB each (a power of two: pinned blocks), 32 layers, 8 ranks
    assert offloaded.host["activations"] == 8 * 32 * 2**30
    assert tiled.tokens_per_s < plain.tokens_per_s  # the MLP's forward runs again in the backward


def test_tiling_and_offload_are_chosen_only_when_the_sequence_does_not_fit_without_them(llama8b):
    assert plan_with_savers(h100_node(llama8b, 4096)).recommended.setting.flags() == []
    tiled = plan_with_savers(h100_node(llama8b, 131072)).recommended.setting
    assert tiled.flags() == ["--tiled_mlp"] and tiled.zero_stage == 2  # before ZeRO-3, which would fit untiled
    chosen = plan_with_savers(h100_node(llama8b, 262144)).recommended.setting
    assert chosen.flags() == ["--tiled_mlp", "--activation_offloading", "true"] and chosen.gradient_checkpointing
    cpu = dataclasses.replace(h100_node(llama8b, 4096), gpu=None, network=None)
    with pytest.raises(memory.MemoryPlanError, match="CPU processes hold them in host memory already"):
        memory.plan_memory(cpu)


@pytest.mark.parametrize(
    "length, n, flags",
    [
        (32768, 1, []),
        (131072, 1, ["--tiled_mlp"]),
        (262144, 1, ["--tiled_mlp", "--activation_offloading", "true"]),
        (524288, 2, ["--tiled_mlp", "--activation_offloading", "true"]),
        (1048576, 4, ["--tiled_mlp", "--activation_offloading", "true"]),
    ],
)
def test_the_plan_finds_the_smallest_sequence_parallelism_that_fits(llama8b, length, n, flags):
    """LoRA on Llama-3.1-8B (its config's positions raised to 1M) on one 8 x H100 node: docs/long-context.md's
    worked example."""
    found = plan_long_context(h100_node(llama8b, length))
    assert found.plan.job.sequence_parallel == n
    assert found.plan.recommended.setting.flags() == flags
    assert [line.split(":")[0] for line in found.tried] == [f"--sequence_parallel {m}" for m in (1, 2, 4) if m < n]


def test_when_nothing_fits_the_plan_says_so_with_each_sequence_parallelism_tried(llama8b):
    l4 = Job(llama8b, GPUS["L4"], 192, 1, 4, 1048576, "bf16", global_batch=4, tiled_mlps=(False, True))
    found = plan_long_context(l4)
    assert found.plan.recommended is None and found.plan.reason.startswith("nothing fits: the closest")
    assert [line.split(":")[0] for line in found.tried] == [
        "--sequence_parallel 1",
        "--sequence_parallel 2",
        "--sequence_parallel 4",
    ]
    assert all("breaks GPU memory" in line for line in found.tried)


def test_llmft_plan_answers_with_n_tiling_offload_and_the_submission(capsys, tmp_path):
    from published_shapes import llama_3_1_8b

    model = tmp_path / "llama-3.1-8b-1m"
    llama_3_1_8b(max_position_embeddings=1_048_576).save_pretrained(model)
    args = ["--model", model, "--node_type", "a3-highgpu-8g", "--max_length", 524288, "--global_batch_size", 8]
    rc = plan_command.main(
        plan_command.make_parser().parse_args([str(a) for a in [*args, "--use_peft", "--write", tmp_path / "p"]])
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert (
        "llmft plan: sequence parallelism: 8 ranks = 4 data-parallel x 2 sequence-parallel; each rank holds 262144 "
        "of a sample's 524288 tokens" in out
    )
    # half of each rank's 262,144 tokens of q, k, v and output (2 x 4096 + 2 x 1024 bf16 values) leave it
    assert "llmft plan: Ulysses all-to-all: 2560 MiB per rank a layer and pass, " in out
    assert "over the NVLink inside the node, " in out
    assert "llmft plan: a smaller sequence parallelism does not fit (with the tiling and offload allowed): " in out
    assert "gradient checkpointing on, tiled MLP, activations offloaded to the host" in out
    sbatch = (tmp_path / "p" / "sbatch.txt").read_text()
    assert "SEQUENCE_PARALLEL=2," in sbatch and "--tiled_mlp --activation_offloading true" in sbatch
    assert json.loads((tmp_path / "p" / "plan.json").read_text())["sequence_parallel"] == 2
    # the same with a given N: checked, not searched
    rc = plan_command.main(
        plan_command.make_parser().parse_args([str(a) for a in [*args, "--use_peft", "--sequence_parallel", 8]])
    )
    assert rc == 0 and "8 ranks = 1 data-parallel x 8 sequence-parallel" in capsys.readouterr().out


def test_check_memory_checks_a_sequence_parallel_setting(capsys, tmp_path):
    from published_shapes import llama_3_1_8b

    model = tmp_path / "llama-3.1-8b"
    llama_3_1_8b().save_pretrained(model)
    common = [
        "--model",
        model,
        "--node_type",
        "a3-highgpu-8g",
        "--nproc_per_node",
        8,
        "--global_batch_size",
        8,
        "--use_peft",
    ]
    common += ["--per_device_train_batch_size", 1, "--zero_stage", 2, "--max_length", 131072, "--check_memory"]
    parse = plan_command.make_parser().parse_args
    rc = plan_command.main(
        parse([str(a) for a in [*common, "--gradient_checkpointing", "true", "--sequence_parallel", 8]])
    )
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    assert "llmft plan: memory: ZeRO-2, micro-batch 1 x accumulation 8, gradient checkpointing on fits" in out
    # not given: llmft train's own choice, recomputation off only where the run fits without it (here it does not)
    rc = plan_command.main(parse([str(a) for a in [*common, "--sequence_parallel", 2]]))
    out, err = capsys.readouterr()
    assert rc == 0 and "memory: ZeRO-2, micro-batch 1 x accumulation 2, gradient checkpointing on fits" in out, err
    rc = plan_command.main(
        parse([str(a) for a in [*common, "--sequence_parallel", 2, "--gradient_checkpointing", "false"]])
    )
    _, err = capsys.readouterr()
    assert rc == 2 and "llmft plan: error: memory: ZeRO-2, micro-batch 1 x accumulation 2" in err


# ---- DeepSpeed's TiledMLP --------------------------------------------------------------------------------------


def test_tiled_mlp_computes_the_same_loss_and_gradients_in_shards():
    """--tiled_mlp's MLPs, in 4 shards (256 tokens at hidden 64), give the loss and every gradient of the plain
    model."""
    from transformers import LlamaForCausalLM

    from llmft.training import tiled_mlp

    ids = torch.randint(0, 512, (2, 256), generator=torch.Generator().manual_seed(0))
    grads = []
    for tiled in (False, True):
        torch.manual_seed(0)
        model = LlamaForCausalLM(activation_probe.config())
        if tiled:
            assert tiled_mlp.install(model, "llama") == 4
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain_loss, plain), (tiled_loss, tiled) = grads
    assert tiled_loss == pytest.approx(plain_loss, rel=1e-6)
    for name, grad in plain.items():
        torch.testing.assert_close(tiled[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    assert memory.tiled_mlp_shards(64, 256) == 4


def test_tiled_mlp_refuses_a_model_without_gated_mlps():
    from transformers import GPT2Config, GPT2LMHeadModel

    from llmft.training.tiled_mlp import TiledMlpError, install

    with pytest.raises(TiledMlpError, match=r"a gpt2 model has none: drop --tiled_mlp$"):
        install(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2)), "gpt2")


def test_activation_offloading_is_refused_without_a_gpu(tmp_path):
    proc = run(
        [PYTHON, "-m", "llmft.train", "--model_name_or_path", "gpt2", "--dataset_name", "d.jsonl"]
        + ["--output_dir", str(tmp_path / "out"), "--activation_offloading", "true"]
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "llmft train: error: --activation_offloading moves activations from GPU memory to host RAM; without a CUDA "
        "GPU they are in host memory already: drop it"
    )
    assert "Traceback" not in proc.stderr


# ---- data for long sequences --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def long_records(tmp_path_factory):
    """Records of 20k, 40k, 300k and 150 tokens (a prompt of 50 words, a completion of the rest)."""
    import random

    from transformers import AutoTokenizer

    from llmft.data.synthetic import make_model_dir, write_jsonl

    root = tmp_path_factory.mktemp("long")
    model = make_model_dir(root / "model", arch="llama", n_head=4, n_kv_head=2)
    tokenizer = AutoTokenizer.from_pretrained(model)
    rng = random.Random(0)
    words = "apple river stone cloud garden window silver forest candle bridge ocean paper".split()

    def text(n):
        return " ".join(rng.choice(words) for _ in range(n))

    rows = [{"prompt": text(50) + "?\n", "completion": text(n)} for n in (20000, 40000, 300000, 100)]
    lengths = [len(tokenizer(r["prompt"] + r["completion"] + tokenizer.eos_token)["input_ids"]) for r in rows]
    return root, tokenizer, write_jsonl(rows, root / "long.jsonl"), lengths


@pytest.mark.parametrize("packing", [False, True])
def test_the_data_fit_and_packing_hold_at_long_lengths(long_records, packing):
    """At max_length 131,072 the 300k-token record is the one truncated, its cut counted to the token; packed rows
    hold every kept token, each row's samples listed (seq_lengths), none over max_length."""
    from test_data_fit import sft_args

    from llmft.data import cache

    root, tokenizer, path, lengths = long_records
    max_length = 131072
    lines = []
    prepared = cache.prepare(
        cache.DataOptions(dataset_name=str(path)),
        tokenizer,
        sft_args(root, max_length=max_length, packing=packing),
        log=lines.append,
        root=root / f"cache-{packing}",
        positions=1_048_576,
    )
    fit = prepared.info["fit"]["train"]
    cut = sum(max(0, n - max_length) for n in lengths)
    assert (fit["records"], fit["kept"], fit["truncated"], fit["dropped"]) == (4, 4, 1, 0)
    assert (fit["tokens"], fit["tokens_cut"], fit["length_max"]) == (sum(lengths), cut, max(lengths))
    assert "train data: 4 of 4 records kept, 1 truncated, 0 dropped" in "\n".join(lines)
    rows = [len(ids) for ids in prepared.train["input_ids"]]
    assert sum(rows) == sum(lengths) - cut and max(rows) <= max_length
    if packing:
        assert len(rows) < 4
        assert [sum(s) for s in prepared.train["seq_lengths"]] == rows


def test_packed_long_rows_keep_their_samples_apart_for_a_sequence_parallel_kernel(long_records):
    """What a --sequence_parallel run with flash-attention gets from a packed row: TRL's collator restarts
    position_ids at each sample (the boundaries the kernel reads, which Ulysses keeps: it splits the row, not the
    positions) and pads the row to a multiple of N."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from llmft.planning.sequence_parallel import pad_to_multiple_of

    seq_lengths = [20053, 40053, 131]
    row = {"input_ids": list(range(sum(seq_lengths))), "seq_lengths": seq_lengths}
    row["labels"] = row["input_ids"]
    n = 4
    collator = DataCollatorForLanguageModeling(
        pad_token_id=0,
        padding_free=True,
        return_position_ids=True,
        pad_to_multiple_of=pad_to_multiple_of(n, None, True, None),
    )
    batch = collator([row])
    positions = batch["position_ids"][0].tolist()
    assert len(positions) % n == 0 and len(positions) >= sum(seq_lengths)
    starts = [i for i, p in enumerate(positions[: sum(seq_lengths)]) if p == 0]
    assert starts == [0, 20053, 20053 + 40053]


@pytest.mark.parametrize("host_ram_gb, tiled", [("8", False), ("4.2", True)])
def test_auto_turns_the_tiled_mlp_on_only_when_the_sequence_does_not_fit_without_it(
    tmp_path, monkeypatch, host_ram_gb, tiled
):
    """In-process, no training: a tiny Llama at 131,072 tokens on this CPU machine (recomputation off) needs 4.4 GiB
    untiled and 3.9 GiB with the tiled MLP, by the planner: with 8 GiB --auto leaves it off, with 4.2 GiB it turns it
    on, says why, and the run's settings carry it (llmft.train installs it on the model)."""
    from llmft.data.synthetic import make_model_dir
    from llmft.train import RunSettings, check_run, make_parser

    model = make_model_dir(tmp_path / "model", arch="llama", n_head=4, n_kv_head=2, n_positions=131072)
    monkeypatch.setenv("LLMFT_HOST_RAM_GB", host_ram_gb)
    argv = ["--model_name_or_path", str(model), "--dataset_name", "d.jsonl", "--output_dir", str(tmp_path / "o")]
    argv += ["--auto", "--gradient_checkpointing", "false", "--max_length", "131072"]
    argv += ["--global_batch_size", "1", "--per_device_train_batch_size", "1"]
    run = RunSettings(*make_parser().parse_args_and_config(args=argv))
    run, decided = check_run(run, cuda=False, gpu=None)
    assert run.llmft.tiled_mlp is tiled
    assert ("tiled MLP because the sequence does not fit without it" in decided.plan.auto) is tiled
    assert run.training.activation_offloading is False  # never on CPU: the activations are in host memory already


# ---- docs/long-context.md's worked example --------------------------------------------------------------------------


def worked_example_rows() -> list[str]:
    """The table in docs/long-context.md: Llama-3.1-8B (positions raised to 512k), LoRA r=16 and full fine-tuning,
    global batch 8, on one 8-GPU node of each type, as `llmft plan --model M --max_length L` answers."""
    from published_shapes import llama_3_1_8b

    from llmft.planning.run_plan import memory_job, resolve_hardware
    from llmft.planning.world import World

    config = llama_3_1_8b(max_position_embeddings=524288)
    rows = []
    for lora in (True, False):
        shape = model_shape(config, use_peft=lora, lora_r=16)
        for node in ("a3-highgpu-8g", "a2-ultragpu-8g", "a2-highgpu-8g"):
            hardware = resolve_hardware(None, None, node, None)
            for length in (32768, 131072, 524288):
                job = memory_job(
                    shape,
                    hardware,
                    World(1, 8, "arguments"),
                    max_length=length,
                    precision="bf16",
                    global_batch=8,
                    tiled_mlp=None,
                    activation_offloading=None,
                )
                found = plan_long_context(job)
                est, s = found.plan.recommended, found.plan.recommended.setting
                stage = f"ZeRO-{s.zero_stage}" + ("" if s.offload == "none" else f" + {s.offload} offload")
                rows.append(
                    f"| {node} ({hardware.gpu.name}) | {'LoRA' if lora else 'full'} | {length // 1024}k | "
                    f"{found.plan.job.sequence_parallel} | {stage} | {'yes' if s.tiled_mlp else 'no'} | "
                    f"{'yes' if s.activation_offloading else 'no'} | {memory.gib(est.gpu_total):.1f} | "
                    f"{memory.gib(est.host['peak']):.0f} | {est.tokens_per_s:,.0f} | {est.time.sequence_s:.2f} |"
                )
    return rows


def test_the_worked_example_in_the_docs_is_this_planners_output():
    text = (Path(__file__).resolve().parents[1] / "docs" / "long-context.md").read_text()
    table = text[text.index("<!-- WORKED_EXAMPLE -->") : text.index("<!-- /WORKED_EXAMPLE -->")]
    shown = [line for line in table.splitlines() if line.startswith("| a")]  # the rows: every node type starts with a
    assert shown == worked_example_rows()


def test_auto_plans_the_batch_over_the_data_parallel_ranks_under_sequence_parallelism(tmp_path, monkeypatch):
    """`llmft train --auto --sequence_parallel 2` on 2 ranks: one data-parallel rank, so a global batch of 4 with
    micro-batches of 2 accumulates 2 (over both ranks it would be 1)."""
    from llmft.data.synthetic import make_model_dir
    from llmft.planning.run_plan import auto_choice
    from llmft.planning.world import World

    model = make_model_dir(tmp_path / "model", arch="llama", n_head=4, n_kv_head=2)
    monkeypatch.setenv("LLMFT_HOST_RAM_GB", "16")
    common = dict(
        precision="fp32",
        max_micro_batch=2,
        global_batch=4,
        grad_accum=None,
        max_length=64,
        use_peft=False,
        lora_r=16,
        lora_target_modules=None,
        allow_gradient_checkpointing=False,
        save_total_limit=None,
        output_dir=str(tmp_path / "o"),
        attention="sdpa",
        load_in_4bit=False,
        save_consolidated=False,
    )
    setting, _ = auto_choice(str(model), World(1, 2, "arguments"), sequence_parallel=2, **common)
    assert (setting.micro_batch, setting.grad_accum) == (2, 2)
    setting, _ = auto_choice(str(model), World(1, 2, "arguments"), **common)
    assert (setting.micro_batch, setting.grad_accum) == (2, 1)

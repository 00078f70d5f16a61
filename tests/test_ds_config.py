"""ZeRO templates and their resolution into the concrete config a run writes to disk; `llmft plan`."""

import json
import re

import pytest
from conftest import PYTHON, run

from llmft.planning.batch import plan_batch
from llmft.planning.ds_config import DSConfigError, load_config, resolve, template_path, templates_dir

OPT = dict(gradient_clipping=1.0, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, hidden_size=64)
TEMPLATES = [
    "zero0.json",
    "zero1.json",
    "zero2.json",
    "zero2_offload.json",
    "zero3.json",
    "zero3_offload.json",
    "zero3_offload_optimizer.json",
]


def leaves(node):
    if isinstance(node, dict):
        for v in node.values():
            yield from leaves(v)
    else:
        yield node


@pytest.mark.parametrize("name", TEMPLATES)
def test_every_template_resolves_to_explicit_numbers(name):
    config = load_config(templates_dir() / name)
    resolved = resolve(config, plan_batch(world_size=4, micro_batch=2, global_batch=64), "bf16", **OPT)
    assert "auto" not in list(leaves(resolved))
    assert resolved["train_batch_size"] == 64
    assert resolved["train_micro_batch_size_per_gpu"] * resolved["gradient_accumulation_steps"] * 4 == 64
    assert resolved["bf16"]["enabled"] is True and resolved["fp16"]["enabled"] is False
    assert resolved["optimizer"]["params"]["betas"] == [0.9, 0.95]


def test_production_defaults_are_in_the_templates():
    z2 = json.loads((templates_dir() / "zero2.json").read_text())["zero_optimization"]
    z3o = json.loads((templates_dir() / "zero3_offload.json").read_text())["zero_optimization"]
    assert z2["overlap_comm"] and z2["contiguous_gradients"] and z2["reduce_bucket_size"] > 0
    for name in ("zero3.json", "zero3_offload.json", "zero3_offload_optimizer.json"):  # checkpoints are shards only
        assert (
            json.loads((templates_dir() / name).read_text())["zero_optimization"][
                "stage3_gather_16bit_weights_on_model_save"
            ]
            is False
        )
    assert z3o["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert z3o["offload_param"] == {"device": "cpu", "pin_memory": True}


def test_stage_and_offload_pick_the_template():
    assert template_path(3, offload=True).name == "zero3_offload.json"
    assert template_path(3, offload="optimizer+params").name == "zero3_offload.json"
    assert template_path(3, offload="optimizer").name == "zero3_offload_optimizer.json"
    assert template_path(2, offload="optimizer").name == "zero2_offload.json"
    assert template_path(2, offload="none").name == "zero2.json"
    opt_only = load_config(template_path(3, offload="optimizer"))["zero_optimization"]
    assert "offload_param" not in opt_only and opt_only["offload_optimizer"]["device"] == "cpu"
    assert template_path(None).name == "zero2.json"


@pytest.mark.parametrize(
    "args, message",
    [
        (dict(zero_stage=7), "unknown ZeRO stage 7; use --zero_stage 0, 1, 2 or 3"),
        (dict(zero_stage=1, offload=True), "--offload needs ZeRO stage 2 or 3"),
        (dict(zero_stage=None, deepspeed="/nonexistent/ds.json"), "DeepSpeed config /nonexistent/ds.json not found"),
        (dict(zero_stage=2, deepspeed="ds_configs/zero2.json"), "either --zero_stage or --deepspeed"),
    ],
)
def test_bad_config_choices_are_refused(args, message):
    with pytest.raises(DSConfigError, match=message.replace("(", r"\(")):
        template_path(**args)


def test_explicit_batch_value_contradicting_the_plan_is_refused(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}))
    with pytest.raises(DSConfigError, match=r"train_micro_batch_size_per_gpu=4 but this run needs 2"):
        resolve(load_config(path), plan_batch(world_size=1, micro_batch=2), "fp32", **OPT)


def test_invalid_json_names_the_line(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{\n  "zero_optimization": {"stage": 2},\n  oops\n}')
    with pytest.raises(DSConfigError, match=r"broken.json is not valid JSON \(line 3"):
        load_config(path)


def test_plan_cli_prints_the_plan_from_slurm_variables():
    proc = run(
        [
            PYTHON,
            "-m",
            "llmft.plan",
            "--global_batch_size",
            "32",
            "--per_device_train_batch_size",
            "2",
            "--zero_stage",
            "3",
        ],
        SLURM_NNODES="2",
        SLURM_GPUS_ON_NODE="4",
        check=True,
    )
    assert "world size 8 (2 nodes x 4 processes, from slurm)" in proc.stdout
    assert "gradient accumulation 2" in proc.stdout
    assert "global batch 32 = micro-batch 2 x accumulation 2 x world size 8" in proc.stdout
    assert "ZeRO stage 3" in proc.stdout


def test_plan_cli_fails_with_one_line_on_impossible_batch():
    proc = run(
        [
            PYTHON,
            "-m",
            "llmft.plan",
            "--global_batch_size",
            "30",
            "--per_device_train_batch_size",
            "2",
            "--nnodes",
            "1",
            "--nproc_per_node",
            "4",
        ]
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "llmft plan: error: global batch 30 is not divisible by micro-batch 2 x world size 4 = 8; use global batch 24 or 32"
    ]


@pytest.mark.parametrize(
    "requested, gpu, expected",
    [
        ("auto", None, "fp32"),  # CPU
        ("auto", "A100-40GB", "bf16"),
        ("auto", "L4", "bf16"),
        ("auto", "H100-80GB", "bf16"),
        ("auto", "T4", "fp16"),  # torch calls bf16 "supported" on a T4 (emulated): still fp16
        ("auto", "V100-16GB", "fp16"),
        ("fp16", "A100-40GB", "fp16"),  # an explicit choice wins where the hardware has it
        ("fp32", "L4", "fp32"),
        ("bf16", None, "bf16"),  # bf16 on CPU runs (slowly): allowed when asked for
    ],
)
def test_precision_follows_the_hardware_unless_chosen(requested, gpu, expected):
    from llmft.planning.hardware import GPUS, choose_precision

    assert choose_precision(requested, GPUS[gpu] if gpu else None) == expected


@pytest.mark.parametrize(
    "requested, gpu, message",
    [
        ("fp8", "A100-40GB", "unknown precision 'fp8'; use one of auto, bf16, fp16, fp32"),
        ("bf16", "T4", "bf16 needs a GPU with compute capability 8.0 or newer; this T4 has 7.5: use --precision fp16"),
        ("fp16", None, "fp16 mixed precision needs a GPU and none is visible here: use --precision fp32"),
    ],
)
def test_impossible_precision_is_refused_with_the_fix(requested, gpu, message):
    from llmft.planning.hardware import GPUS, HardwareError, choose_precision

    with pytest.raises(HardwareError, match=re.escape(message)):
        choose_precision(requested, GPUS[gpu] if gpu else None)


@pytest.mark.parametrize(
    "device_name, memory, cc, expected, peak",
    [
        ("NVIDIA L4", 22.0, (8, 9), "L4", 121.0),
        ("NVIDIA A100-SXM4-40GB", 39.4, (8, 0), "A100-40GB", 312.0),
        ("NVIDIA A100-SXM4-80GB", 79.1, (8, 0), "A100-80GB", 312.0),
        ("NVIDIA H100 80GB HBM3", 79.1, (9, 0), "H100-80GB", 989.0),
        ("NVIDIA H100 PCIe", 79.1, (9, 0), "H100-PCIe", 756.0),
        ("Tesla T4", 14.6, (7, 5), "T4", 65.0),
        (
            "NVIDIA RTX 6000 Ada Generation",
            47.5,
            (8, 9),
            "NVIDIA RTX 6000 Ada Generation",
            None,
        ),  # unknown: no peak, no MFU
    ],
)
def test_cuda_device_names_map_to_catalogue_facts(device_name, memory, cc, expected, peak):
    from llmft.planning.hardware import gpu_from_device

    gpu = gpu_from_device(device_name, memory, cc)
    assert (gpu.name, gpu.peak_tflops, gpu.memory_gib, gpu.compute_capability) == (expected, peak, memory, cc)


@pytest.mark.parametrize(
    "facts, kernel",
    [
        (
            dict(cuda=True, offload=False, fused_adam_prebuilt=True, cuda_compiler=False),
            "fused",
        ),  # the Dockerfile's image
        (
            dict(cuda=True, offload=False, fused_adam_prebuilt=False, cuda_compiler=True),
            "fused",
        ),  # JIT-built on the first step
        (
            dict(cuda=True, offload=False, fused_adam_prebuilt=False, cuda_compiler=False),
            "torch",
        ),  # pip torch, no toolkit
        (
            dict(cuda=True, offload=True, fused_adam_prebuilt=False, cuda_compiler=False),
            "deepspeed",
        ),  # DeepSpeedCPUAdam
        (dict(cuda=False, offload=False, fused_adam_prebuilt=False, cuda_compiler=False), "deepspeed"),  # CPU runs
        (  # a CPU run where no c++ is (a container image without one): CPU FusedAdam could not even load
            dict(cuda=False, offload=False, fused_adam_prebuilt=False, cuda_compiler=False, cxx_compiler=False),
            "torch",
        ),
        (
            dict(cuda=False, offload=True, fused_adam_prebuilt=False, cuda_compiler=False, cxx_compiler=False),
            "deepspeed",
        ),
    ],
)
def test_adam_runs_where_it_can_be_built(facts, kernel):
    from llmft.planning.ds_config import adam_kernel

    assert adam_kernel(**facts) == kernel


def test_torch_adam_config_trains_under_deepspeed(tmp_path):
    """The "torch" choice sets DeepSpeed's torch_adam on the template's AdamW (and only on an Adam block), and a real
    ZeRO-2 engine built from that config runs torch.optim.AdamW and takes a step."""
    from llmft.planning.ds_config import with_adam_kernel

    plan = plan_batch(micro_batch=2, world_size=1, global_batch=2)
    config = resolve(
        load_config(template_path(2)),
        plan,
        "fp32",
        gradient_clipping=1.0,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        hidden_size=8,
    )
    assert with_adam_kernel(config, "fused") is config
    assert (
        with_adam_kernel({**config, "optimizer": {"type": "Lamb", "params": {}}}, "torch")["optimizer"]["params"] == {}
    )
    torch_adam = with_adam_kernel(config, "torch")
    assert (
        torch_adam["optimizer"]["params"]["torch_adam"] is True and "torch_adam" not in config["optimizer"]["params"]
    )
    (tmp_path / "ds.json").write_text(json.dumps(torch_adam))
    script = f"""
import json, torch, deepspeed
from llmft.training.deepspeed_env import skip_deepspeed_shm_op
skip_deepspeed_shm_op()  # as llmft train does: no CPU shared-memory op build
model = torch.nn.Linear(8, 8)
engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=json.load(open({str(tmp_path / "ds.json")!r})))
before = model.weight.detach().clone()
loss = engine(torch.randn(2, 8)).pow(2).sum()
engine.backward(loss)
engine.step()
print(type(optimizer.optimizer).__module__, type(optimizer.optimizer).__name__, bool((model.weight != before).any()))
torch.distributed.destroy_process_group()
"""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = run(
        [PYTHON, "-c", script],
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "torch.optim.adamw AdamW True"

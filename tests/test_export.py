"""`llmft export` and `llmft push` on checkpoints of real 2-process `llmft train` runs (DeepSpeed on CPU): a ChatML
model whose end-of-turn token (`<|im_end|>`) is not its EOS, trained on chat records long enough to end its turns.

One full ZeRO-3 run and one LoRA ZeRO-2 run per module; the full run is exported once and shared."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest
from conftest import PYTHON, REPO, run

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def chat_setup(tmp_path_factory) -> tuple[Path, Path]:
    """(model dir, chat data): the tiny GPT-2 with a ChatML template and its own end-of-turn token."""
    from llmft.data.synthetic import as_format, make_examples, make_model, make_tokenizer, write_jsonl

    root = tmp_path_factory.mktemp("chatml")
    tokenizer = make_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    model = make_model(tokenizer)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    return root / "model", write_jsonl(as_format(make_examples(256), "messages"), root / "chat.jsonl")


def _train(out: Path, model: Path, data: Path, *flags: str) -> Path:
    run(
        [
            PYTHON,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(_free_port()),
            "-m",
            "llmft.train",
            "--model_name_or_path",
            str(model),
            "--dataset_name",
            str(data),
            "--output_dir",
            str(out),
            "--global_batch_size",
            "8",
            "--per_device_train_batch_size",
            "4",
            "--report_to",
            "none",
            "--logging_steps",
            "10",
            "--disable_tqdm",
            "true",
            *flags,
        ],
        timeout=600,
        check=True,
    )
    return out


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, chat_setup) -> Path:
    """40 steps at a high learning rate: enough for the tiny model to end its replies with <|im_end|>."""
    model, data = chat_setup
    out = tmp_path_factory.mktemp("full") / "run"
    return _train(
        out, model, data, "--zero_stage", "3", "--max_steps", "40", "--save_steps", "20", "--learning_rate", "1e-2"
    )


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, chat_setup, full_run) -> Path:
    """A LoRA run on the full run's fp32 export (a base that already ends its turns, so the stop check can pass)."""
    _, data = chat_setup
    root = tmp_path_factory.mktemp("lora")
    model = root / "base"
    export(full_run, "--out", model, "--dtype", "float32")
    out = root / "run"
    lora = ["--use_peft", "--lora_r", "8", "--lora_target_modules", "c_attn", "c_proj"]
    return _train(out, model, data, "--zero_stage", "2", "--max_steps", "4", "--save_steps", "4", *lora)


def export(*args, check=True, **env):
    proc = run([PYTHON, "-m", "llmft.cli", "export", *map(str, args)], timeout=300, **env)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def exported(full_run, tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("exported") / "model"
    return out, export(full_run, "--out", out).stderr


def _tensors(directory: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_the_export_is_the_checkpoint_in_bf16_with_its_stops_template_and_checks(full_run, exported, chat_setup):
    import torch
    from transformers import AutoTokenizer

    from llmft.checkpoint.zero import load_fp32_state_dict

    out, stderr = exported
    assert "checks passed" in stderr and "the chat prompt stops at its end of turn" in stderr, stderr[-2000:]
    masters = load_fp32_state_dict(full_run / "checkpoint-40" / "global_step40")  # the newest complete checkpoint
    weights = _tensors(out)
    config = json.loads((out / "config.json").read_text())
    # tied: the LM head is the input embedding, written once, and config.json says so
    assert config["tie_word_embeddings"] is True and "lm_head.weight" not in weights
    assert config["dtype"] == "bfloat16" and config["use_cache"] is True
    assert set(weights) == set(masters) - {"lm_head.weight"}
    assert all(weights[k].dtype == torch.bfloat16 and torch.equal(weights[k], masters[k].bfloat16()) for k in weights)
    assert not (out / "model.safetensors.index.json").exists()  # one shard under 5GB: no index, as save_pretrained
    tokenizer = AutoTokenizer.from_pretrained(out)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tokenizer.eos_token_id, im_end] and im_end != tokenizer.eos_token_id
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(full_run / "checkpoint-40").chat_template == CHATML
    record = json.loads((out / "llmft_export.json").read_text())
    assert record["source"] == str(full_run / "checkpoint-40" / "global_step40") and record["zero_stage"] == 3
    chat = [t for p, t in zip(record["prompts"], record["tokens"]) if p["chat"]]
    assert chat and chat[0][-1] == im_end and len(chat[0]) < record["max_new_tokens"]


def test_shards_and_the_check_alone_fail_on_a_missing_shard_changed_weights_and_eos_only(exported, tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    out, _ = exported
    sharded = tmp_path / "sharded"
    record = json.loads((out / "llmft_export.json").read_text())
    run_dir = Path(record["source"]).parent.parent
    export(run_dir, "--out", sharded, "--max_shard_size", "100KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1  # a tensor over the size gets a shard of its own (huggingface_hub's rule)
    for shard in (load_file(sharded / s) for s in shards):
        assert sum(t.numel() * t.element_size() for t in shard.values()) <= 100_000 or len(shard) == 1
    assert _tensors(sharded).keys() == _tensors(out).keys()
    a = AutoModelForCausalLM.from_pretrained(sharded).state_dict()
    b = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(v.equal(b[k]) for k, v in a.items())
    assert "checks passed" in export("--check", sharded).stderr

    changed = tmp_path / "changed"  # a weight nudged after the export: the fresh process's tokens differ
    shutil.copytree(out, changed)
    weights = load_file(changed / "model.safetensors")
    weights["transformer.wte.weight"] = weights["transformer.wte.weight"].flip(0).contiguous()
    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})
    bad = export("--check", changed, check=False)
    assert bad.returncode == 1 and "differ from the checkpoint's" in bad.stderr, bad.stderr[-2000:]

    eos_only = tmp_path / "eos_only"  # the stop list without <|im_end|>: a served chat model would not stop
    shutil.copytree(out, eos_only)
    generation = json.loads((eos_only / "generation_config.json").read_text())
    generation["eos_token_id"] = generation["eos_token_id"][0]
    (eos_only / "generation_config.json").write_text(json.dumps(generation))
    bad = export("--check", eos_only, check=False)
    assert bad.returncode == 1 and "without stopping" in bad.stderr, bad.stderr[-2000:]

    (sharded / shards[-1]).unlink()
    bad = export("--check", sharded, check=False)
    assert bad.returncode == 1 and f"the index names {shards[-1]}, which is missing" in bad.stderr


def test_lora_both_writes_the_merged_model_and_the_adapter_vllm_reads(lora_run, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from llmft.checkpoint.loader import load

    out = tmp_path / "both"
    stderr = export(lora_run, "--out", out, "--lora", "both").stderr
    assert "checks passed" in stderr
    merged = load(lora_run / "checkpoint-4" / "global_step4", merge=True).model  # fp32 merge
    weights = _tensors(out)
    assert not any("lora_" in k for k in weights)
    assert all(torch.equal(v, merged.state_dict()[k].bfloat16()) for k, v in weights.items())
    adapter = out / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8 and set(config["target_modules"]) == {"c_attn", "c_proj"}
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"])
    with_adapter = PeftModel.from_pretrained(base, adapter).merge_and_unload()
    assert all(torch.equal(v, merged.state_dict()[k]) for k, v in with_adapter.state_dict().items())

    alone = tmp_path / "adapter_only"
    assert "checks passed" in export(lora_run, "--out", alone, "--lora", "adapter").stderr
    assert (alone / "adapter_model.safetensors").is_file() and not (alone / "config.json").exists()


def test_the_model_card_parses_and_says_how_where_and_with_what(full_run, exported, tmp_path):
    from huggingface_hub import ModelCard

    from llmft.checkpoint.model_card import write_card

    out, _ = exported
    card = ModelCard.load(out / "README.md")
    assert card.data.pipeline_tag == "text-generation" and card.data.library_name == "transformers"
    assert {"llmft", "full"} <= set(card.data.tags)
    assert card.data.license is None and "license" not in card.content.split("---")[1]  # never a placeholder
    assert card.data.base_model is None  # a local base model is named in the text, not as a Hub id
    launch = json.loads((full_run / "llmft_launch.json").read_text())
    assert launch["command"].startswith("llmft train ") and "--zero_stage 3" in launch["command"]
    for expected in (
        launch["command"],
        "| data fit | 256 records: 256 kept whole, 0 truncated, 0 dropped",
        "| learning_rate | 0.01 |",
        '"stage": 3',
        "| GPUs | none (CPU) |",
        "| nodes x processes per node | 1 x 2 |",
        "| scheduler | none |",
        f"| tokens/s | {json.loads((full_run / 'run_summary.json').read_text())['tokens_per_second']} |",
        f"| transformers | {launch['versions']['transformers']} |",
        "vllm serve",
        "`<|im_end|>`",
    ):
        assert expected in card.content, expected

    # with `llmft eval` results, a base model's local card naming its licence, and a Hub base model id
    run_copy = tmp_path / "run"
    shutil.copytree(full_run, run_copy, ignore=shutil.ignore_patterns("global_step*"))
    (run_copy / "eval").mkdir()
    (run_copy / "eval" / "summary.jsonl").write_text(
        json.dumps({"step": 40, "task": "gsm8k", "metrics": {"exact_match,strict-match": 0.25}, "stderr": {}})
        + "\n"
        + json.dumps({"step": 20, "task": "gsm8k", "metrics": {"exact_match,strict-match": 0.5}, "stderr": {}})
        + "\n"
    )
    record = json.loads((out / "llmft_export.json").read_text())
    record["source"] = str(run_copy / "checkpoint-40" / "global_step40")
    card = ModelCard.load(write_card(tmp_path, record, repo="my-org/my-model"))
    results = card.data.eval_results
    assert [(r.dataset_type, r.metric_name, r.metric_value) for r in results] == [
        ("gsm8k", "exact_match,strict-match", 0.25)
    ]
    assert 'from_pretrained("my-org/my-model"' in card.content


def test_card_metadata_decisions():
    from llmft.checkpoint.model_card import base_license, gpu_hours, hub_id

    assert hub_id("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B" and hub_id("gpt2") == "gpt2"
    assert hub_id("/models/llama") is None and hub_id("data/train.jsonl") is None and hub_id(None) is None
    assert gpu_hours([{"gpu": "H100", "wall_seconds": 3600, "world_size": 8}, {"gpu": None, "wall_seconds": 9}]) == 8.0
    assert gpu_hours([{"gpu": None, "wall_seconds": 60, "world_size": 2}]) is None
    assert base_license(None) is None


def test_base_licence_comes_from_the_local_card(tmp_path):
    from llmft.checkpoint.model_card import base_license

    (tmp_path / "README.md").write_text("---\nlicense: apache-2.0\n---\n# base\n")
    assert base_license(str(tmp_path)) == "apache-2.0"
    (tmp_path / "README.md").write_text("---\nlicense: license\n---\n# TRL's placeholder\n")
    assert base_license(str(tmp_path)) is None


def test_end_of_turn_and_stop_decisions(tiny_model):
    from transformers import AutoTokenizer

    from llmft.checkpoint.export import end_of_turn_token, first_special_token, stop_token_ids, template_stops

    assert first_special_token("<|eot_id|><|start_header_id|>", ["<|start_header_id|>", "<|eot_id|>"]) == "<|eot_id|>"
    assert first_special_token("\n<|im_end|>", ["<|im_end|>", "<|im_start|>"]) == "<|im_end|>"
    assert first_special_token("plain text", ["<|im_end|>"]) is None
    assert stop_token_ids(2, 7) == [2, 7] and stop_token_ids(2, 2) == 2 and stop_token_ids([2, 9], 9) == [2, 9]
    assert stop_token_ids(2, None) == 2
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)  # llmft's default template ends turns with the EOS
    assert end_of_turn_token(tokenizer) == tokenizer.eos_token
    assert template_stops(tokenizer, tokenizer.eos_token_id) == (tokenizer.eos_token, tokenizer.eos_token_id)
    tokenizer.chat_template = None  # trained without a template: the EOS alone
    assert template_stops(tokenizer, tokenizer.eos_token_id) == (None, tokenizer.eos_token_id)


LLAMA3 = (
    "<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
GEMMA = (
    "{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@pytest.mark.parametrize(
    "specials,template,expected",
    [
        (["<|im_start|>", "<|im_end|>"], CHATML, "<|im_end|>"),
        (["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], LLAMA3, "<|eot_id|>"),
        (["<start_of_turn>", "<end_of_turn>"], GEMMA, "<end_of_turn>"),
    ],
)
def test_the_end_of_turn_token_is_read_from_the_template(specials, template, expected):
    from llmft.checkpoint.export import template_stops
    from llmft.data.synthetic import make_tokenizer

    tokenizer = make_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.chat_template = template
    eot_id = tokenizer.convert_tokens_to_ids(expected)
    assert template_stops(tokenizer, tokenizer.eos_token_id) == (expected, [tokenizer.eos_token_id, eot_id])


def test_the_launch_record_hides_access_tokens():
    from llmft.training.run_identity import launch_record, redact_secrets

    argv = ["--hub_token", "hf_secret", "--eos_token", "<|im_end|>", "--push_to_hub_token=hf_secret2", "--lr", "1"]
    assert redact_secrets(argv) == [
        "--hub_token",
        "<redacted>",
        "--eos_token",
        "<|im_end|>",
        "--push_to_hub_token=<redacted>",
        "--lr",
        "1",
    ]
    record = launch_record(argv, {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "SLURM_JOB_ID": "77"})
    assert "hf_secret" not in json.dumps(record)
    assert (record["nnodes"], record["nproc_per_node"], record["scheduler"], record["job_id"]) == (2, 4, "slurm", "77")


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["{run}", "--out", "{nonempty}"], "is a directory that is not empty: give a new or empty directory"),
        (["{run}", "--out", "{new}", "--lora", "adapter"], "--lora adapter but"),
        (["{run}", "--out", "{new}", "--max_shard_size", "five gigs"], "--max_shard_size 'five gigs' is not a size"),
        (["{run}", "--out", "{new}", "--push_to_hub", "just-a-name"], "'just-a-name' is not ORG/NAME"),
        (["{incomplete}", "--out", "{new}"], "has no llmft_complete.json: it was interrupted while saving"),
        (["{run}", "--out", "{new}", "--private"], "--private applies to --push_to_hub"),
        (["--check", "{new}"], "has no readable llmft_export.json"),
        (["--check", "{new}", "--dtype", "float32"], "--check DIR runs the checks alone: drop --dtype"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(full_run, tmp_path, capsys, argv, expected):
    from llmft.export import main, make_parser

    incomplete = tmp_path / "run"
    shutil.copytree(full_run, incomplete, ignore=shutil.ignore_patterns("checkpoint-20"))
    (incomplete / "checkpoint-40" / "llmft_complete.json").unlink()
    (tmp_path / "nonempty").mkdir()
    (tmp_path / "nonempty" / "keep.txt").write_text("mine")
    places = {
        "run": full_run,
        "nonempty": tmp_path / "nonempty",
        "new": tmp_path / "new",
        "incomplete": incomplete / "checkpoint-40",
    }
    assert main(make_parser().parse_args([a.format(**places) for a in argv])) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("llmft export: error: ") and "\n" not in err and expected in err, err
    assert (tmp_path / "nonempty" / "keep.txt").read_text() == "mine" and not (tmp_path / "new").exists()


def test_an_export_that_fails_half_way_leaves_no_directory(full_run, tmp_path, capsys, monkeypatch):
    """The export is written beside DIR and renamed into place at the end: a failure leaves neither."""
    from llmft.checkpoint import export as library
    from llmft.checkpoint.run_dir import CheckpointError
    from llmft.export import main, make_parser

    def fail(*args, **kwargs):
        raise CheckpointError("the disk filled up (a stand-in)")

    monkeypatch.setattr(library, "write_generation_config", fail)  # after the weights were written
    assert main(make_parser().parse_args([str(full_run), "--out", str(tmp_path / "x")])) == 2
    assert "the disk filled up" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_infer_export_names_the_new_command(full_run, capsys):
    from llmft.infer import main, make_parser

    assert main(make_parser().parse_args([str(full_run), "--export", "somewhere"])) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"llmft infer: error: --export moved to its own command: llmft export {full_run} --out somewhere"


def test_push_uploads_the_directory_through_huggingface_hub(exported, tmp_path):
    from hub_standin import HubStandin

    out, _ = exported
    with HubStandin(lifetime_s=120) as hub:
        env = dict(HF_ENDPOINT=hub.url, HF_TOKEN="hf_standin_token", HF_HUB_OFFLINE="0", HF_HUB_DISABLE_TELEMETRY="1")
        hub.refuse_commits = 1  # the first try fails at the commit, as one line; the rerun completes it
        first = run([PYTHON, "-m", "llmft.cli", "push", str(out), "my-org/my-model", "--private"], timeout=120, **env)
        assert first.returncode == 2 and "the Hub refused the upload to my-org/my-model" in first.stderr
        pushed = run([PYTHON, "-m", "llmft.cli", "push", str(out), "my-org/my-model", "--private"], timeout=120, **env)
        assert pushed.returncode == 0, pushed.stderr[-2000:]
        bad = run([PYTHON, "-m", "llmft.cli", "push", str(out), "my-org"], timeout=120, **env)
        source = json.loads((out / "llmft_export.json").read_text())["source"]
        again = tmp_path / "again"  # export and push in one command: the card names the repository
        export(source, "--out", again, "--push_to_hub", "my-org/again", **env)
    repo = hub.repos["my-org/my-model"]
    assert repo["private"] and repo["commits"] == 1
    assert repo["files"] == {p.name: p.read_bytes() for p in out.iterdir()}
    assert all(r["token"] for r in hub.requests) and all(r["path"].startswith("/api/") for r in hub.requests)
    assert "hf_standin_token" not in first.stderr + pushed.stderr + pushed.stdout
    assert bad.returncode == 2 and "'my-org' is not ORG/NAME" in bad.stderr
    assert len(hub.cards) == 3 and hub.cards[1] == (out / "README.md").read_text()
    assert not hub.repos["my-org/again"]["private"]
    assert hub.repos["my-org/again"]["files"] == {p.name: p.read_bytes() for p in again.iterdir()}
    assert 'from_pretrained("my-org/again"' in (again / "README.md").read_text()


def test_the_jobs_export_step_exports_the_finished_run_with_its_checks(full_run, tmp_path):
    """EXPORT=DIR on either scheduler: after a finished run, `llmft export RUN --out DIR` (relative to the submit
    directory) runs as one step; its exit code is the job's. Without EXPORT nothing runs."""
    from llmft.launch import job, knobs

    submit = tmp_path / "submit"
    submit.mkdir()
    said = []
    k = knobs.resolve({}, ["EXPORT=exported/final"], cwd=submit)
    command = job.export_command(k, PYTHON, full_run, submit)
    assert command == [PYTHON, "-m", "llmft.export", str(full_run), "--out", str(submit / "exported" / "final")]
    assert job.export_after_training(command, [], said.append) == 0
    assert said[-1] == f"exported to {submit / 'exported' / 'final'}"
    assert json.loads((submit / "exported" / "final" / "llmft_export.json").read_text())["step"] == 40
    assert job.export_after_training(command, [], said.append) == 2  # the directory is taken now: export's exit code
    assert said[-1] == "error: llmft export exited 2; the run itself is complete"
    assert job.export_command(knobs.resolve({}, [], cwd=submit), PYTHON, full_run, submit) is None
    assert job.export_after_training(None, [], said.append) == 0


NF4 = {"quant_type": "nf4", "double_quant": True, "blocksize": 64, "dtype": "bfloat16"}


def test_a_qlora_merge_needs_the_runs_recorded_4bit_settings_and_the_adapter_alone_needs_none():
    from llmft.checkpoint.qlora_merge import merge_settings_problem
    from llmft.planning.hardware import GPUS
    from llmft.planning.qlora import QuantRequest, choose_quantization, recorded_settings
    from llmft.training.run_identity import differences

    qlora = {"quantization": "4bit", "quantization_settings": NF4}
    assert merge_settings_problem(qlora, "merged") is None and merge_settings_problem(qlora, "both") is None
    unrecorded = merge_settings_problem({"quantization": "4bit", "lora": {"r": 8}}, "merged")
    assert unrecorded.startswith("the run trained its adapter against a 4bit base (QLoRA)")
    assert "does not record how" in unrecorded and unrecorded.endswith(
        "--lora adapter (vLLM serves it on the base with --enable-lora)"
    )
    for broken in (
        {**NF4, "blocksize": None},
        {**NF4, "dtype": "int8"},
        {k: v for k, v in NF4.items() if k != "double_quant"},
    ):
        assert "does not record how" in merge_settings_problem(
            {"quantization": "4bit", "quantization_settings": broken}, "merged"
        )
    eight = merge_settings_problem({"quantization": "8bit"}, "both")
    assert "dequantizes 4-bit bases only" in eight and "--lora adapter" in eight
    assert merge_settings_problem({"quantization": "4bit"}, "adapter") is None
    assert (
        merge_settings_problem({"quantization": None}, "merged") is None
        and merge_settings_problem({}, "merged") is None
    )
    decided = choose_quantization(
        QuantRequest(load_in_4bit=True, quant_type="fp4"),
        gpu=GPUS["T4"],
        zero_stage=2,
        offload=False,
        use_peft=True,
        precision="fp16",
        bitsandbytes="0.50.2",
    )
    assert recorded_settings(decided) == {
        "quant_type": "fp4",
        "double_quant": False,
        "blocksize": 64,
        "dtype": "float16",
    }
    assert (
        recorded_settings({"load_in_8bit": True, "model_dtype": "bfloat16"}) is None
        and recorded_settings(None) is None
    )
    fp4 = {**NF4, "quant_type": "fp4"}  # a rerun into the run's directory with other 4-bit settings is another run
    assert differences({"quantization_settings": NF4}, {"quantization_settings": fp4}) == [
        "QLoRA 4-bit settings: quant_type nf4 -> fp4"
    ]


def test_a_qlora_merge_without_bitsandbytes_is_one_line_naming_the_install_and_the_adapter(monkeypatch):
    import sys

    import torch

    from llmft.checkpoint.qlora_merge import quantize_round_trip
    from llmft.checkpoint.run_dir import CheckpointError

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # not installed: importing it raises ImportError
    with pytest.raises(CheckpointError) as e:
        quantize_round_trip(torch.ones(4, 64), NF4, transposed=False)
    assert "needs bitsandbytes: pip install bitsandbytes" in str(e.value) and "--lora adapter" in str(e.value)


BNB_SITE = REPO / ".bnb-site"  # bitsandbytes, apart from .venv (the Makefile says why)


@pytest.fixture
def bitsandbytes_site(monkeypatch) -> Path:
    """bitsandbytes on this process's path and the exporter's: `make test`'s set-up installs it into .bnb-site."""
    assert (BNB_SITE / "bitsandbytes").is_dir(), f"{BNB_SITE}: no bitsandbytes there; run `make test-setup` first"
    monkeypatch.syspath_prepend(str(BNB_SITE))
    return BNB_SITE


def _round_trip(weight, settings):
    """The test's own dequant(quant(W)) for a GPT-2 Conv1D weight: transposed to nn.Linear's layout, in the run's dtype."""
    import torch
    from bitsandbytes import functional as F

    packed, state = F.quantize_4bit(
        weight.to(getattr(torch, settings["dtype"])).T.contiguous(),
        blocksize=settings["blocksize"],
        quant_type=settings["quant_type"],
        compress_statistics=settings["double_quant"],
    )
    return F.dequantize_4bit(packed, state).T.float()


@pytest.mark.parametrize("settings", [NF4, {**NF4, "quant_type": "fp4", "double_quant": False}], ids=["nf4", "fp4"])
def test_a_qlora_merge_folds_the_adapter_into_the_dequantized_base_it_was_trained_on(
    lora_run, tmp_path, settings, bitsandbytes_site
):
    """The merged weights are dequant(quant(W)) + scale * B @ A, not W + scale * B @ A, and the exported model's
    greedy tokens are those of PEFT's model: the adapter on the dequantized base."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmft.checkpoint import export_checks
    from llmft.checkpoint.loader import load

    run_dir = tmp_path / "qlora"  # the LoRA run, recorded as a 4-bit one (QLoRA cannot train without CUDA)
    shutil.copytree(lora_run, run_dir)
    record = json.loads((run_dir / "llmft_run.json").read_text())
    (run_dir / "llmft_run.json").write_text(
        json.dumps({**record, "quantization": "4bit", "quantization_settings": settings})
    )
    out = tmp_path / "merged"
    merged = export(run_dir, "--out", out, "--lora", "both", "--dtype", "float32", PYTHONPATH=str(bitsandbytes_site))
    stderr = merged.stderr
    assert "checks passed" in stderr and "8 base layers quantized as the run did" in stderr, stderr[-2000:]
    assert json.loads((out / "llmft_export.json").read_text())["dequantized_base"] == settings
    double = ", double quantization" if settings["double_quant"] else ""
    assert (
        f"| merge | the adapter merged into the base dequantized from {settings['quant_type']} 4-bit (block size 64"
        f"{double}, from bfloat16)" in (out / "README.md").read_text()
    )
    weights = _tensors(out)
    adapter_config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    base = AutoModelForCausalLM.from_pretrained(adapter_config["base_model_name_or_path"], dtype=torch.float32)
    original = {k: v.clone() for k, v in base.state_dict().items()}
    plain = load(run_dir / "checkpoint-4" / "global_step4", merge=True).model.state_dict()  # W + scale * B @ A
    scale = adapter_config["lora_alpha"] / adapter_config["r"]
    quantized = [k for k in weights if k.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))]
    assert len(quantized) == 8 and weights["transformer.wte.weight"].equal(original["transformer.wte.weight"])
    for name in quantized:
        dequantized = _round_trip(original[name], settings)
        prefix = f"base_model.model.{name.removesuffix('.weight')}"
        lora_a, lora_b = adapter.get(f"{prefix}.lora_A.weight"), adapter.get(f"{prefix}.lora_B.weight")
        delta = 0 if lora_a is None else scale * (lora_b @ lora_a).T  # Conv1D stores W transposed (in, out)
        assert torch.allclose(weights[name], dequantized + delta, rtol=0, atol=1e-6), name
        assert not torch.allclose(weights[name], original[name] + delta, rtol=0, atol=1e-4), name
        assert not torch.allclose(weights[name], plain[name], rtol=0, atol=1e-4), name
        base.get_parameter(name).data.copy_(dequantized)
    with_adapter = PeftModel.from_pretrained(base, out / "adapter").eval()  # unmerged: base + B @ A on the fly
    export_record = json.loads((out / "llmft_export.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokens = export_checks.greedy_tokens(with_adapter, tokenizer, export_record["prompts"], export_record["stop_ids"])
    assert tokens == export_record["tokens"]  # and the checks found the exported model's tokens equal to these


def test_a_failed_check_pushes_nothing(full_run, tmp_path, capsys, monkeypatch):
    from hub_standin import HubStandin

    from llmft.checkpoint import export_checks
    from llmft.export import main, make_parser

    monkeypatch.setattr(export_checks, "run_checks", lambda directory, record: ["a stand-in problem"])
    with HubStandin(lifetime_s=120) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        argv = [str(full_run), "--out", str(tmp_path / "x"), "--push_to_hub", "my-org/never"]
        assert main(make_parser().parse_args(argv)) == 1
    assert "llmft export: check failed: a stand-in problem" in capsys.readouterr().err
    assert hub.requests == [] and (tmp_path / "x" / "config.json").is_file()

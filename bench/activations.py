"""What autograd keeps per token and decoder layer: full fine-tuning vs LoRA vs QLoRA, beside llmft.planning.memory's count.

    python bench/activations.py                 # CUDA if present (bf16, QLoRA too), else CPU (bf16, no QLoRA)
    python bench/activations.py --hidden 4096 --intermediate 14336 --heads 32 --kv_heads 8

A Llama-shaped model (by default TinyLlama's layer shape: 2048 hidden, 5632 MLP, 32 / 4 heads) with 1 and with 2
decoder layers, one packed row of --tokens tokens; the difference between the two is one layer's share. Bytes are
those of the distinct storages autograd saves (`saved_tensors_hooks`), parameters excluded, in the dtypes training
uses: bf16 weights, LoRA adapters in bf16 (DeepSpeed casts a bf16 run's trainable parameters; TRL casts QLoRA's),
LoRA r=16 on every linear layer, dropout as given. QLoRA needs CUDA (bitsandbytes' 4-bit kernels).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def saved_bytes(model, tokens: int, device) -> int:
    import torch

    storages = {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        inner.model(input_ids=ids, position_ids=torch.arange(tokens, device=device)[None]).last_hidden_state.sum()
    return sum(storages.values())


def build(config, kind: str, dropout: float, device, workdir: Path):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    torch.manual_seed(0)
    if kind == "qlora":
        path = workdir / f"base-{config.num_hidden_layers}"
        if not path.is_dir():
            AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
        model = AutoModelForCausalLM.from_pretrained(
            path, quantization_config=quant, dtype=torch.bfloat16, device_map={"": 0}
        )
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(device)
    if kind != "full":
        model = get_peft_model(
            model,
            LoraConfig(r=16, lora_alpha=32, lora_dropout=dropout, target_modules="all-linear", task_type="CAUSAL_LM"),
        )
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(torch.bfloat16)
    model.train()
    return model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv_heads", type=int, default=4)
    p.add_argument("--tokens", type=int, default=2048)
    a = p.parse_args()

    import torch
    from transformers import LlamaConfig

    from llmft.planning.memory import layer_activation_bytes_per_token
    from llmft.planning.model_shape import model_shape

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    tokens = a.tokens if cuda else min(a.tokens, 256)

    def config(layers):
        c = LlamaConfig(
            hidden_size=a.hidden,
            intermediate_size=a.intermediate,
            num_attention_heads=a.heads,
            num_key_value_heads=a.kv_heads,
            num_hidden_layers=layers,
            vocab_size=1024,
            max_position_embeddings=8192,
        )
        c._attn_implementation = "sdpa"
        return c

    shape = model_shape(config(1))
    linear_inputs = 6 * a.hidden + a.intermediate  # q, k, v, o, gate, up take hidden; down takes the MLP width
    where = torch.cuda.get_device_name(0) if cuda else "CPU"
    print(
        f"{where}, torch {torch.__version__}; layer {a.hidden} hidden, {a.intermediate} MLP, {a.heads}/{a.kv_heads} heads; "
        f"{tokens} tokens (one packed row, no mask), bf16"
    )
    print(
        f"llmft.planning.memory per token and layer (sdpa / flash): {layer_activation_bytes_per_token(shape, 'bf16', 'sdpa')} / "
        f"{layer_activation_bytes_per_token(shape, 'bf16', 'flash_attention_2')} bytes; adapted linears' inputs: "
        f"{linear_inputs} elements"
    )
    print("| run | bytes per token and layer | vs full | extra per adapted-input element |\n|---|---|---|---|")
    kinds = [("full", 0.0), ("lora", 0.05), ("lora", 0.0)] + ([("qlora", 0.05), ("qlora", 0.0)] if cuda else [])
    full = None
    with tempfile.TemporaryDirectory() as tmp:
        for kind, dropout in kinds:
            per_layer = [
                saved_bytes(build(config(n), kind, dropout, device, Path(tmp)), tokens, device) for n in (1, 2)
            ]
            per_token_layer = (per_layer[1] - per_layer[0]) / tokens
            full = per_token_layer if kind == "full" else full
            name = kind if kind == "full" else f"{kind} r=16 all-linear, dropout {dropout}"
            print(
                f"| {name} | {per_token_layer:.0f} | {per_token_layer / full:.2f}x | "
                f"{(per_token_layer - full) / linear_inputs:+.2f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

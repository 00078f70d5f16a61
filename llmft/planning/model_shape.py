"""A model's shape for the memory planner, from its config alone: built on the meta device, no weights loaded.

    shape = model_shape(load_model_config("meta-llama/Llama-3.1-8B"))          # a hub id (needs the hub or its cache)
    shape = model_shape(load_model_config("runs/cfg"), use_peft=True, lora_r=16)  # a directory holding config.json

Counting parameters on a model built from the config (rather than from formulas per architecture) gets tied
embeddings, biases and norms right for any architecture transformers knows; LoRA's trainable count comes from
PEFT itself on that meta model, with TRL's defaults (PEFT's target modules for the architecture when none are given).
"""

from __future__ import annotations

import re
from pathlib import Path

from llmft.planning.memory import MemoryPlanError, ModelShape


def load_model_config(model: str, trust_remote_code: bool = False):
    """The transformers config of a local model directory (config.json alone is enough) or a hub id."""
    from transformers import AutoConfig

    path = Path(model)
    if path.is_file() and path.name == "config.json":
        path = path.parent
    if path.exists():
        if not (path / "config.json").is_file():
            raise MemoryPlanError(f"--model {model}: no config.json in that directory; point it at a model directory")
        model = str(path)
    elif model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise MemoryPlanError(f"--model {model}: no such directory (give a local model directory or a hub id)")
    try:
        return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MemoryPlanError(f"--model {model}: cannot read its config ({first})") from None


def model_positions(config) -> int | None:
    """The longest sequence the model's position embeddings cover (None: the config does not say)."""
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def cap_max_length(config, requested: int | None) -> tuple[int | None, str | None]:
    """The max_length a run uses: the request, capped at the model's positions. Returns (value, note when capped).

    `llmft train`, `llmft prepare`, `llmft plan` and `--auto` all call this, so they plan and train the same length."""
    positions = model_positions(config)
    if positions and requested and requested > positions:
        return positions, f"max_length {requested} exceeds the model's {positions} positions; using {positions}"
    return requested, None


def _lora_targets(targets):
    """TRL turns one --lora_target_modules value into a string that PEFT reads as a regex; a plain name means
    "modules called that" (as in llmft.train)."""
    if isinstance(targets, (list, tuple)) and len(targets) == 1:
        targets = targets[0]
    if isinstance(targets, str) and targets != "all-linear" and re.fullmatch(r"[\w.]+", targets):
        return [targets]
    return targets


def model_shape(config, *, use_peft: bool = False, lora_r: int = 16, lora_target_modules=None) -> ModelShape:
    """Build the model on the meta device and read what the accounting needs."""
    import warnings

    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError) as e:
        raise MemoryPlanError(f"cannot build a causal LM from this config ({str(e).splitlines()[0]})") from None
    params = sum({id(p): p.numel() for p in model.parameters()}.values())  # tied weights once
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    head = model.get_output_embeddings()
    head_weight = id(head.weight) if head is not None else None
    quantizable = sum(
        m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and id(m.weight) != head_weight
    )
    names = [name for name, _ in model.named_modules()]
    gated = any(n.endswith(("gate_proj", "gate_up_proj", ".w1", ".w3")) for n in names)
    rms = any("RMSNorm" in type(m).__name__ for m in model.modules())

    hidden = config.hidden_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    intermediate = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    act = str(getattr(config, "hidden_act", None) or getattr(config, "activation_function", "")).lower()
    # Tensors of the MLP's width autograd keeps: SwiGLU gate, SiLU, up, product; a fused GELU its input and output;
    # the tanh-approximation written as elementwise ops (GPT-2's gelu_new) five; x * sigmoid(1.702 x) three.
    mlp_saved = 4 if gated else {"gelu_new": 5, "gelu_fast": 5, "quick_gelu": 3}.get(act, 2)
    dropout = (
        max(float(getattr(config, k, 0) or 0) for k in ("resid_pdrop", "hidden_dropout", "hidden_dropout_prob")) > 0
    )

    stored = getattr(config, "dtype", None)  # transformers 5 reads config.json's torch_dtype into it too
    checkpoint_dtype = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(
        str(stored).replace("torch.", "")
    )

    lora_params = lora_inputs = lora_mlp_inputs = 0
    if use_peft:
        from peft import LoraConfig, get_peft_model

        if lora_r is None or lora_r < 1:
            raise MemoryPlanError(f"--lora_r must be a positive integer, got {lora_r!r}")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                peft_model = get_peft_model(
                    model,
                    LoraConfig(r=lora_r, target_modules=_lora_targets(lora_target_modules), task_type="CAUSAL_LM"),
                )
        except ValueError as e:
            raise MemoryPlanError(f"LoRA: {str(e).splitlines()[0]}") from None
        lora_params, _ = peft_model.get_nb_trainable_parameters()
        if lora_params == 0:
            raise MemoryPlanError(f"--lora_target_modules {lora_target_modules} matches no layer of this model")
        from peft.tuners.lora import LoraLayer

        adapted = [m for m in peft_model.modules() if isinstance(m, LoraLayer)]
        lora_inputs = sum(getattr(m, "in_features", 0) or 0 for m in adapted) // max(1, config.num_hidden_layers)
        lora_mlp_inputs = sum(
            getattr(m, "in_features", 0) or 0
            for name, m in peft_model.named_modules()
            if isinstance(m, LoraLayer) and ".mlp." in name
        ) // max(1, config.num_hidden_layers)

    return ModelShape(
        name=getattr(config, "_name_or_path", "") or config.model_type,
        params=params,
        largest_layer_params=largest,
        layers=config.num_hidden_layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        kv_heads_named=getattr(config, "num_key_value_heads", None) is not None,
        head_dim=head_dim,
        intermediate=intermediate,
        vocab=config.vocab_size,
        gated_mlp=gated,
        rms_norm=rms,
        dropout=dropout,
        mlp_saved=mlp_saved,
        checkpoint_dtype=checkpoint_dtype,
        quantizable_params=quantizable,
        lora_params=lora_params,
        lora_inputs=lora_inputs,
        lora_mlp_inputs=lora_mlp_inputs,
    )

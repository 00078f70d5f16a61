"""Published model configs the planning tests plan for, built from the hyper-parameters in each model's own
config.json on the hub (nothing is downloaded): written once, so every test that says "Llama-3.1-8B" means the same
model."""

from __future__ import annotations

from transformers import LlamaConfig


def llama_3_1_8b(**overrides) -> LlamaConfig:
    """meta-llama/Llama-3.1-8B: 8,030,261,248 parameters, weights stored in bf16."""
    published = dict(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    return LlamaConfig(**{**published, **overrides})


def llama_3_2_1b(**overrides) -> LlamaConfig:
    """meta-llama/Llama-3.2-1B: 1.24B parameters, tied embeddings, weights stored in bf16."""
    published = dict(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=128256,
        tie_word_embeddings=True,
        dtype="bfloat16",
    )
    return LlamaConfig(**{**published, **overrides})


def tinyllama_1_1b(**overrides) -> LlamaConfig:
    """TinyLlama/TinyLlama-1.1B: 1.10B parameters (bench/gpu.py's model on the 2026-11-24 H100)."""
    published = dict(
        hidden_size=2048,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        intermediate_size=5632,
        vocab_size=32000,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    return LlamaConfig(**{**published, **overrides})

"""A tiny random llama for fast tests (saved to a directory so it can be fingerprinted)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def tiny_llama(path: Path, seed: int = 0) -> Any:
    """2 layers, 4 q heads / 2 KV heads, head_dim 16, vocab 128; saved to `path`, fp32 eval."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(str(path))
    from compactor.hf import load_model

    loaded, _ = load_model(path)
    return loaded


_REAL: dict[str, Any] = {}


def real_model(path: Path) -> tuple[Any, Any]:
    """(model, tokenizer) of the prepared checkpoint, loaded once per test session."""
    from compactor.hf import load_model

    key = str(path)
    if key not in _REAL:
        torch.set_num_threads(1)
        _REAL[key] = load_model(path)
    return _REAL[key]

"""A tiny random llama for fast tests (saved to a directory so it can be fingerprinted)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 128  # the tiny model's vocabulary size


def tiny_llama(path: Path, seed: int = 0) -> Any:
    """2 layers, 4 q heads / 2 KV heads, head_dim 16, vocab 128; saved to `path`, fp32 eval."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
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


def random_ids(n: int, seed: int = 0) -> list[int]:
    """`n` token ids drawn uniformly from [0, VOCAB) by a CPU generator seeded with `seed`.

    The same (n, seed) always gives the same list; every id is valid for `tiny_llama`.
    """
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


_REAL: dict[str, Any] = {}


def real_model(path: Path) -> tuple[Any, Any]:
    """(model, tokenizer) of the prepared checkpoint, loaded once per test session."""
    from compactor.hf import load_model

    key = str(path)
    if key not in _REAL:
        torch.set_num_threads(1)
        _REAL[key] = load_model(path)
    return _REAL[key]

"""A small valid CompactedPrefix with chosen per-head lengths (`make_prefix`), shared by the
result-bound, echo-check, integrity and wire tests."""

from __future__ import annotations

import torch

from compactor.types import CompactedLayer, CompactedPrefix, prefix_hash


def make_prefix(lengths, T=20, D=8, dtype=torch.float32, seed=0) -> CompactedPrefix:
    """A valid prefix; `lengths[l]` = t_h of each KV head of layer l."""
    g = torch.Generator().manual_seed(seed)
    layers = []
    for ls in lengths:
        n = sum(ls)
        ip = torch.tensor([0, *torch.cumsum(torch.tensor(ls), 0).tolist()], dtype=torch.int32)
        layers.append(
            CompactedLayer(
                keys=(3 * torch.randn(n, D, generator=g)).to(dtype),
                values=torch.randn(n, D, generator=g).to(dtype),
                beta=torch.randn(n, generator=g),
                indptr=ip,
                kept_indices=torch.randint(-1, T, (n,), generator=g),
            )
        )
    return CompactedPrefix(
        model_fingerprint="fp",
        logical_length=T,
        prefix_hash=prefix_hash(range(T)),
        method="am-highest",
        params={"ratio": 0.25},
        layers=layers,
        head_dim=D,
        num_kv_heads=len(lengths[0]),
        dtype=dtype,
    )

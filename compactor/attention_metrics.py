"""Per-layer/head attention metrics of a compacted layer on held-out queries.

Shape legend: T prefix tokens, N compacted rows of a layer (ragged over heads), n held-out
queries, H_kv KV heads, D head dim.

Both metrics compare attention over the *prefix block only* (original keys vs compacted
rows): by the block decomposition (see ``compactor.pipeline``) matching the block's local
output and mass is what makes the full attention match.
  output_rel_err[h] = mean_q ||o_c(q) - o(q)|| / ||o(q)||
  mass_rel_err[h]   = mean_q |M_c(q) / M(q) - 1|,  M(q) = sum_j exp(q.k_j * scale + beta_j)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from compactor.solvers import attend
from compactor.types import CompactedLayer

__all__ = ["AttentionErrors", "attention_errors"]


class AttentionErrors(NamedTuple):
    """Per KV head: output_rel_err [H_kv], mass_rel_err [H_kv] (fp32)."""

    output_rel_err: torch.Tensor
    mass_rel_err: torch.Tensor


def attention_errors(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    layer: CompactedLayer,
    sm_scale: float | None = None,
) -> AttentionErrors:
    """Errors of `layer` against the original prefix on `queries`.

    Args:
        queries: [H_kv, n, D] post-RoPE held-out queries (GQA pooled).
        keys, values: [H_kv, T, D] the original prefix of this layer.
        layer: its compacted form (H_kv heads).
    Raises:
        ValueError: shapes disagree.
    """
    if keys.dim() != 3 or values.shape != keys.shape:
        raise ValueError(
            f"keys/values must be [H_kv, T, D], got {tuple(keys.shape)}/{tuple(values.shape)}"
        )
    if queries.dim() != 3 or queries.shape[0] != keys.shape[0] or queries.shape[2] != keys.shape[2]:
        raise ValueError(
            f"queries must be [H_kv, n, D] matching keys {tuple(keys.shape)}, got {tuple(queries.shape)}"
        )
    if layer.num_kv_heads != keys.shape[0]:
        raise ValueError(f"layer has {layer.num_kv_heads} KV heads, keys have {keys.shape[0]}")
    out_err, mass_err = [], []
    for h in range(keys.shape[0]):
        q = queries[h].float()
        o_ref, lse_ref = attend(q, keys[h], values[h], sm_scale=sm_scale)
        kc, vc, bc = layer.head(h)
        if kc.shape[0] == 0:
            out_err.append(torch.tensor(1.0))
            mass_err.append(torch.tensor(1.0))
            continue
        o_c, lse_c = attend(q, kc, vc, beta=bc, sm_scale=sm_scale)
        denom = o_ref.norm(dim=-1).clamp_min(1e-12)
        out_err.append(((o_c - o_ref).norm(dim=-1) / denom).mean())
        mass_err.append((torch.exp(lse_c - lse_ref) - 1).abs().mean())
    return AttentionErrors(torch.stack(out_err), torch.stack(mass_err))

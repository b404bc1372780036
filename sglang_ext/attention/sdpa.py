"""Causal attention with a per-entry, per-KV-head logit bias (beta), in torch SDPA.

The CPU path of the plugin (`sglang_ext.attention.rows`) and the reference the Triton path is
tested against: a layout adapter over `compaction_kernels.biased_attention.reference.biased_attention`
(which owns the maths). Free of SGLang imports, so the kernel tests run without it.
"""

from __future__ import annotations

import torch

from compaction_kernels.biased_attention.reference import biased_attention

__all__ = ["biased_sdpa"]


def biased_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    beta: torch.Tensor,
    q_offset: int,
    scale: float | None,
) -> torch.Tensor:
    """Causal attention of q new tokens over n entries with a per-entry, per-KV-head bias.

    Args:
        query: [H_q, q, D]; token i sits at position q_offset + i.
        key, value: [H_kv, n, D].
        beta: [n, H_kv] fp32, added to the scaled logits (-inf masks an entry).
        q_offset: position of the first query token (n - q for extend and decode).
        scale: logit scale (None: 1/sqrt(D)).
    Returns:
        [H_q, q, D] in the query's dtype.
    """
    h_q, _, _ = query.shape
    h_kv, n, _ = key.shape
    if h_q % h_kv or beta.shape != (n, h_kv):
        raise ValueError(
            f"bad shapes: query {tuple(query.shape)}, key {tuple(key.shape)}, "
            f"beta {tuple(beta.shape)}"
        )
    out = biased_attention(
        query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0), beta.t().unsqueeze(0),
        sm_scale=scale, causal_offset=q_offset,
    )  # fmt: skip
    return out.squeeze(0)

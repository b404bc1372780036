"""Causal attention with a per-entry, per-KV-head logit bias (beta), in torch SDPA.

The CPU path of the plugin (`sglang_ext.attention`) and the reference the Triton path is
tested against. Free of SGLang imports, so the kernel tests run on machines without it.
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention

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
    h_q, q_len, _ = query.shape
    h_kv, n, _ = key.shape
    if h_q % h_kv or beta.shape != (n, h_kv):
        raise ValueError(
            f"bad shapes: query {tuple(query.shape)}, key {tuple(key.shape)}, "
            f"beta {tuple(beta.shape)}"
        )
    group = h_q // h_kv
    bias = beta.t().to(query.dtype).repeat_interleave(group, dim=0)  # [H_q, n]
    pos_q = torch.arange(q_offset, q_offset + q_len, device=query.device)[:, None]
    future = torch.arange(n, device=query.device)[None, :] > pos_q  # [q, n]
    mask = bias[:, None, :].masked_fill(future[None], float("-inf"))  # [H_q, q, n]
    out = scaled_dot_product_attention(
        query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0),
        attn_mask=mask.unsqueeze(0), scale=scale, enable_gqa=group > 1,
    )  # fmt: skip
    return out.squeeze(0)

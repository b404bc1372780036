"""The CPU biased path of `sglang_ext.adapter.wrapped_backend.CompactionBackend`: torch SDPA per request.

A batch that touches a compacted prefix runs here on CPU (on CUDA it runs `sglang_ext.cascade`).
A compacted request's KV row is the node's T entries (t_max physical slots, then T - t_max
aliases of `ALIAS_SLOT`) and then its own tail; `physical_entries` drops the aliases, and the
request attends only the m = n - (T - t_max) entries left, with beta [S, H_kv] of their slots
added to the logits (-inf masks a head's padding) and the causal mask of its new tokens, which
are the last q of them. Keys are stored after RoPE, so which entries are read does not move
anyone's position: the new tokens keep their logical positions (T + ...), which SGLang
computes from the row and seq_lens. A plain request of the same batch attends its whole row
(beta 0 on ordinary slots). The work per layer scales with t_max + the tail, not with T.

Legend: B requests, n_tok = sum_b q_b new tokens, q_b new tokens of request b, n_b = seq_len
KV entries of its row, m entries it reads, T / t_max logical / physical length of a compacted
prefix, H_q / H_kv heads, D head dim, S pool slots.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sglang_ext.kv_store import ALIAS_SLOT
from sglang_ext.sdpa import biased_sdpa

__all__ = ["attend_rows", "biased_sdpa", "physical_entries"]


def physical_entries(row: torch.Tensor, alias_slot: int = ALIAS_SLOT) -> torch.Tensor:
    """The slots of a compacted request's KV row its attention reads: all but the aliases.

    Args:
        row: [n] int slot ids, `req_to_token[r, :n]`.
        alias_slot: the slot aliases point at (SGLang's padding slot, never a token's).
    Returns:
        [m] int64, the row's other slots in row order (its t_max physical slots, then its tail).
    """
    row = row.to(torch.int64)
    return row[row != alias_slot]


def attend_rows(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    beta_layer: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: Sequence[int],
    seq_lens: Sequence[int],
    q_lens: Sequence[int],
    compacted: Sequence[bool],
    scale: float | None,
) -> torch.Tensor:
    """Biased causal attention of a batch, one torch SDPA per request (module legend).

    Args:
        q: [n_tok, H_q, D], the requests' new tokens in batch order.
        k_cache, v_cache: [S, H_kv, D] one layer of the pool (any float dtype; read in q's).
        beta_layer: [S, H_kv] fp32, that layer's biases.
        req_to_token: [R, W] int slot table; rows, seq_lens, q_lens: [B] host ints.
        compacted: [B] whether request b's row starts on a compacted prefix (it then reads
            `physical_entries` of its row; a plain request reads its whole row).
        scale: logit scale (None: 1/sqrt(D)).
    Returns:
        out [n_tok, H_q, D] in q's dtype; mutates nothing.
    """
    if not len(rows) == len(seq_lens) == len(q_lens) == len(compacted):
        raise ValueError(
            f"rows/seq_lens/q_lens/compacted differ in length: {len(rows)}, {len(seq_lens)}, "
            f"{len(q_lens)}, {len(compacted)}"
        )
    if q.shape[0] != sum(q_lens):
        raise ValueError(f"q has {q.shape[0]} tokens, q_lens sum to {sum(q_lens)}")
    out = torch.empty_like(q)
    start = 0
    for row, n, q_len, comp in zip(rows, seq_lens, q_lens, compacted):
        end = start + q_len
        slots = req_to_token[row, :n].to(torch.int64)
        if comp:
            slots = physical_entries(slots)
        qs = q[start:end].movedim(0, 1)  # [H_q, q, D]
        k = k_cache[slots].movedim(0, 1).to(q.dtype)  # [H_kv, m, D]
        v = v_cache[slots].movedim(0, 1).to(q.dtype)
        res = biased_sdpa(qs, k, v, beta_layer[slots], slots.numel() - q_len, scale)
        out[start:end] = res.movedim(0, 1)
        start = end
    return out

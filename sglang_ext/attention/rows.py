"""The CPU biased path of `sglang_ext.adapter.wrapped_backend.CompactionBackend`: torch SDPA per request.

A batch that touches a compacted prefix runs here on CPU (on CUDA it runs `sglang_ext.attention.cascade`).
A compacted request's KV row is the node's T entries (N physical slots, then T - N aliases of
`ALIAS_SLOT`) and then its own tail. The prefix's entries are packed in the cells of its N
slots (`sglang_ext.packing`); the caller gathers this layer's once per prefix (`PrefixPart`:
[H_kv, W] entries, a head's unused ones with beta -inf), and the request attends them and its
tail [T, n), with the causal mask of its new tokens, which are the tail's last q. Keys are
stored after RoPE, so which entries are read does not move anyone's position: the new tokens
keep their logical positions (T + ...), which SGLang computes from the row and seq_lens. A
plain request of the same batch attends its whole row (beta 0 on ordinary slots). The work
per layer scales with W + the tail, not with T.

Legend: B requests, n_tok = sum_b q_b new tokens, q_b new tokens of request b, n_b = seq_len
KV entries of its row, T / N / W logical length, physical slots and longest head of a
compacted prefix, H_q / H_kv heads, D head dim, S pool slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from sglang_ext.attention.sdpa import biased_sdpa

__all__ = ["PrefixPart", "attend_rows", "biased_sdpa"]


class PrefixPart(NamedTuple):
    """One layer of a compacted prefix as a request attends it: keys, values [H_kv, W, D],
    beta [H_kv, W] fp32 (`PackedLayout.read`), and its logical length T."""

    keys: torch.Tensor
    values: torch.Tensor
    beta: torch.Tensor
    logical_length: int


def attend_rows(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    beta_layer: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: Sequence[int],
    seq_lens: Sequence[int],
    q_lens: Sequence[int],
    prefixes: Sequence[PrefixPart | None],
    scale: float | None,
) -> torch.Tensor:
    """Biased causal attention of a batch, one torch SDPA per request (module legend).

    Args:
        q: [n_tok, H_q, D], the requests' new tokens in batch order.
        k_cache, v_cache: [S, H_kv, D] one layer of the pool (any float dtype; read in q's).
        beta_layer: [S, H_kv] fp32, that layer's biases.
        req_to_token: [R, C] int slot table; rows, seq_lens, q_lens: [B] host ints.
        prefixes: [B] the compacted prefix request b's row starts on (it then reads the
            prefix's entries and its row's tail [T, n_b)), or None (it reads its whole row).
        scale: logit scale (None: 1/sqrt(D)).
    Returns:
        out [n_tok, H_q, D] in q's dtype; mutates nothing.
    """
    if not len(rows) == len(seq_lens) == len(q_lens) == len(prefixes):
        raise ValueError(
            f"rows/seq_lens/q_lens/prefixes differ in length: {len(rows)}, {len(seq_lens)}, "
            f"{len(q_lens)}, {len(prefixes)}"
        )
    if q.shape[0] != sum(q_lens):
        raise ValueError(f"q has {q.shape[0]} tokens, q_lens sum to {sum(q_lens)}")
    out = torch.empty_like(q)
    start = 0
    for row, n, q_len, part in zip(rows, seq_lens, q_lens, prefixes):
        end = start + q_len
        first = 0 if part is None else part.logical_length
        slots = req_to_token[row, first:n].to(torch.int64)
        qs = q[start:end].movedim(0, 1)  # [H_q, q, D]
        k = k_cache[slots].movedim(0, 1).to(q.dtype)  # [H_kv, m, D]
        v = v_cache[slots].movedim(0, 1).to(q.dtype)
        beta = beta_layer[slots]  # [m, H_kv]
        if part is not None:
            k = torch.cat([part.keys.to(q.dtype), k], dim=1)
            v = torch.cat([part.values.to(q.dtype), v], dim=1)
            beta = torch.cat([part.beta.t(), beta])
        res = biased_sdpa(qs, k, v, beta, k.shape[1] - q_len, scale)
        out[start:end] = res.movedim(0, 1)
        start = end
    return out

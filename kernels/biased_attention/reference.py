"""Torch reference (fp32, the truth) for attention with a per-key bias over ragged KV.

``logit = q.k * sm_scale + beta`` (sm_scale defaults to 1/sqrt(D), beta natural-log,
-inf masks), softmax over the entries of the query's KV head, and the natural-log LSE
of those logits. Straight per-segment loops: slow, obviously right, device-agnostic.

Shape legend and layouts: see :mod:`kernels.biased_attention._common` (B requests, n query
tokens, H_q/H_kv heads with G = H_q // H_kv, D head dim, ragged ``indptr [B*H_kv+1]``
int32 over ``keys/values [N, D]`` and ``beta [N]``; paged ``k_cache/v_cache [S, H_kv, D]``,
``beta_cache [S, H_kv]``, ``kv_indptr [B+1]``, ``kv_indices [nnz]``).

All functions return :class:`AttentionOutput` with ``out`` in fp32 and ``lse`` fp32; they
mutate nothing.
"""

from __future__ import annotations

import math

import torch

from kernels.biased_attention._common import (
    AttentionOutput,
    check_indptr,
    check_paged,
    check_queries,
    check_ragged,
    default_sm_scale,
)

__all__ = ["attend", "decode", "extend", "paged_decode", "paged_extend"]


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, sm_scale: float
) -> AttentionOutput:
    """Biased attention of ``q [m, D]`` over one KV set ``k, v [t, D]``, ``beta [t]``.

    Returns ``out [m, D]`` fp32 and ``lse [m]`` fp32; t == 0 or all beta == -inf gives
    out = 0 and lse = -inf.
    """
    logits = q.float() @ k.float().T * sm_scale + beta.float()[None, :]  # [m, t]
    lse = (
        torch.logsumexp(logits, dim=-1) if k.shape[0] else logits.new_full((q.shape[0],), -math.inf)
    )
    finite = torch.isfinite(lse)
    probs = torch.exp(logits - torch.where(finite, lse, 0.0)[:, None])
    probs = torch.where(finite[:, None], probs, 0.0)
    return AttentionOutput(probs @ v.float(), lse)


def extend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    beta: torch.Tensor,
    indptr: torch.Tensor,
    qo_indptr: torch.Tensor | None = None,
    *,
    sm_scale: float | None = None,
) -> AttentionOutput:
    """Queries ``q [n, H_q, D]`` attend (non-causally) their request's ragged KV.

    Args:
        q: ``[n, H_q, D]``; request b owns rows ``qo_indptr[b]:qo_indptr[b+1]``.
        keys, values: ``[N, D]``; beta: ``[N]`` fp32.
        indptr: ``[B*H_kv + 1]`` int32, segment ``b*H_kv + h`` = request b, KV head h.
        qo_indptr: ``[B+1]`` int32; None means one request (B = 1) owning all n rows.
        sm_scale: logit scale, default 1/sqrt(D).

    Returns:
        ``out [n, H_q, D]`` fp32, ``lse [n, H_q]`` fp32 (natural log).
    """
    check_ragged(keys, values, beta, indptr)
    if qo_indptr is None:
        qo_indptr = torch.tensor([0, q.shape[0]], dtype=torch.int32)
    num_req = qo_indptr.numel() - 1
    check_indptr(qo_indptr, "qo_indptr", None, q.shape[0])
    if num_req <= 0 or (indptr.numel() - 1) % num_req != 0:
        raise ValueError(f"indptr has {indptr.numel() - 1} segments, not a multiple of B={num_req}")
    num_kv_heads = (indptr.numel() - 1) // num_req
    group = check_queries(q, num_kv_heads, keys.shape[1])
    scale = default_sm_scale(keys.shape[1], sm_scale)
    seg, qo = indptr.cpu().tolist(), qo_indptr.cpu().tolist()
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float32, device=q.device)
    for b in range(num_req):
        for h in range(num_kv_heads):
            s, e = seg[b * num_kv_heads + h], seg[b * num_kv_heads + h + 1]
            heads = slice(h * group, (h + 1) * group)
            qs = q[qo[b] : qo[b + 1], heads].reshape(-1, q.shape[2])  # [n_b * G, D]
            res = attend(qs, keys[s:e], values[s:e], beta[s:e], scale)
            out[qo[b] : qo[b + 1], heads] = res.out.view(-1, group, q.shape[2])
            lse[qo[b] : qo[b + 1], heads] = res.lse.view(-1, group)
    return AttentionOutput(out, lse)


def decode(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    beta: torch.Tensor,
    indptr: torch.Tensor,
    *,
    sm_scale: float | None = None,
) -> AttentionOutput:
    """One query token per request: ``q [B, H_q, D]`` over ragged ``indptr [B*H_kv+1]``.

    Returns ``out [B, H_q, D]`` fp32 and ``lse [B, H_q]`` fp32.
    """
    qo_indptr = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    return extend(q, keys, values, beta, indptr, qo_indptr, sm_scale=sm_scale)


def paged_extend(
    q: torch.Tensor,
    qo_indptr: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    beta_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    *,
    sm_scale: float | None = None,
) -> AttentionOutput:
    """Paged layout: ``q [n, H_q, D]`` rows of request b attend its slots, non-causally.

    Args:
        q: ``[n, H_q, D]``; qo_indptr ``[B+1]`` int32.
        k_cache, v_cache: ``[S, H_kv, D]``; beta_cache ``[S, H_kv]`` fp32.
        kv_indptr: ``[B+1]`` int32; kv_indices ``[nnz]`` int32 slot ids.

    Returns:
        ``out [n, H_q, D]`` fp32, ``lse [n, H_q]`` fp32.
    """
    check_paged(k_cache, v_cache, beta_cache, kv_indptr, kv_indices)
    num_req = kv_indptr.numel() - 1
    check_indptr(qo_indptr, "qo_indptr", num_req + 1, q.shape[0])
    num_kv_heads = k_cache.shape[1]
    group = check_queries(q, num_kv_heads, k_cache.shape[2])
    scale = default_sm_scale(k_cache.shape[2], sm_scale)
    kv, qo = kv_indptr.cpu().tolist(), qo_indptr.cpu().tolist()
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float32, device=q.device)
    for b in range(num_req):
        slots = kv_indices[kv[b] : kv[b + 1]].long()
        for h in range(num_kv_heads):
            heads = slice(h * group, (h + 1) * group)
            qs = q[qo[b] : qo[b + 1], heads].reshape(-1, q.shape[2])
            res = attend(qs, k_cache[slots, h], v_cache[slots, h], beta_cache[slots, h], scale)
            out[qo[b] : qo[b + 1], heads] = res.out.view(-1, group, q.shape[2])
            lse[qo[b] : qo[b + 1], heads] = res.lse.view(-1, group)
    return AttentionOutput(out, lse)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    beta_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    *,
    sm_scale: float | None = None,
) -> AttentionOutput:
    """Paged decode: ``q [B, H_q, D]``, one token per request. Returns fp32 out and lse."""
    qo_indptr = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    return paged_extend(
        q, qo_indptr, k_cache, v_cache, beta_cache, kv_indptr, kv_indices, sm_scale=sm_scale
    )

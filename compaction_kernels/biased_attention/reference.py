"""Torch reference for attention with a per-key bias: the one implementation of the maths.

``logit = q.k * sm_scale + beta`` (sm_scale defaults to 1/sqrt(D), beta natural-log, -inf
masks), softmax over the keys a query sees, and the natural-log LSE of those logits.

:func:`biased_attention` (torch's fused SDPA, in q's dtype) and :func:`biased_attention_lse`
(explicit fp32, with the LSE) are the op on dense, batched, per-head tensors (GQA, causal
tail, float mask); everything else in the project that computes biased attention in torch
calls them: the solvers (``compactor.solvers.attend``), the plugin's CPU path
(``sglang_ext.attention.sdpa.biased_sdpa``), the HF decode paths (``compactor.hf``) and the
ragged/paged loops below, which the Triton kernels are tested against.
:func:`attention_bias` builds the additive float mask (beta expanded to the query heads,
causal tail) that the HF path also hands to transformers.

Shape legend and layouts: see :mod:`compaction_kernels.biased_attention._common` (B requests, n query
tokens, H_q/H_kv heads with G = H_q // H_kv, D head dim, ragged ``indptr [B*H_kv+1]``
int32 over ``keys/values [N, D]`` and ``beta [N]``; paged ``k_cache/v_cache [S, H_kv, D]``,
``beta_cache [S, H_kv]``, ``kv_indptr [B+1]``, ``kv_indices [nnz]``); m query rows and t
keys of one dense call. Nothing here mutates its inputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.nn.functional import scaled_dot_product_attention

from compaction_kernels.biased_attention._common import (
    AttentionOutput,
    PagedKV,
    RaggedKV,
    check_paged_call,
    check_queries,
    check_ragged_call,
    decode_qo_indptr,
    default_sm_scale,
    ragged_pool,
)

__all__ = [
    "attention_bias",
    "biased_attention",
    "biased_attention_lse",
    "decode",
    "extend",
    "paged_decode",
    "paged_extend",
]


def biased_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor | None = None,
    *,
    sm_scale: float | None = None,
    causal_offset: int | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``softmax(q k^T * sm_scale + beta [+ bias]) v`` over dense per-head tensors.

    Args:
        q: ``[..., H_q, m, D]`` (or ``[..., m, D]`` with no head dim); leading dims broadcast.
        k, v: ``[..., H_kv, t, D]``; H_q = G * H_kv, query head i reads KV head i // G.
        beta: ``[..., H_kv, t]`` per-key natural-log bias, broadcast like k's leading
            dims (under GQA its head dim must be H_kv or 1); -inf masks a key; None is 0.
        sm_scale: logit scale; None is 1/sqrt(D).
        causal_offset: query row i sits at position ``causal_offset + i`` and sees keys
            ``j <= causal_offset + i`` only (None: every key).
        bias: extra float mask broadcastable to the logits ``[..., H_q, m, t]``, added as
            is (e.g. transformers' 4-D attention mask); -inf masks.

    Returns:
        ``out [..., H_q, m, D]`` in q's dtype, from torch's fused SDPA in that dtype (the
        decoding paths: no fp32 logits are materialised; a row with every key masked gets
        whatever the SDPA backend gives, NaN on some). :func:`biased_attention_lse` is the
        same op in fp32 with the log attention mass.
    """
    group = _gqa_group(q, k)
    if sm_scale is not None:
        default_sm_scale(q.shape[-1], sm_scale)  # validates
    mask = bias
    if beta is not None or causal_offset is not None:
        mask = _key_bias(q, k, beta, group, causal_offset, q.dtype, bias)
    return scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=sm_scale, enable_gqa=group > 1
    )


def biased_attention_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor | None = None,
    *,
    sm_scale: float | None = None,
    causal_offset: int | None = None,
    bias: torch.Tensor | None = None,
) -> AttentionOutput:
    """:func:`biased_attention` (same arguments) computed explicitly in fp32, with the
    natural-log attention mass: the truth the solvers and kernels are checked against.

    Returns:
        ``AttentionOutput(out [..., H_q, m, D], lse [..., H_q, m])``, both fp32; a row that
        sees no finite logit gets out = 0, lse = -inf.
    """
    group = _gqa_group(q, k)
    mask = None
    if beta is not None or causal_offset is not None:
        mask = _key_bias(q, k, beta, group, causal_offset, torch.float32, None)
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    logits = q.float() @ k.float().transpose(-1, -2) * default_sm_scale(q.shape[-1], sm_scale)
    if mask is not None:
        logits = logits + mask
    if bias is not None:
        logits = logits + bias.float()
    lse = torch.logsumexp(logits, dim=-1)  # -inf for t == 0
    finite = torch.isfinite(lse)
    probs = torch.exp(logits - torch.where(finite, lse, 0.0).unsqueeze(-1))
    probs = torch.where(finite.unsqueeze(-1), probs, 0.0)
    return AttentionOutput(probs @ v.float(), lse)


def attention_bias(
    beta: torch.Tensor,
    q_len: int,
    *,
    group: int = 1,
    causal_offset: int | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Additive float mask ``[..., H * G, q_len | 1, t]`` of a per-key ``beta [..., H, t]``.

    Each head's row is repeated ``group`` times (H_kv -> H_q, GQA); with ``causal_offset``
    query row i (position ``causal_offset + i``) gets -inf on keys ``j > causal_offset + i``
    (else the query dim is 1, to broadcast). Cast to ``dtype`` (default: beta's) first.
    Returns a new tensor; beta is unchanged.
    """
    b = beta if dtype is None else beta.to(dtype)
    if group > 1 and b.dim() >= 2 and b.shape[-2] > 1:
        b = b.repeat_interleave(group, dim=-2)
    b = b.unsqueeze(-2)
    if causal_offset is None:
        return b
    pos = torch.arange(causal_offset, causal_offset + q_len, device=b.device)[:, None]
    future = torch.arange(b.shape[-1], device=b.device)[None, :] > pos  # [q_len, t]
    return b.masked_fill(future, float("-inf"))


def extend(
    q: torch.Tensor,
    kv: RaggedKV,
    qo_indptr: torch.Tensor | None = None,
    *,
    sm_scale: float | None = None,
) -> AttentionOutput:
    """Queries ``q [n, H_q, D]`` attend (non-causally) their request's ragged KV.

    Args:
        q: ``[n, H_q, D]``; request b owns rows ``qo_indptr[b]:qo_indptr[b+1]``.
        kv: ``keys, values [N, D]``, ``beta [N]`` fp32 and ``indptr [B*H_kv + 1]`` int32,
            segment ``b*H_kv + h`` = request b, KV head h.
        qo_indptr: ``[B+1]`` int32; None means one request (B = 1) owning all n rows.
        sm_scale: logit scale, default 1/sqrt(D).

    Returns:
        ``out [n, H_q, D]`` fp32, ``lse [n, H_q]`` fp32 (natural log).
    """
    qo_indptr, num_kv_heads = check_ragged_call(q, kv, qo_indptr)
    seg = kv.indptr.cpu().tolist()

    def rows(b: int, h: int) -> slice:
        return slice(seg[b * num_kv_heads + h], seg[b * num_kv_heads + h + 1])

    pool = ragged_pool(kv.keys, kv.values, kv.beta, num_kv_heads)
    return _per_segment(q, qo_indptr, pool, rows, sm_scale)


def decode(q: torch.Tensor, kv: RaggedKV, *, sm_scale: float | None = None) -> AttentionOutput:
    """One query token per request: ``q [B, H_q, D]`` over ragged ``kv.indptr [B*H_kv+1]``.

    Returns ``out [B, H_q, D]`` fp32 and ``lse [B, H_q]`` fp32.
    """
    return extend(q, kv, decode_qo_indptr(q), sm_scale=sm_scale)


def paged_extend(
    q: torch.Tensor, qo_indptr: torch.Tensor, kv: PagedKV, *, sm_scale: float | None = None
) -> AttentionOutput:
    """Paged layout: ``q [n, H_q, D]`` rows of request b attend its slots, non-causally.

    Args:
        q: ``[n, H_q, D]``; qo_indptr ``[B+1]`` int32.
        kv: the pool ``k_cache, v_cache [S, H_kv, D]``, ``beta_cache [S, H_kv]`` fp32 and
            its slot table ``kv_indptr [B+1]``, ``kv_indices [nnz]`` int32 slot ids.

    Returns:
        ``out [n, H_q, D]`` fp32, ``lse [n, H_q]`` fp32.
    """
    check_paged_call(q, qo_indptr, kv)
    slots, table = kv.kv_indices, kv.kv_indptr.cpu().tolist()

    def rows(b: int, h: int) -> torch.Tensor:
        return slots[table[b] : table[b + 1]].long()

    return _per_segment(q, qo_indptr, (kv.k_cache, kv.v_cache, kv.beta_cache), rows, sm_scale)


def paged_decode(q: torch.Tensor, kv: PagedKV, *, sm_scale: float | None = None) -> AttentionOutput:
    """Paged decode: ``q [B, H_q, D]``, one token per request. Returns fp32 out and lse."""
    return paged_extend(q, decode_qo_indptr(q), kv, sm_scale=sm_scale)


# ---- private helpers -------------------------------------------------------------------


def _gqa_group(q: torch.Tensor, k: torch.Tensor) -> int:
    """G = H_q // H_kv when q ``[..., H_q, m, D]`` and k ``[..., H_kv, t, D]`` differ in
    heads (1 when they match or one side broadcasts); ValueError otherwise."""
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in head dim D")
    if q.dim() < 3 or k.dim() < 3:
        return 1
    h_q, h_kv = q.shape[-3], k.shape[-3]
    if h_q == h_kv or 1 in (h_q, h_kv):
        return 1
    if h_q % h_kv:
        raise ValueError(f"H_q={h_q} must be a multiple of H_kv={h_kv}")
    return h_q // h_kv


def _key_bias(
    q: torch.Tensor,
    k: torch.Tensor,
    beta: torch.Tensor | None,
    group: int,
    causal_offset: int | None,
    dtype: torch.dtype,
    extra: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`attention_bias` of beta (zeros when None) plus an optional extra float mask."""
    if beta is None:
        beta = torch.zeros(k.shape[:-1], dtype=dtype, device=k.device)
    elif group > 1 and (beta.dim() < 2 or beta.shape[-2] not in (1, k.shape[-3])):
        raise ValueError(
            f"beta {tuple(beta.shape)} must be [..., H_kv={k.shape[-3]} or 1, t] under GQA"
        )
    mask = attention_bias(beta, q.shape[-2], group=group, causal_offset=causal_offset, dtype=dtype)
    return mask if extra is None else mask + extra


def _per_segment(
    q: torch.Tensor,
    qo_indptr: torch.Tensor,
    pool: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    rows: Callable[[int, int], slice | torch.Tensor],
    sm_scale: float | None,
) -> AttentionOutput:
    """The G q heads of KV head h, query rows of request b, over pool rows ``rows(b, h)``.

    ``pool`` is ``(k [S, H_kv, D], v, beta [S, H_kv])`` (a ragged set through
    :func:`ragged_pool`). Returns fp32 ``out [n, H_q, D]``, ``lse [n, H_q]`` (-inf, 0 for
    heads with no entries).
    """
    k_pool, v_pool, b_pool = pool
    num_kv_heads, dim = k_pool.shape[1], k_pool.shape[2]
    group = check_queries(q, num_kv_heads, dim)
    scale = default_sm_scale(dim, sm_scale)
    qo = qo_indptr.cpu().tolist()
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float32, device=q.device)
    for b in range(len(qo) - 1):
        for h in range(num_kv_heads):
            r, heads = rows(b, h), slice(h * group, (h + 1) * group)
            qs = q[qo[b] : qo[b + 1], heads].reshape(-1, dim)  # [n_b * G, D]
            res = biased_attention_lse(qs, k_pool[r, h], v_pool[r, h], b_pool[r, h], sm_scale=scale)
            out[qo[b] : qo[b + 1], heads] = res.out.view(-1, group, dim)
            lse[qo[b] : qo[b + 1], heads] = res.lse.view(-1, group)
    return AttentionOutput(out, lse)

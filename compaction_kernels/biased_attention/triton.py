"""Triton attention with a per-key bias over ragged compacted KV or SGLang's paged pool.

One kernel and one plan()/run() wrapper serve decode and extend, ragged and paged. The
common form is the paged one: a pool ``[S, H_kv, D]`` read through a slot table. A ragged
set is that pool with the identity slot table and one segment per (request, KV head): its
``keys [N, D]`` are viewed as ``[N, H_kv, D]`` with head stride 0 (:func:`ragged_pool`) and
``kv_indices=None`` tells the kernel to read rows directly and segments per head.

A program owns one tile of ``BLOCK_M`` packed (query token, q head of the group) rows of one
request and one KV head, so the G q heads sharing a KV head read each K/V tile once (GQA
packing). The grid is ``(tiles, H_kv, splits)``: with splits > 1 each program covers one
chunk of the KV segment (split-K / flash-decoding) and a second kernel merges the partial
states by LSE. Decode is extend with one token per request; plan() picks splits so long
prefixes with small batches still fill the GPU.

Shape legend and layouts: :mod:`compaction_kernels.biased_attention._common` (B requests, n query
tokens, H_q = G * H_kv, D, ragged ``indptr [B*H_kv+1]`` int32 over ``keys/values [N, D]``,
``beta [N]`` fp32; paged ``k_cache/v_cache [S, H_kv, D]``, ``beta_cache [S, H_kv]``,
``kv_indptr [B+1]``, ``kv_indices [nnz]`` int32).

Results: ``out`` in q's dtype, ``lse`` fp32 natural log; empty/fully masked sets give
out = 0, lse = -inf. Runs on CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import math
from typing import TypedDict, Unpack

import torch
import triton

from compaction_kernels.biased_attention._common import (
    AttentionOutput,
    PagedKV,
    RaggedKV,
    check_paged_call,
    check_pool,
    check_queries,
    check_ragged_call,
    check_rows,
    check_slot_table,
    check_triton_device,
    decode_qo_indptr,
    ragged_pool,
)
from compaction_kernels.biased_attention._kernels import _biased_attn_fwd, _combine_splits
from compaction_kernels.biased_attention._plan import AttentionPlan, make_plan

__all__ = [
    "AttentionPlan",
    "BiasedPagedAttention",
    "RunOptions",
    "decode",
    "extend",
    "paged_decode",
    "paged_extend",
]

_LOG2E = 1.4426950408889634


class RunOptions(TypedDict, total=False):
    """Keyword options of the one-shot calls, as in :meth:`BiasedPagedAttention.plan`."""

    sm_scale: float | None
    num_splits: int | None
    block_n: int | None


class BiasedPagedAttention:
    """plan()/run() wrapper over the paged pool, or a ragged set as its identity-table case.

    Paged (SGLang, page size 1, beta per slot and head): ``kv_indptr [B+1]`` and
    ``kv_indices [nnz]`` int32 slot ids; run() takes ``k_cache/v_cache [S, H_kv, D]`` and
    ``beta_cache [S, H_kv]``. Ragged: ``kv_indices=None`` and ``kv_indptr`` the ragged
    ``indptr [B*H_kv+1]``; run() takes ``keys/values [N, D]`` and ``beta [N]``.
    """

    def __init__(self) -> None:
        self._plan: AttentionPlan | None = None

    @property
    def planned(self) -> AttentionPlan:
        if self._plan is None:
            raise RuntimeError("call plan() before run()")
        return self._plan

    def plan(
        self,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor | None,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qo_indptr: torch.Tensor | None = None,
        *,
        sm_scale: float | None = None,
        num_splits: int | None = None,
        block_n: int | None = None,
        block_m: int | None = None,
    ) -> AttentionPlan:
        """Plan a call (tables on the KV's device); ``qo_indptr [B+1]`` int32 for extend, or
        None for decode (one query token per request). Reads the indptrs on the host (one
        sync). Mutates only this wrapper's plan."""
        if kv_indices is not None:
            check_slot_table(kv_indptr, kv_indices)
        elif (kv_indptr.numel() - 1) % max(num_kv_heads, 1):
            raise ValueError(
                f"indptr has {kv_indptr.numel() - 1} segments, not a multiple of "
                f"H_kv={num_kv_heads}"
            )
        segments_per_req = 1 if kv_indices is not None else max(num_kv_heads, 1)
        decode_ = qo_indptr is None
        if qo_indptr is None:
            num_req = (kv_indptr.numel() - 1) // segments_per_req
            qo_indptr = torch.arange(num_req + 1, dtype=torch.int32)
        self._plan = make_plan(
            qo_indptr=qo_indptr,
            kv_indptr=kv_indptr,
            kv_indices=kv_indices,
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            sm_scale=sm_scale,
            num_splits=num_splits,
            block_n=block_n,
            block_m=block_m,
            decode=decode_,
        )
        return self._plan

    def run(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor
    ) -> AttentionOutput:
        """``q [n, H_q, D]`` over the planned KV: paged ``k, v [S, H_kv, D]``, ``beta
        [S, H_kv]`` fp32, or ragged ``k, v [N, D]``, ``beta [N]`` fp32."""
        plan = self.planned
        if not plan.paged:
            check_rows(k, v, beta, plan.head_dim)
            k, v, beta = ragged_pool(k, v, beta, plan.num_kv_heads)
        check_pool(k, v, beta, plan.num_kv_heads, plan.head_dim)
        if k.stride(2) != 1 or v.stride(2) != 1:
            raise ValueError("keys and values need a contiguous last dim")
        return _launch(plan, q, k, v, beta)


def extend(
    q: torch.Tensor,
    kv: RaggedKV,
    qo_indptr: torch.Tensor | None = None,
    **options: Unpack[RunOptions],
) -> AttentionOutput:
    """One-shot plan+run, ragged extend; same contract as ``reference.extend``
    (qo_indptr None: one request owning all n query rows)."""
    qo_indptr, num_kv = check_ragged_call(q, kv, qo_indptr)
    qo = qo_indptr.to(kv.indptr.device)
    return _one_shot(q, kv[:3], num_kv, kv.indptr, None, qo, **options)


def decode(q: torch.Tensor, kv: RaggedKV, **options: Unpack[RunOptions]) -> AttentionOutput:
    """One-shot ragged decode, ``q [B, H_q, D]``; same contract as ``reference.decode``."""
    _, num_kv = check_ragged_call(q, kv, decode_qo_indptr(q))
    return _one_shot(q, kv[:3], num_kv, kv.indptr, None, None, **options)


def paged_extend(
    q: torch.Tensor, qo_indptr: torch.Tensor, kv: PagedKV, **options: Unpack[RunOptions]
) -> AttentionOutput:
    """One-shot paged extend; same contract as ``reference.paged_extend``."""
    check_paged_call(q, qo_indptr, kv)
    qo = qo_indptr.to(kv.kv_indptr.device)
    return _one_shot(q, kv[:3], kv.k_cache.shape[1], kv.kv_indptr, kv.kv_indices, qo, **options)


def paged_decode(q: torch.Tensor, kv: PagedKV, **options: Unpack[RunOptions]) -> AttentionOutput:
    """One-shot paged decode, ``q [B, H_q, D]``; same contract as ``reference.paged_decode``."""
    check_paged_call(q, decode_qo_indptr(q), kv)
    return _one_shot(q, kv[:3], kv.k_cache.shape[1], kv.kv_indptr, kv.kv_indices, None, **options)


# ---- private helpers -------------------------------------------------------------------


def _one_shot(
    q: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    num_kv_heads: int,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor | None,
    qo_indptr: torch.Tensor | None,
    **options: Unpack[RunOptions],
) -> AttentionOutput:
    """plan() + run() of a fresh wrapper on validated arguments."""
    wrapper = BiasedPagedAttention()
    wrapper.plan(kv_indptr, kv_indices, q.shape[1], num_kv_heads, q.shape[2], qo_indptr, **options)
    return wrapper.run(q, *kv)


def _launch(
    plan: AttentionPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
) -> AttentionOutput:
    """Launch on a pool ``k, v [S, H_kv, D]``, ``beta [S, H_kv]`` (ragged: head stride 0)."""
    check_triton_device(q, k, v, beta, plan.kv_indptr)
    if q.shape[0] != plan.total_q or q.shape[1] != plan.num_qo_heads:
        raise ValueError(
            f"q must be [n={plan.total_q}, H_q={plan.num_qo_heads}, D] as planned, "
            f"got {tuple(q.shape)}"
        )
    check_queries(q, plan.num_kv_heads, plan.head_dim)
    if q.stride(2) != 1:
        q = q.contiguous()
    n, num_qo, dim = q.shape
    out = torch.empty((n, num_qo, dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((n, num_qo), dtype=torch.float32, device=q.device)
    num_tiles = plan.tile_req.numel()
    if n == 0 or num_tiles == 0:
        return AttentionOutput(out.zero_(), lse.fill_(-math.inf))
    splits = plan.num_splits
    if splits == 1:
        o_buf, l_buf = out, lse
    else:
        o_buf = torch.empty((splits, n, num_qo, dim), dtype=torch.float32, device=q.device)
        l_buf = torch.empty((splits, n, num_qo), dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(dim))
    indices = plan.kv_indices if plan.kv_indices is not None else plan.kv_indptr
    _biased_attn_fwd[(num_tiles, plan.num_kv_heads, splits)](
        q,
        k,
        v,
        beta,
        plan.kv_indptr,
        indices,
        plan.qo_indptr,
        plan.tile_req,
        plan.tile_start,
        o_buf,
        l_buf,
        plan.sm_scale * _LOG2E,
        plan.chunk_size,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        beta.stride(0),
        beta.stride(1),
        0 if splits == 1 else o_buf.stride(0),
        o_buf.stride(-3),
        o_buf.stride(-2),
        0 if splits == 1 else l_buf.stride(0),
        l_buf.stride(-2),
        H_KV=plan.num_kv_heads,
        GROUP=plan.num_qo_heads // plan.num_kv_heads,
        HEAD_DIM=dim,
        BLOCK_D=block_d,
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n,
        PAGED=plan.paged,
        PRECISION="ieee" if k.dtype == torch.float32 else "tf32",
    )
    if splits > 1:
        _combine_splits[(n * num_qo,)](
            o_buf,
            l_buf,
            out,
            lse,
            lse,  # no masked splits: not read
            splits,
            n * num_qo,
            num_qo,
            HEAD_DIM=dim,
            BLOCK_S=triton.next_power_of_2(splits),
            BLOCK_D=block_d,
            MASKED_SPLITS=0,
        )
    return AttentionOutput(out, lse)

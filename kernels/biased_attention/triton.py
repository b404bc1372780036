"""Triton attention with a per-key bias over ragged compacted KV or SGLang's paged pool.

One kernel serves decode and extend, ragged and paged. A program owns one tile of
``BLOCK_M`` packed (query token, q head of the group) rows of one request and one KV
head, so the G q heads sharing a KV head read each K/V tile once (GQA packing). The grid
is ``(tiles, H_kv, splits)``: with splits > 1 each program covers one chunk of the KV
segment (split-K / flash-decoding) and a second kernel merges the partial states by LSE.
Decode is extend with one token per request; plan() picks splits so long prefixes with
small batches still fill the GPU.

Shape legend and layouts: :mod:`kernels.biased_attention._common` (B requests, n query
tokens, H_q = G * H_kv, D, ragged ``indptr [B*H_kv+1]`` int32 over ``keys/values [N, D]``,
``beta [N]`` fp32; paged ``k_cache/v_cache [S, H_kv, D]``, ``beta_cache [S, H_kv]``,
``kv_indptr [B+1]``, ``kv_indices [nnz]`` int32).

Results: ``out`` in q's dtype, ``lse`` fp32 natural log; empty/fully masked sets give
out = 0, lse = -inf. Runs on CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from kernels.biased_attention._common import (
    AttentionOutput,
    check_indptr,
    check_paged,
    check_queries,
    check_ragged,
    check_triton_device,
    default_sm_scale,
)
from kernels.biased_attention._kernels import _biased_attn_fwd, _combine_splits

__all__ = [
    "AttentionPlan",
    "BiasedPagedAttention",
    "BiasedRaggedAttention",
    "decode",
    "extend",
    "paged_decode",
    "paged_extend",
]

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class AttentionPlan:
    """What plan() decided (device tensors included); run() only launches."""

    paged: bool
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    total_q: int
    sm_scale: float
    block_m: int
    block_n: int
    num_splits: int
    chunk_size: int
    qo_indptr: torch.Tensor  # [B+1] int32
    kv_indptr: torch.Tensor  # ragged [B*H_kv+1] or paged [B+1], int32
    kv_indices: torch.Tensor | None  # paged [nnz] int32
    tile_req: torch.Tensor  # [tiles] int32 request of each tile
    tile_start: torch.Tensor  # [tiles] int32 first packed row of each tile


def _make_plan(
    *,
    paged: bool,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor | None,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    sm_scale: float | None,
    num_splits: int | None,
    block_n: int | None,
    block_m: int | None,
    decode: bool,
) -> AttentionPlan:
    device = kv_indptr.device
    if num_kv_heads <= 0 or num_qo_heads % num_kv_heads:
        raise ValueError(f"H_q={num_qo_heads} must be a multiple of H_kv={num_kv_heads}")
    if head_dim <= 0:
        raise ValueError(f"head_dim must be positive, got {head_dim}")
    group = num_qo_heads // num_kv_heads
    num_req = qo_indptr.numel() - 1
    check_indptr(qo_indptr, "qo_indptr", None, None)
    segments = num_req if paged else num_req * num_kv_heads
    check_indptr(kv_indptr, "kv_indptr" if paged else "indptr", segments + 1, None)
    qo_host = qo_indptr.cpu().long()
    kv_host = kv_indptr.cpu().long()
    max_len = int((kv_host[1:] - kv_host[:-1]).max()) if segments else 0
    on_gpu = device.type == "cuda"
    if block_m is None:
        block_m = max(16, triton.next_power_of_2(group)) if decode else (64 if on_gpu else 16)
    if block_n is None:
        block_n = 64 if on_gpu else 16
    for name, val in (("block_m", block_m), ("block_n", block_n)):
        if val < 16 or val & (val - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {val}")
    rows = (qo_host[1:] - qo_host[:-1]) * group
    tiles_per_req = (rows + block_m - 1) // block_m
    num_tiles = int(tiles_per_req.sum())
    first = torch.cumsum(tiles_per_req, 0) - tiles_per_req
    tile_req = torch.repeat_interleave(torch.arange(num_req), tiles_per_req)
    tile_start = (torch.arange(num_tiles) - first[tile_req]) * block_m
    if num_splits is None:
        num_splits = 1
        if on_gpu and max_len > 0:
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            want = math.ceil(2 * sms / max(1, num_tiles * num_kv_heads))
            num_splits = max(1, min(want, math.ceil(max_len / 256)))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    chunk = max(block_n, math.ceil(max(max_len, 1) / num_splits / block_n) * block_n)
    num_splits = max(1, math.ceil(max_len / chunk))
    return AttentionPlan(
        paged=paged,
        num_qo_heads=num_qo_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        total_q=int(qo_host[-1]),
        sm_scale=default_sm_scale(head_dim, sm_scale),
        block_m=block_m,
        block_n=block_n,
        num_splits=num_splits,
        chunk_size=chunk,
        qo_indptr=qo_indptr.to(device),
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        tile_req=tile_req.to(device=device, dtype=torch.int32),
        tile_start=tile_start.to(device=device, dtype=torch.int32),
    )


def _launch(
    plan: AttentionPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    k_strides: tuple[int, int],
    v_strides: tuple[int, int],
    b_strides: tuple[int, int],
) -> AttentionOutput:
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
        *k_strides,
        *v_strides,
        *b_strides,
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
            splits,
            n * num_qo,
            HEAD_DIM=dim,
            BLOCK_S=triton.next_power_of_2(splits),
            BLOCK_D=block_d,
        )
    return AttentionOutput(out, lse)


class BiasedRaggedAttention:
    """plan()/run() wrapper over the batched ragged layout (``indptr [B*H_kv+1]``)."""

    def __init__(self) -> None:
        self._plan: AttentionPlan | None = None

    @property
    def planned(self) -> AttentionPlan:
        if self._plan is None:
            raise RuntimeError("call plan() before run()")
        return self._plan

    def plan(
        self,
        indptr: torch.Tensor,
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
        """Plan a call: ``indptr [B*H_kv+1]`` int32 (device of the KV);
        ``qo_indptr [B+1]`` int32, or None for decode (one query token per request).
        Reads indptrs on the host (one sync). Mutates only this wrapper's plan."""
        if (indptr.numel() - 1) % max(num_kv_heads, 1):
            raise ValueError(
                f"indptr has {indptr.numel() - 1} segments, not a multiple of H_kv={num_kv_heads}"
            )
        decode_ = qo_indptr is None
        if qo_indptr is None:
            qo_indptr = torch.arange((indptr.numel() - 1) // num_kv_heads + 1, dtype=torch.int32)
        self._plan = _make_plan(
            paged=False,
            qo_indptr=qo_indptr,
            kv_indptr=indptr,
            kv_indices=None,
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
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, beta: torch.Tensor
    ) -> AttentionOutput:
        """``q [n, H_q, D]`` over ``keys/values [N, D]``, ``beta [N]`` fp32 (as planned)."""
        plan = self.planned
        if keys.dim() != 2 or keys.shape[1] != plan.head_dim:
            raise ValueError(f"keys must be [N, D={plan.head_dim}], got {tuple(keys.shape)}")
        if values.shape != keys.shape or beta.shape != keys.shape[:1]:
            raise ValueError(
                f"values {tuple(values.shape)} / beta {tuple(beta.shape)} do not match "
                f"keys {tuple(keys.shape)}"
            )
        if beta.dtype != torch.float32:
            raise ValueError(f"beta must be float32, got {beta.dtype}")
        if keys.stride(1) != 1 or values.stride(1) != 1:
            raise ValueError("keys and values need a contiguous last dim")
        return _launch(
            plan,
            q,
            keys,
            values,
            beta,
            (keys.stride(0), 0),
            (values.stride(0), 0),
            (beta.stride(0), 0),
        )


class BiasedPagedAttention:
    """plan()/run() wrapper over SGLang's paged pool (page size 1, beta per slot+head)."""

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
        kv_indices: torch.Tensor,
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
        """Plan a call: ``kv_indptr [B+1]``, ``kv_indices [nnz]`` int32 slot ids;
        ``qo_indptr [B+1]`` for extend or None for decode. Reads indptrs on the host."""
        if kv_indices.dim() != 1 or kv_indices.dtype != torch.int32:
            raise ValueError(f"kv_indices must be 1-D int32, got {kv_indices.dtype}")
        check_indptr(kv_indptr, "kv_indptr", None, kv_indices.numel())
        decode_ = qo_indptr is None
        if qo_indptr is None:
            qo_indptr = torch.arange(kv_indptr.numel(), dtype=torch.int32)
        self._plan = _make_plan(
            paged=True,
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
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        beta_cache: torch.Tensor,
    ) -> AttentionOutput:
        """``q [n, H_q, D]`` over ``k_cache/v_cache [S, H_kv, D]``, ``beta_cache [S, H_kv]``."""
        plan = self.planned
        want = (plan.num_kv_heads, plan.head_dim)
        if k_cache.dim() != 3 or tuple(k_cache.shape[1:]) != want:
            raise ValueError(
                f"k_cache must be [S, {want[0]}, {want[1]}], got {tuple(k_cache.shape)}"
            )
        if v_cache.shape != k_cache.shape or beta_cache.shape != k_cache.shape[:2]:
            raise ValueError(
                f"v_cache {tuple(v_cache.shape)} / beta_cache {tuple(beta_cache.shape)} do not "
                f"match k_cache {tuple(k_cache.shape)}"
            )
        if beta_cache.dtype != torch.float32:
            raise ValueError(f"beta_cache must be float32, got {beta_cache.dtype}")
        if k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
            raise ValueError("k_cache and v_cache need a contiguous last dim")
        return _launch(
            plan,
            q,
            k_cache,
            v_cache,
            beta_cache,
            (k_cache.stride(0), k_cache.stride(1)),
            (v_cache.stride(0), v_cache.stride(1)),
            (beta_cache.stride(0), beta_cache.stride(1)),
        )


def extend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    beta: torch.Tensor,
    indptr: torch.Tensor,
    qo_indptr: torch.Tensor | None = None,
    *,
    sm_scale: float | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> AttentionOutput:
    """One-shot plan+run, ragged extend; same contract as ``reference.extend``
    (qo_indptr None: one request owning all n query rows)."""
    check_ragged(keys, values, beta, indptr)
    if qo_indptr is None:
        qo_indptr = torch.tensor([0, q.shape[0]], dtype=torch.int32)
    num_req = qo_indptr.numel() - 1
    if num_req <= 0 or (indptr.numel() - 1) % num_req:
        raise ValueError(f"indptr has {indptr.numel() - 1} segments, not a multiple of B={num_req}")
    check_indptr(qo_indptr, "qo_indptr", None, q.shape[0])
    num_kv = (indptr.numel() - 1) // num_req
    check_queries(q, num_kv, keys.shape[1])
    wrapper = BiasedRaggedAttention()
    wrapper.plan(
        indptr,
        q.shape[1],
        num_kv,
        keys.shape[1],
        qo_indptr.to(indptr.device),
        sm_scale=sm_scale,
        num_splits=num_splits,
        block_n=block_n,
    )
    return wrapper.run(q, keys, values, beta)


def decode(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    beta: torch.Tensor,
    indptr: torch.Tensor,
    *,
    sm_scale: float | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> AttentionOutput:
    """One-shot ragged decode, ``q [B, H_q, D]``; same contract as ``reference.decode``."""
    check_ragged(keys, values, beta, indptr)
    if q.dim() != 3 or q.shape[0] == 0 or (indptr.numel() - 1) % q.shape[0]:
        raise ValueError(
            f"q must be [B, H_q, D] with B dividing the {indptr.numel() - 1} indptr segments, "
            f"got {tuple(q.shape)}"
        )
    num_kv = (indptr.numel() - 1) // q.shape[0]
    check_queries(q, num_kv, keys.shape[1])
    wrapper = BiasedRaggedAttention()
    wrapper.plan(
        indptr,
        q.shape[1],
        num_kv,
        keys.shape[1],
        sm_scale=sm_scale,
        num_splits=num_splits,
        block_n=block_n,
    )
    return wrapper.run(q, keys, values, beta)


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
    num_splits: int | None = None,
    block_n: int | None = None,
) -> AttentionOutput:
    """One-shot paged extend; same contract as ``reference.paged_extend``."""
    check_paged(k_cache, v_cache, beta_cache, kv_indptr, kv_indices)
    check_indptr(qo_indptr, "qo_indptr", kv_indptr.numel(), q.shape[0])
    wrapper = BiasedPagedAttention()
    wrapper.plan(
        kv_indptr,
        kv_indices,
        q.shape[1],
        k_cache.shape[1],
        k_cache.shape[2],
        qo_indptr.to(kv_indptr.device),
        sm_scale=sm_scale,
        num_splits=num_splits,
        block_n=block_n,
    )
    return wrapper.run(q, k_cache, v_cache, beta_cache)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    beta_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    *,
    sm_scale: float | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> AttentionOutput:
    """One-shot paged decode, ``q [B, H_q, D]``; same contract as ``reference.paged_decode``."""
    check_paged(k_cache, v_cache, beta_cache, kv_indptr, kv_indices)
    if q.dim() != 3 or q.shape[0] != kv_indptr.numel() - 1:
        raise ValueError(f"q must be [B={kv_indptr.numel() - 1}, H_q, D], got {tuple(q.shape)}")
    wrapper = BiasedPagedAttention()
    wrapper.plan(
        kv_indptr,
        kv_indices,
        q.shape[1],
        k_cache.shape[1],
        k_cache.shape[2],
        sm_scale=sm_scale,
        num_splits=num_splits,
        block_n=block_n,
    )
    return wrapper.run(q, k_cache, v_cache, beta_cache)

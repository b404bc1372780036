"""Triton kernels for CUDA-graph decode: a device-side slot-table fill and a fixed-grid launch.

Nothing here reads a device tensor on the host or allocates a tensor whose shape depends on
tensor data, so both calls can run between (or inside) CUDA graph replays with persistent
buffers. The state lives with the caller (``sglang_ext.graph_decode.GraphDecodePlan``).

Slot table of a batch over SGLang's ``req_to_token [R, W]`` (request b owns row
``rows[b]``, n_b = ``seq_lens[b]`` entries). A request on a compacted prefix of logical length
T_b holding p_b physical slots has, in its row, the p_b slots, then T_b - p_b alias columns
(the masked padding slot), then its own n_b - T_b tokens; a plain request has p_b = T_b = 0.
:func:`fill_slot_table` writes, for b < bs, ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` = the
row's columns [0, p_b) then [T_b, n_b): the physical entries and the tail, never an alias.
The torch reference is :func:`kernels.biased_attention.reference.compacted_slot_table`.

:func:`launch_decode` runs ``_biased_attn_fwd`` with grid ``(n, H_kv, splits)`` for
``q [n, H_q, D]`` (one token per request), a split size fixed by the caller (from the largest
context, not from the batch), then ``_combine_splits``. Splits past a request's length, and
requests with an empty table, store out = 0, lse = -inf and cost one empty loop.

Shape legend: :mod:`kernels.biased_attention._common`; bs requests filled, max_bs capacity.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.biased_attention._kernels import _biased_attn_fwd, _combine_splits

__all__ = ["fill_slot_table", "launch_decode"]

_LOG2E = 1.4426950408889634


def fill_slot_table(
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    prefix_physical: torch.Tensor,
    prefix_logical: torch.Tensor,
    bs: int,
    lens: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    block: int = 128,
) -> None:
    """Write the alias-free slot table of the first ``bs`` requests into fixed buffers.

    Args:
        req_to_token: [R, W] int32/int64 (last dim contiguous).
        rows, seq_lens, prefix_physical, prefix_logical: [>= bs] device ints (p_b, T_b are
            0 for plain requests).
        bs: requests to fill (host int); ``bs <= lens.numel()``.
        lens: [max_bs] int32 scratch; kv_indptr: [max_bs+1] int32; kv_indices: [cap] int32.

    Mutates ``lens`` (n_b - T_b + p_b for b < bs, 0 after), ``kv_indptr`` (its cumsum, so
    requests past bs are empty) and ``kv_indices[:kv_indptr[bs]]``. No host sync; the caller
    guarantees (host-side, beforehand) that the lengths fit ``kv_indices``.
    """
    lens.zero_()
    if bs:
        gap = prefix_logical[:bs] - prefix_physical[:bs]  # alias columns, skipped
        lens[:bs].copy_(seq_lens[:bs] - gap)
    kv_indptr[:1].zero_()
    torch.cumsum(lens, 0, dtype=torch.int32, out=kv_indptr[1:])
    if bs == 0:
        return
    _fill_slot_table_kernel[(bs,)](
        req_to_token,
        rows,
        kv_indptr,
        prefix_physical,
        prefix_logical,
        kv_indices,
        req_to_token.stride(0),
        BLOCK=block,
    )


def launch_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    beta_cache: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    o_part: torch.Tensor,
    lse_part: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    sm_scale: float,
    chunk_size: int,
    block_n: int,
) -> None:
    """Decode ``q [n, H_q, D]`` over a paged pool with a fixed grid ``(n, H_kv, splits)``.

    Args:
        q: [n, H_q, D]; k_cache, v_cache: [S, H_kv, D]; beta_cache: [S, H_kv] fp32.
        tables: (kv_indptr [>= n+1], kv_indices, qo_indptr [>= n+1] = arange, tile_req
            [>= n] = arange, tile_start [>= n] = 0), int32 device tensors.
        o_part: [splits, n, H_q, D] fp32 contiguous, lse_part: [splits, n, H_q] fp32
            contiguous (splits = its first dim); out: [n, H_q, D] contiguous; lse: [n, H_q]
            fp32 contiguous.
        chunk_size: entries per split, a multiple of block_n; split s of request b covers
            entries [s * chunk_size, (s+1) * chunk_size) of its table.

    Mutates o_part, lse_part, out and lse. No host sync, no allocation.
    """
    n, num_qo, dim = q.shape
    num_kv = k_cache.shape[1]
    group = num_qo // num_kv
    splits = o_part.shape[0]
    if n == 0:
        return
    kv_indptr, kv_indices, qo_indptr, tile_req, tile_start = tables
    block_d = max(16, triton.next_power_of_2(dim))
    o_buf, l_buf = (out, lse) if splits == 1 else (o_part, lse_part)
    _biased_attn_fwd[(n, num_kv, splits)](
        q,
        k_cache,
        v_cache,
        beta_cache,
        kv_indptr,
        kv_indices,
        qo_indptr,
        tile_req,
        tile_start,
        o_buf,
        l_buf,
        sm_scale * _LOG2E,
        chunk_size,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        beta_cache.stride(0),
        beta_cache.stride(1),
        0 if splits == 1 else o_buf.stride(0),
        o_buf.stride(-3),
        o_buf.stride(-2),
        0 if splits == 1 else l_buf.stride(0),
        l_buf.stride(-2),
        H_KV=num_kv,
        GROUP=group,
        HEAD_DIM=dim,
        BLOCK_D=block_d,
        BLOCK_M=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        PAGED=True,
        PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32",
    )
    if splits > 1:
        _combine_splits[(n * num_qo,)](
            o_part,
            lse_part,
            out,
            lse,
            splits,
            n * num_qo,
            HEAD_DIM=dim,
            BLOCK_S=triton.next_power_of_2(splits),
            BLOCK_D=block_d,
        )


@triton.jit
def _fill_slot_table_kernel(
    ReqToToken,
    Rows,
    KvIndptr,
    PrefixPhysical,
    PrefixLogical,
    KvIndices,
    stride_r2t,
    BLOCK: tl.constexpr,
):
    """Program b copies row ``Rows[b]`` columns [0, p) and [T, n) to its table segment."""
    b = tl.program_id(0)
    row = tl.load(Rows + b).to(tl.int64)
    start = tl.load(KvIndptr + b)
    length = tl.load(KvIndptr + b + 1) - start
    p = tl.load(PrefixPhysical + b).to(tl.int32)
    skip = tl.load(PrefixLogical + b).to(tl.int32) - p
    src = ReqToToken + row * stride_r2t
    for j0 in range(0, length, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        ok = j < length
        col = tl.where(j < p, j, j + skip).to(tl.int64)
        slot = tl.load(src + col, mask=ok, other=0)
        tl.store(KvIndices + start + j, slot.to(tl.int32), mask=ok)

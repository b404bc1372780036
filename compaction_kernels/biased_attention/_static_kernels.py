"""Triton JIT kernels of the static decode cascade (launch code: :mod:`.static`).

Every grid is fixed by the batch size alone, so a CUDA graph captures the launches once and
replays them for any batch of that size; what differs between batches lives in tables read
on the device.

``_static_attn_fwd``: grid ``(tiles, H_kv, SPLITS)``. Tile i serves kernel request
``TileReq[i]`` (< 0: a padding tile, which stores nothing) from its packed query row
``TileStart[i]``; request r's query rows are ``[QoIndptr[r], QoIndptr[r+1])`` and row j is
batch token ``TokIdx[j]``. Split s covers ``ceil(len / SPLITS)`` (rounded up to BLOCK_N) of
the request's KV segment, computed here from the segment's length: an empty split stores
out = 0, lse = -inf. Two ways to find a request's KV:

- PAGED (tails): ``SegA [R+1]`` indptr into ``SegB`` (slot ids), read through the pool
  ``K, V [S, H_kv, D]``, ``Beta [S, H_kv]``.
- ADDRESSED (compacted prefixes): ``SegA [R]`` holds the address of the request's entry
  indptr ``[L * (H_kv + 1)]`` int64 (layer l, KV head h: entries ``[ip[l(H+1)+h],
  ip[l(H+1)+h+1])``), ``SegB [R]`` the address of its cells ``[3, E]`` int64 (the byte
  addresses of each entry's K row, V row and fp32 beta), ``SegC [R]`` its E. K only gives
  the element type: an entry may sit in any layer's buffer.

Partial results go to ``OPart [splits, n, H_q, D]``, ``LPart [splits, n, H_q]`` at split
``split_base + s``; ``_combine_splits`` (:mod:`._kernels`) merges them.

``_gather_slots``: grid ``(B, cdiv(W, BLOCK))``; request b's slots ``req_to_token[Rows[b],
Starts[b] + j]`` for j < ``Indptr[b+1] - Indptr[b]`` are copied to ``Out[Indptr[b] + j]``.
"""

import triton
import triton.language as tl

from compaction_kernels.biased_attention._kernels import _finish, _softmax_step

__all__ = ["_gather_slots", "_static_attn_fwd"]


@triton.jit
def _static_attn_fwd(
    Q,
    K,
    V,
    Beta,
    TileReq,
    TileStart,
    QoIndptr,
    TokIdx,
    SegA,
    SegB,
    SegC,
    OPart,
    LPart,
    layer,
    split_base,
    sm_scale_log2,
    stride_qn,
    stride_qh,
    stride_k_row,
    stride_k_head,
    stride_v_row,
    stride_v_head,
    stride_b_row,
    stride_b_head,
    stride_os,
    stride_on,
    stride_oh,
    stride_ls,
    stride_ln,
    H_KV: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    ADDRESSED: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    r = tl.load(TileReq + tile)
    if r < 0:
        return
    p0 = tl.load(TileStart + tile)
    q_start = tl.load(QoIndptr + r)
    n_rows = (tl.load(QoIndptr + r + 1) - q_start) * GROUP
    rows = p0 + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    tok = tl.load(TokIdx + q_start + rows // GROUP, mask=row_ok, other=0).to(tl.int64)
    qh = h * GROUP + rows % GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(
        Q + tok[:, None] * stride_qn + qh[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    q = q.to(K.dtype.element_ty)
    if ADDRESSED:
        ip = tl.load(SegA + r).to(tl.pointer_type(tl.int64))
        cells = tl.load(SegB + r).to(tl.pointer_type(tl.int64))
        num_entries = tl.load(SegC + r)
        seg = layer * (H_KV + 1) + h
        kv_start = tl.load(ip + seg)
        kv_end = tl.load(ip + seg + 1)
    else:
        kv_start = tl.load(SegA + r)
        kv_end = tl.load(SegA + r + 1)
    chunk = tl.cdiv(tl.cdiv(kv_end - kv_start, SPLITS), BLOCK_N) * BLOCK_N
    lo = kv_start + split * chunk
    hi = tl.minimum(lo + chunk, kv_end)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        ok = pos < hi
        kv_mask = ok[:, None] & d_ok[None, :]
        if ADDRESSED:
            k_at = tl.load(cells + pos, mask=ok, other=0).to(tl.pointer_type(K.dtype.element_ty))
            v_at = tl.load(cells + num_entries + pos, mask=ok, other=0)
            b_at = tl.load(cells + 2 * num_entries + pos, mask=ok, other=0)
            k = tl.load(k_at[:, None] + d[None, :], mask=kv_mask, other=0.0)
            v_ptr = v_at.to(tl.pointer_type(K.dtype.element_ty))
            v = tl.load(v_ptr[:, None] + d[None, :], mask=kv_mask, other=0.0)
            bias = tl.load(b_at.to(tl.pointer_type(tl.float32)), mask=ok, other=float("-inf"))
        else:
            slot = tl.load(SegB + pos, mask=ok, other=0).to(tl.int64)
            k_row = K + h.to(tl.int64) * stride_k_head + slot * stride_k_row
            k = tl.load(k_row[:, None] + d[None, :], mask=kv_mask, other=0.0)
            v_row = V + h.to(tl.int64) * stride_v_head + slot * stride_v_row
            v = tl.load(v_row[:, None] + d[None, :], mask=kv_mask, other=0.0)
            b_row = Beta + h.to(tl.int64) * stride_b_head + slot * stride_b_row
            bias = tl.load(b_row, mask=ok, other=float("-inf"))
        m_i, l_i, acc = _softmax_step(q, k, v, bias, ok, m_i, l_i, acc, sm_scale_log2, PRECISION)
    out, lse = _finish(acc, l_i, m_i)
    at = split_base + split
    o_ptr = OPart + at * stride_os + tok[:, None] * stride_on + qh[:, None] * stride_oh
    tl.store(o_ptr + d[None, :], out, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LPart + at * stride_ls + tok * stride_ln + qh, lse, mask=row_ok)


@triton.jit
def _gather_slots(
    ReqToToken,
    Rows,
    Starts,
    Indptr,
    Out,
    stride_row,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    lo = tl.load(Indptr + b)
    ok = j < tl.load(Indptr + b + 1) - lo
    row = tl.load(Rows + b).to(tl.int64)
    start = tl.load(Starts + b)
    slots = tl.load(ReqToToken + row * stride_row + start + j, mask=ok, other=0)
    tl.store(Out + lo + j, slots.to(tl.int32), mask=ok)

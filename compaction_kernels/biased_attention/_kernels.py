"""Triton JIT kernels behind :mod:`compaction_kernels.biased_attention.triton` (launch code lives there).

``_biased_attn_fwd``: grid ``(tiles, H_kv, splits)``; a program loads ``BLOCK_M`` packed
(query token, group q head) rows of one request, walks its KV head's chunk
``[kv_start + split*chunk_size, ...)`` in ``BLOCK_N`` blocks (ragged rows, or slots read
through ``KvIndices`` when PAGED), and keeps an online softmax in base 2. It stores the
normalised output and the natural-log LSE for its split (``Out [splits, n, H_q, D]``,
``Lse [splits, n, H_q]``; split stride 0 when there is one split). Empty or fully masked
chunks store out = 0, lse = -inf without NaN.

``_combine_splits``: one program per (token, q head) row merges the splits by LSE.
"""

import triton
import triton.language as tl

__all__ = ["_biased_attn_fwd", "_combine_splits", "_finish", "_softmax_step"]


@triton.jit
def _softmax_step(q, k, v, bias, ok, m_i, l_i, acc, sm_scale_log2, PRECISION: tl.constexpr):
    """One ``BLOCK_N`` block of the online softmax in base 2: q [M, D] (K's dtype), k, v
    [N, D], bias [N] fp32 natural log, ok [N] (False: not an entry). Returns m, l, acc."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale_log2
    s = s + (bias * 1.4426950408889634)[None, :]
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _finish(acc, l_i, m_i):
    """The normalised output [M, D] and natural-log LSE [M] of an online softmax (no entry
    seen: out = 0, lse = -inf, no NaN)."""
    has = l_i > 0.0
    denom = tl.where(has, l_i, 1.0)
    out = acc / denom[:, None]
    lse = tl.where(has, (m_i + tl.log2(denom)) * 0.6931471805599453, float("-inf"))
    return out, lse


@triton.jit
def _biased_attn_fwd(
    Q,
    K,
    V,
    Beta,
    KvIndptr,
    KvIndices,
    QoIndptr,
    TileReq,
    TileStart,
    Out,
    Lse,
    sm_scale_log2,
    chunk_size,
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
    PAGED: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    b = tl.load(TileReq + tile)
    p0 = tl.load(TileStart + tile)
    q_start = tl.load(QoIndptr + b)
    n_rows = (tl.load(QoIndptr + b + 1) - q_start) * GROUP
    rows = p0 + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    tok = (q_start + rows // GROUP).to(tl.int64)
    qh = h * GROUP + rows % GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(
        Q + tok[:, None] * stride_qn + qh[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    q = q.to(K.dtype.element_ty)
    if PAGED:
        seg = b
    else:
        seg = b * H_KV + h
    kv_start = tl.load(KvIndptr + seg)
    kv_end = tl.load(KvIndptr + seg + 1)
    lo = kv_start + split * chunk_size
    hi = tl.minimum(lo + chunk_size, kv_end)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_head = K + h.to(tl.int64) * stride_k_head
    v_head = V + h.to(tl.int64) * stride_v_head
    b_head = Beta + h.to(tl.int64) * stride_b_head
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        ok = pos < hi
        if PAGED:
            r = tl.load(KvIndices + pos, mask=ok, other=0).to(tl.int64)
        else:
            r = pos.to(tl.int64)
        kv_mask = ok[:, None] & d_ok[None, :]
        k = tl.load(k_head + r[:, None] * stride_k_row + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_head + r[:, None] * stride_v_row + d[None, :], mask=kv_mask, other=0.0)
        bias = tl.load(b_head + r * stride_b_row, mask=ok, other=float("-inf"))
        m_i, l_i, acc = _softmax_step(q, k, v, bias, ok, m_i, l_i, acc, sm_scale_log2, PRECISION)
    out, lse = _finish(acc, l_i, m_i)
    o_ptr = (
        Out + split * stride_os + tok[:, None] * stride_on + qh[:, None] * stride_oh + d[None, :]
    )
    tl.store(o_ptr, out, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(Lse + split * stride_ls + tok * stride_ln + qh, lse, mask=row_ok)


@triton.jit
def _combine_splits(
    OPart,
    LsePart,
    Out,
    Lse,
    TokGroup,
    num_splits,
    split_rows,
    num_qo,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED_SPLITS: tl.constexpr,
):
    """Row `row` = token * num_qo + q head of ``OPart [splits, split_rows, D]``, ``LsePart
    [splits, split_rows]`` merged by LSE into ``Out [rows, D]``, ``Lse [rows]``. With
    MASKED_SPLITS = m > 0, splits [0, m) count only for tokens whose ``TokGroup`` entry is
    >= 0 (their other rows hold nothing)."""
    row = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    sp_ok = sp < num_splits
    if MASKED_SPLITS > 0:
        has = tl.load(TokGroup + row // num_qo) >= 0
        sp_ok = sp_ok & ((sp >= MASKED_SPLITS) | has)
    s = tl.load(LsePart + sp * split_rows + row, mask=sp_ok, other=float("-inf"))
    s_max = tl.max(s, 0)
    finite = s_max > float("-inf")
    ref = tl.where(finite, s_max, 0.0)
    w = tl.exp(s - ref)
    total = tl.where(finite, tl.sum(w, 0), 1.0)
    mask = sp_ok[:, None] & (d[None, :] < HEAD_DIM)
    o = tl.load(
        OPart + (sp[:, None] * split_rows + row) * HEAD_DIM + d[None, :], mask=mask, other=0.0
    )
    out = tl.sum(o * (w / total)[:, None], 0)
    tl.store(Out + row * HEAD_DIM + d, out, mask=d < HEAD_DIM)
    tl.store(Lse + row, tl.where(finite, ref + tl.log(total), float("-inf")))

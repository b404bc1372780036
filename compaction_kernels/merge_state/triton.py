"""Triton ``merge_state``: combine two partial attention results by their LSE.

Shape legend: n query tokens, H heads, D head dim; ``v_a, v_b [n, H, D]`` (any float
dtype), ``s_a, s_b [n, H]`` fp32 natural-log LSE (-inf = empty side). Same maths as
:mod:`compaction_kernels.merge_state.reference`; both sides -inf gives v = 0, s = -inf.

Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from compaction_kernels.biased_attention._common import AttentionOutput, check_triton_device
from compaction_kernels.merge_state.reference import check_states

__all__ = ["merge_state"]


@triton.jit
def _merge_state_kernel(
    VA,
    SA,
    VB,
    SB,
    VO,
    SO,
    num_rows,
    head_dim,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < num_rows
    mask = row_ok[:, None] & (cols[None, :] < head_dim)
    s_a = tl.load(SA + rows, mask=row_ok, other=float("-inf")) * 1.4426950408889634
    s_b = tl.load(SB + rows, mask=row_ok, other=float("-inf")) * 1.4426950408889634
    s_max = tl.maximum(s_a, s_b)
    finite = s_max > float("-inf")
    ref = tl.where(finite, s_max, 0.0)
    w_a = tl.exp2(s_a - ref)
    w_b = tl.exp2(s_b - ref)
    total = tl.where(finite, w_a + w_b, 1.0)
    offs = rows[:, None].to(tl.int64) * head_dim + cols[None, :]
    v_a = tl.load(VA + offs, mask=mask, other=0.0).to(tl.float32)
    v_b = tl.load(VB + offs, mask=mask, other=0.0).to(tl.float32)
    out = v_a * (w_a / total)[:, None] + v_b * (w_b / total)[:, None]
    out = tl.where(finite[:, None], out, 0.0)
    tl.store(VO + offs, out, mask=mask)
    lse = tl.where(finite, (ref + tl.log2(total)) * 0.6931471805599453, float("-inf"))
    tl.store(SO + rows, lse, mask=row_ok)


def merge_state(
    v_a: torch.Tensor,
    s_a: torch.Tensor,
    v_b: torch.Tensor,
    s_b: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
) -> AttentionOutput:
    """Merge two partial states; returns ``out [n, H, D]`` (``out_dtype``, default v_a's
    dtype) and ``lse [n, H]`` fp32. Inputs are not modified."""
    check_states(v_a, s_a, v_b, s_b)
    check_triton_device(v_a, s_a, v_b, s_b)
    n, h, d = v_a.shape
    out = torch.empty((n, h, d), dtype=out_dtype or v_a.dtype, device=v_a.device)
    lse = torch.empty((n, h), dtype=torch.float32, device=v_a.device)
    num_rows = n * h
    if num_rows == 0:
        return AttentionOutput(out, lse)
    block_d = max(16, triton.next_power_of_2(d))
    block_r = max(1, min(64, 4096 // block_d))
    grid = (triton.cdiv(num_rows, block_r),)
    _merge_state_kernel[grid](
        v_a.contiguous(),
        s_a.contiguous(),
        v_b.contiguous(),
        s_b.contiguous(),
        out,
        lse,
        num_rows,
        d,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
    )
    return AttentionOutput(out, lse)

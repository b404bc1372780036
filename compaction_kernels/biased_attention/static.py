"""Launches of the static decode cascade: every grid and argument fixed by the batch size.

A CUDA graph records kernel launches with their arguments, so a step it can replay for any
batch of one size takes all its varying facts from device tables, never from the launch:
which requests read which compacted prefix, the queries of each, the tails' slots. This
module launches the kernels of :mod:`._static_kernels` over such tables; what fills them is
the caller's (``sglang_ext.attention.static_cascade``). Shape legend:
:mod:`compaction_kernels.biased_attention._common` (n query tokens, H_q = G * H_kv, D).

Kernel requests come in two kinds: *addressed* (a compacted prefix: its entries found through
a table of byte addresses, so entries may sit in any layer's buffer and no copy is made) and
*paged* (a request's own slots in SGLang's pool). Both write split partials into one pair of
buffers ``o_part [splits, n, H_q, D]``, ``l_part [splits, n, H_q]`` fp32, at their own split
offsets, which :meth:`StaticAttention.combine` merges by LSE. Runs on CUDA tensors, or on CPU
tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton

from compaction_kernels.biased_attention._common import check_queries, default_sm_scale
from compaction_kernels.biased_attention._kernels import _combine_splits
from compaction_kernels.biased_attention._static_kernels import _gather_slots, _static_attn_fwd

__all__ = ["KernelRequests", "StaticAttention", "gather_slots"]

_LOG2E = 1.4426950408889634


class KernelRequests(NamedTuple):
    """The kernel requests of one launch, as device tables (int64 unless said).

    `tile_req`, `tile_start` [tiles]: the request and first packed query row of each program
    (request < 0: a padding tile); `qo_indptr` [R+1] and `tok_idx` [n_r]: request r's query
    rows and the batch token of each. `seg_a`, `seg_b`, `seg_c`: paged, the indptr [R+1] and
    the int32 slot ids it indexes (`seg_c` unused); addressed, per request the address of its
    entry indptr, of its cells and its entry count E (module :mod:`._static_kernels`).
    """

    tile_req: torch.Tensor
    tile_start: torch.Tensor
    qo_indptr: torch.Tensor
    tok_idx: torch.Tensor
    seg_a: torch.Tensor
    seg_b: torch.Tensor
    seg_c: torch.Tensor


@dataclass(frozen=True)
class StaticAttention:
    """The fixed launch shape of one model's attention: heads, head dim, tile sizes and the
    split counts of the prefix and tail launches (``prefix_splits + tail_splits`` partials).

    Raises:
        ValueError: H_q not a multiple of H_kv, a non-positive size, or a block size that is
            not a power of two >= 16.
    """

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    prefix_splits: int
    tail_splits: int
    block_m: int = 16
    block_n: int = 16

    def __post_init__(self) -> None:
        if self.num_kv_heads <= 0 or self.num_qo_heads % self.num_kv_heads:
            raise ValueError(
                f"H_q={self.num_qo_heads} must be a positive multiple of H_kv={self.num_kv_heads}"
            )
        if min(self.head_dim, self.prefix_splits, self.tail_splits) < 1:
            raise ValueError(
                f"head_dim, prefix_splits and tail_splits must be >= 1, got {self.head_dim}, "
                f"{self.prefix_splits}, {self.tail_splits}"
            )
        for name, val in (("block_m", self.block_m), ("block_n", self.block_n)):
            if val < 16 or val & (val - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {val}")

    @property
    def group(self) -> int:
        """G, the q heads that read one KV head."""
        return self.num_qo_heads // self.num_kv_heads

    @property
    def splits(self) -> int:
        """Partials per (token, q head): the prefix's, then the tail's."""
        return self.prefix_splits + self.tail_splits

    @property
    def tail_block_m(self) -> int:
        """Packed rows of a tail program: one decode token's G q heads."""
        return max(16, triton.next_power_of_2(self.group))

    def prefix_tiles(self, num_tokens: int, max_groups: int) -> int:
        """The prefix launch's programs along axis 0 for up to `num_tokens` tokens in up to
        `max_groups` kernel requests: each request may leave one tile partly filled."""
        return math.ceil(num_tokens * self.group / self.block_m) + min(num_tokens, max_groups)

    def attend(
        self,
        q: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        requests: KernelRequests,
        parts: tuple[torch.Tensor, torch.Tensor],
        *,
        layer: int,
        sm_scale: float | None,
        addressed: bool,
    ) -> None:
        """One launch over `requests`: q [n, H_q, D]; `kv` the pool's layer (k, v [S, H_kv,
        D], beta [S, H_kv] fp32; addressed: k only gives the dtype); writes the prefix
        partials (addressed) or the tail partials into `parts`. Mutates `parts` only."""
        k, v, beta = kv
        o_part, l_part = parts
        check_queries(q, self.num_kv_heads, self.head_dim)
        splits, base = (
            (self.prefix_splits, 0) if addressed else (self.tail_splits, self.prefix_splits)
        )
        block_m = self.block_m if addressed else self.tail_block_m
        grid = (requests.tile_req.numel(), self.num_kv_heads, splits)
        _static_attn_fwd[grid](
            q, k, v, beta, *requests, o_part, l_part, layer, base,
            default_sm_scale(self.head_dim, sm_scale) * _LOG2E,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            beta.stride(0), beta.stride(1), o_part.stride(0), o_part.stride(1),
            o_part.stride(2), l_part.stride(0), l_part.stride(1),
            H_KV=self.num_kv_heads, GROUP=self.group, HEAD_DIM=self.head_dim,
            BLOCK_D=max(16, triton.next_power_of_2(self.head_dim)), BLOCK_M=block_m,
            BLOCK_N=self.block_n, SPLITS=splits, ADDRESSED=addressed,
            PRECISION="ieee" if k.dtype == torch.float32 else "tf32",
        )  # fmt: skip

    def combine(
        self,
        parts: tuple[torch.Tensor, torch.Tensor],
        out: torch.Tensor,
        lse: torch.Tensor,
        tok_group: torch.Tensor,
    ) -> None:
        """Merge `parts` (o_part [splits, n_max, H_q, D], l_part [splits, n_max, H_q], the
        first n tokens used) into out [n, H_q, D] (any float dtype) and lse [n, H_q] fp32,
        both contiguous; the prefix partials of token i count only where tok_group[i] >= 0.
        Mutates out, lse."""
        o_part, l_part = parts
        rows = out.shape[0] * self.num_qo_heads
        split_rows = o_part.shape[1] * self.num_qo_heads
        _combine_splits[(rows,)](
            o_part, l_part, out, lse, tok_group, self.splits, split_rows, self.num_qo_heads,
            HEAD_DIM=self.head_dim, BLOCK_S=triton.next_power_of_2(self.splits),
            BLOCK_D=max(16, triton.next_power_of_2(self.head_dim)),
            MASKED_SPLITS=self.prefix_splits,
        )  # fmt: skip


def gather_slots(
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    starts: torch.Tensor,
    indptr: torch.Tensor,
    out: torch.Tensor,
    block: int = 256,
) -> None:
    """out[indptr[b] + j] = req_to_token[rows[b], starts[b] + j] for j < indptr[b+1] -
    indptr[b] (rows, starts [B], indptr [B+1] on the table's device; out int32). The grid
    covers the table's width W whatever the lengths. Mutates `out` only."""
    num_req, width = rows.numel(), req_to_token.shape[1]
    _gather_slots[(num_req, triton.cdiv(width, block))](
        req_to_token, rows, starts, indptr, out, req_to_token.stride(0), BLOCK=block
    )

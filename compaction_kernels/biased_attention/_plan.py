"""CPU-side planning for the Triton biased-attention kernels (no kernel launch here).

:func:`make_plan` reads the indptrs on the host once and decides the tiling (``BLOCK_M``
packed query rows x ``BLOCK_N`` keys), the split-K factor and the per-tile request tables;
:class:`AttentionPlan` carries that (device tensors included) to ``run()``. Shape legend:
:mod:`compaction_kernels.biased_attention._common`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from compaction_kernels.biased_attention._common import check_indptr, default_sm_scale

__all__ = ["AttentionPlan", "make_plan"]


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
    kv_indices: torch.Tensor | None  # paged [nnz] int32; None: ragged (identity)
    tile_req: torch.Tensor  # [tiles] int32 request of each tile
    tile_start: torch.Tensor  # [tiles] int32 first packed row of each tile


def make_plan(
    *,
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
    """Validate the tables and decide tiles, blocks and splits (host-side; one sync)."""
    device, paged = kv_indptr.device, kv_indices is not None
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

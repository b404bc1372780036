"""Shared types, validation and layout helpers for biased attention (no triton import).

Shape legend (used by every module of this package):
    B        batch: requests (or compacted prefixes) in one call
    T        logical prefix length (tokens before compaction)
    t        kept entries per KV head after compaction (t_h when it differs per head)
    n        query tokens in total (``total_q``); decode has n == B
    H_q      query heads; H_kv KV heads; G = H_q // H_kv (GQA: q head i reads KV head i // G)
    D        head dim
    N        rows of the ragged KV arrays, N = sum over segments of their length
    S        slots of the paged KV pool (SGLang ``token_to_kv_pool``)

Ragged (compacted) layout, batched:
    keys   [N, D]         model dtype
    values [N, D]         model dtype
    beta   [N]            fp32, natural-log bias added to the *scaled* logit; -inf masks
    indptr [B*H_kv + 1]   int32, monotone, indptr[0] == 0, indptr[-1] == N;
                          segment b*H_kv + h (request b, KV head h) owns rows
                          indptr[b*H_kv + h] : indptr[b*H_kv + h + 1] (may be empty).
    One compacted layer of one prefix is the case B == 1 (``indptr [H_kv + 1]``).

Paged layout (SGLang, page size 1):
    k_cache [S, H_kv, D], v_cache [S, H_kv, D]   model dtype
    beta_cache [S, H_kv]                          fp32 (-inf on padding / aliased slots)
    kv_indptr [B+1] int32, kv_indices [nnz] int32 slot ids; request b reads slots
    kv_indices[kv_indptr[b]:kv_indptr[b+1]] for every KV head.

Queries: decode ``q [B, H_q, D]`` (one token per request); extend ``q [n, H_q, D]`` with
``qo_indptr [B+1]`` int32 (request b owns query rows qo_indptr[b]:qo_indptr[b+1]); extend
attends the prefix non-causally (every query sees every prefix entry).

Results: ``out [n, H_q, D]`` (decode: [B, H_q, D]) and ``lse [n, H_q]`` fp32, the
natural-log log-sum-exp of ``q.k * sm_scale + beta`` over the entries seen. An empty (or
fully masked) entry set gives out = 0 and lse = -inf.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch

__all__ = [
    "AttentionOutput",
    "PagedKV",
    "RaggedKV",
    "check_indptr",
    "check_paged_call",
    "check_pool",
    "check_queries",
    "check_ragged",
    "check_ragged_call",
    "check_rows",
    "check_slot_table",
    "check_triton_device",
    "decode_qo_indptr",
    "default_sm_scale",
    "ragged_pool",
    "ragged_to_paged",
]


class RaggedKV(NamedTuple):
    """A batched ragged (compacted) KV set (module legend): ``keys/values [N, D]``, ``beta
    [N]`` fp32, ``indptr [B*H_kv + 1]`` int32 (segment ``b*H_kv + h``: request b, KV head h)."""

    keys: torch.Tensor
    values: torch.Tensor
    beta: torch.Tensor
    indptr: torch.Tensor


class PagedKV(NamedTuple):
    """A paged KV pool and its slot table (module legend): ``k_cache/v_cache [S, H_kv, D]``,
    ``beta_cache [S, H_kv]`` fp32, ``kv_indptr [B+1]`` and ``kv_indices [nnz]`` int32."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    beta_cache: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor


class AttentionOutput(NamedTuple):
    """Attention result: ``out [n, H_q, D]`` and ``lse [n, H_q]`` (fp32, natural log)."""

    out: torch.Tensor
    lse: torch.Tensor


def default_sm_scale(head_dim: int, sm_scale: float | None) -> float:
    """Return ``sm_scale`` or 1/sqrt(D); ValueError when not a positive finite number."""
    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not math.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"sm_scale must be positive and finite, got {sm_scale}")
    return float(sm_scale)


def check_indptr(indptr: torch.Tensor, name: str, length: int | None, total: int | None) -> None:
    """Validate an indptr: 1-D int32, ``[length]`` long, starts at 0, monotone, ends at total.

    Reads the tensor on the host (a device sync when it lives on a GPU): call it from
    ``plan()``, not from the hot path.
    """
    if indptr.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(indptr.shape)}")
    if indptr.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {indptr.dtype}")
    if length is not None and indptr.numel() != length:
        raise ValueError(f"{name} must have {length} entries, got {indptr.numel()}")
    if indptr.numel() == 0:
        raise ValueError(f"{name} must not be empty")
    host = indptr.cpu()
    if int(host[0]) != 0:
        raise ValueError(f"{name}[0] must be 0, got {int(host[0])}")
    if host.numel() > 1 and bool((host[1:] < host[:-1]).any()):
        bad = int(torch.nonzero(host[1:] < host[:-1])[0, 0])
        raise ValueError(
            f"{name} must be non-decreasing; {name}[{bad + 1}]={int(host[bad + 1])} "
            f"< {name}[{bad}]={int(host[bad])}"
        )
    if total is not None and int(host[-1]) != total:
        raise ValueError(f"{name}[-1]={int(host[-1])} must equal {total}")


def check_ragged(
    keys: torch.Tensor,
    values: torch.Tensor,
    beta: torch.Tensor,
    indptr: torch.Tensor,
    num_kv_heads: int | None = None,
) -> None:
    """Validate a ragged KV set (see module legend); ValueError names the bad argument."""
    check_rows(keys, values, beta)
    if num_kv_heads is not None and (indptr.numel() - 1) % num_kv_heads != 0:
        raise ValueError(
            f"indptr has {indptr.numel() - 1} segments, not a multiple of H_kv={num_kv_heads}"
        )
    check_indptr(indptr, "indptr", None, keys.shape[0])


def check_rows(
    keys: torch.Tensor, values: torch.Tensor, beta: torch.Tensor, head_dim: int | None = None
) -> None:
    """Validate ragged rows ``keys/values [N, D]``, ``beta [N]`` fp32 (no indptr, no sync)."""
    if keys.dim() != 2 or (head_dim is not None and keys.shape[1] != head_dim):
        want = "[N, D]" if head_dim is None else f"[N, D={head_dim}]"
        raise ValueError(f"keys must be {want}, got shape {tuple(keys.shape)}")
    _check_kv_pair(keys, values, beta, ("keys", "values", "beta"), "[N]")


def check_pool(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    beta_cache: torch.Tensor,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
) -> None:
    """Validate a paged pool ``[S, H_kv, D]`` (against H_kv and D when given)."""
    if k_cache.dim() != 3:
        raise ValueError(f"k_cache must be [S, H_kv, D], got shape {tuple(k_cache.shape)}")
    heads = k_cache.shape[1] if num_kv_heads is None else num_kv_heads
    want = (heads, k_cache.shape[2] if head_dim is None else head_dim)
    if tuple(k_cache.shape[1:]) != want:
        raise ValueError(
            f"k_cache must be [S, H_kv, D] with (H_kv, D)={want}, got {tuple(k_cache.shape)}"
        )
    _check_kv_pair(k_cache, v_cache, beta_cache, ("k_cache", "v_cache", "beta_cache"), "[S, H_kv]")


def check_slot_table(kv_indptr: torch.Tensor, kv_indices: torch.Tensor) -> None:
    """Validate a per-request slot table: ``kv_indices [nnz]`` int32 and ``kv_indptr [B+1]``."""
    if kv_indices.dim() != 1 or kv_indices.dtype != torch.int32:
        raise ValueError(
            f"kv_indices must be 1-D int32, got {kv_indices.dtype} {tuple(kv_indices.shape)}"
        )
    check_indptr(kv_indptr, "kv_indptr", None, kv_indices.numel())


def check_queries(q: torch.Tensor, num_kv_heads: int, head_dim: int, name: str = "q") -> int:
    """Validate ``q [n, H_q, D]`` against H_kv and D; return the group size G."""
    if q.dim() != 3:
        raise ValueError(f"{name} must be [n, H_q, D], got shape {tuple(q.shape)}")
    if q.shape[2] != head_dim:
        raise ValueError(f"{name} head dim {q.shape[2]} must equal the KV head dim {head_dim}")
    if num_kv_heads <= 0 or q.shape[1] % num_kv_heads != 0:
        raise ValueError(f"H_q={q.shape[1]} must be a positive multiple of H_kv={num_kv_heads}")
    return q.shape[1] // num_kv_heads


def decode_qo_indptr(q: torch.Tensor) -> torch.Tensor:
    """``qo_indptr [B+1]`` int32 (host) of a decode batch ``q [B, H_q, D]``: one row each."""
    return torch.arange(q.shape[0] + 1, dtype=torch.int32)


def check_ragged_call(
    q: torch.Tensor, kv: RaggedKV, qo_indptr: torch.Tensor | None
) -> tuple[torch.Tensor, int]:
    """Validate a ragged extend call; return ``(qo_indptr [B+1], H_kv)``.

    ``qo_indptr`` None means one request owning all n query rows.
    """
    keys, values, beta, indptr = kv
    check_ragged(keys, values, beta, indptr)
    if qo_indptr is None:
        qo_indptr = torch.tensor([0, q.shape[0]], dtype=torch.int32)
    num_req = qo_indptr.numel() - 1
    if num_req <= 0 or (indptr.numel() - 1) % num_req:
        raise ValueError(f"indptr has {indptr.numel() - 1} segments, not a multiple of B={num_req}")
    check_indptr(qo_indptr, "qo_indptr", None, q.shape[0])
    num_kv_heads = (indptr.numel() - 1) // num_req
    check_queries(q, num_kv_heads, keys.shape[1])
    return qo_indptr, num_kv_heads


def check_paged_call(q: torch.Tensor, qo_indptr: torch.Tensor, kv: PagedKV) -> None:
    """Validate a paged extend call: the pool, its slot table (ids in ``[0, S)``),
    ``qo_indptr [B+1]`` and the queries (see module legend)."""
    k_cache, v_cache, beta_cache, kv_indptr, kv_indices = kv
    check_pool(k_cache, v_cache, beta_cache)
    check_slot_table(kv_indptr, kv_indices)
    if kv_indices.numel():
        lo, hi = int(kv_indices.min()), int(kv_indices.max())
        if lo < 0 or hi >= k_cache.shape[0]:
            raise ValueError(f"kv_indices must lie in [0, S={k_cache.shape[0]}), got [{lo}, {hi}]")
    check_indptr(qo_indptr, "qo_indptr", kv_indptr.numel(), q.shape[0])
    check_queries(q, k_cache.shape[1], k_cache.shape[2])


def ragged_pool(
    keys: torch.Tensor, values: torch.Tensor, beta: torch.Tensor, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """View ragged ``keys/values [N, D]``, ``beta [N]`` as a pool ``[N, H_kv, D]``, ``[N, H_kv]``.

    Zero-copy: every KV head aliases the same rows (head stride 0), so segment
    ``b*H_kv + h`` of the ragged indptr, read through head h, is that segment's rows. This is
    how the ragged layout is the paged one with an identity slot table.
    """
    return (
        keys.unsqueeze(1).expand(-1, num_kv_heads, -1),
        values.unsqueeze(1).expand(-1, num_kv_heads, -1),
        beta.unsqueeze(1).expand(-1, num_kv_heads),
    )


def ragged_to_paged(
    keys: torch.Tensor,
    values: torch.Tensor,
    beta: torch.Tensor,
    indptr: torch.Tensor,
    num_kv_heads: int,
) -> PagedKV:
    """Pad a batched ragged KV set into the paged layout (a new pool; inputs unchanged).

    Request b gets L_b = max_h t_{b,h} consecutive slots; row j of head h holds that head's
    j-th entry, and slots past a head's count get zeros with beta = -inf (masked).

    Returns the :class:`PagedKV` ``(k_cache [S, H_kv, D], v_cache, beta_cache [S, H_kv],
    kv_indptr [B+1], kv_indices [S])`` with S = sum_b L_b, all on ``keys.device``.
    """
    check_ragged(keys, values, beta, indptr, num_kv_heads)
    host = indptr.cpu().long()
    counts = (host[1:] - host[:-1]).view(-1, num_kv_heads)  # [B, H_kv]
    lengths = counts.max(dim=1).values if counts.numel() else torch.zeros(0, dtype=torch.long)
    num_slots = int(lengths.sum())
    dev, head_dim = keys.device, keys.shape[1]
    k_cache = keys.new_zeros(num_slots, num_kv_heads, head_dim)
    v_cache = values.new_zeros(num_slots, num_kv_heads, head_dim)
    beta_cache = torch.full((num_slots, num_kv_heads), -math.inf, dtype=torch.float32, device=dev)
    kv_indptr = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(lengths, 0).to(torch.int32)
    base = 0
    for b in range(counts.shape[0]):
        for h in range(num_kv_heads):
            s, c = int(host[b * num_kv_heads + h]), int(counts[b, h])
            k_cache[base : base + c, h] = keys[s : s + c]
            v_cache[base : base + c, h] = values[s : s + c]
            beta_cache[base : base + c, h] = beta[s : s + c]
        base += int(lengths[b])
    kv_indices = torch.arange(num_slots, dtype=torch.int32, device=dev)
    return PagedKV(k_cache, v_cache, beta_cache, kv_indptr.to(dev), kv_indices)


def check_triton_device(*tensors: torch.Tensor) -> None:
    """Triton needs CUDA tensors, or CPU tensors with ``TRITON_INTERPRET=1`` set before
    triton was first imported; RuntimeError otherwise. All tensors must share a device."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    device = next(iter(devices))
    if device.type == "cuda":
        return
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return
    raise RuntimeError(
        f"Triton kernels need CUDA tensors; got {device}. To run on CPU set "
        "TRITON_INTERPRET=1 before triton is first imported (slow but exact)."
    )


def _check_kv_pair(
    k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, names: tuple[str, str, str], rows: str
) -> None:
    """``v`` must match ``k`` in shape and dtype, ``beta`` be fp32 of k's row shape."""
    kn, vn, bn = names
    if v.shape != k.shape:
        raise ValueError(f"{vn} shape {tuple(v.shape)} must equal {kn} shape {tuple(k.shape)}")
    if v.dtype != k.dtype:
        raise ValueError(f"{vn} dtype {v.dtype} must equal {kn} dtype {k.dtype}")
    if beta.shape != k.shape[:-1]:
        raise ValueError(f"{bn} must be {rows}={list(k.shape[:-1])}, got shape {tuple(beta.shape)}")
    if beta.dtype != torch.float32:
        raise ValueError(f"{bn} must be float32, got {beta.dtype}")

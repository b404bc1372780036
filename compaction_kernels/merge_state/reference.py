"""Torch reference for ``merge_state``: combine two partial attention results.

Shape legend: n query tokens, H heads (H_q), D head dim.
    v_a, v_b  [n, H, D]   partial outputs (each normalised over its own KV subset)
    s_a, s_b  [n, H]      fp32 natural-log LSE of each subset's logits (-inf: empty subset)

Result: ``v = v_a * exp(s_a - s) + v_b * exp(s_b - s)`` with ``s = logaddexp(s_a, s_b)``,
i.e. attention over the union of the two KV subsets. When both sides are -inf the result
is v = 0, s = -inf (never NaN). Mutates nothing.
"""

from __future__ import annotations

import math

import torch

from compaction_kernels.biased_attention._common import AttentionOutput

__all__ = ["check_states", "merge_state"]


def check_states(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> None:
    """ValueError unless ``v_a, v_b [n, H, D]`` match and ``s_a, s_b [n, H]`` are fp32."""
    if v_a.dim() != 3:
        raise ValueError(f"v_a must be [n, H, D], got shape {tuple(v_a.shape)}")
    if v_b.shape != v_a.shape:
        raise ValueError(f"v_b shape {tuple(v_b.shape)} must equal v_a {tuple(v_a.shape)}")
    for name, s in (("s_a", s_a), ("s_b", s_b)):
        if s.shape != v_a.shape[:2]:
            raise ValueError(f"{name} must be [n, H]={tuple(v_a.shape[:2])}, got {tuple(s.shape)}")
        if s.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {s.dtype}")


def merge_state(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> AttentionOutput:
    """Merge two partial states; returns ``out [n, H, D]`` fp32 and ``lse [n, H]`` fp32."""
    check_states(v_a, s_a, v_b, s_b)
    s_max = torch.maximum(s_a, s_b)
    finite = torch.isfinite(s_max)
    ref = torch.where(finite, s_max, 0.0)
    w_a = torch.exp(s_a - ref)  # exp(-inf) = 0 for an empty side
    w_b = torch.exp(s_b - ref)
    total = w_a + w_b
    safe = torch.where(finite, total, 1.0)
    out = (v_a.float() * w_a[..., None] + v_b.float() * w_b[..., None]) / safe[..., None]
    out = torch.where(finite[..., None], out, 0.0)
    lse = torch.where(finite, ref + torch.log(safe), -math.inf)
    return AttentionOutput(out, lse)

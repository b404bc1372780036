"""Uniform budgets: the same kept count t for every KV head (what the curves are measured at,
and what every budget plan starts from)."""

from __future__ import annotations

import math

__all__ = ["head_budgets"]


def head_budgets(
    T: int, H_kv: int, ratio: float | None = None, tokens: int | None = None
) -> list[int]:
    """Uniform budget t per KV head: round(ratio * T), or ``tokens`` capped at T; >= 1.

    Exactly one of ratio (in (0, 1]) / tokens (>= 1) must be given; ValueError otherwise.
    """
    if isinstance(T, bool) or not isinstance(T, int) or T < 1:
        raise ValueError(f"T must be an int >= 1, got {T!r}")
    if isinstance(H_kv, bool) or not isinstance(H_kv, int) or H_kv < 1:
        raise ValueError(f"H_kv must be an int >= 1, got {H_kv!r}")
    if (ratio is None) == (tokens is None):
        raise ValueError("give exactly one of ratio= or tokens=")
    if ratio is not None:
        if not (isinstance(ratio, int | float) and math.isfinite(ratio) and 0 < ratio <= 1):
            raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")
        t = max(1, min(T, round(ratio * T)))
    else:
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"tokens must be an int >= 1, got {tokens!r}")
        t = min(T, tokens)
    return [t] * H_kv

"""Per-head budgets that differ: non-uniform from sensitivity curves (uniform: `.uniform`).

Shape legend: T prefix tokens, t kept, H_kv KV heads, L layers, F kept fractions of a
sensitivity curve (`compactor.head_budgets.curves`).

Non-uniform allocation (Attention Matching, sec. on head budgets): measure, per (layer,
head), the compaction error as a function of the kept fraction, then start from the
uniform split and greedily move budget from the head whose error grows least to the
head whose error shrinks most, keeping the total fixed, while that lowers the summed
error.
"""

from __future__ import annotations

import math

from compactor.head_budgets.curves import SensitivityCurves

__all__ = ["allocate"]


def allocate(
    curves: SensitivityCurves,
    total_budget: int,
    T: int,
    *,
    min_tokens: int = 1,
    max_tokens: int | None = None,
    step: int | None = None,
    per_layer: bool = False,
    max_swaps: int = 100_000,
) -> list[list[int]]:
    """Greedy-swap non-uniform budgets with a fixed total.

    Args:
        curves: errors [L][H_kv][F] at fractions [F]; interpolated linearly in the kept
            fraction, with the implicit end points (0, max(1, err at f_1)) (nothing kept:
            output lost) and (1, 0) (everything kept: exact).
        total_budget: kept entries summed over all L * H_kv heads.
        T: prefix length. min_tokens / max_tokens: per-head bounds (max default T).
        step: tokens moved per swap (default max(1, T // 100)).
        per_layer: keep each layer's total fixed (swap only within a layer).

    Returns:
        budgets [L][H_kv] ints with the exact requested total.
    """
    L, H, _ = curves.shape
    hi_tok = T if max_tokens is None else min(T, max_tokens)
    if T < 1 or min_tokens < 1 or hi_tok < min_tokens:
        raise ValueError(f"bad bounds: T={T}, min_tokens={min_tokens}, max_tokens={max_tokens}")
    if not L * H * min_tokens <= total_budget <= L * H * hi_tok:
        raise ValueError(
            f"total_budget {total_budget} outside [{L * H * min_tokens}, {L * H * hi_tok}] "
            f"for {L}x{H} heads"
        )
    if per_layer and total_budget % L:
        raise ValueError("per_layer allocation needs total_budget divisible by the layer count")
    stride = max(1, T // 100) if step is None else step
    if stride < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    b = _uniform_split(total_budget, L, H, per_layer)
    b = [min(max(x, min_tokens), hi_tok) for x in b]
    # uniform split may need a fix-up after clamping (only when bounds bite)
    _rebalance(b, total_budget, min_tokens, hi_tok)
    xs = [0.0, *curves.fractions] + ([1.0] if curves.fractions[-1] < 1 else [])
    flat = [row for layer in curves.errors for row in layer]
    tables = []
    for row in flat:
        ys = [max(1.0, row[0]), *row] + ([0.0] if curves.fractions[-1] < 1 else [])
        tables.append((xs, ys))

    def err(i: int, tokens: int) -> float:
        return _interp(tokens / T, *tables[i])

    groups = (
        [list(range(li * H, (li + 1) * H)) for li in range(L)]
        if per_layer
        else [list(range(L * H))]
    )
    for group in groups:
        for _ in range(max_swaps):
            best_gain, r = -math.inf, -1
            best_loss, d = math.inf, -1
            for i in group:
                if b[i] < hi_tok:
                    up = min(stride, hi_tok - b[i])
                    g = (err(i, b[i]) - err(i, b[i] + up)) / up
                    if g > best_gain:
                        best_gain, r = g, i
                if b[i] > min_tokens:
                    dn = min(stride, b[i] - min_tokens)
                    lo = (err(i, b[i] - dn) - err(i, b[i])) / dn
                    if lo < best_loss:
                        best_loss, d = lo, i
            if r < 0 or d < 0 or r == d or best_gain <= best_loss + 1e-12:
                break
            amount = min(stride, hi_tok - b[r], b[d] - min_tokens)
            before = err(r, b[r]) + err(d, b[d])
            after = err(r, b[r] + amount) + err(d, b[d] - amount)
            if after >= before - 1e-12:
                break
            b[r] += amount
            b[d] -= amount
    return [b[li * H : (li + 1) * H] for li in range(L)]


def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    if x <= xs[0]:
        return ys[0]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            a = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            return ys[i - 1] + a * (ys[i] - ys[i - 1])
    return ys[-1]


def _uniform_split(total: int, L: int, H: int, per_layer: bool) -> list[int]:
    if per_layer:
        per = total // L
        return [per // H + (1 if h < per % H else 0) for _ in range(L) for h in range(H)]
    n = L * H
    return [total // n + (1 if i < total % n else 0) for i in range(n)]


def _rebalance(b: list[int], total: int, lo: int, hi: int) -> None:
    """Mutates b so sum(b) == total within [lo, hi] per entry (feasibility checked)."""
    i = 0
    while sum(b) != total:
        diff = total - sum(b)
        j = i % len(b)
        if diff > 0 and b[j] < hi:
            b[j] += 1
        elif diff < 0 and b[j] > lo:
            b[j] -= 1
        i += 1

"""Paired scoring of a compacted cache against the full cache on the same items.

An item is one scored question; `stock` and `ours` say whether each answered it correctly.

- accuracy: the fraction correct, stock's and ours;
- retention: P(ours correct | stock correct), the share of stock's right answers kept;
- McNemar counts: b = stock right and ours wrong, c = stock wrong and ours right, with the
  exact two-sided binomial p-value of b against c;
- 95% intervals by a seeded bootstrap over items (percentile method);
- two methods on the same items: the difference of their retentions, with an interval from
  resampling the items with both outcomes together (paired), narrower than the two
  retentions' own intervals suggest when the methods agree on most items.

Per-token measures (teacher-forced top-1 agreement, the log-prob gap on stock's answers) are
means over items with their own bootstrap intervals: they do not compound like exact greedy
agreement over many tokens does.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

__all__ = ["bootstrap_interval", "mcnemar_p", "paired_summary", "retention_difference"]

BOOTSTRAP_SAMPLES = 2000
_T = TypeVar("_T")


def _mean(xs: Sequence[Any]) -> float:
    return sum(xs) / len(xs)


def mcnemar_p(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value: b and c discordant pairs, binomial(b + c, 1/2)."""
    if b < 0 or c < 0:
        raise ValueError(f"discordant counts must be >= 0, got {b}, {c}")
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2**n
    return min(1.0, 2 * tail)


def bootstrap_interval(
    values: Sequence[_T],
    stat: Callable[[list[_T]], float | None] = _mean,
    seed: int = 0,
    samples: int = BOOTSTRAP_SAMPLES,
) -> tuple[float, float] | None:
    """95% percentile interval of `stat` (default: the mean) over resamples of `values`;
    None when there are none. `stat` gets a list and may return None (a resample it cannot
    score), which is skipped."""
    if not values:
        return None
    rng = random.Random(seed)
    n = len(values)
    got = []
    for _ in range(samples):
        s = stat([values[rng.randrange(n)] for _ in range(n)])
        if s is not None:
            got.append(float(s))
    if not got:
        return None
    got.sort()
    return got[int(0.025 * (len(got) - 1))], got[math.ceil(0.975 * (len(got) - 1))]


def _retention(pairs: Sequence[tuple[bool, bool]]) -> float | None:
    kept = [o for s, o in pairs if s]
    return sum(kept) / len(kept) if kept else None


def _retention_gap(triples: Sequence[tuple[bool, bool, bool]]) -> float | None:
    kept = [(a, b) for s, a, b in triples if s]
    return sum(a - b for a, b in kept) / len(kept) if kept else None


def retention_difference(
    stock: Sequence[bool], a: Sequence[bool], b: Sequence[bool], seed: int = 0
) -> tuple[float | None, tuple[float, float] | None]:
    """Retention of `a` minus retention of `b` on the same items, and its 95% interval from
    a bootstrap that resamples items (stock's, a's and b's outcome together).

    Raises:
        ValueError: the three lists of different lengths.
    """
    if not len(stock) == len(a) == len(b):
        raise ValueError(f"retention_difference: {len(stock)} stock items, {len(a)} and {len(b)}")
    triples = [(bool(s), bool(x), bool(y)) for s, x, y in zip(stock, a, b, strict=True)]
    return _retention_gap(triples), bootstrap_interval(triples, _retention_gap, seed=seed)


def paired_summary(
    stock: Sequence[bool],
    ours: Sequence[bool],
    token_agreement: Sequence[float] = (),
    logprob_gap: Sequence[float] = (),
    seed: int = 0,
) -> dict[str, Any]:
    """Accuracy, retention, McNemar and per-token means, each with a 95% interval.

    Raises:
        ValueError: `stock` and `ours` (or a per-token list given) of different lengths.
    """
    n = len(stock)
    if len(ours) != n or any(len(x) not in (0, n) for x in (token_agreement, logprob_gap)):
        raise ValueError(
            f"paired_summary: {n} stock items, {len(ours)} ours, "
            f"{len(token_agreement)} agreements, {len(logprob_gap)} gaps"
        )
    pairs = [(bool(s), bool(o)) for s, o in zip(stock, ours, strict=True)]
    b = sum(s and not o for s, o in pairs)
    c = sum(o and not s for s, o in pairs)
    out: dict[str, Any] = {
        "items": n,
        "stock_accuracy": sum(stock) / n if n else None,
        "accuracy": sum(ours) / n if n else None,
        "accuracy_ci": bootstrap_interval([float(o) for o in ours], seed=seed),
        "retention": _retention(pairs),
        "retention_ci": bootstrap_interval(pairs, _retention, seed=seed),
        "mcnemar": {"both": sum(s and o for s, o in pairs), "stock_only": b, "ours_only": c,
                    "neither": sum(not s and not o for s, o in pairs), "p": mcnemar_p(b, c)},
    }  # fmt: skip
    for key, vals in (("token_agreement", token_agreement), ("logprob_gap", logprob_gap)):
        if vals:
            out[key] = sum(vals) / len(vals)
            out[key + "_ci"] = bootstrap_interval(list(vals), seed=seed)
    return out

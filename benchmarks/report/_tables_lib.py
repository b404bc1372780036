"""The renderer registry of benchmarks/report/readme_tables.py and the cell formats its renderers share.

A renderer takes the parsed result files its `@table` names (in that order) and returns the
table's header row then its body rows, every cell a string.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

RESULTS = "benchmarks/results"

Renderer = Callable[[list[dict[str, Any]]], list[list[str]]]
TABLES: dict[str, tuple[tuple[str, ...], Renderer]] = {}


def table(name: str, *files: str) -> Callable[[Renderer], Renderer]:
    """Register a renderer: its result files (under benchmarks/results) -> header + rows."""

    def deco(fn: Renderer) -> Renderer:
        TABLES[name] = (tuple(f"{RESULTS}/{f}" for f in files), fn)
        return fn

    return deco


def num(v: float, digits: int = 3) -> str:
    """`digits` decimals; a bare "0" for zero."""
    return "0" if v == 0 else f"{v:.{digits}f}"


def short(v: float) -> str:
    """.297 below 1, 1.06 above (the all-methods table's compact style)."""
    return f"{v:.3f}"[1:] if abs(v) < 1 else f"{v:.2f}"


def sig(v: float) -> str:
    """Three decimals below 1, two below 10, one above."""
    return f"{v:.3f}" if v < 1 else f"{v:.2f}" if v < 10 else f"{v:.1f}"


def frac(p: float, n: int) -> str:
    """A share `p` of `n` as "k/n"."""
    return f"{round(p * n)}/{n}"


def rec(records: list[dict[str, Any]], **match: Any) -> dict[str, Any]:
    """The first record whose fields equal `match`.

    Raises:
        KeyError: no record matches.
    """
    for r in records:
        if all(r.get(k) == v for k, v in match.items()):
            return r
    raise KeyError(f"no record with {match}")


def held(r: dict[str, Any], base: int) -> list[str]:
    """A server run's config, the KV slots it held, and how many times fewer than `base`."""
    return [r["config"], str(r["kv_slots_held"]), f"{base / r['kv_slots_held']:.1f}x"]


def seen_unseen(r: dict[str, Any], key: str) -> str:
    """`key` on the fitted and on the unseen questions, as "0.88 / 0.75"."""
    return f"{r[key + '_seen']:.2f} / {r[key + '_unseen']:.2f}"

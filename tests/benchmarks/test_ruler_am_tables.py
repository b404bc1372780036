"""The Attention Matching tables of the RULER-style suite: a method against kvzip on the same
items, paired."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.report._tables_ruler_am import paired_to


def _items(scores: dict[str, list[float]], stock: list[float]) -> list[dict[str, Any]]:
    return [
        {"task": "niah_single", "haystack": "filler", "tokens": 2000, "seed": 1000 + i,
         "stock_score": s, "setting": "agnostic", "method": method, "ratio": 0.1,
         "score": score, "token_agreement": 0.9, "logprob_gap": 0.1, "output_err": 0.2}
        for method, got in scores.items() for i, (s, score) in enumerate(zip(stock, got))
    ]  # fmt: skip


def test_paired_difference_and_the_items_each_keeps_alone() -> None:
    stock = [1.0, 1.0, 1.0, 1.0, 0.0]
    items = _items({"kvzip": [1.0, 1.0, 0.0, 0.0, 0.0], "x": [1.0, 1.0, 1.0, 1.0, 1.0]}, stock)
    cell = paired_to({"items": items}, "x", 0.1)
    # 4 of stock's 4 against 2 of 4; x is also right on the item stock gets wrong
    assert cell.startswith("+0.50 [") and cell.endswith("(3 / 0)")


def test_methods_on_different_items_are_refused() -> None:
    items = _items({"kvzip": [1.0, 1.0], "x": [1.0, 0.0]}, [1.0, 1.0])
    items = [r for r in items if not (r["method"] == "x" and r["seed"] == 1001)]
    with pytest.raises(ValueError, match="different items"):
        paired_to({"items": items}, "x", 0.1)

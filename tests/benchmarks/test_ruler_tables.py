"""The head-to-head tables of the RULER-style suite (`ruler_10x`, `ruler_20x`): our kvzip and
kvpress's KVzip at 10x / 20x on the same items, each with the items it answers right where the
other fails."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.offline.ruler_results import summarize
from benchmarks.report._tables_ruler import _ruler_10x, _ruler_20x


def _items(scores: dict[str, list[float]], stock: list[float], ratio: float = 0.1) -> list[Any]:
    return [
        {"task": "niah_single", "haystack": "filler", "tokens": 2000, "seed": 1000 + i,
         "stock_score": s, "setting": "agnostic", "method": method, "ratio": ratio,
         "score": score, "token_agreement": None if ":" in method else 0.9,
         "logprob_gap": None if ":" in method else 0.1, "seconds": 1.0}
        for method, got in scores.items() for i, (s, score) in enumerate(zip(stock, got))
    ]  # fmt: skip


def _file(scores: dict[str, list[float]], stock: list[float]) -> dict[str, Any]:
    items = _items(scores, stock)
    return {"summary": summarize(items), "items": items}


def test_each_method_counts_what_it_keeps_that_the_other_loses() -> None:
    stock = [1.0, 1.0, 1.0, 1.0, 0.0]
    ours = [1.0, 1.0, 1.0, 0.0, 0.0]
    theirs = [1.0, 0.0, 0.0, 1.0, 0.0]
    rows = _ruler_10x([_file({"kvzip": ours, "kvpress:kvzip": theirs}, stock)])
    assert rows[1][:3] == ["stock", "5", "accuracy 0.80"]
    assert rows[2][0] == "our kvzip" and rows[2][2].startswith("0.75 [")
    assert rows[2][3] == "0.90" and rows[3][3] == "-"  # kvpress's runs generate only
    assert rows[2][4] == "2 (McNemar p 1.00)" and rows[3][4] == "1"
    assert rows[2][5].startswith("+0.25 [") and rows[3][5] == "-"  # (3 - 2) of stock's 4


def test_methods_on_different_items_are_refused() -> None:
    data = _file({"kvzip": [1.0, 1.0], "kvpress:kvzip": [1.0, 0.0]}, [1.0, 1.0])
    data["items"] = [r for r in data["items"] if not (r["method"] == "kvzip" and r["seed"] == 1001)]
    with pytest.raises(ValueError, match="ruler_10x: 1 and 2 items differ"):
        _ruler_10x([data])


def test_the_20x_table_reads_the_20x_items() -> None:
    stock = [1.0, 1.0, 1.0, 0.0]
    items = _items({"kvzip": [1.0, 1.0, 1.0, 0.0], "kvpress:kvzip": [1.0, 1.0, 1.0, 0.0]}, stock)
    items += _items({"kvzip": [1.0, 1.0, 0.0, 0.0], "kvpress:kvzip": [1.0, 0.0, 0.0, 0.0]}, stock,
                    ratio=0.05)  # fmt: skip
    data = {"summary": summarize(items), "items": items}
    assert _ruler_10x([data])[2][4] == "0 (McNemar p 1.00)"
    rows = _ruler_20x([data])
    assert rows[2][2].startswith("0.67 [") and rows[3][2].startswith("0.33 [")
    assert rows[2][4] == "1 (McNemar p 1.00)" and rows[3][4] == "0"


def test_the_repeat_table_pairs_the_two_sources_of_each_split() -> None:
    from benchmarks.report._tables_ruler import _ruler_repeat

    stock = [1.0, 1.0, 1.0, 0.0]
    dev_a, dev_b = (
        _file({"kvzip": [1.0, 0.0, 0.0, 0.0]}, stock),
        _file({"kvzip": [1.0, 1.0, 0.0, 0.0]}, stock),
    )
    held = [_items({"kvzip": got}, stock) + _items({"kvzip": got20}, stock, ratio=0.05)
            for got, got20 in (([1.0] * 3 + [0.0], [1.0, 0.0, 0.0, 0.0]),
                               ([1.0] * 3 + [0.0], [0.0, 1.0, 1.0, 0.0]))]  # fmt: skip
    files = [dev_a, dev_b, *({"summary": summarize(h), "items": h} for h in held)]
    rows = _ruler_repeat(files)
    assert rows[1][:2] == ["dev", "repeat-prefill"] and rows[1][3] == "-"  # dev ran 10x only
    assert rows[1][2].startswith("0.33 [") and rows[1][2].endswith("(4 items)")
    assert rows[1][4] == "0 / -" and rows[2][4] == "1 / -"
    assert rows[3][4] == "0 / 1" and rows[4][4] == "0 / 2"
    held[1] = [r for r in held[1] if r["seed"] != 1003 or r["ratio"] != 0.05]
    files[3] = {"summary": summarize(held[1]), "items": held[1]}
    with pytest.raises(ValueError, match="held-out repeat-prefill at 20x: 4 items, the other"):
        _ruler_repeat(files)

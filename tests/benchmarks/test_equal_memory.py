"""The arithmetic of `benchmarks/server/equal_memory.py` (its servers run in the benchmark only)."""

from __future__ import annotations

import math

import pytest

from benchmarks.server.equal_memory import RATIO_RANGE, _args, logppl_gap, matched_ratio, summarize


def test_the_matched_ratio_keeps_gvotes_entries() -> None:
    # 90 heads of a 400-token prefix keeping 7200 entries: 20% per head
    ratio, clamped = matched_ratio(7200, 90, 400)
    assert math.isclose(ratio, 0.2) and not clamped
    assert matched_ratio(1, 90, 400) == (RATIO_RANGE[0], True)
    assert matched_ratio(90 * 400, 90, 400) == (RATIO_RANGE[1], True)
    with pytest.raises(ValueError, match="positive sizes"):
        matched_ratio(100, 0, 400)


def test_the_gap_is_per_token_over_every_question() -> None:
    stock = [[-0.1, -0.2], [-0.5]]
    other = [[-0.4, -0.2], [-1.1]]
    assert math.isclose(logppl_gap(stock, other), (0.3 + 0.0 + 0.6) / 3)
    assert logppl_gap(stock, stock) == 0.0
    with pytest.raises(ValueError, match="answers of 2 and 1 tokens"):
        logppl_gap([[-0.1, -0.2]], [[-0.1]])


def test_summary_averages_documents_per_config_and_kind() -> None:
    rows = [
        {"config": "uniform", "kind": "needle", "unseen_agree": 0.5, "unseen_logppl_gap": 0.2,
         "physical_slots": 40, "kept_entries": 3600, "physical_vs_gvote": 1.0, "ratio": 0.1},
        {"config": "uniform", "kind": "needle", "unseen_agree": 1.0, "unseen_logppl_gap": 0.4,
         "physical_slots": 44, "kept_entries": 3960, "physical_vs_gvote": 1.1, "ratio": 0.1},
        {"config": "stock", "kind": "needle", "unseen_agree": None, "unseen_logppl_gap": 0.0},
    ]  # fmt: skip
    by = {s["config"]: s for s in summarize(rows)}
    assert by["uniform"]["docs"] == 2 and math.isclose(by["uniform"]["unseen_agree"], 0.75)
    assert math.isclose(by["uniform"]["unseen_logppl_gap"], 0.3)
    assert by["uniform"]["physical_slots"] == 42
    assert by["stock"]["unseen_agree"] is None and by["stock"]["physical_slots"] is None


def test_gvote_runs_first_and_sets_the_memory() -> None:
    assert _args([]).configs.split(",")[0] == "gvote"
    with pytest.raises(SystemExit):
        _args(["--configs", "uniform,gvote"])

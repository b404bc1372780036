"""benchmarks/offline/compaction_speed.py times a method's `compact` in stages through a copy
of `SelectingMethod.compact` (pick, then the AM refit): the copy does the same work, refit
options included (its halves, keys held verbatim), and times the stages it runs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from benchmarks.offline.compaction_speed import StageClock, timed_method
from compactor.methods import get_method


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("am-highest", {}),
        ("kvzip", {}),
        ("kvzip", {"refit": "am"}),
        ("kvzip", {"refit": "beta"}),
        ("kvzip", {"refit": "am", "refit_verbatim": 0.2}),
    ],
)
def test_the_timed_copy_compacts_as_the_method_does(name: str, params: dict[str, Any]) -> None:
    g = torch.Generator().manual_seed(0)
    H, T, n, D = 2, 40, 24, 16
    k, v, q = (torch.randn(s, generator=g) for s in ((H, T, D), (H, T, D), (H, n, D)))
    k[1, 17] = 6 * q[1, 4] / q[1, 4].norm()  # query 4 of head 1 reads key 17 sharply
    budgets = [6, 9]
    clock = StageClock()
    want = get_method(name, **params).compact_layer(k, v, q, budgets)
    got = timed_method(name, clock, **params).compact_layer(k, v, q, budgets)
    for field in ("keys", "values", "beta", "indptr", "kept_indices"):
        torch.testing.assert_close(getattr(got, field), getattr(want, field), msg=field)
    refits = "refit" in params or name.startswith("am-")
    assert set(clock.wall) == (
        {"selection", "beta", "values"} if refits else {"selection", "values"}
    )

"""The plugin checks that a result is the one it asked for (method and budget echo) and
bounds its stream by the spec's budget, not by every head keeping all T tokens."""

from __future__ import annotations

import dataclasses

import pytest

from compactor.spec import CompactionSpec
from sglang_ext.pool_shape import PoolShape, echo_check
from tests._results import make_prefix


def test_result_budget_follows_the_spec() -> None:
    assert CompactionSpec(method="am-highest", ratio=0.1).result_budget(1000) == 100
    assert CompactionSpec(method="am-highest", tokens=7).result_budget(1000) == 7
    assert CompactionSpec(method="am-highest").result_budget(1000) is None  # auto: the service
    assert CompactionSpec(method="gvote", ratio=0.1).result_budget(1000) is None  # its own


def test_echo_check_names_a_wrong_method_or_budget() -> None:
    prefix = make_prefix([[3, 3], [3, 3]])  # 2 layers x 2 heads, 12 entries
    T = 16
    echo_check(prefix, prefix.method, T, budget=2)  # 12 <= 2 * 2 * min(16, 4)
    with pytest.raises(ValueError, match=r"result of method 'other', asked for"):
        echo_check(dataclasses.replace(prefix, method="other"), prefix.method, T, budget=2)
    with pytest.raises(ValueError, match=r"result keeps 12 entries, over 8 for budget 1 of T=16"):
        echo_check(prefix, prefix.method, T, budget=1)
    echo_check(prefix, prefix.method, T, budget=None)  # own budget: bounded by T


def test_the_stream_limit_uses_the_budget() -> None:
    import torch

    shape = PoolShape(30, 3, 64, torch.bfloat16)
    full, budgeted = shape.max_result_bytes(4096), shape.max_result_bytes(4096, 410)
    assert budgeted < full / 4  # ~5x smaller at ratio 0.1 (2t of T)

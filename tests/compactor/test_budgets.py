"""Uniform and non-uniform (greedy-swap) budgets, sensitivity curves and their JSON."""

from __future__ import annotations

import pytest
import torch

from compactor.head_budgets.allocate import allocate
from compactor.head_budgets.curves import (
    SensitivityCurves,
    load_sensitivity_json,
    save_sensitivity_json,
    sensitivity_curve,
    sensitivity_path,
)
from compactor.head_budgets.uniform import head_budgets
from compactor.methods import get_method


def test_head_budgets():
    assert head_budgets(1024, 3, ratio=0.1) == [102, 102, 102]
    assert head_budgets(10, 2, ratio=0.01) == [1, 1]  # at least 1
    assert head_budgets(10, 2, tokens=50) == [10, 10]  # capped at T
    assert head_budgets(100, 1, tokens=7) == [7]


@pytest.mark.parametrize(
    "kw",
    [
        dict(T=0, H_kv=1, ratio=0.1),
        dict(T=10, H_kv=0, ratio=0.1),
        dict(T=10, H_kv=1),
        dict(T=10, H_kv=1, ratio=0.1, tokens=3),
        dict(T=10, H_kv=1, ratio=0.0),
        dict(T=10, H_kv=1, ratio=1.5),
        dict(T=10, H_kv=1, tokens=0),
        dict(T=10, H_kv=1, tokens=2.5),
    ],
)
def test_head_budgets_errors(kw):
    with pytest.raises(ValueError):
        head_budgets(**kw)


def curves_two_kinds() -> SensitivityCurves:
    fr = [0.05, 0.1, 0.2, 0.5]
    sensitive = [0.9, 0.6, 0.3, 0.1]
    flat = [0.02, 0.015, 0.01, 0.005]
    return SensitivityCurves(fr, [[sensitive, flat], [flat, flat]], method="am-omp")


def test_allocate_moves_budget_to_sensitive_heads_and_keeps_total():
    c = curves_two_kinds()
    total = 4 * 100
    b = allocate(c, total, T=1000, min_tokens=5)
    assert sum(map(sum, b)) == total
    assert min(min(r) for r in b) >= 5
    assert b[0][0] > 100 and all(x < 100 for x in (b[0][1], b[1][0], b[1][1]))

    def total_err(bs):
        from compactor.head_budgets.allocate import _interp

        xs = [0.0, *c.fractions, 1.0]
        out = 0.0
        for li, layer in enumerate(bs):
            for h, t in enumerate(layer):
                row = c.errors[li][h]
                out += _interp(t / 1000, xs, [max(1.0, row[0]), *row, 0.0])
        return out

    assert total_err(b) < total_err([[100, 100], [100, 100]])


def test_allocate_per_layer_keeps_layer_totals():
    b = allocate(curves_two_kinds(), 400, T=1000, per_layer=True)
    assert [sum(r) for r in b] == [200, 200]
    assert b[0][0] > b[0][1]


def test_allocate_errors():
    c = curves_two_kinds()
    with pytest.raises(ValueError, match="total_budget"):
        allocate(c, 3, T=1000)  # below 4 heads * min 1
    with pytest.raises(ValueError, match="total_budget"):
        allocate(c, 5000, T=1000)
    with pytest.raises(ValueError, match="divisible"):
        allocate(c, 401, T=1000, per_layer=True)


def test_curves_validation_and_json_round_trip(tmp_path):
    c = curves_two_kinds()
    path = sensitivity_path(tmp_path, "am-omp")
    assert path.name == "sensitivity.am-omp.json"
    save_sensitivity_json(path, c)
    assert load_sensitivity_json(path) == c
    path.write_text("{}")
    with pytest.raises(ValueError, match="sensitivity"):
        load_sensitivity_json(path)
    with pytest.raises(ValueError, match="increasing"):
        SensitivityCurves([0.5, 0.1], [[[1.0, 2.0]]])
    with pytest.raises(ValueError, match="errors"):
        SensitivityCurves([0.1, 0.5], [[[1.0]]])


def test_sensitivity_curve_decreases_with_kept_fraction():
    g = torch.Generator().manual_seed(0)
    H, T, D = 2, 96, 16
    keys, values = torch.randn(H, T, D, generator=g) * 1.5, torch.randn(H, T, D, generator=g)
    q = torch.randn(H, 128, D, generator=g) * 1.5
    err = sensitivity_curve(keys, values, q, [0.05, 0.25, 1.0], get_method("am-highest"))
    assert err.shape == (H, 3)
    assert (err[:, 0] > err[:, 1]).all() and (err[:, 2] < 1e-2).all()

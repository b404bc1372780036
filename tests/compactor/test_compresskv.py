"""CompressKV: SRH scoring finds a planted retrieval head; layer budgets; shared selection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from compactor.eval.compresskv_calibration import answer_span_mass, layer_budget_error
from compactor.methods import LayerInput, get_method
from compactor.methods.compresskv import cached_calibration, layer_budgets, load_calibration

D = 16


def test_answer_span_mass_finds_planted_retrieval_head() -> None:
    g = torch.Generator().manual_seed(0)
    P, HQ, HKV = 50, 6, 2
    keys = torch.randn(HKV, P, D, generator=g)
    span = (20, 24)
    pos = torch.tensor([44, 45, 46])
    q = torch.randn(HQ, 3, D, generator=g) * 0.3
    u = torch.randn(D, generator=g)
    keys[1, span[0] : span[1]] = u + 0.1 * keys[1, span[0] : span[1]]
    q[4] = u  # query head 4 (KV head 1) retrieves the span
    mass = answer_span_mass(q, pos, keys, span, D**-0.5)
    score = mass.mean(-1)
    assert int(score.argmax()) == 4 and float(score[4]) > 0.5
    # causal: a query before the span sees none of it
    early = answer_span_mass(q[:, :1], torch.tensor([10]), keys, span, D**-0.5)
    assert float(early.max()) == 0.0


def test_layer_budgets_proportional_clamped_and_total() -> None:
    b = layer_budgets([1.0, 2.0, 1.0, 4.0], 10, 100, 0.25, 3.0)
    assert abs(sum(b) - 40) <= 2
    assert b[3] > b[1] > b[0] == b[2]
    clamped = layer_budgets([1.0, 1.0, 1.0, 100.0], 10, 100, 0.5, 2.0)
    assert clamped[3] == 20 and min(clamped) >= 5
    assert layer_budgets([1.0, 1.0], 10, 100, 0.5, 2.0) == [10, 10]


def _calib(tmp_path: Path, srh: list[list[float]], err: list[float]) -> str:
    p = tmp_path / "compresskv_calibration.json"
    p.write_text(json.dumps({"srh_scores": srh, "layer_errors": err}))
    return str(p)


class _Ctx:
    def __init__(self, layer: int, model_dir: str | None = None):
        self.layer, self.model_dir = layer, model_dir


def test_srh_heads_pick_one_shared_token_set(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    HKV, G, n, T = 2, 2, 5, 40
    k = torch.randn(HKV, T, D, generator=g)
    q = torch.randn(HKV, G * n, D, generator=g) * 0.1
    k[1, 33] = 0
    k[1, 33, 0] = 5.0
    q[1, n:, 0] = 5.0  # query head 3 (KV 1, group 1) retrieves token 33
    path = _calib(tmp_path, [[0.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]], [1.0, 1.0])
    m = get_method("compresskv", calibration=path, top_heads=1, kernel=1)
    sel, report = m.pick(LayerInput(k, k, q, (3, 3), context=_Ctx(0)))
    rows = [r.tolist() for r in sel.per_head()]
    assert rows[0] == rows[1] and 33 in rows[0]
    assert report == {"layer": 0, "budget": 3, "srh_heads": [3]}
    assert torch.equal(m.select(k, k, q, [3, 3], context=_Ctx(0)).indices, sel.indices)
    other = get_method("compresskv", calibration=path, top_heads=1, kernel=1)
    assert 33 not in other.select(k, k, q, [3, 3], context=_Ctx(1)).per_head()[0].tolist()


def test_per_layer_budget_from_errors_and_model_dir(tmp_path: Path) -> None:
    _calib(tmp_path, [[1.0, 0.5]] * 3, [1.0, 1.0, 4.0])
    k = torch.randn(1, 60, D)
    q = torch.randn(1, 8, D)
    m = get_method("compresskv", min_scale=0.5, max_scale=2.0)
    results = [
        m.compact(LayerInput(k, k, q, (10,), context=_Ctx(i, str(tmp_path)))) for i in range(3)
    ]
    lens = [r.layer.head_lengths()[0] for r in results]
    assert lens[2] == 20 and lens[0] == lens[1] < 10
    assert [r.report["budget"] for r in results] == lens
    assert [r.report["layer"] for r in results] == [0, 1, 2]
    fitted = get_method("compresskv", calibration=str(tmp_path), refit="am")
    assert fitted.compact_layer(k, k, q, [10], context=_Ctx(2)).head_lengths() == [20]


def test_calibration_cached_per_file_version(tmp_path: Path) -> None:
    path = _calib(tmp_path, [[1.0, 0.5]], [1.0])
    first = cached_calibration(path)
    assert cached_calibration(tmp_path) is first  # the directory names the same file
    assert first == load_calibration(path)
    _calib(tmp_path, [[0.5, 1.0, 2.0]], [3.0])  # rewritten (another size): read again
    assert cached_calibration(path)["srh_scores"] == [[0.5, 1.0, 2.0]]


def test_layer_budget_error_is_zero_at_full_budget() -> None:
    k, v, q = torch.randn(2, 30, D), torch.randn(2, 30, D), torch.randn(2, 7, D)
    assert layer_budget_error(q, k, v, 30, 0.25) < 1e-5
    assert layer_budget_error(q, k, v, 2, 0.25) > layer_budget_error(q, k, v, 20, 0.25)


def test_bad_calibration_and_params(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="calibrate"):
        load_calibration(tmp_path)
    bad = tmp_path / "compresskv_calibration.json"
    bad.write_text(json.dumps({"srh_scores": [[1.0]], "layer_errors": [1.0, 2.0]}))
    with pytest.raises(ValueError, match="equal L"):
        load_calibration(bad)
    with pytest.raises(ValueError, match="calibration"):
        get_method("compresskv").select(
            torch.randn(1, 5, D), torch.randn(1, 5, D), torch.randn(1, 2, D), [2]
        )
    for params in ({"kernel": 2}, {"min_scale": 2.0}, {"top_heads": 0}):
        with pytest.raises(ValueError):
            get_method("compresskv", **params)

"""kv-compress on hand-made attention patterns: metric, GQA aggregation, variable budgets,
refit, parameters, registry, and a run through the pipeline and the eval sweep (tiny model).

Shape legend: L layers, T prefix tokens, n reference queries per query head, H_kv KV heads,
G query heads per KV head, D head dim.

Most layers here use one-hot keys (keys = identity, D = T) and sm_scale 1, so a query's
attention row is softmax(q): a query of log-probabilities p attends with exactly p.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

from compactor.cli import main
from compactor.methods import LayerInput, get_method
from compactor.methods.context import LayerBudgetPlanner
from compactor.methods.kv_compress import KVCompress, kv_compress_scores, round_layer_shares
from compactor.solvers import attend
from compactor.spec import CompactionSpec, QueryConfig
from tests._tiny import random_ids


def _onehot_layer(rows: list[list[torch.Tensor]], T: int) -> tuple[torch.Tensor, ...]:
    """keys = identity [H_kv, T, T], random values, pooled queries [H_kv, G*n, T] whose
    attention rows are the given probability vectors (rows[h] lists head h's rows)."""
    H = len(rows)
    keys = torch.eye(T).expand(H, T, T).contiguous()
    values = torch.randn(H, T, T, generator=torch.Generator().manual_seed(0))
    queries = torch.stack([torch.stack([p.log() for p in head]) for head in rows])
    return keys, values, queries


def _row(T: int, peaks: dict[int, float]) -> torch.Tensor:
    """An attention row over T keys: `peaks` {index: mass}, the rest spread evenly."""
    rest = (1.0 - sum(peaks.values())) / (T - len(peaks))
    p = torch.full((T,), rest)
    for i, m in peaks.items():
        p[i] = m
    return p


def _kept(layer: Any, h: int) -> list[int]:
    lo, hi = int(layer.indptr[h]), int(layer.indptr[h + 1])
    return sorted(layer.kept_indices[lo:hi].tolist())


def test_keys_the_observed_queries_attend_to_are_kept() -> None:
    T = 12
    rows = [[_row(T, {3: 0.5, 9: 0.4}), _row(T, {3: 0.45, 7: 0.45}), _row(T, {9: 0.8})]]
    keys, values, q = _onehot_layer(rows, T)
    method = get_method("kv-compress", per_head=False)
    res = method.compact(LayerInput(keys, values, q, (3,), sm_scale=1.0))
    assert _kept(res.layer, 0) == [3, 7, 9]
    assert bool((res.layer.beta == 0).all())  # refit "none": originals, beta 0
    assert torch.equal(res.layer.values, values[0, [3, 7, 9]])


def test_the_metric_is_squared_attention_not_its_sum() -> None:
    """Key 0 gets 0.86 from one query; key 1 gets 0.37 from four: the sum of attention
    ranks key 1 first (1.50 vs 1.22), the sum of squares key 0 (0.77 vs 0.55)."""
    T = 8
    one = _row(T, {0: 0.86})
    many = _row(T, {1: 0.37})
    keys, values, q = _onehot_layer([[one, many, many, many, many]], T)
    probs = torch.stack([one, many, many, many, many])
    scores = kv_compress_scores(keys, q, 1.0)
    assert torch.allclose(scores[0], probs.square().sum(0), atol=1e-6)
    assert probs.sum(0)[1] > probs.sum(0)[0] and scores[0, 0] > scores[0, 1]
    x = LayerInput(keys, values, q, (1,), sm_scale=1.0)
    assert _kept(get_method("kv-compress").compact(x).layer, 0) == [0]
    # a plain-attention sum (one-shot H2O, no recent tokens) keeps the other key
    h2o = get_method("h2o", recent_fraction=0.0)
    assert _kept(h2o.compact(x).layer, 0) == [1]


def test_gqa_metric_sums_over_the_query_heads_of_a_kv_head() -> None:
    """Two query heads over one KV head: query head 0 looks at key 2, head 1 at key 5; the
    KV head's metric is the sum of both heads' metrics and keeps both keys."""
    T = 10
    head0 = [_row(T, {2: 0.9}), _row(T, {2: 0.7, 4: 0.1})]
    head1 = [_row(T, {5: 0.95}), _row(T, {5: 0.6})]
    keys, values, pooled = _onehot_layer([head0 + head1], T)  # [1, G*n = 2*2, T]
    per_head = [kv_compress_scores(keys, pooled[:, g * 2 : (g + 1) * 2], 1.0) for g in (0, 1)]
    assert torch.allclose(kv_compress_scores(keys, pooled, 1.0), per_head[0] + per_head[1])
    x = LayerInput(keys, values, pooled, (2,), sm_scale=1.0)
    assert _kept(get_method("kv-compress").compact(x).layer, 0) == [2, 5]
    # the same on random GQA data: a per-query-head loop summed equals the pooled metric
    g = torch.Generator().manual_seed(1)
    H, G, n, D, T2 = 3, 2, 5, 8, 17
    k, qh = torch.randn(H, T2, D, generator=g), torch.randn(H, G, n, D, generator=g)
    loop = torch.zeros(H, T2)
    for h in range(H):
        for j in range(G):
            a = torch.softmax(qh[h, j] @ k[h].T / math.sqrt(D), -1)
            loop[h] += a.square().sum(0)
    got = kv_compress_scores(k, qh.reshape(H, G * n, D), 1 / math.sqrt(D))
    assert torch.allclose(got, loop, atol=1e-6)


def test_a_concentrated_head_gets_fewer_entries_than_a_diffuse_one() -> None:
    T, n = 16, 6
    focused = [_row(T, {4: 0.49, 11: 0.49})] * n  # two keys hold the attention
    diffuse = [torch.full((T,), 1.0 / T)] * n
    keys, values, q = _onehot_layer([focused, diffuse], T)
    x = LayerInput(keys, values, q, (4, 4), sm_scale=1.0)
    res = get_method("kv-compress").compact(x)
    budgets = res.report["budgets"]
    assert sum(budgets) == 8 and res.layer.head_lengths() == budgets
    assert budgets[0] < budgets[1] and budgets == [2, 6]
    assert _kept(res.layer, 0) == [4, 11]
    # min_fraction raises the concentrated head's share to its floor (0.75 * 4 = 3)
    floored = get_method("kv-compress", min_fraction=0.75).compact(x)
    assert floored.report["budgets"] == [3, 5]
    # per_head=False: every head keeps its given budget
    fixed = get_method("kv-compress", per_head=False).compact(x)
    assert fixed.layer.head_lengths() == [4, 4]


def test_layer_budgets_sum_to_the_total_and_follow_the_metric() -> None:
    T, n = 16, 4  # two KV heads per layer
    focused = [_row(T, {3: 0.9})] * n
    diffuse = [torch.full((T,), 1.0 / T)] * n
    half = [_row(T, {i: 0.124 for i in range(0, T, 2)})] * n  # diffuse over half the keys
    layers = [_onehot_layer([focused, focused], T), _onehot_layer([diffuse, diffuse], T)]
    layers.append(_onehot_layer([focused, half], T))
    keys, queries = [x[0] for x in layers], [x[2] for x in layers]
    method = get_method("kv-compress")
    assert isinstance(method, LayerBudgetPlanner)
    for budget in (1, 3, 5, 16):
        planned = method.plan_layer_budgets(keys, queries, budget, sm_scale=1.0)
        assert sum(planned) == len(layers) * budget and all(1 <= b <= T for b in planned)
        if 1 < budget < T:
            assert planned[0] < min(planned[1:])  # layers with diffuse heads get more
    off = get_method("kv-compress", across_layers=False)
    assert off.plan_layer_budgets(keys, queries, 5, sm_scale=1.0) == [5, 5, 5]
    assert round_layer_shares([5, 7, 12], 2, 12) == [3, 3, 6]
    assert round_layer_shares([4, 6], 2, 5) == [2, 3]


def test_plan_and_pick_are_the_global_eviction_with_one_head() -> None:
    """H_kv = 1: the per-layer plan is exact, so plan + per-layer pick keep exactly the
    global top-(L * t) entries of all layers' metrics (each layer keeping >= 1)."""
    g = torch.Generator().manual_seed(3)
    L, T, n, D, t = 4, 30, 9, 8, 7
    keys = [torch.randn(1, T, D, generator=g) * (0.5 + li) for li in range(L)]
    values = [torch.randn(1, T, D, generator=g) for _ in range(L)]
    queries = [torch.randn(1, n, D, generator=g) for _ in range(L)]
    method = get_method("kv-compress")
    planned = method.plan_layer_budgets(keys, queries, t)
    scale = 1 / math.sqrt(D)
    scores = torch.stack([kv_compress_scores(k, q, scale)[0] for k, q in zip(keys, queries)])
    floored = scores.clone()  # every layer (= head) keeps at least its best entry
    floored[torch.arange(L), scores.argmax(-1)] = math.inf
    top = floored.flatten().topk(L * t).indices
    for li in range(L):
        x = LayerInput(keys[li], values[li], queries[li], (planned[li],))
        want = sorted(int(i) % T for i in top if int(i) // T == li)
        assert _kept(method.compact(x).layer, 0) == want


def test_window_queries_are_causal_and_the_window_is_kept() -> None:
    g = torch.Generator().manual_seed(4)
    H, T, D, w = 2, 20, 8, 3
    keys, values = torch.randn(H, T, D, generator=g), torch.randn(H, T, D, generator=g)
    q = torch.randn(H, 2 * w, D, generator=g)  # G = 2 query heads, w window tokens each
    scores = kv_compress_scores(keys, q, 0.5, window=w)
    assert bool(torch.isinf(scores[:, T - w :]).all())
    # the window's first query sees keys 0..T-w only (causal), so its attention sums to 1
    probs = torch.softmax((q[0, 0] @ keys[0, : T - w + 1].T) * 0.5, -1)
    assert bool((probs.square() <= scores[0, : T - w + 1] + 1e-6).all())
    res = get_method("kv-compress", window=w).compact(LayerInput(keys, values, q, (5, 5)))
    for h in range(H):
        assert set(range(T - w, T)) <= set(_kept(res.layer, h))


def test_am_refit_has_lower_output_error_than_keeping_the_originals() -> None:
    g = torch.Generator().manual_seed(5)
    H, T, n, D = 2, 96, 160, 16
    centers = torch.randn(H, 5, D, generator=g) * 1.5

    def around(m: int) -> torch.Tensor:
        idx = torch.randint(0, 5, (H, m), generator=g).unsqueeze(-1).expand(-1, -1, D)
        return torch.gather(centers, 1, idx) + torch.randn(H, m, D, generator=g)

    keys, values, q = around(T), torch.randn(H, T, D, generator=g), around(n)
    x = LayerInput(keys, values, q, (12, 12))
    ref, _ = attend(q, keys, values)

    def err(layer: Any) -> float:
        e = []
        for h in range(H):
            k, v, b = layer.head(h)
            o, _ = attend(q[h], k, v, b)
            e.append(float((o - ref[h]).norm() / ref[h].norm()))
        return sum(e) / H

    plain = get_method("kv-compress", refit="none").compact(x)
    fitted = get_method("kv-compress", refit="am").compact(x)
    assert plain.report == fitted.report  # the same selection
    assert torch.equal(plain.layer.kept_indices, fitted.layer.kept_indices)
    assert bool((fitted.layer.beta != 0).any()) and bool((plain.layer.beta == 0).all())
    assert err(fitted.layer) < 0.8 * err(plain.layer)
    bounds = get_method("kv-compress", refit="am", refit_beta_bounds=(-1, 0.5))
    assert float(bounds.compact(x).layer.beta.max()) <= 0.5 + 1e-5


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"refit": "amm"}, "'amm'"),
        ({"refit": "None"}, "'None'"),
        ({"window": -1}, "-1"),
        ({"window": 2.5}, "2.5"),
        ({"min_fraction": 1.5}, "1.5"),
        ({"min_fraction": True}, "True"),
        ({"per_head": "yes"}, "'yes'"),
        ({"across_layers": 0}, "0"),
        ({"refit_beta_bounds": (1.0, 2.0)}, "(1.0, 2.0)"),
        ({"refit_beta_bounds": "wide"}, "'wide'"),
        ({"ratio": 0.5}, "'ratio'"),
    ],
)
def test_bad_parameters_raise_naming_the_value(params: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError) as err:
        get_method("kv-compress", **params)
    assert needle in str(err.value)


def test_bad_inputs_raise() -> None:
    keys, values, q = torch.randn(1, 6, 4), torch.randn(1, 6, 4), torch.randn(1, 2, 4)
    with pytest.raises(ValueError, match="window=6 must be < T=6"):
        get_method("kv-compress", window=6).compact(LayerInput(keys, values, q, (2,)))
    m = KVCompress()
    with pytest.raises(ValueError, match="budget 7 must be in"):
        m.plan_layer_budgets([keys], [q], 7)
    with pytest.raises(ValueError, match="every layer"):
        m.plan_layer_budgets([keys], [], 2)
    with pytest.raises(ValueError, match="same H_kv and T"):
        m.plan_layer_budgets([keys, keys[:, :5]], [q, q], 2)
    assert get_method("kv-compress", refit=None).refit == "none"  # the other methods' spelling


def test_listed_with_its_parameters_and_accepted_by_the_spec(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["methods", "kv-compress", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["methods"][0]
    params = {p["name"]: p["default"] for p in row["params"]}
    assert params == {
        "window": 0,
        "min_fraction": 0.0,
        "per_head": True,
        "across_layers": True,
        "refit": "none",
        "refit_beta_bounds": [-3.0, 3.0],
    }
    assert row["selects"] and not row["needs_context"] and "2410.00161" in row["doc"]
    CompactionSpec(method="kv-compress", method_params={"refit": "am"}, ratio=0.2).validate()
    with pytest.raises(ValueError, match="refit"):
        CompactionSpec(method="kv-compress", method_params={"refit": "x"}, ratio=0.2).validate()


def test_pipeline_and_eval_on_the_tiny_model(tiny: Any) -> None:
    """compact_prefix keeps the total budget with budgets varying per layer and head; the
    eval sweep runs it next to the uncompacted cache, with and without the AM refit."""
    from compactor.eval.harness import EvalCase
    from compactor.eval.runner import run_eval
    from compactor.pipeline import Hooks, compact_prefix

    ids = random_ids(40, seed=7)
    queries = QueryConfig(sources=("repeat-prefill",))
    spec = CompactionSpec(method="kv-compress", ratio=0.25, queries=queries)
    hooks = Hooks(progress=False, model_fingerprint="tiny")
    prefix, _ = compact_prefix(tiny, None, ids, spec, hooks=hooks)
    t = prefix.budget.budget_per_head
    lengths = [c for layer in prefix.layers for c in layer.head_lengths()]
    assert sum(lengths) == len(prefix.layers) * prefix.num_kv_heads * t
    assert len(set(lengths)) > 1  # variable per (layer, head)
    assert len(prefix.params["method_report"]) == len(prefix.layers)
    case = EvalCase("kvc", ids, [random_ids(4, 1), random_ids(3, 2)])
    methods = ["full", "kv-compress", "kv-compress:refit=am:min_fraction=0.5"]
    recs = run_eval(tiny, None, [case], methods, [0.25], spec=spec, progress=False)
    by = {r["method"]: r for r in recs}
    assert set(by) == set(methods)
    for name in methods[1:]:
        assert 0 < by[name]["kept_per_head"] <= 0.25 * by["full"]["kept_per_head"] + 1
        assert math.isfinite(by[name]["output_rel_err"]) and by[name]["output_rel_err"] > 0

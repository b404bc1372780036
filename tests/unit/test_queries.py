"""compactor.queries: sources, pooling, reservoir, plan/collect."""

from __future__ import annotations

import pytest
import torch

from compactor import hf
from compactor.queries import QueryConfig, collect_queries, plan_queries, random_queries, reservoir
from tests.unit._tiny import real_model, tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("tiny"))


def _ids(n, seed=0):
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_reservoir_is_deterministic_and_capped():
    q = torch.randn(2, 50, 4)
    a, b = reservoir(q, 10, seed=3), reservoir(q, 10, seed=3)
    assert a.shape == (2, 10, 4) and torch.equal(a, b)
    assert not torch.equal(a, reservoir(q, 10, seed=4))
    assert reservoir(q, 100) is q
    with pytest.raises(ValueError, match="cap"):
        reservoir(q, 0)


def test_random_queries_norms():
    q = random_queries(torch.tensor([1.0, 5.0]), 7, 8, seed=0)
    assert q.shape == (2, 7, 8)
    torch.testing.assert_close(q.norm(dim=-1), torch.tensor([[1.0] * 7, [5.0] * 7]))


def test_config_validation():
    with pytest.raises(ValueError, match="unknown query source 'nope'"):
        QueryConfig(sources=("nope",))
    with pytest.raises(ValueError, match="max_queries_per_head"):
        QueryConfig(max_queries_per_head=0)


def test_sources_shapes_and_repeat_prefill_semantics(tiny):
    ids = _ids(24)
    pre = hf.prefill(tiny, ids, with_queries=True)
    cfg = QueryConfig(
        sources=("context-prefill", "repeat-prefill", "random", "follow-up"),
        max_queries_per_head=10_000,
        random_count=5,
    )
    plan = plan_queries(tiny, None, ids, pre, cfg, follow_ups=[[1, 2, 3]])
    qs = collect_queries(tiny, hf.PrefixState.full(pre), plan)
    # per KV head: G=2 x (24 repeat + 3 follow-up + 24 context) + 5 random
    assert set(qs) == {0, 1} and qs[0].shape == (2, 2 * (24 + 3 + 24) + 5, 16)
    # repeat-prefill: queries of the second copy == queries of positions T..2T-1 of C+C
    with hf.record_queries(tiny, [1]) as rec:
        tiny(input_ids=torch.tensor([ids + ids]))
    expect = hf.pool_gqa(rec[1][0][:, 24:], 2)
    only = plan_queries(
        tiny, None, ids, pre, QueryConfig(sources=("repeat-prefill",), max_queries_per_head=10_000)
    )
    got = collect_queries(tiny, hf.PrefixState.full(pre), only, layers=[1])[1]
    torch.testing.assert_close(got, expect, atol=1e-4, rtol=0)


def test_missing_inputs_raise(tiny):
    ids = _ids(10)
    pre = hf.prefill(tiny, ids)
    with pytest.raises(ValueError, match="with_queries"):
        plan_queries(tiny, None, ids, pre, QueryConfig(sources=("random",)))
    with pytest.raises(ValueError, match="tokenizer"):
        plan_queries(tiny, None, ids, pre, QueryConfig(sources=("self-study",)))
    with pytest.raises(ValueError, match="follow_ups"):
        plan_queries(tiny, None, ids, pre, QueryConfig(sources=("follow-up",)))


def test_self_study_on_real_model(prepared_model):
    model, tok = real_model(prepared_model)
    ids = tok("The lighthouse on the north cape shows two red flashes every twenty seconds.")[
        "input_ids"
    ]
    pre = hf.prefill(model, ids)
    cfg = QueryConfig(sources=("self-study",), self_study_tokens=1)
    plan = plan_queries(model, tok, ids, pre, cfg)
    assert len(plan.continuations) == 4 and all(
        c.source == "self-study" for c in plan.continuations
    )
    assert (
        plan_queries(model, tok, ids, pre, cfg).continuations == plan.continuations
    )  # deterministic
    qs = collect_queries(model, hf.PrefixState.full(pre), plan, layers=[0, 29])
    n = 3 * sum(len(c.tokens) for c in plan.continuations)
    assert all(len(c.tokens) > 1 for c in plan.continuations)
    assert qs[29].shape == (3, n, 64)

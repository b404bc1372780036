"""GVote on synthetic layers whose right answers are known."""

from __future__ import annotations

import itertools

import pytest
import torch

from compactor.methods import LayerInput, get_method
from compactor.methods.context import LayerContext, apply_rope, rope_cos_sin
from compactor.methods.gvote import GVote, nucleus_size

E, HQ, HKV, D, T = 24, 4, 2, 8, 40


def _ctx(seed: int = 0, noise: float = 1.0) -> tuple[LayerContext, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, E, generator=g) * noise + torch.randn(E, generator=g)
    w = torch.randn(HQ * D, E, generator=g) / E**0.5
    inv = 1.0 / (100.0 ** (torch.arange(0, D, 2).float() / D))
    ctx = LayerContext(
        layer=3,
        num_layers=8,
        hidden=hidden,
        q_weight=w,
        q_bias=None,
        inv_freq=inv,
        rope_scale=1.0,
        last_query=torch.zeros(HQ, D),
        num_q_heads=HQ,
        head_dim=D,
    )
    last = ctx.project_queries(hidden[-1:], torch.tensor([T - 1]))[:, 0]
    keys = torch.randn(HKV, T, D, generator=g)
    return LayerContext(**{**ctx.__dict__, "last_query": last}), keys


def test_nucleus_size_known_values() -> None:
    p = torch.tensor([[0.5, 0.3, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]])
    assert nucleus_size(p, 0.8).tolist() == [2, 4]
    assert nucleus_size(p, 0.81).tolist() == [3, 4]
    assert nucleus_size(p, 0.5).tolist() == [1, 2]
    assert nucleus_size(p, 1.0).tolist() == [4, 4]


def test_union_grows_with_S() -> None:
    ctx, k = _ctx()
    q = torch.randn(HKV, 6, D)
    sizes = []
    sets = []
    for S in (0, 2, 8, 32):
        sel = GVote(S=S, p=0.6).select(k, k, q, [1, 1], context=ctx)
        sizes.append(sum(sel.budgets()))
        sets.append([set(r.tolist()) for r in sel.per_head()])
    assert sizes == sorted(sizes) and sizes[-1] > sizes[0]
    for small, big in itertools.pairwise(sets):  # samples are prefix-consistent: nested sets
        assert all(a <= b for a, b in zip(small, big))


def test_last_query_alone_keeps_its_nucleus() -> None:
    ctx, k = _ctx(seed=1)
    m = GVote(S=0, p=0.7)
    sel, report = m.pick(LayerInput(k, k, torch.randn(HKV, 3, D), (1, 1), context=ctx))
    G = HQ // HKV
    logits = torch.einsum("hd,htd->ht", ctx.last_query, k.repeat_interleave(G, 0)) / D**0.5
    nb = nucleus_size(torch.softmax(logits, -1), 0.7)
    expect = []
    for h in range(HKV):
        s = set()
        for j in range(h * G, (h + 1) * G):
            s |= set(logits[j].topk(int(nb[j])).indices.tolist())
        expect.append(sorted(s))
    assert [r.tolist() for r in sel.per_head()] == expect
    assert report["nucleus_budget_per_q_head"] == nb.tolist()
    assert report["kept_per_kv_head"] == [len(e) for e in expect]
    assert report["layer"] == 3 and report["span"] == [0, T]
    assert report["ratio"] == sum(len(e) for e in expect) / (HKV * T)


def test_sampled_queries_follow_the_gaussian_and_averaged_rope() -> None:
    ctx, _ = _ctx(noise=1e-6)  # hidden states all equal -> every sample = the mean
    q = GVote(S=3, n_sink=0, horizon=5).sample_queries(ctx)
    pre = (ctx.hidden[0] @ ctx.q_weight.T).view(HQ, D)
    cos, sin = rope_cos_sin(ctx.inv_freq, torch.arange(T, T + 5))
    ref = apply_rope(pre.unsqueeze(1), cos.mean(0, keepdim=True), sin.mean(0, keepdim=True))
    torch.testing.assert_close(q, ref.expand(-1, 3, -1), atol=1e-4, rtol=1e-4)


def test_sinks_are_skipped_in_the_fit() -> None:
    ctx, _ = _ctx(noise=1e-6)
    h = ctx.hidden.clone()
    h[:4] = 1e4  # massive sink activations
    ctx2 = LayerContext(**{**ctx.__dict__, "hidden": h})
    q_skip = GVote(S=2, n_sink=4).sample_queries(ctx2)
    q_ref = GVote(S=2, n_sink=4).sample_queries(ctx)
    torch.testing.assert_close(q_skip, q_ref, atol=1e-3, rtol=1e-3)


def test_compact_ragged_output_and_report() -> None:
    ctx, k = _ctx(seed=2)
    v = torch.randn_like(k)
    m = get_method("gvote", p=0.5, S=4)
    x = LayerInput(k, v, torch.randn(HKV, 5, D), (T, T), context=ctx)
    layer, report = m.compact(x)
    lens = layer.head_lengths()
    assert lens == report["kept_per_kv_head"]
    assert layer.keys.shape[0] == sum(lens)
    assert 0 < report["ratio"] <= 1 and report["ratio"] == sum(lens) / (HKV * T)
    assert m.compact(x).report == report  # nothing accumulates on the method
    assert m.compact_layer(k, v, x.queries, [T, T], context=ctx).head_lengths() == lens
    fitted = get_method("gvote", p=0.5, S=4, refit="am").compact(x)
    assert fitted.layer.head_lengths() == lens and fitted.report == report


def test_span_and_errors() -> None:
    ctx, k = _ctx()
    sub = ctx.for_span(4, T)
    sel = GVote(S=2).select(k[:, 4:], k[:, 4:], torch.randn(HKV, 2, D), [1, 1], context=sub)
    assert max(max(r.tolist()) for r in sel.per_head()) < T - 4
    with pytest.raises(ValueError, match="LayerContext"):
        GVote().select(k, k, torch.randn(HKV, 2, D), [1, 1])
    with pytest.raises(ValueError, match="does not match"):
        GVote().select(k[:, 1:], k[:, 1:], torch.randn(HKV, 2, D), [1, 1], context=ctx)
    for bad in ({"p": 0.0}, {"S": -1}, {"horizon": 0}, {"S": 0, "vote_last_query": False}):
        with pytest.raises(ValueError):
            GVote(**bad)
    with pytest.raises(ValueError, match="span"):
        ctx.for_span(5, T + 1)

"""snapkv, h2o, streamingllm, kvzip, kvcompose on synthetic inputs with known answers."""

from __future__ import annotations

import math

import pytest
import torch

from compactor.methods import get_method
from compactor.methods._scoring import attention_probs, global_topk_budgets, topk_selection
from compactor.methods.base import LayerInput
from compactor.methods.baselines import snapkv_scores
from compactor.methods.kvcompose import KVCompose

D = 16


def _rand(H: int = 2, T: int = 40, n: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(H, T, D, generator=g)
    v = torch.randn(H, T, D, generator=g)
    q = torch.randn(H, n, D, generator=g)
    return k, v, q


def _kept(layer, h: int) -> list[int]:
    lo, hi = int(layer.indptr[h]), int(layer.indptr[h + 1])
    return layer.kept_indices[lo:hi].tolist()


def _out_err(k, v, q, layer) -> float:
    """Mean relative attention-output error of a compacted layer on queries q."""
    scale = 1 / math.sqrt(D)
    errs = []
    for h in range(k.shape[0]):
        o = torch.softmax(q[h] @ k[h].T * scale, -1) @ v[h]
        ck, cv, b = layer.head(h)
        oc = torch.softmax(q[h] @ ck.float().T * scale + b, -1) @ cv.float()
        errs.append(((oc - o).norm(dim=-1) / o.norm(dim=-1)).mean())
    return float(torch.stack(errs).mean())


def test_streamingllm_keeps_exactly_sinks_and_window() -> None:
    k, v, q = _rand(T=50)
    layer = get_method("streamingllm", n_sink=4).compact_layer(k, v, q, [10, 6])
    assert _kept(layer, 0) == [0, 1, 2, 3, *range(44, 50)]
    assert _kept(layer, 1) == [0, 1, 2, 3, 48, 49]
    assert torch.equal(layer.beta, torch.zeros_like(layer.beta))
    assert torch.equal(layer.keys[:4], k[0, :4])
    tiny = get_method("streamingllm", n_sink=4).compact_layer(k, v, q, [3, 1])
    assert _kept(tiny, 0) == [0, 1, 2] and _kept(tiny, 1) == [0]


def test_snapkv_finds_planted_key_and_pools_neighbours() -> None:
    k, v, q = _rand(H=1, T=60)
    k[0, 30] = 0
    q[0] = 0.1 * q[0]
    q[0, :, 0] = 8.0
    k[0, 30, 0] = 4.0  # every query attends to key 30
    sel = get_method("snapkv", kernel=5).select(k, v, q, [5])
    assert 30 in sel.per_head()[0].tolist()
    # pooling spreads key 30's score over 28..32, so those are exactly the top 5
    assert sel.per_head()[0].tolist() == [28, 29, 30, 31, 32]
    sel1 = get_method("snapkv", kernel=1).select(k, v, q, [1])
    assert sel1.per_head()[0].tolist() == [30]


def test_snapkv_window_mode_keeps_window_and_matches_manual_scores() -> None:
    k, v, _ = _rand(H=2, T=30)
    w, G = 4, 3
    q = torch.randn(2, G * w, D)
    scores = snapkv_scores(k, q, 0.25, window=w, kernel=1)
    # manual: causal softmax per window token, mean over queries of non-window columns
    for h in range(2):
        acc = torch.zeros(30 - w)
        for r in range(G * w):
            pos = 30 - w + r % w
            p = torch.softmax(q[h, r] @ k[h, : pos + 1].T * 0.25, -1)
            acc += p[: 30 - w]
        torch.testing.assert_close(scores[h, : 30 - w], acc / (G * w))
    sel = get_method("snapkv", window=w).select(k, v, q, [8, 8])
    for row in sel.per_head():
        assert set(range(26, 30)) <= set(row.tolist())


def test_h2o_splits_budget_between_recent_and_heavy_hitters() -> None:
    k, v, q = _rand(H=1, T=40)
    k[0, 5, :] = 0
    k[0, 5, 0] = 6.0
    q[0, :, 0] = 5.0
    sel = get_method("h2o", recent_fraction=0.5).select(k, v, q, [6])
    kept = sel.per_head()[0].tolist()
    assert kept[-3:] == [37, 38, 39] and 5 in kept and len(kept) == 6
    heavy = attention_probs(k, q, 0.25).sum(1)[0]
    assert sel.per_head()[0].tolist() == sorted([37, 38, 39, *heavy[:37].topk(3).indices.tolist()])


def test_kvzip_non_uniform_gives_diffuse_head_more_budget() -> None:
    k, v, q = _rand(H=2, T=40)
    k[0] *= 0.01  # head 0: flat attention over all keys -> low max scores everywhere
    k[1, 3] = q[1].mean(0) * 5  # head 1: one key grabs almost all attention
    m = get_method("kvzip")
    sel = m.select(k, v, q, [10, 10])
    b = sel.budgets()
    assert sum(b) == 20 and min(b) >= 1
    assert 3 in sel.per_head()[1].tolist()
    uni = get_method("kvzip", non_uniform=False).select(k, v, q, [10, 10])
    assert uni.budgets() == [10, 10]
    scores = attention_probs(k, q, 0.25).amax(1)
    assert b == global_topk_budgets(scores, 20)


def test_attention_probs_share_the_softmax_with_the_sinks() -> None:
    k, _, q = _rand(H=2, T=12, n=5, seed=4)
    full = torch.softmax(q @ k.transpose(1, 2) * 0.25, -1)
    got = attention_probs(k[:, 3:], q, 0.25, sinks=k[:, :3])
    assert torch.allclose(got, full[..., 3:], atol=1e-6)
    assert torch.allclose(attention_probs(k, q, 0.25, sinks=k[:, :0]), full, atol=1e-6)
    with pytest.raises(ValueError, match="sinks must be"):
        LayerInput(k, k, q, (2, 2), None, None, k[:1, :3])


def test_kvzip_does_not_keep_what_only_a_sink_reader_touches() -> None:
    """q0 reads the sink (logit 10) and key 0 a little (2); q1 reads key 1 (1.5). Without the
    sink in the softmax q0's leftover looks like a sharp read of key 0 (0.79 > 0.69); with it,
    key 0 gets 3e-4 and key 1 is kept, as a reader of the full cache would say."""
    q = torch.eye(4)[:2].unsqueeze(0)  # [1, 2, 4]
    sink = torch.tensor([[[10.0, 0, 0, 0]]])
    keys = torch.tensor([[[2.0, 0, 0, 0], [0, 1.5, 0, 0], [0, 0, 0, 0]]])
    kvzip = get_method("kvzip")
    alone = kvzip.pick(LayerInput(keys, keys, q, (1,), 1.0)).selection
    shared = kvzip.pick(LayerInput(keys, keys, q, (1,), 1.0, None, sink)).selection
    assert alone.per_head()[0].tolist() == [0]
    assert shared.per_head()[0].tolist() == [1]
    # over layers too: a second layer whose q1 reads key 1 less sharply (1.2) than the first
    # layer's q1 still gets its share once q0's sink reading stops counting as a sharp read
    other = torch.tensor([[[0.0, 0, 0, 0], [0, 1.2, 0, 0], [0, 0, 0, 0]]])
    assert kvzip.plan_layer_budgets([keys, other], [q, q], 1, 1.0) == [2, 1]
    assert kvzip.plan_layer_budgets([keys, other], [q, q], 1, 1.0, [sink, sink]) == [1, 1]


def test_attention_probs_share_the_softmax_with_the_suffix() -> None:
    """suffix_lse is one more logit per query row: the probabilities over the prefix keys are
    those of a softmax over [keys, the suffix's own keys]; -inf (no suffix) changes nothing."""
    k, _, q = _rand(H=2, T=12, n=5, seed=5)
    own = torch.randn(2, 5, 3, D, generator=torch.Generator().manual_seed(6))  # 3 per row
    lse = torch.einsum("hnd,hnjd->hnj", q, own).mul(0.25).logsumexp(-1)  # [H, n]
    logits = torch.cat([q @ k.transpose(1, 2) * 0.25, lse.unsqueeze(-1)], -1)
    want = torch.softmax(logits, -1)[..., :-1]
    assert torch.allclose(attention_probs(k, q, 0.25, suffix_lse=lse), want, atol=1e-6)
    none = torch.full_like(lse, -math.inf)
    assert torch.allclose(attention_probs(k, q, 0.25, suffix_lse=none), attention_probs(k, q, 0.25))
    with pytest.raises(ValueError, match="suffix_lse must be"):
        LayerInput(k, k, q, (2, 2), suffix_lse=lse[:, :4])


def test_kvzip_does_not_keep_what_only_a_reader_of_its_own_tokens_touches() -> None:
    """q0 reads its own continuation (log mass 10) and key 0 a little (2); q1 reads key 1
    (1.5). Scored over the prefix alone, q0's leftover looks like a sharp read of key 0; with
    its own tokens in the softmax key 0 gets 3e-4 and key 1 is kept, as the model reads."""
    q = torch.eye(4)[:2].unsqueeze(0)  # [1, 2, 4]
    keys = torch.tensor([[[2.0, 0, 0, 0], [0, 1.5, 0, 0], [0, 0, 0, 0]]])
    suffix = torch.tensor([[10.0, -math.inf]])
    kvzip = get_method("kvzip")
    assert kvzip.needs_suffix_lse
    alone = kvzip.pick(LayerInput(keys, keys, q, (1,), 1.0)).selection
    shared = kvzip.pick(LayerInput(keys, keys, q, (1,), 1.0, suffix_lse=suffix)).selection
    assert alone.per_head()[0].tolist() == [0]
    assert shared.per_head()[0].tolist() == [1]
    other = torch.tensor([[[0.0, 0, 0, 0], [0, 1.2, 0, 0], [0, 0, 0, 0]]])
    assert kvzip.plan_layer_budgets([keys, other], [q, q], 1, 1.0) == [2, 1]
    plan = kvzip.plan_layer_budgets([keys, other], [q, q], 1, 1.0, None, [suffix, suffix])
    assert plan == [1, 1]


def test_global_topk_budgets_floor_and_total() -> None:
    s = torch.tensor([[9.0, 8.0, 7.0, 6.0], [0.1, 0.0, 0.0, 0.0]])
    assert global_topk_budgets(s, 4) == [3, 1]
    assert global_topk_budgets(s, 4, floor=0) == [4, 0]


def test_kvcompose_plan_matches_reference_and_keeps_total() -> None:
    k1, _, q = _rand(H=2, T=32, seed=1)
    peaked = k1.clone()
    peaked[:, 7] = q.mean(1) * 6
    layers = [k1 * 0.01, peaked, k1]
    m = KVCompose(group_size=2)
    plan = m.plan_layer_budgets(layers, [q] * 3, 8)
    # reference: per query head max over queries, mean over the group, + mean over heads,
    # composite = mean over heads of sorted scores, layer 0 raised to the max, global top-24
    comp = []
    for k in layers:
        p = torch.softmax(q @ k.transpose(1, 2) * 0.25, -1).view(2, 2, 6, 32)
        s = p.amax(2).mean(1)
        s = s + s.mean(0, keepdim=True)
        comp.append(s.sort(-1, descending=True).values.mean(0))
    c = torch.stack(comp)
    c[0] = c.max(0).values
    ref = torch.bincount(c.flatten().topk(24).indices // 32, minlength=3).tolist()
    assert plan == ref and sum(plan) == 24
    assert plan[0] == max(plan)
    sel = m.select(peaked, peaked, q, [plan[1]] * 2)
    assert sel.budgets() == [plan[1]] * 2
    with pytest.raises(ValueError):
        KVCompose(agg_task="median")


def test_topk_selection_sorted_and_ragged() -> None:
    s = torch.tensor([[0.1, 0.9, 0.5, 0.7], [1.0, 0.0, 0.2, 0.3]])
    sel = topk_selection(s, [2, 3])
    assert sel.per_head()[0].tolist() == [1, 3]
    assert sel.per_head()[1].tolist() == [0, 2, 3]


def test_kvzip_splits_the_budget_over_layers_by_a_global_top_k() -> None:
    """Layer 0 reads six keys sharply (weight ~1 each), layer 1 reads all ten a little (0.1):
    the six best of all twelve picks are layer 0's; layerwise keeps the budget per layer."""
    T, D = 10, 16
    sharp = torch.zeros(1, T, D)
    sharp[0, :6, :6] = 10 * torch.eye(6)
    q = torch.zeros(1, 6, D)
    q[0, :, :6] = torch.eye(6)
    keys, queries = [sharp, torch.zeros(1, T, D)], [q, q]
    assert get_method("kvzip").plan_layer_budgets(keys, queries, 3, sm_scale=1.0) == [6, 1]
    flat = get_method("kvzip", layerwise=True).plan_layer_budgets(keys, queries, 3, 1.0)
    assert flat == [3, 3]
    with pytest.raises(ValueError, match="layerwise must be a bool"):
        get_method("kvzip", layerwise=1)


def test_kvzip_rms_reduction_prefers_the_key_every_query_reads() -> None:
    """One query reads key 0 alone; nine read key 1 with ~0.79 of their attention. The max
    keeps key 0 (its one sharp reader), the RMS key 1 (read by most); bad names refused."""
    keys = torch.tensor([[[10.0, 0, 0], [0, 1, 0], [0, 0, 0]]])
    q = torch.zeros(1, 10, 3)
    q[0, 0, 0] = 1.0
    q[0, 1:, 1] = 2.0
    x = LayerInput(keys, keys, q, (1,), 1.0)
    assert get_method("kvzip").pick(x).selection.per_head()[0].tolist() == [0]
    assert get_method("kvzip", reduce="rms").pick(x).selection.per_head()[0].tolist() == [1]
    with pytest.raises(ValueError, match="reduce must be one of"):
        get_method("kvzip", reduce="mean")


@pytest.mark.parametrize("name", ["snapkv", "h2o", "streamingllm", "kvzip", "kvcompose"])
def test_am_refit_reduces_output_error_on_fit_queries(name: str) -> None:
    k, v, q = _rand(H=2, T=64, n=48, seed=3)
    plain = get_method(name).compact_layer(k, v, q, [12, 12])
    fitted = get_method(name, refit="am").compact_layer(k, v, q, [12, 12])
    assert plain.head_lengths() == fitted.head_lengths()
    assert torch.equal(plain.kept_indices, fitted.kept_indices)
    assert _out_err(k, v, q, fitted) < _out_err(k, v, q, plain)


def _mass_sq_err(k, v, q, layer) -> float:
    """Sum over heads and queries of the squared error of the attention mass exp(q k' s)."""
    scale, err = 1 / math.sqrt(D), 0.0
    for h in range(k.shape[0]):
        m = torch.exp(q[h] @ k[h].T * scale).sum(-1)
        ck, _, b = layer.head(h)
        err += float((torch.exp(q[h] @ ck.float().T * scale + b).sum(-1) - m).square().sum())
    return err


@pytest.mark.parametrize("name", ["kvzip", "snapkv", "kv-compress"])
def test_refit_halves_fit_only_their_part(name: str) -> None:
    k, v, q = _rand(H=3, T=37, n=29, seed=5)
    budgets = [7, 5, 9]
    plain = get_method(name).compact_layer(k, v, q, budgets)
    beta = get_method(name, refit="beta").compact_layer(k, v, q, budgets)
    values = get_method(name, refit="values").compact_layer(k, v, q, budgets)
    both = get_method(name, refit="am").compact_layer(k, v, q, budgets)
    for layer in (beta, values, both):
        assert torch.equal(layer.kept_indices, plain.kept_indices)
        assert layer.head_lengths() == plain.head_lengths()
    # beta alone: the original values, a fitted beta that matches the mass better
    assert torch.equal(beta.values, plain.values)
    assert bool((beta.beta != 0).any())
    assert _mass_sq_err(k, v, q, beta) < _mass_sq_err(k, v, q, plain)
    # values alone: beta 0, fitted values that match the outputs better
    assert torch.equal(values.beta, torch.zeros_like(values.beta))
    assert not torch.equal(values.values, plain.values)
    assert _out_err(k, v, q, values) < _out_err(k, v, q, plain)
    # both: the "am" refit fits beta as "beta" does
    assert torch.allclose(both.beta, beta.beta)


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("snapkv", {"kernel": 4}),
        ("snapkv", {"window": -1}),
        ("h2o", {"recent_fraction": 1.5}),
        ("streamingllm", {"n_sink": -1}),
        ("kvzip", {"refit": "omp"}),
        ("kvzip", {"refit": "none"}),
        ("kv-compress", {"refit": "both"}),
        ("kvzip", {"refit_beta_bounds": (1.0, 2.0)}),
    ],
)
def test_bad_parameters_raise(name: str, params: dict) -> None:
    with pytest.raises(ValueError):
        get_method(name, **params)


def test_window_longer_than_prefix_raises() -> None:
    k, v, q = _rand(T=8)
    with pytest.raises(ValueError, match="window"):
        get_method("snapkv", window=8).select(k, v, q, [2, 2])

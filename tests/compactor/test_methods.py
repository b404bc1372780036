"""Attention Matching methods: exact recovery, registry, budgets, bounds, quality."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest
import torch

from compactor.methods import (
    CompactionMethod,
    LayerInput,
    MethodResult,
    ScoreMethod,
    SelectingMethod,
    Selection,
    describe_methods,
    get_method,
    list_methods,
    method_class,
)
from compactor.methods.refit import refit
from compactor.solvers import attend
from compactor.types import CompactedLayer, CompactedPrefix

AM = ["am-highest", "am-omp", "am-omp-fast"]


def clustered(H=2, T=256, n=384, D=32, seed=0):
    """keys/values [H, T, D], fit and held-out queries [H, n, D] from the same law."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(H, 6, D, generator=g) * 1.5
    pick = lambda m: torch.gather(  # noqa: E731
        centers, 1, torch.randint(0, 6, (H, m), generator=g).unsqueeze(-1).expand(-1, -1, D)
    )
    keys = pick(T) + torch.randn(H, T, D, generator=g)
    values = torch.randn(H, T, D, generator=g)
    return (
        keys,
        values,
        pick(n) + torch.randn(H, n, D, generator=g),
        pick(n) + torch.randn(H, n, D, generator=g),
    )


def errors(layer: CompactedLayer, keys, values, q):
    """Mean over heads of relative output error and mean |mass ratio - 1|."""
    ref, lse = attend(q, keys, values)
    out_e, mass_e = [], []
    for h in range(keys.shape[0]):
        k, v, b = layer.head(h)
        o, l_c = attend(q[h], k, v, b)
        out_e.append(float((o - ref[h]).norm() / ref[h].norm()))
        mass_e.append(float((l_c - lse[h]).exp().sub(1).abs().mean()))
    return sum(out_e) / len(out_e), sum(mass_e) / len(mass_e)


def test_omp_exact_recovery_of_duplicated_keys():
    """T keys = t distinct keys, key j repeated m_j times (same value): the exact answer
    is one copy of each with beta_j = log m_j and the original values."""
    g = torch.Generator().manual_seed(0)
    H, t, D = 2, 7, 16
    distinct_k = torch.randn(H, t, D, generator=g) * 0.7
    distinct_v = torch.randn(H, t, D, generator=g)
    mult = torch.randint(1, 6, (t,), generator=g)
    src = torch.repeat_interleave(torch.arange(t), mult)
    perm = torch.randperm(src.numel(), generator=g)
    src = src[perm]
    keys, values = distinct_k[:, src], distinct_v[:, src]
    q_fit = torch.randn(H, 200, D, generator=g)
    q_eval = torch.randn(H, 200, D, generator=g)
    layer = get_method("am-omp", value_ridge=1e-7).compact_layer(keys, values, q_fit, [t] * H)
    assert layer.head_lengths() == [t] * H
    assert layer.kept_indices is not None
    for h in range(H):
        lo, hi = int(layer.indptr[h]), int(layer.indptr[h + 1])
        chosen = src[layer.kept_indices[lo:hi]]
        assert sorted(chosen.tolist()) == list(range(t))  # one copy of each distinct key
        torch.testing.assert_close(layer.beta[lo:hi], mult[chosen].float().log(), atol=1e-3, rtol=0)
        torch.testing.assert_close(layer.values[lo:hi], distinct_v[h, chosen], atol=1e-3, rtol=1e-3)
    out_err, mass_err = errors(layer, keys, values, q_eval)
    assert out_err < 1e-3 and mass_err < 1e-3


def test_one_table_names_every_method_and_facts_need_no_instance(monkeypatch):
    """Every method is in `METHODS`, each name imports only its own module, class-level facts
    are read without building a method, and a table name cannot be taken by another class."""
    import subprocess
    import sys

    from compactor.methods import METHODS, register_method

    assert set(METHODS) <= set(list_methods()) and len(METHODS) == 12
    code = ("import sys; from compactor.methods import method_class; "
            "c = method_class('kv-compress'); "
            "print(c.own_budget, sorted(m for m in sys.modules if m.startswith('compactor.methods.')))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "compactor.methods.kv_compress" in out.stdout
    assert "compactor.methods.baselines" not in out.stdout  # no discovery of the others
    built = []
    monkeypatch.setattr(CompactionMethod, "__init__", lambda *a, **k: built.append(a))
    for name in METHODS:
        cls = method_class(name)
        assert cls.name == name and isinstance(cls.needs_context, bool)
    assert built == []
    with pytest.raises(ValueError, match=r"belongs to compactor\.methods\.attention_matching"):

        @register_method("am-highest")
        @dataclasses.dataclass
        class Impostor(CompactionMethod):
            def compact(self, x):  # pragma: no cover - never called
                raise AssertionError


def test_registry():
    names = list_methods()
    for n in [*AM, "keep-only"]:
        assert n in names
    with pytest.raises(ValueError, match="unknown compaction method"):
        get_method("no-such-method")
    with pytest.raises(ValueError, match="no parameter"):
        get_method("am-omp", kk=3)
    fast = get_method("am-omp-fast")
    assert (fast.k, fast.tau) == (4, 2) and fast.name == "am-omp-fast"
    assert get_method("keep-only", inner="am-highest").params() == {
        "inner": "am-highest",
        "inner_params": get_method("am-highest").params(),
    }


def test_registry_imports_lazily():
    code = (
        "import sys, compactor.methods as m; "
        "assert 'compactor.methods.attention_matching' not in sys.modules; "
        "m.get_method('am-omp'); "
        "assert 'compactor.methods.attention_matching' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "name, params",
    [
        ("am-omp", {"k": 0}),
        ("am-omp", {"tau": 0}),
        ("am-omp", {"k": 1.5}),
        ("am-omp", {"prune_beta": 1.0}),
        ("am-omp-fast", {"value_ridge": -1.0}),
        ("am-highest", {"beta_bounds": (1.0, 2.0)}),
        ("am-highest", {"beta_bounds": (-math.inf, 3)}),
        ("am-highest", {"beta_bounds": 3}),
        ("keep-only", {"inner": 3}),
    ],
)
def test_bad_hyper_parameters(name, params):
    with pytest.raises(ValueError):
        get_method(name, **params)


@pytest.mark.parametrize("budgets", [[0, 3], [3, 300], [3]])
def test_bad_budgets(budgets):
    keys, values, q, _ = clustered(T=64, n=32)
    with pytest.raises(ValueError, match="budget"):
        get_method("am-omp").compact_layer(keys, values, q, budgets)


def test_bad_shapes():
    keys, values, q, _ = clustered(T=64, n=32)
    m = get_method("am-highest")
    with pytest.raises(ValueError, match="values"):
        m.compact_layer(keys, values[:, :10], q, [4, 4])
    with pytest.raises(ValueError, match="queries"):
        m.compact_layer(keys, values, q[:1], [4, 4])


@pytest.mark.parametrize("name", [*AM, "keep-only"])
def test_ragged_budgets_respected_and_valid(name):
    keys, values, q, _ = clustered(H=3, T=128, n=192)
    keys, values = keys.to(torch.bfloat16), values.to(torch.bfloat16)
    budgets = [5, 17, 1]
    layer = get_method(name).compact_layer(keys, values, q.to(torch.bfloat16), budgets)
    lengths = layer.head_lengths()
    assert all(1 <= n <= b for n, b in zip(lengths, budgets))
    if name in ("am-highest", "keep-only"):
        assert lengths == budgets
    assert layer.keys.dtype == torch.bfloat16 and layer.values.dtype == torch.bfloat16
    assert layer.beta.dtype == torch.float32
    prefix = CompactedPrefix(
        "fp", 128, "h", name, get_method(name).params(), [layer], 32, 3, torch.bfloat16
    )
    prefix.validate("fp", num_layers=1, num_kv_heads=3, head_dim=32)
    assert layer.kept_indices is not None
    for h in range(3):
        lo, hi = int(layer.indptr[h]), int(layer.indptr[h + 1])
        idx = layer.kept_indices[lo:hi]
        assert idx.unique().numel() == idx.numel()
        assert torch.equal(layer.keys[lo:hi], keys[h, idx])  # keys are original post-RoPE keys


def test_batched_equals_per_head_loop():
    keys, values, q, _ = clustered(H=3, T=96, n=128, seed=3)
    budgets = [4, 11, 7]
    for name in AM:
        m = get_method(name)
        batched = m.compact_layer(keys, values, q, budgets)
        for h in range(3):
            single = m.compact_layer(keys[h : h + 1], values[h : h + 1], q[h : h + 1], [budgets[h]])
            lo, hi = int(batched.indptr[h]), int(batched.indptr[h + 1])
            assert batched.kept_indices is not None and single.kept_indices is not None
            assert torch.equal(batched.kept_indices[lo:hi], single.kept_indices), name
            torch.testing.assert_close(batched.beta[lo:hi], single.beta, atol=1e-3, rtol=1e-3)


def test_beta_bounds():
    keys, values, q, _ = clustered(T=200, n=300, seed=1)
    hi_layer = get_method("am-highest").compact_layer(keys, values, q, [20, 20])
    assert hi_layer.beta.min() >= -3 - 1e-5 and hi_layer.beta.max() <= 3 + 1e-5
    tight = get_method("am-highest", beta_bounds=(-0.5, 0.5)).compact_layer(
        keys, values, q, [20, 20]
    )
    assert tight.beta.abs().max() <= 0.5 + 1e-5
    for name in ("am-omp", "am-omp-fast"):
        layer = get_method(name).compact_layer(keys, values, q, [20, 20])
        assert torch.isfinite(layer.beta).all() and layer.beta.min() >= -7 - 1e-4
    keep = get_method("keep-only").compact_layer(keys, values, q, [20, 20])
    assert (keep.beta == 0).all()


def test_keep_only_uses_the_inner_selection_and_original_values():
    keys, values, q, _ = clustered(T=128, n=160, seed=2)
    omp = get_method("am-omp").compact_layer(keys, values, q, [12, 12])
    keep = get_method("keep-only").compact_layer(keys, values, q, [12, 12])
    assert omp.kept_indices is not None and keep.kept_indices is not None
    assert torch.equal(omp.kept_indices, keep.kept_indices)
    for h in range(2):
        lo, hi = int(keep.indptr[h]), int(keep.indptr[h + 1])
        assert torch.equal(keep.values[lo:hi], values[h, keep.kept_indices[lo:hi]])


@pytest.mark.parametrize("name", ["am-omp", "am-omp-fast"])
def test_omp_beats_keep_only_on_held_out(name):
    keys, values, q_fit, q_eval = clustered(T=256, n=512, seed=4)
    budgets = [26, 26]
    am = get_method(name).compact_layer(keys, values, q_fit, budgets)
    keep = get_method("keep-only", inner=name).compact_layer(keys, values, q_fit, budgets)
    am_out, am_mass = errors(am, keys, values, q_eval)
    keep_out, keep_mass = errors(keep, keys, values, q_eval)
    assert am_out < 0.8 * keep_out
    assert am_mass < 0.5 * keep_mass


def test_refit_after_any_selection_improves_fit():
    keys, values, q, _ = clustered(T=160, n=256, seed=5)
    g = torch.Generator().manual_seed(0)
    sel = Selection.from_lists(
        [torch.randperm(160, generator=g)[:16], torch.randperm(160, generator=g)[:9]]
    )
    assert sel.budgets() == [16, 9]
    fitted = refit(keys, values, q, sel)
    plain = refit(keys, values, q, sel, fit_beta=False, fit_values=False)
    assert (plain.beta == 0).all() and fitted.head_lengths() == [16, 9]
    f_out, f_mass = errors(fitted, keys, values, q)
    p_out, p_mass = errors(plain, keys, values, q)
    assert f_out < p_out and f_mass < p_mass


def test_keep_all_is_near_exact():
    keys, values, q, _ = clustered(T=48, n=128, seed=6)
    layer = get_method("am-highest").compact_layer(keys, values, q, [48, 48])
    out_e, mass_e = errors(layer, keys, values, q)
    assert out_e < 1e-2 and mass_e < 1e-3


def test_layer_input_validates_once_and_derives():
    keys, values, q, _ = clustered(H=2, T=40, n=8, D=16)
    x = LayerInput(keys, values, q, [5, 7.0])
    assert x.budgets == (5, 7) and all(type(b) is int for b in x.budgets)
    assert (x.H, x.T, x.D) == (2, 40, 16) and x.scale == 0.25
    assert LayerInput(keys, values, q, (5, 7), sm_scale=0.5).scale == 0.5
    assert x.targets is x.targets  # computed once, shared by a pick and its refit
    with pytest.raises(ValueError, match="sm_scale"):
        LayerInput(keys, values, q, (5, 7), sm_scale=-1.0)
    with pytest.raises(ValueError, match="values"):
        LayerInput(keys, values[:, :10], q, (5, 7))
    with pytest.raises(ValueError, match="queries"):
        LayerInput(keys, values, q[:1], (5, 7))
    with pytest.raises(ValueError, match="budget of head 1"):
        LayerInput(keys, values, q, (5, 41))
    with pytest.raises(ValueError, match="one budget per KV head"):
        LayerInput(keys, values, q, (5,))


@pytest.mark.parametrize("name", [*AM, "keep-only"])
def test_compact_result_equals_compact_layer(name):
    keys, values, q, _ = clustered(T=96, n=64, seed=7)
    m = get_method(name)
    res = m.compact(LayerInput(keys, values, q, (9, 14)))
    assert isinstance(res, MethodResult) and res.report == {}
    ref = m.compact_layer(keys, values, q, [9, 14])
    for f in ("keys", "values", "beta", "indptr", "kept_indices"):
        assert torch.equal(getattr(res.layer, f), getattr(ref, f))
    picked = m.pick(LayerInput(keys, values, q, (9, 14)))
    assert torch.equal(picked.selection.indices, m.select(keys, values, q, [9, 14]).indices)


def test_callers_conveniences_are_defined_once():
    """compact_layer / select / SelectingMethod.compact live in the base, never overridden."""
    for name in list_methods():
        cls = method_class(name)
        assert cls.compact_layer is CompactionMethod.compact_layer
        if issubclass(cls, SelectingMethod):
            assert cls.compact is SelectingMethod.compact
            assert cls.select is SelectingMethod.select
    for name in ("snapkv", "kvzip", "kvcompose", "compresskv", "am-highest"):
        assert issubclass(method_class(name), ScoreMethod)


def test_keep_only_needs_a_selecting_inner():
    @dataclasses.dataclass
    class _Whole(CompactionMethod):
        def compact(self, x: LayerInput) -> MethodResult:
            raise AssertionError("never called")

    with pytest.raises(ValueError, match="does not select a key subset"):
        get_method("keep-only", inner=_Whole())
    inner = get_method("kvzip")
    keys, values, q, _ = clustered(T=64, n=32)
    res = get_method("keep-only", inner=inner).compact(LayerInput(keys, values, q, (6, 6)))
    assert sum(res.report["budgets"]) == 12 and bool((res.layer.beta == 0).all())


def test_describe_methods_reads_the_dataclasses():
    infos = {m.name: m for m in describe_methods()}
    assert sorted(infos) == list_methods()
    omp = infos["am-omp"]
    assert omp.doc.startswith("OMP key selection") and "\n" not in omp.doc
    params = {p.name: p for p in omp.params}
    assert (params["k"].type, params["k"].default, params["k"].required) == ("int", 1, False)
    assert infos["am-omp-fast"].params[0].default == 4
    assert infos["gvote"].needs_context and not infos["snapkv"].needs_context
    assert infos["keep-only"].params[1].default == {}  # default_factory called
    assert [m.name for m in describe_methods(["kvzip"])] == ["kvzip"]
    with pytest.raises(ValueError, match="unknown compaction method"):
        describe_methods(["no-such-method"])


def test_blocked_targets_and_fits_match_the_one_block_path():
    """A tiny work budget (blocks of heads and queries, phi never kept) gives the same
    reference statistics, selections and refit as the one-block path."""
    from compactor.methods.attention_matching import highest_attention_select, omp_select
    from compactor.methods.targets import Targets

    keys, values, q, _ = clustered(H=3, T=120, n=150, seed=7)
    scale = 32**-0.5
    big = Targets(keys, values, q, scale)
    small = Targets(keys, values, q, scale, block_bytes=4 * 120 * 40)  # 40 query rows
    for a, b in ((big.mass, small.mass), (big.out, small.out), (big.rowmax, small.rowmax)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(big.key_rms(), small.key_rms(), atol=1e-6, rtol=1e-5)
    assert small._phi is None and small.heads_per_block() == 1
    torch.testing.assert_close(big.phi[1:3], small.phi_heads(1, 3), atol=1e-6, rtol=1e-5)
    budgets = [12, 7, 12]
    sel = highest_attention_select(big, budgets)
    assert torch.equal(sel.indices, highest_attention_select(small, budgets).indices)
    omp_big = omp_select(big, budgets, k=4, tau=2)
    omp_small = omp_select(small, budgets, k=4, tau=2)
    assert torch.equal(omp_big.indices, omp_small.indices)
    assert torch.equal(omp_big.mask, omp_small.mask)
    a = refit(keys, values, q, sel, beta_bounds=(-3.0, 3.0), targets=big)
    b = refit(keys, values, q, sel, beta_bounds=(-3.0, 3.0), targets=small)
    torch.testing.assert_close(a.beta, b.beta, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(a.values, b.values, atol=1e-4, rtol=1e-4)

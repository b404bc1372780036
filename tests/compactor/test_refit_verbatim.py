"""The AM refit with some kept entries held verbatim (beta 0, their own values)."""

from __future__ import annotations

import math

import pytest
import torch

from compactor.methods import Selection, get_method
from compactor.methods.refit import fit_layer_values, refit
from compactor.methods.targets import reference_targets

D = 16


def _layer(H: int = 3, T: int = 41, n: int = 57, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(H, T, D, generator=g),
        torch.randn(H, T, D, generator=g),
        torch.randn(H, n, D, generator=g),
    )


def _selection(T: int, budgets: list[int], seed: int = 1) -> Selection:
    g = torch.Generator().manual_seed(seed)
    return Selection.from_lists([torch.randperm(T, generator=g)[:t].sort().values for t in budgets])


def _residuals(k, v, q, layer) -> tuple[float, float]:
    """Sums over heads and queries of the squared mass and output errors."""
    scale, mass_e, out_e = 1 / math.sqrt(D), 0.0, 0.0
    for h in range(k.shape[0]):
        w = torch.exp(q[h] @ k[h].T * scale)
        ck, cv, b = layer.head(h)
        wc = torch.exp(q[h] @ ck.float().T * scale + b)
        mass_e += float((wc.sum(-1) - w.sum(-1)).square().sum())
        o = (w @ v[h]) / w.sum(-1, keepdim=True)
        oc = (wc @ cv.float()) / wc.sum(-1, keepdim=True)
        out_e += float((oc - o).square().sum())
    return mass_e, out_e


def test_verbatim_entries_keep_beta_0_and_their_values_and_the_rest_is_fitted() -> None:
    k, v, q = _layer()
    sel = _selection(41, [9, 5, 12])
    verbatim = torch.zeros_like(sel.mask)
    verbatim[0, [1, 4]] = True
    verbatim[2, 0] = True
    verbatim[1, :5] = True  # a head held whole
    layer = refit(k, v, q, sel, verbatim=verbatim)
    plain = refit(k, v, q, sel, fit_beta=False, fit_values=False)
    held = verbatim[sel.mask]  # the packed entries held verbatim
    assert torch.equal(layer.kept_indices, plain.kept_indices)
    assert torch.equal(layer.beta[held], torch.zeros(int(held.sum())))
    assert torch.equal(layer.values[held], plain.values[held])
    assert bool((layer.beta[~held] != 0).any())
    assert not torch.equal(layer.values[~held], plain.values[~held])
    # head 1 held whole is the plain selection; the others fit better than it
    assert torch.equal(layer.values[9:14], plain.values[9:14])
    m_fit, o_fit = _residuals(k[[0, 2]], v[[0, 2]], q[[0, 2]], _pick_heads(layer, [0, 2]))
    m_plain, o_plain = _residuals(k[[0, 2]], v[[0, 2]], q[[0, 2]], _pick_heads(plain, [0, 2]))
    assert m_fit < m_plain and o_fit < o_plain


def test_no_verbatim_entry_is_the_plain_refit() -> None:
    k, v, q = _layer(seed=2)
    sel = _selection(41, [7, 11, 3], seed=3)
    none = torch.zeros_like(sel.mask)
    a, b = refit(k, v, q, sel), refit(k, v, q, sel, verbatim=none)
    torch.testing.assert_close(a.beta, b.beta, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.values, b.values, atol=1e-4, rtol=1e-4)


def test_verbatim_values_need_their_prior() -> None:
    k, v, q = _layer(seed=4)
    sel = _selection(41, [3, 3, 3])
    tg = reference_targets(k, v, q, 1 / math.sqrt(D))
    ck = torch.gather(k, 1, sel.indices.unsqueeze(-1).expand(-1, -1, D))
    beta = torch.zeros(sel.indices.shape)
    with pytest.raises(ValueError, match="prior"):
        fit_layer_values(q, ck, beta, sel, tg, sm_scale=0.25, verbatim=sel.mask)


def test_kvzip_holds_the_keys_a_query_reads_sharply_verbatim() -> None:
    k, v, q = _layer(H=3, T=45, n=31, seed=6)
    k[1, 17] = 6 * q[1, 4] / q[1, 4].norm()  # query 4 of head 1 reads key 17 sharply
    budgets = [7, 9, 5]
    plain = get_method("kvzip").compact_layer(k, v, q, budgets)
    fitted = get_method("kvzip", refit="am").compact_layer(k, v, q, budgets)
    held = get_method("kvzip", refit="am", refit_verbatim=0.5).compact_layer(k, v, q, budgets)
    assert torch.equal(held.kept_indices, plain.kept_indices)
    lo = int(held.indptr[1])
    j = lo + _kept(held, 1).index(17)
    assert float(held.beta[j]) == 0.0 and torch.equal(held.values[j], v[1, 17])
    assert not torch.equal(fitted.values[j], v[1, 17])  # the plain refit moves it
    everything = get_method("kvzip", refit="am", refit_verbatim=1e-9)
    whole = everything.compact_layer(k, v, q, budgets)  # every kept key is read a little
    assert torch.equal(whole.values, plain.values) and not bool(whole.beta.any())


def test_kvzip_holds_a_head_a_query_reads_sharply_whole() -> None:
    """refit_hold="heads": head 1 (query 4 reads key 17 sharply) is kept as selected, every
    entry of it; heads 0 and 2 (no read >= 0.5) are fitted as by the plain refit."""
    k, v, q = _layer(H=3, T=45, n=31, seed=6)
    k[1, 17] = 6 * q[1, 4] / q[1, 4].norm()
    budgets = [7, 9, 5]
    plain = get_method("kvzip").compact_layer(k, v, q, budgets)
    fitted = get_method("kvzip", refit="am").compact_layer(k, v, q, budgets)
    m = get_method("kvzip", refit="am", refit_verbatim=0.5, refit_hold="heads")
    held = m.compact_layer(k, v, q, budgets)
    lo, hi = int(held.indptr[1]), int(held.indptr[2])
    assert torch.equal(held.values[lo:hi], plain.values[lo:hi])
    assert not bool(held.beta[lo:hi].any())
    for a, b in ((0, lo), (hi, int(held.indptr[3]))):
        torch.testing.assert_close(held.values[a:b], fitted.values[a:b])
        torch.testing.assert_close(held.beta[a:b], fitted.beta[a:b])
    with pytest.raises(ValueError, match="refit_hold must be one of"):
        get_method("kvzip", refit="am", refit_verbatim=0.5, refit_hold="layers")
    with pytest.raises(ValueError, match="refit_hold='heads' needs refit_verbatim"):
        get_method("kvzip", refit="am", refit_hold="heads")


@pytest.mark.parametrize(
    "params",
    [
        {"refit": "am", "refit_verbatim": 0.0},
        {"refit": "am", "refit_verbatim": 1.5},
        {"refit": "am", "refit_verbatim": True},
        {"refit": "am", "refit_verbatim": "0.5"},
        {"refit_verbatim": 0.5},  # nothing to hold out of
    ],
)
def test_bad_refit_verbatim_raises(params: dict) -> None:
    with pytest.raises(ValueError, match="refit_verbatim"):
        get_method("kvzip", **params)


def _kept(layer, h: int) -> list[int]:
    return layer.kept_indices[int(layer.indptr[h]) : int(layer.indptr[h + 1])].tolist()


def _pick_heads(layer, heads: list[int]):
    """A CompactedLayer-like view of some heads (what `_residuals` reads: .head(h))."""

    class _View:
        def head(self, h: int):
            return layer.head(heads[h])

    return _View()

"""Solvers against scipy / closed forms."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.optimize as so
import torch

from compactor.solvers import NNLSOptions, attend, lstsq_values, nnls, nnls_gram


@pytest.mark.parametrize("seed", range(6))
def test_nnls_matches_scipy(seed):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(60, 13, generator=g, dtype=torch.float64)
    b = torch.randn(60, generator=g, dtype=torch.float64)
    w = nnls(A, b)
    ref, _ = so.nnls(A.numpy(), b.numpy())
    np.testing.assert_allclose(w.numpy(), ref, atol=1e-9)


def test_nnls_batched_and_masked_match_per_problem():
    g = torch.Generator().manual_seed(1)
    A = torch.rand(3, 80, 9, generator=g, dtype=torch.float64)
    b = torch.rand(3, 80, generator=g, dtype=torch.float64) * 3
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[1, 6:] = False
    mask[2, 3:] = False
    w = nnls(A, b, NNLSOptions(mask=mask))
    for h in range(3):
        m = mask[h].numpy()
        ref, _ = so.nnls(A[h].numpy()[:, m], b[h].numpy())
        np.testing.assert_allclose(w[h].numpy()[m], ref, atol=1e-8)
        assert (w[h][~mask[h]] == 0).all()


def test_nnls_box_bounds_match_lsq_linear():
    g = torch.Generator().manual_seed(2)
    A = torch.rand(2, 300, 20, generator=g, dtype=torch.float64)
    b = A[:, :, :8].sum(-1) * 1.5 + 0.05 * torch.rand(2, 300, generator=g, dtype=torch.float64)
    lo, hi = math.exp(-3), math.exp(3)
    w = nnls(A, b, NNLSOptions(lo, hi))
    for h in range(2):
        ref = so.lsq_linear(A[h].numpy(), b[h].numpy(), bounds=(lo, hi), tol=1e-14).x
        np.testing.assert_allclose(w[h].numpy(), ref, atol=1e-6)
    assert (w >= lo - 1e-12).all() and (w <= hi + 1e-12).all()


def test_nnls_fp32_exact_recovery():
    g = torch.Generator().manual_seed(3)
    A = torch.rand(500, 12, generator=g)
    w_true = torch.rand(12, generator=g) + 0.5
    w = nnls(A, A @ w_true)
    assert w.dtype == torch.float32
    torch.testing.assert_close(w, w_true, rtol=1e-3, atol=1e-3)


def _box_problem(B, m, k, seed):
    """Attention-mass-like box NNLS: positive features, target a positive combination."""
    g = torch.Generator().manual_seed(seed)
    A = torch.rand(B, m, k, generator=g, dtype=torch.float64) ** 3
    w_true = torch.rand(B, k, generator=g, dtype=torch.float64) * 4
    b = (A @ w_true.unsqueeze(-1)).squeeze(-1) + 0.3 * torch.rand(B, m, generator=g).double()
    return A, b


def _objective(A, b, w, ridge):
    G = A.transpose(1, 2) @ A
    lam = ridge * torch.diagonal(G, dim1=1, dim2=2).mean(-1)
    res = (A @ w.unsqueeze(-1)).squeeze(-1) - b
    return 0.5 * (res.square().sum(-1) + lam * w.square().sum(-1))


@pytest.mark.parametrize("m,k", [(200, 30), (40, 90)])
def test_nnls_fixed_rounds_reach_the_exact_box_solution(m, k):
    """The fixed-work path (no host sync; kernel form when m < k) finds the exact solution
    of well-posed box problems within its rounds, and is always feasible."""
    A, b = _box_problem(3, m, k, seed=m)
    lo, hi = math.exp(-3), math.exp(3)
    exact = nnls(A, b, NNLSOptions(lo, hi, ridge=1e-3))
    for rounds in (16, 2):
        w = nnls(A, b, NNLSOptions(lo, hi, ridge=1e-3, rounds=rounds))
        assert w.dtype == torch.float64 and w.shape == (3, k)
        assert (w >= lo).all() and (w <= hi).all()
        f, f_ex = _objective(A, b, w, 1e-3), _objective(A, b, exact, 1e-3)
        assert (f >= f_ex - 1e-9 * f_ex.abs()).all()
        if rounds == 16:
            torch.testing.assert_close(w, exact, atol=1e-7, rtol=1e-7)
    # fp32 input, mask: padded entries are 0, the rest matches the fp64 answer closely
    mask = torch.ones(3, k, dtype=torch.bool)
    mask[1, k // 2 :] = False
    w32 = nnls(A.float(), b.float(), NNLSOptions(lo, hi, mask, ridge=1e-3, rounds=16))
    ref = nnls(A, b, NNLSOptions(lo, hi, mask, ridge=1e-3))
    assert w32.dtype == torch.float32 and (w32[~mask] == 0).all()
    rel = (_objective(A, b, w32.double(), 1e-3) - _objective(A, b, ref, 1e-3)) / _objective(
        A, b, ref, 1e-3
    )
    assert rel.abs().max() < 1e-4


def test_nnls_gram_fixed_rounds_never_worse_than_the_clamped_start():
    A, b = _box_problem(4, 120, 25, seed=7)
    G = A.transpose(1, 2) @ A
    c = (A.transpose(1, 2) @ b.unsqueeze(-1)).squeeze(-1)
    lo, hi = 0.5, 2.0
    start = torch.linalg.solve(G, c).clamp(lo, hi)
    w0 = nnls_gram(G, c, NNLSOptions(lo, hi, rounds=0))
    torch.testing.assert_close(w0, start, atol=1e-9, rtol=1e-9)  # 0 rounds: clamped LS
    w = nnls_gram(G, c, NNLSOptions(lo, hi, rounds=3))
    assert (_objective(A, b, w, 0.0) <= _objective(A, b, start, 0.0) + 1e-12).all()
    with pytest.raises(ValueError, match="rounds"):
        nnls_gram(G, c, NNLSOptions(rounds=-1))


def test_nnls_shape_errors():
    with pytest.raises(ValueError):
        nnls(torch.zeros(4, 3), torch.zeros(5))
    with pytest.raises(ValueError, match="lower"):
        nnls(torch.zeros(4, 3), torch.zeros(4), NNLSOptions(2.0, 1.0))


def test_lstsq_values_closed_form():
    g = torch.Generator().manual_seed(4)
    P = torch.softmax(torch.randn(2, 50, 7, generator=g, dtype=torch.float64), -1)
    Y = torch.randn(2, 50, 5, generator=g, dtype=torch.float64)
    C = lstsq_values(P, Y, ridge=0.0)
    ref = torch.linalg.lstsq(P, Y).solution
    torch.testing.assert_close(C, ref, atol=1e-6, rtol=1e-6)
    # ridge towards a prior: closed form (P'P + lam I) C = P'Y + lam prior
    prior = torch.randn(2, 7, 5, generator=g, dtype=torch.float64)
    ridge = 0.1
    C2 = lstsq_values(P, Y, ridge=ridge, prior=prior)
    G = P.transpose(1, 2) @ P
    lam = ridge * torch.diagonal(G, dim1=1, dim2=2).mean(-1)[:, None, None]
    ref2 = torch.linalg.solve(
        G + lam * torch.eye(7, dtype=torch.float64), P.transpose(1, 2) @ Y + lam * prior
    )
    torch.testing.assert_close(C2, ref2, atol=1e-9, rtol=1e-9)


def test_lstsq_values_masked_rows_match_subproblem():
    g = torch.Generator().manual_seed(5)
    P = torch.rand(40, 6, generator=g, dtype=torch.float64)
    Y = torch.randn(40, 3, generator=g, dtype=torch.float64)
    mask = torch.tensor([True, True, False, True, False, True])
    P_masked = P * mask
    C = lstsq_values(P_masked, Y, ridge=0.0, mask=mask)
    ref = torch.linalg.lstsq(P[:, mask], Y).solution
    torch.testing.assert_close(C[mask], ref, atol=1e-6, rtol=1e-6)
    assert (C[~mask] == 0).all()


def test_lstsq_values_kernel_form_when_fewer_rows_than_unknowns():
    """n < t goes through the [n, n] kernel system: the same ridge solution as the normal
    equations (closed form), padded rows still come back as the prior."""
    g = torch.Generator().manual_seed(8)
    P = torch.softmax(torch.randn(2, 9, 20, generator=g, dtype=torch.float64), -1)
    Y = torch.randn(2, 9, 4, generator=g, dtype=torch.float64)
    prior = torch.randn(2, 20, 4, generator=g, dtype=torch.float64)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, 15:] = False
    Pm = P * mask.unsqueeze(1)
    C = lstsq_values(Pm, Y, ridge=0.05, prior=prior, mask=mask)
    for h in range(2):
        m = mask[h]
        Ph = Pm[h][:, m]
        G = Ph.T @ Ph
        lam = 0.05 * torch.diagonal(G).mean()
        ref = torch.linalg.solve(
            G + lam * torch.eye(int(m.sum()), dtype=G.dtype), Ph.T @ Y[h] + lam * prior[h][m]
        )
        torch.testing.assert_close(C[h][m], ref, atol=1e-8, rtol=1e-8)
        assert torch.equal(C[h][~m], prior[h][~m])
    C32 = lstsq_values(Pm.float(), Y.float(), ridge=0.05, mask=mask)
    assert C32.dtype == torch.float32 and (C32[1, 15:] == 0).all()


def test_attend_matches_sdpa_and_beta_is_log_weight():
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, n, 16, generator=g) for n in (5, 9, 9))
    out, _lse = attend(q, k, v)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # duplicating a key == one copy with beta = log 2
    k2, v2 = torch.cat([k, k[:, :1]], 1), torch.cat([v, v[:, :1]], 1)
    beta = torch.zeros(2, 9)
    beta[:, 0] = math.log(2)
    o1, l1 = attend(q, k2, v2)
    o2, l2 = attend(q, k, v, beta)
    torch.testing.assert_close(o1, o2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(l1, l2, atol=1e-5, rtol=1e-5)

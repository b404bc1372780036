"""Solvers against scipy / closed forms."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.optimize as so
import torch

from compactor.solvers import attend, lstsq_values, nnls


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
    w = nnls(A, b, mask=mask)
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
    w = nnls(A, b, lower=lo, upper=hi)
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


def test_nnls_shape_errors():
    with pytest.raises(ValueError):
        nnls(torch.zeros(4, 3), torch.zeros(5))
    with pytest.raises(ValueError, match="lower"):
        nnls(torch.zeros(4, 3), torch.zeros(4), lower=2.0, upper=1.0)


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

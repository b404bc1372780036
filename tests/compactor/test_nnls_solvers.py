"""nnls_projected (reference clamped least squares + projected gradient) against scipy."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.optimize as so
import torch

from compactor.methods.refit import fit_beta_nnls
from compactor.solvers import NNLSOptions, nnls, nnls_projected


def _objective(A: torch.Tensor, b: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (torch.bmm(A, w.unsqueeze(-1)).squeeze(-1) - b).square().sum(-1)


@pytest.mark.parametrize("seed", range(4))
def test_projected_reaches_scipy_on_well_conditioned_problems(seed):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(3, 61, 7, generator=g, dtype=torch.float64)
    b = torch.randn(3, 61, generator=g, dtype=torch.float64)
    w = nnls_projected(A, b, iters=3000)
    for h in range(3):
        ref, _ = so.nnls(A[h].numpy(), b[h].numpy())
        np.testing.assert_allclose(w[h].numpy(), ref, atol=1e-6)
    # KKT: gradient >= 0 on the zero entries, ~0 on the positive ones
    grad = torch.bmm(
        A.transpose(1, 2), torch.bmm(A, w.unsqueeze(-1)).squeeze(-1).unsqueeze(-1)
    ).squeeze(-1)
    grad = grad - torch.bmm(A.transpose(1, 2), b.unsqueeze(-1)).squeeze(-1)
    assert (grad[w <= 0] >= -1e-6).all()
    assert grad[w > 1e-8].abs().max() < 1e-6


def test_projected_is_exact_when_least_squares_is_inside_the_box():
    g = torch.Generator().manual_seed(5)
    A = torch.rand(2, 97, 11, generator=g, dtype=torch.float64)
    w_true = torch.rand(2, 11, generator=g, dtype=torch.float64) + 0.5
    b = torch.bmm(A, w_true.unsqueeze(-1)).squeeze(-1)
    w = nnls_projected(A, b, iters=0)
    torch.testing.assert_close(w, w_true, rtol=1e-6, atol=1e-6)


def test_projected_box_mask_and_fewer_rows_than_unknowns():
    g = torch.Generator().manual_seed(6)
    lo, hi = math.exp(-3), math.exp(3)
    for m, k in [(53, 9), (7, 13)]:  # Gram path, then the kernel (m < k) path
        A = torch.rand(3, m, k, generator=g)
        b = A[:, :, :4].sum(-1) * 2.0
        mask = torch.ones(3, k, dtype=torch.bool)
        mask[1, k - 3 :] = False
        w = nnls_projected(A, b, NNLSOptions(lo, hi, mask=mask, ridge=1e-6), iters=5)
        assert w.dtype == torch.float32 and w.shape == (3, k)
        assert (w[~mask] == 0).all()
        assert (w[mask] >= lo - 1e-6).all() and (w[mask] <= hi * (1 + 1e-6)).all()
        # every projected step lowers the objective: never worse than the clamped start
        w0 = nnls_projected(A, b, NNLSOptions(lo, hi, mask=mask, ridge=1e-6), iters=0)
        A0 = A * mask.unsqueeze(1)
        assert (_objective(A0, b, w) <= _objective(A0, b, w0) * (1 + 1e-5) + 1e-6).all()


def test_projected_single_problem_and_errors():
    g = torch.Generator().manual_seed(7)
    A = torch.rand(40, 5, generator=g, dtype=torch.float64)
    b = torch.rand(40, generator=g, dtype=torch.float64)
    w = nnls_projected(A, b, iters=4000)
    np.testing.assert_allclose(w.numpy(), nnls(A, b).numpy(), atol=1e-6)
    assert nnls_projected(A[:, :0], b).shape == (0,)
    with pytest.raises(ValueError):
        nnls_projected(A, b[:-1])
    with pytest.raises(ValueError):
        nnls_projected(A, b, iters=-1)


def test_fit_beta_nnls_solver_switch():
    g = torch.Generator().manual_seed(8)
    A = torch.rand(2, 64, 6, generator=g)
    mass = A.sum(-1) * 1.3
    mask = torch.ones(2, 6, dtype=torch.bool)
    b_as = fit_beta_nnls(A, mass, mask, (-3.0, 3.0), solver="active-set")
    b_pg = fit_beta_nnls(A, mass, mask, (-3.0, 3.0), solver="projected")
    torch.testing.assert_close(b_pg, b_as, atol=1e-3, rtol=1e-3)
    with pytest.raises(ValueError):
        fit_beta_nnls(A, mass, mask, (-3.0, 3.0), solver="nope")


def test_auto_solver_is_the_active_set_on_the_cpu_and_projected_elsewhere():
    from compactor.methods.refit import nnls_solver_for

    assert nnls_solver_for("auto", "cpu") == "active-set"
    assert nnls_solver_for("auto", torch.device("cuda", 0)) == "projected"
    assert nnls_solver_for("auto", "meta") == "projected"
    assert nnls_solver_for("projected", "cpu") == "projected"
    with pytest.raises(ValueError, match="unknown NNLS solver"):
        nnls_solver_for("nope", "cpu")
    g = torch.Generator().manual_seed(9)
    A = torch.rand(3, 50, 7, generator=g)
    mass = A[:, :, :3].sum(-1) * 1.7
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[2, 5:] = False
    auto = fit_beta_nnls(A, mass, mask, (-3.0, 3.0), solver="auto")
    assert torch.equal(auto, fit_beta_nnls(A, mass, mask, (-3.0, 3.0), solver="active-set"))
    assert torch.equal(auto, fit_beta_nnls(A, mass, mask, (-3.0, 3.0)))  # the default: auto

"""fp32 solvers for Attention Matching: box-bounded NNLS and ridge least-squares values.

Shape legend: T prefix tokens, t kept, n reference queries, H_q/H_kv heads, D head dim,
B batch (usually H_kv: one independent problem per KV head), m rows, k unknowns.

All functions accept a single problem (``A [m, k]``) or a batch (``A [B, m, k]``); they
compute in fp32 (or fp64 if given fp64) on the device of their inputs and mutate nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from compaction_kernels.biased_attention.reference import biased_attention_lse
from compactor._boxqp import GramOps, box, fixed_work, nnls_data, pdas, polish

__all__ = [
    "NNLS_SOLVERS",
    "NNLSOptions",
    "attend",
    "lstsq_values",
    "nnls",
    "nnls_gram",
    "nnls_projected",
]

# Box-NNLS solvers by name (see compactor.methods.refit.NNLS_SOLVER): the fixed-round
# active set (:func:`nnls`) and the reference clamped least squares + projected gradient.
NNLS_SOLVERS = ("active-set", "projected")


@dataclass(frozen=True)
class NNLSOptions:
    """The box, padding and solver settings of one box-NNLS solve (every solver takes one).

    Shape legend as in the module: B problems, k unknowns; w [k] or [B, k].

    Attributes:
        lower / upper: bounds, scalars or tensors broadcastable to w ([k] / [B, k]);
            ``upper=None`` means +inf. Default: plain NNLS (w >= 0).
        mask: optional [k] / [B, k] bool; False entries are padding and are returned as 0.
        ridge: Tikhonov term, relative to the mean diagonal of A^T A.
        rounds: None = exact (see :func:`nnls_gram`); an int = fixed work, no host sync
            per round. With fewer rows than unknowns (m < k) the fixed-work path solves in
            fp64 through the [m, m] kernel matrices (lam I + A_F A_F'), never forming A'A.
        polish_rounds: cap on the exact path's active-set rounds (default 2k + 18).
    :func:`nnls_projected` reads the box, mask and ridge only (it has ``iters`` instead).
    """

    lower: float | torch.Tensor = 0.0
    upper: float | torch.Tensor | None = None
    mask: torch.Tensor | None = None
    ridge: float = 0.0
    rounds: int | None = None
    polish_rounds: int | None = None


def nnls(A: torch.Tensor, b: torch.Tensor, opts: NNLSOptions | None = None) -> torch.Tensor:
    """Box-bounded non-negative least squares: argmin_w ||A w - b||^2, lower <= w <= upper.

    Args:
        A: [m, k] or [B, m, k].
        b: [m] or [B, m].
        opts: bounds, padding mask, ridge and rounds (:class:`NNLSOptions`; None: plain
            exact NNLS, w >= 0).

    Returns:
        w: [k] or [B, k], dtype of A promoted to at least fp32.
    """
    o = opts or NNLSOptions()
    A, b, mask, batched = _as_batch(A, b, o.mask)
    dt = torch.promote_types(A.dtype, torch.float32)
    A, b = A.to(dt), b.to(dt)
    if o.rounds is not None and A.shape[1] < A.shape[2]:
        # fewer rows than unknowns: solve in the rows' space, in fp64 (see _DataOps)
        w = nnls_data(A, b, o.lower, o.upper, mask, o.ridge, o.rounds).to(dt)
        return w if batched else w.squeeze(0)
    G = A.transpose(1, 2) @ A
    c = (A.transpose(1, 2) @ b.unsqueeze(-1)).squeeze(-1)
    w = nnls_gram(G, c, replace(o, mask=mask))
    return w if batched else w.squeeze(0)


def nnls_gram(G: torch.Tensor, c: torch.Tensor, opts: NNLSOptions | None = None) -> torch.Tensor:
    """Box-bounded QP min 0.5 w'Gw - c'w on the normal equations (G = A'A, c = A'b).

    Both paths start from the least-squares solution and run primal-dual active-set
    (PDAS, semismooth Newton) rounds: guess the entries at each bound from the last
    iterate and its gradient, solve the free entries exactly (one batched Cholesky per
    round for all B problems), keep the best feasible iterate seen.

    * ``rounds=None`` (exact): 8 such rounds as a warm start, then primal active-set
      rounds until the KKT conditions hold (a host sync per round to test them); exact up
      to rounding whenever it converges within ``polish_rounds`` (default 2k + 18).
    * ``rounds=R`` (fixed work): at most R + 1 Cholesky factorizations: ceil(R/2) PDAS
      rounds, then primal active-set rounds from the best iterate (monotone). No host
      sync but a convergence test every round on the CPU (free there) and every 4 rounds
      elsewhere; feasible by construction. Well-posed attention-mass problems (more
      queries than kept keys) reach the exact answer in a few rounds; underdetermined
      ones (fewer queries than keys, where PDAS may cycle) end near it. :func:`nnls`
      solves those through the [m, m] kernel system instead of the [k, k] Gram matrix.

    Args: G [B, k, k] symmetric PSD, c [B, k]; opts as in :func:`nnls` (mask [B, k]).
    Returns: w [B, k]; padded (mask False) entries are 0.
    """
    o = opts or NNLSOptions()
    rounds = o.rounds
    B, k, _ = G.shape
    dt = G.dtype
    if k == 0:
        return G.new_zeros(B, 0)
    if rounds is not None and (isinstance(rounds, bool) or rounds < 0):
        raise ValueError(f"nnls: rounds must be None or an int >= 0, got {rounds!r}")
    lo, hi = box(o.lower, o.upper, B, k, G, check_tensors=rounds is None)
    if o.mask is not None:
        m = o.mask.to(torch.bool)
        zero = G.new_zeros(())
        G = _mask_gram(G, m) + torch.diag_embed((~m).to(dt))
        c = torch.where(m, c, zero)
        lo = torch.where(m, lo, zero)
        hi = torch.where(m, hi, zero)
    if o.ridge > 0:
        diag_mean = torch.diagonal(G, dim1=1, dim2=2).mean(-1).clamp_min(1e-30)  # [B]
        G = G + torch.diag_embed((o.ridge * diag_mean)[:, None].expand(B, k))
    ops = GramOps(G, c)
    if rounds is not None:
        return fixed_work(ops, lo, hi, rounds)
    w = pdas(ops, lo, hi, 8)
    return polish(ops, w, lo, hi, o.polish_rounds if o.polish_rounds is not None else 2 * k + 18)


def nnls_projected(
    A: torch.Tensor, b: torch.Tensor, opts: NNLSOptions | None = None, *, iters: int = 2
) -> torch.Tensor:
    """Box-bounded NNLS as the Attention Matching reference solves it: ridge least squares,
    clamped into the box, then ``iters`` projected-gradient steps
    w <- clamp(w - (A'(A w - b) + lam w) / L, lower, upper), L = ||A'A + lam I||_F (an
    upper bound on the largest eigenvalue, so every step lowers the objective).

    Shape legend: B problems (usually H_kv), m rows (n reference queries), k unknowns
    (t kept keys). Same arguments and result as :func:`nnls` (``iters`` replaces
    ``opts.rounds`` / ``opts.polish_rounds``, which are not read): A [m, k] / [B, m, k],
    b [m] / [B, m], opts' lower / upper / mask broadcastable to [B, k]; returns w [k] /
    [B, k], padded entries 0. One batched Cholesky, no active
    set and no host sync at all (a failed factorization leaves that problem at the
    clamped zero start). Exact when the least-squares solution lies inside the box;
    otherwise approximate (projected gradient converges slowly on ill-conditioned A).
    The ridge (at least 1e-9) is relative to the mean diagonal of A'A, padded columns
    counted as 1, as in :func:`nnls`. With m < k the least squares and the steps go
    through the data (fp64 [m, m] kernel system), never forming A'A.
    """
    o = opts or NNLSOptions()
    A, b, mask, batched = _as_batch(A, b, o.mask)
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 0:
        raise ValueError(f"nnls_projected: iters must be an int >= 0, got {iters!r}")
    dt = torch.promote_types(A.dtype, torch.float32)
    B, m, k = A.shape
    if k == 0:
        w0 = A.new_zeros(B, 0, dtype=dt)
        return w0 if batched else w0.squeeze(0)
    kernel = m < k
    wdt = torch.float64 if kernel else dt
    A, b = A.to(wdt), b.to(wdt)
    lo, hi = box(o.lower, o.upper, B, k, A, check_tensors=False)
    colsq = A.square().sum(1)  # diag of A'A: [B, k]
    if mask is not None:
        msk = mask.to(torch.bool)
        zero = A.new_zeros(())
        A = A * msk.unsqueeze(1)
        lo, hi = torch.where(msk, lo, zero), torch.where(msk, hi, zero)
        colsq = torch.where(msk, colsq, torch.ones((), dtype=wdt, device=A.device))
    lam = max(o.ridge, 1e-9) * colsq.mean(-1).clamp_min(1e-30)  # [B]
    At = A.transpose(1, 2)
    if kernel:  # w = A'(AA' + lam I)^-1 b; ||A'A + lam I||_F from the [m, m] kernel
        K = torch.bmm(A, At)
        eye = torch.eye(m, dtype=wdt, device=A.device)
        L, info = torch.linalg.cholesky_ex(K + lam[:, None, None] * eye)
        y = torch.cholesky_solve(b.unsqueeze(-1), L)
        w = torch.bmm(At, y).squeeze(-1)
        ev2 = K.square().sum((1, 2)) + 2 * lam * torch.diagonal(K, dim1=1, dim2=2).sum(-1)
        lip = (ev2 + k * lam.square()).sqrt()
    else:
        G = torch.bmm(At, A) + torch.diag_embed(lam[:, None].expand(B, k))
        L, info = torch.linalg.cholesky_ex(G)
        c = torch.bmm(At, b.unsqueeze(-1))
        w = torch.cholesky_solve(c, L).squeeze(-1)
        lip = torch.linalg.matrix_norm(G)  # Frobenius
    ok = (info == 0) & torch.isfinite(w).all(-1)
    w = torch.where(ok.unsqueeze(-1), w, w.new_zeros(()))
    w = torch.minimum(torch.maximum(w, lo), hi)
    step = (1.0 / lip.clamp_min(1e-30)).unsqueeze(-1)  # [B, 1]
    for _ in range(iters):
        if kernel:
            res = torch.bmm(A, w.unsqueeze(-1)) - b.unsqueeze(-1)
            grad = torch.bmm(At, res).squeeze(-1) + lam[:, None] * w
        else:
            grad = torch.bmm(G, w.unsqueeze(-1)).squeeze(-1) - c.squeeze(-1)
        w = torch.minimum(torch.maximum(w - step * grad, lo), hi)
    w = w.to(dt)
    return w if batched else w.squeeze(0)


def lstsq_values(
    P: torch.Tensor,
    Y: torch.Tensor,
    *,
    ridge: float = 1e-3,
    prior: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ridge least-squares values: argmin_C ||P C - Y||^2 + lam ||C - prior||^2.

    Used with P = attention weights of the compacted keys (beta included) for each
    reference query, and Y = the original attention outputs, so that the compacted
    outputs match the original ones.

    Args:
        P: [n, t] or [B, n, t] compacted attention weights.
        Y: [n, D] or [B, n, D] target outputs.
        ridge: lam relative to the mean diagonal of P^T P (0 = plain least squares).
        prior: [t, D] / [B, t, D] values to shrink towards (default 0).
        mask: [t] / [B, t] bool; False rows are padding and come back as prior (or 0).

    Returns:
        C: [t, D] or [B, t, D] (fp32 or wider).

    With fewer rows than unknowns (n < t) the same solution comes from the kernel form
    C = prior + P'(P P' + lam I)^-1 (Y - P prior), an [n, n] system solved in fp64, instead
    of the [t, t] normal equations.
    """
    batched = P.dim() == 3
    if not batched:
        P, Y = P.unsqueeze(0), Y.unsqueeze(0)
        prior = None if prior is None else prior.unsqueeze(0)
        mask = None if mask is None else mask.unsqueeze(0)
    if P.dim() != 3 or Y.dim() != 3 or P.shape[:2] != Y.shape[:2]:
        raise ValueError(f"lstsq_values: P {tuple(P.shape)} and Y {tuple(Y.shape)} do not match")
    dt = torch.promote_types(P.dtype, torch.float32)
    P, Y = P.to(dt), Y.to(dt)
    B, n, t = P.shape
    if n < t:
        C = _lstsq_values_kernel(P, Y, ridge, prior, mask).to(dt)
        return C if batched else C.squeeze(0)
    G = P.transpose(1, 2) @ P
    R = P.transpose(1, 2) @ Y
    eye = torch.eye(t, dtype=dt, device=P.device).expand(B, t, t)
    if mask is not None:
        m = mask.to(torch.bool)
        zero = G.new_zeros(())
        G = _mask_gram(G, m)
        R = torch.where(m.unsqueeze(-1), R, zero)
        diag_mean = torch.diagonal(G, dim1=1, dim2=2).sum(-1) / m.sum(-1).clamp_min(1)
    else:
        diag_mean = torch.diagonal(G, dim1=1, dim2=2).mean(-1)
    lam = (max(ridge, 1e-9) * diag_mean.clamp_min(1e-30))[:, None, None]
    G = G + lam * eye
    if prior is not None:
        R = R + lam * prior.to(dt)
    if mask is not None:
        # padded rows: identity system -> solution equals prior (or 0)
        pad = (~mask.to(torch.bool)).to(dt)
        G = G + torch.diag_embed(pad)
    C = _solve_spd(G, R)
    return C if batched else C.squeeze(0)


def _lstsq_values_kernel(
    P: torch.Tensor,
    Y: torch.Tensor,
    ridge: float,
    prior: torch.Tensor | None,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`lstsq_values` for P [B, n, t] with n < t, through the [n, n] kernel system
    in fp64 (same lam: ridge times the mean diagonal of P'P over the valid columns)."""
    P, Y = P.double(), Y.double()
    colsq = P.square().sum(1)  # diag of P'P: [B, t]
    if mask is not None:
        m = mask.to(torch.bool)
        P = P * m.unsqueeze(1)
        diag_mean = torch.where(m, colsq, 0.0).sum(-1) / m.sum(-1).clamp_min(1)
    else:
        diag_mean = colsq.mean(-1)
    lam = max(ridge, 1e-9) * diag_mean.clamp_min(1e-30)
    B, n, t = P.shape
    base = (
        prior.double()
        if prior is not None
        else torch.zeros(B, t, Y.shape[-1], dtype=P.dtype, device=P.device)
    )
    K = torch.bmm(P, P.transpose(1, 2)) + lam[:, None, None] * torch.eye(
        n, dtype=P.dtype, device=P.device
    )
    resid = Y - torch.bmm(P, base)
    Z = _solve_spd(K, resid)  # [B, n, D]
    return base + torch.bmm(P.transpose(1, 2), Z)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor | None = None,
    sm_scale: float | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention with a logit bias: out = softmax(q k' * sm_scale + beta) v.

    A thin adapter over :func:`compaction_kernels.biased_attention.reference.biased_attention` (fp32,
    with the LSE) that folds the padding ``mask`` into beta.

    Args:
        q: [..., n, D]; k, v: [..., t, D]; beta: [..., t] fp32 or None;
        mask: [..., t] bool (False = padding, excluded). sm_scale defaults to 1/sqrt(D).

    Returns:
        (out [..., n, D] fp32, lse [..., n] fp32) where lse = log sum_j exp(logit_j) is the
        log attention mass of this block (-inf if every entry is masked).
    """
    if mask is not None:
        base = beta.float() if beta is not None else torch.zeros(mask.shape, device=mask.device)
        beta = base.masked_fill(~mask, -math.inf)
    return biased_attention_lse(q, k, v, beta, sm_scale=sm_scale)


# ---- private helpers -------------------------------------------------------------------


def _solve_spd(G: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """Solve G X = R for batched SPD G [B, k, k]; R [B, k] or [B, k, D]."""
    vec = R.dim() == 2
    rhs = R.unsqueeze(-1) if vec else R
    L, info = torch.linalg.cholesky_ex(G)
    if bool((info == 0).all()):
        X = torch.cholesky_solve(rhs, L)
    else:
        X = torch.linalg.lstsq(G, rhs).solution
    return X.squeeze(-1) if vec else X


def _as_batch(
    A: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, bool]:
    """``(A [B, m, k], b [B, m], mask [B, k] | None, batched)``: a single problem
    (A [m, k], b [m], mask [k]) as a batch of one; ValueError when A and b do not match."""
    batched = A.dim() == 3
    if not batched:
        A, b = A.unsqueeze(0), b.unsqueeze(0)
        mask = None if mask is None else mask.unsqueeze(0)
    if A.dim() != 3 or b.dim() != 2 or b.shape != A.shape[:2]:
        raise ValueError(f"nnls: A {tuple(A.shape)} and b {tuple(b.shape)} do not match")
    return A, b, mask, batched


def _mask_gram(G: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """G [B, k, k] with the rows and columns of padded entries (mask [B, k] bool False)
    zeroed (a new tensor)."""
    return torch.where(mask.unsqueeze(1) & mask.unsqueeze(2), G, G.new_zeros(()))

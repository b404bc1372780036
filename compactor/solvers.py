"""fp32 solvers for Attention Matching: box-bounded NNLS and ridge least-squares values.

Shape legend: T prefix tokens, t kept, n reference queries, H_q/H_kv heads, D head dim,
B batch (usually H_kv: one independent problem per KV head), m rows, k unknowns.

All functions accept a single problem (``A [m, k]``) or a batch (``A [B, m, k]``); they
compute in fp32 (or fp64 if given fp64) on the device of their inputs and mutate nothing.
"""

from __future__ import annotations

import math

import torch

from kernels.biased_attention.reference import biased_attention

__all__ = ["attend", "lstsq_values", "nnls", "nnls_gram"]


def nnls(
    A: torch.Tensor,
    b: torch.Tensor,
    *,
    lower: float | torch.Tensor = 0.0,
    upper: float | torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    ridge: float = 0.0,
    rounds: int | None = None,
    polish_rounds: int | None = None,
) -> torch.Tensor:
    """Box-bounded non-negative least squares: argmin_w ||A w - b||^2, lower <= w <= upper.

    Args:
        A: [m, k] or [B, m, k].
        b: [m] or [B, m].
        lower / upper: bounds, scalars or tensors broadcastable to w ([k] / [B, k]);
            ``upper=None`` means +inf. Default: plain NNLS (w >= 0).
        mask: optional [k] / [B, k] bool; False entries are padding and are returned as 0.
        ridge: Tikhonov term, relative to the mean diagonal of A^T A.
        rounds: None = exact (see :func:`nnls_gram`); an int = that many fixed-work
            active-set rounds, no host sync.
        polish_rounds: cap on the exact path's active-set rounds (default 2k + 18).

    Returns:
        w: [k] or [B, k], dtype of A promoted to at least fp32.
    """
    batched = A.dim() == 3
    if not batched:
        A, b = A.unsqueeze(0), b.unsqueeze(0)
        if mask is not None:
            mask = mask.unsqueeze(0)
    if A.dim() != 3 or b.dim() != 2 or b.shape != A.shape[:2]:
        raise ValueError(f"nnls: A {tuple(A.shape)} and b {tuple(b.shape)} do not match")
    dt = torch.promote_types(A.dtype, torch.float32)
    A, b = A.to(dt), b.to(dt)
    G = A.transpose(1, 2) @ A
    c = (A.transpose(1, 2) @ b.unsqueeze(-1)).squeeze(-1)
    w = nnls_gram(
        G,
        c,
        lower=lower,
        upper=upper,
        mask=mask,
        ridge=ridge,
        rounds=rounds,
        polish_rounds=polish_rounds,
    )
    return w if batched else w.squeeze(0)


def nnls_gram(
    G: torch.Tensor,
    c: torch.Tensor,
    *,
    lower: float | torch.Tensor = 0.0,
    upper: float | torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    ridge: float = 0.0,
    rounds: int | None = None,
    polish_rounds: int | None = None,
) -> torch.Tensor:
    """Box-bounded QP min 0.5 w'Gw - c'w on the normal equations (G = A'A, c = A'b).

    Both paths start from the least-squares solution and run primal-dual active-set
    (PDAS, semismooth Newton) rounds: guess the entries at each bound from the last
    iterate and its gradient, solve the free entries exactly (one batched Cholesky per
    round for all B problems), keep the best feasible iterate seen.

    * ``rounds=None`` (exact): 8 such rounds as a warm start, then primal active-set
      polishing until the KKT conditions hold (host syncs to test convergence); exact
      up to rounding whenever it converges within ``polish_rounds`` (default 2k + 18).
    * ``rounds=R`` (fixed work): R rounds and nothing else: R + 1 Cholesky factorizations,
      no host sync, feasible by construction. Exact once the active set is identified,
      which takes a few rounds on attention-mass problems (the objective gap is measured
      in ``benchmarks/methods_speed.py``); otherwise the best clamped iterate.

    Args: G [B, k, k] symmetric PSD, c [B, k]; the rest as in :func:`nnls`.
    Returns: w [B, k]; padded (mask False) entries are 0.
    """
    B, k, _ = G.shape
    dt = G.dtype
    if k == 0:
        return G.new_zeros(B, 0)
    if rounds is not None and (isinstance(rounds, bool) or rounds < 0):
        raise ValueError(f"nnls: rounds must be None or an int >= 0, got {rounds!r}")
    lo = torch.as_tensor(lower, dtype=dt, device=G.device).expand(B, k).clone()
    hi_val = math.inf if upper is None else upper
    hi = torch.as_tensor(hi_val, dtype=dt, device=G.device).expand(B, k).clone()
    if isinstance(lower, torch.Tensor) or isinstance(upper, torch.Tensor):
        if rounds is None and bool((lo > hi).any()):  # a host sync: the exact path only
            raise ValueError("nnls: lower bound above upper bound")
    elif upper is not None and lower > upper:
        raise ValueError(f"nnls: lower bound {lower} above upper bound {upper}")
    if mask is not None:
        m = mask.to(torch.bool)
        zero = G.new_zeros(())
        both = m.unsqueeze(1) & m.unsqueeze(2)
        G = torch.where(both, G, zero) + torch.diag_embed((~m).to(dt))
        c = torch.where(m, c, zero)
        lo = torch.where(m, lo, zero)
        hi = torch.where(m, hi, zero)
    if ridge > 0:
        diag_mean = torch.diagonal(G, dim1=1, dim2=2).mean(-1).clamp_min(1e-30)  # [B]
        G = G + torch.diag_embed((ridge * diag_mean)[:, None].expand(B, k))
    w = _pdas(G, c, lo, hi, 8 if rounds is None else rounds)
    if rounds is not None:
        return w
    return _polish(G, c, w, lo, hi, polish_rounds)


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
    B, _, t = P.shape
    G = P.transpose(1, 2) @ P
    R = P.transpose(1, 2) @ Y
    eye = torch.eye(t, dtype=dt, device=P.device).expand(B, t, t)
    if mask is not None:
        m = mask.to(torch.bool)
        zero = G.new_zeros(())
        both = m.unsqueeze(1) & m.unsqueeze(2)
        G = torch.where(both, G, zero)
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


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor | None = None,
    sm_scale: float | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention with a logit bias: out = softmax(q k' * sm_scale + beta) v.

    A thin adapter over :func:`kernels.biased_attention.reference.biased_attention` (fp32,
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
    return biased_attention(q, k, v, beta, sm_scale=sm_scale, with_lse=True)


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


def _solve_spd_masked(
    G: torch.Tensor, R: torch.Tensor, free: torch.Tensor, jit: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Solve the free block of G [B, k, k] for R [B, k] (other entries 0), no host sync.

    The non-free rows and columns are replaced by the identity and the free diagonal gets
    ``jit`` [B] added. Returns (x [B, k], ok [B] bool: the factorization succeeded and x
    is finite).
    """
    zero = G.new_zeros(())
    both = free.unsqueeze(1) & free.unsqueeze(2)
    diag = torch.where(free, jit[:, None], torch.ones((), dtype=G.dtype, device=G.device))
    Gf = torch.where(both, G, zero) + torch.diag_embed(diag)
    L, info = torch.linalg.cholesky_ex(Gf)
    x = torch.cholesky_solve(torch.where(free, R, zero).unsqueeze(-1), L).squeeze(-1)
    ok = (info == 0) & torch.isfinite(x).all(-1)
    return torch.where(ok.unsqueeze(-1) & free, x, zero), ok


def _objective(G: torch.Tensor, c: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """0.5 w'Gw - c'w per problem: [B]."""
    Gw = (G @ w.unsqueeze(-1)).squeeze(-1)
    return (w * (0.5 * Gw - c)).sum(-1)


def _pdas(
    G: torch.Tensor, c: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, rounds: int
) -> torch.Tensor:
    """Primal-dual active-set rounds for min 0.5 w'Gw - c'w, lo <= w <= hi; no host sync.

    Starts from the least-squares solution; each round predicts the bound entries from
    z = w - grad / diag(G) (z < lo: at lo, z > hi: at hi, the rest free), solves the free
    entries exactly and takes the gradient on the bound ones. Returns the feasible
    iterate (clamped into the box) with the lowest objective seen, per problem: [B, k].
    """
    dt = G.dtype
    zero = G.new_zeros(())
    d = torch.diagonal(G, dim1=1, dim2=2).clamp_min(1e-30)  # [B, k]
    jit = (1e-12 if dt == torch.float64 else 1e-7) * d.mean(-1)  # [B]
    all_free = torch.ones_like(c, dtype=torch.bool)
    w, _ = _solve_spd_masked(G, c, all_free, jit)
    grad = torch.zeros_like(w)
    best = torch.minimum(torch.maximum(w, lo), hi)
    best_f = _objective(G, c, best)
    check = 1 if G.device.type == "cpu" else 4  # rounds between fixed-point tests (a sync)
    prev: torch.Tensor | None = None
    for r in range(rounds):
        z = w - grad / d
        at_lo = z < lo
        at_hi = (z > hi) & ~at_lo
        free = ~(at_lo | at_hi)
        state = torch.stack([at_lo, at_hi])
        if prev is not None and r % check == 0 and bool(torch.equal(state, prev)):
            break  # a fixed point: every further round would repeat the last one
        prev = state
        fixed = torch.where(at_lo, lo, torch.where(at_hi, hi, zero))
        rhs = c - (G @ fixed.unsqueeze(-1)).squeeze(-1)
        x, ok = _solve_spd_masked(G, rhs, free, jit)
        w_new = torch.where(free, x, fixed)
        w = torch.where(ok.unsqueeze(-1), w_new, best)
        g = (G @ w.unsqueeze(-1)).squeeze(-1) - c
        grad = torch.where(free & ok.unsqueeze(-1), zero, g)
        cand = torch.minimum(torch.maximum(w, lo), hi)
        f = _objective(G, c, cand)
        better = f < best_f  # False for NaN
        best = torch.where(better.unsqueeze(-1), cand, best)
        best_f = torch.where(better, f, best_f)
    return best


def _polish(
    G: torch.Tensor,
    c: torch.Tensor,
    w: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    max_rounds: int | None = None,
) -> torch.Tensor:
    """Primal active-set refinement of an approximate box-QP solution w [B, k].

    Starts from the bounds w sits on, solves the free entries exactly, steps back to the
    box when the solve leaves it (fixing the entries that hit a bound), and releases the
    bound entries with a violated KKT sign (all at first, then the worst one). Returns a new tensor; exact at the end
    whenever it converges within ``max_rounds`` (default 2k + 10).
    """
    B, k = w.shape
    dt = G.dtype
    zero = torch.zeros((), dtype=dt, device=G.device)
    span = (hi - lo).clamp(max=1e30)
    hi_fin = torch.where(torch.isfinite(hi), hi.abs(), zero)
    eps = 1e-9 * torch.maximum(lo.abs(), hi_fin).clamp_min(1.0)
    eps = torch.minimum(eps, 0.25 * span.clamp_min(0))
    at_lo = w <= lo + eps
    at_hi = (w >= hi - eps) & ~at_lo
    w = torch.where(at_lo, lo, torch.where(at_hi, hi, w))
    done = torch.zeros(B, dtype=torch.bool, device=G.device)
    gscale = c.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    diag_mean = torch.diagonal(G, dim1=1, dim2=2).mean(-1).clamp_min(1e-30)
    jit = (1e-12 if dt == torch.float64 else 1e-7) * diag_mean
    block_rounds = 8
    for rounds in range(max_rounds if max_rounds is not None else 2 * k + 10 + block_rounds):
        free = ~(at_lo | at_hi)
        fixed_val = torch.where(at_lo, lo, torch.where(at_hi, hi, zero))
        rhs = c - (G @ fixed_val.unsqueeze(-1)).squeeze(-1)
        both = free.unsqueeze(1) & free.unsqueeze(2)
        Gf = torch.where(both, G, zero) + torch.diag_embed(torch.where(free, jit[:, None], 1.0))
        x = _solve_spd(Gf, torch.where(free, rhs, zero))
        x = torch.where(free, x, fixed_val)
        ok = torch.isfinite(x).all(-1)
        inside = ((x >= lo) & (x <= hi)).all(-1) & ok
        # infeasible: move from w towards x as far as the box allows, fix what hits a bound
        d = x - w
        with torch.no_grad():
            a_lo = torch.where(d < 0, (lo - w) / d.clamp(max=-1e-300), torch.full_like(d, 2.0))
            a_hi = torch.where(d > 0, (hi - w) / d.clamp(min=1e-300), torch.full_like(d, 2.0))
            alpha = torch.minimum(a_lo, a_hi).amin(-1).clamp(0.0, 1.0)
        step_rows = ~inside & ok & ~done
        w_step = w + alpha.unsqueeze(-1) * d
        hit_lo = step_rows.unsqueeze(-1) & free & (w_step <= lo + eps)
        hit_hi = step_rows.unsqueeze(-1) & free & (w_step >= hi - eps) & ~hit_lo
        move = (inside & ~done).unsqueeze(-1)
        w = torch.where(move, x, torch.where(step_rows.unsqueeze(-1), w_step, w))
        at_lo, at_hi = at_lo | hit_lo, at_hi | hit_hi
        w = torch.where(at_lo, lo, torch.where(at_hi, hi, w))
        # feasible solve: check KKT on the bound entries; release the worst violator
        grad = (G @ w.unsqueeze(-1)).squeeze(-1) - c
        viol = torch.where(at_lo, -grad, zero) + torch.where(at_hi, grad, zero)
        vtol = 1e-9 * gscale
        release_row = inside & ~done & (viol > vtol).any(-1)
        done = done | (inside & ~release_row) | ~ok
        # release every violator early on (fast), only the worst one later (finite)
        vmax = viol.amax(-1, keepdim=True)
        pick = (viol > vtol) if rounds < block_rounds else (viol >= vmax) & (viol > vtol)
        rel = pick & release_row.unsqueeze(-1)
        at_lo, at_hi = at_lo & ~rel, at_hi & ~rel
        if bool(done.all()):
            break
    return w

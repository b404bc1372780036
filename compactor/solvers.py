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
        rounds: None = exact (see :func:`nnls_gram`); an int = fixed work, no host sync
            per round. With fewer rows than unknowns (m < k) the fixed-work path solves in
            fp64 through the [m, m] kernel matrices (lam I + A_F A_F'), never forming A'A.
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
    if rounds is not None and A.shape[1] < A.shape[2]:
        # fewer rows than unknowns: solve in the rows' space, in fp64 (see _DataOps)
        w = _nnls_data(A, b, lower, upper, mask, ridge, rounds).to(dt)
        return w if batched else w.squeeze(0)
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
      rounds until the KKT conditions hold (a host sync per round to test them); exact up
      to rounding whenever it converges within ``polish_rounds`` (default 2k + 18).
    * ``rounds=R`` (fixed work): at most R + 1 Cholesky factorizations: ceil(R/2) PDAS
      rounds, then primal active-set rounds from the best iterate (monotone). No host
      sync but a convergence test every round on the CPU (free there) and every 4 rounds
      elsewhere; feasible by construction. Well-posed attention-mass problems (more
      queries than kept keys) reach the exact answer in a few rounds; underdetermined
      ones (fewer queries than keys, where PDAS may cycle) end near it. :func:`nnls`
      solves those through the [m, m] kernel system instead of the [k, k] Gram matrix.

    Args: G [B, k, k] symmetric PSD, c [B, k]; the rest as in :func:`nnls`.
    Returns: w [B, k]; padded (mask False) entries are 0.
    """
    B, k, _ = G.shape
    dt = G.dtype
    if k == 0:
        return G.new_zeros(B, 0)
    if rounds is not None and (isinstance(rounds, bool) or rounds < 0):
        raise ValueError(f"nnls: rounds must be None or an int >= 0, got {rounds!r}")
    lo, hi = _box(lower, upper, B, k, G, check_tensors=rounds is None)
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
    ops = _GramOps(G, c)
    if rounds is not None:
        return _fixed_work(ops, lo, hi, rounds)
    w = _pdas(ops, lo, hi, 8)
    return _polish(ops, w, lo, hi, polish_rounds if polish_rounds is not None else 2 * k + 18)


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


class _GramOps:
    """The box QP min 0.5 w'Gw - c'w given by G [B, k, k] and c [B, k] (for :func:`_pdas`)."""

    def __init__(self, G: torch.Tensor, c: torch.Tensor) -> None:
        self.G, self.c = G, c
        self.d = torch.diagonal(G, dim1=1, dim2=2).clamp_min(1e-30)  # [B, k]
        self.jit = (1e-12 if G.dtype == torch.float64 else 1e-7) * self.d.mean(-1)  # [B]

    def solve(self, free: torch.Tensor, fixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Free entries [B, k] bool solved exactly, the others at `fixed` [B, k] (0 on free).

        Returns (w [B, k], ok [B]: the factorization succeeded and w is finite).
        """
        G = self.G
        zero = G.new_zeros(())
        rhs = self.c - _mv(G, fixed)
        both = free.unsqueeze(1) & free.unsqueeze(2)
        diag = torch.where(free, self.jit[:, None], torch.ones((), dtype=G.dtype, device=G.device))
        Gf = torch.where(both, G, zero) + torch.diag_embed(diag)
        L, info = torch.linalg.cholesky_ex(Gf)
        x = torch.cholesky_solve(torch.where(free, rhs, zero).unsqueeze(-1), L).squeeze(-1)
        ok = (info == 0) & torch.isfinite(x).all(-1)
        return torch.where(free, x, fixed), ok

    def grad(self, w: torch.Tensor) -> torch.Tensor:
        return _mv(self.G, w) - self.c

    def objective(self, w: torch.Tensor) -> torch.Tensor:
        """0.5 w'Gw - c'w per problem: [B]."""
        return (w * (0.5 * _mv(self.G, w) - self.c)).sum(-1)


class _DataOps:
    """The same QP from the data: min 0.5 ||A w - b||^2 + 0.5 lam ||w||^2, A [B, m, k] with
    m < k, b [B, m], lam [B] > 0 (for :func:`_pdas`). A free-set solve goes through the
    kernel system (lam I + A_F A_F') [m, m] instead of the [k, k] Gram matrix."""

    def __init__(self, A: torch.Tensor, b: torch.Tensor, lam: torch.Tensor) -> None:
        self.A, self.b, self.lam = A, b, lam
        self.d = A.square().sum(1) + lam[:, None]  # diag of A'A + lam I: [B, k]
        self.eye = torch.eye(A.shape[1], dtype=A.dtype, device=A.device)

    def solve(self, free: torch.Tensor, fixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`_GramOps.solve`: x_F = A_F' (lam I + A_F A_F')^-1 (b - A fixed)."""
        A = self.A
        AF = A * free.unsqueeze(1)
        K = torch.bmm(AF, AF.transpose(1, 2)) + self.lam[:, None, None] * self.eye
        L, info = torch.linalg.cholesky_ex(K)
        r = self.b - _mv(A, fixed)
        y = torch.cholesky_solve(r.unsqueeze(-1), L)
        x = torch.bmm(AF.transpose(1, 2), y).squeeze(-1)
        ok = (info == 0) & torch.isfinite(x).all(-1)
        return torch.where(free, x, fixed), ok

    def grad(self, w: torch.Tensor) -> torch.Tensor:
        res = _mv(self.A, w) - self.b
        return (
            torch.bmm(self.A.transpose(1, 2), res.unsqueeze(-1)).squeeze(-1) + self.lam[:, None] * w
        )

    def objective(self, w: torch.Tensor) -> torch.Tensor:
        """0.5 ||A w - b||^2 + 0.5 lam ||w||^2 per problem: [B]."""
        res = _mv(self.A, w) - self.b
        return 0.5 * (res.square().sum(-1) + self.lam * w.square().sum(-1))


def _box(
    lower: float | torch.Tensor,
    upper: float | torch.Tensor | None,
    B: int,
    k: int,
    like: torch.Tensor,
    check_tensors: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) [B, k] in the dtype and on the device of `like`; ValueError when lower >
    upper (tested for tensor bounds only with `check_tensors`: a host sync)."""
    lo = torch.as_tensor(lower, dtype=like.dtype, device=like.device).expand(B, k).clone()
    hi_val = math.inf if upper is None else upper
    hi = torch.as_tensor(hi_val, dtype=like.dtype, device=like.device).expand(B, k).clone()
    if isinstance(lower, torch.Tensor) or isinstance(upper, torch.Tensor):
        if check_tensors and bool((lo > hi).any()):
            raise ValueError("nnls: lower bound above upper bound")
    elif upper is not None and lower > upper:
        raise ValueError(f"nnls: lower bound {lower} above upper bound {upper}")
    return lo, hi


def _mv(M: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Batched matrix-vector product M [B, r, k] x [B, k] -> [B, r]."""
    if M.device.type == "cpu":  # CPU BLAS runs batched GEMV slowly: a fused multiply-sum
        return (M * x.unsqueeze(1)).sum(-1)
    return torch.bmm(M, x.unsqueeze(-1)).squeeze(-1)


def _nnls_data(
    A: torch.Tensor,
    b: torch.Tensor,
    lower: float | torch.Tensor,
    upper: float | torch.Tensor | None,
    mask: torch.Tensor | None,
    ridge: float,
    rounds: int,
) -> torch.Tensor:
    """Fixed-work NNLS for A [B, m, k] with m < k, in fp64 through :class:`_DataOps`; the
    ridge (at least 1e-9, as the Gram path's jitter would add) is relative to the mean
    diagonal of A'A with padded columns counted as 1, as in :func:`nnls_gram`."""
    B, _, k = A.shape
    A, b = A.double(), b.double()
    lo, hi = _box(lower, upper, B, k, A, check_tensors=False)
    colsq = A.square().sum(1)
    if mask is not None:
        m = mask.to(torch.bool)
        zero = A.new_zeros(())
        A = A * m.unsqueeze(1)
        lo, hi = torch.where(m, lo, zero), torch.where(m, hi, zero)
        colsq = torch.where(m, colsq, torch.ones((), dtype=A.dtype, device=A.device))
    lam = max(ridge, 1e-9) * colsq.mean(-1).clamp_min(1e-30)
    return _fixed_work(_DataOps(A, b, lam), lo, hi, rounds)


def _fixed_work(
    ops: _GramOps | _DataOps, lo: torch.Tensor, hi: torch.Tensor, rounds: int
) -> torch.Tensor:
    """At most `rounds` solves: PDAS for half of them (fast when it converges), then primal
    active-set rounds from its best iterate (monotone: never worse). Both stop early at
    convergence, tested every round on the CPU and every 4 rounds elsewhere (the only host
    syncs; stopping early gives the same result)."""
    pdas = (rounds + 1) // 2
    w = _pdas(ops, lo, hi, pdas)
    check = 1 if lo.device.type == "cpu" else 4
    return _polish(ops, w, lo, hi, rounds - pdas, check) if rounds > pdas else w


def _pdas(
    ops: _GramOps | _DataOps, lo: torch.Tensor, hi: torch.Tensor, rounds: int
) -> torch.Tensor:
    """Primal-dual active-set rounds for the box QP of `ops`, lo <= w <= hi [B, k].

    Starts from the least-squares solution; each round predicts the bound entries from
    z = w - grad / diag (z < lo: at lo, z > hi: at hi, the rest free), solves the free
    entries exactly and takes the gradient on the bound ones. Returns the feasible
    iterate (clamped into the box) with the lowest objective seen, per problem: [B, k].
    No host sync except a fixed-point test (all active sets unchanged: stop, the result
    would not change) every round on the CPU and every 4 rounds on other devices.
    """
    zero = lo.new_zeros(())
    all_free = torch.ones_like(lo, dtype=torch.bool)
    w, _ = ops.solve(all_free, torch.zeros_like(lo))
    w = torch.where(torch.isfinite(w), w, zero)
    grad = torch.zeros_like(w)
    best = torch.minimum(torch.maximum(w, lo), hi)
    best_f = ops.objective(best)
    check = 1 if lo.device.type == "cpu" else 4
    prev: torch.Tensor | None = None
    for r in range(rounds):
        z = w - grad / ops.d
        at_lo = z < lo
        at_hi = (z > hi) & ~at_lo
        free = ~(at_lo | at_hi)
        state = torch.stack([at_lo, at_hi])
        if prev is not None and r % check == 0 and bool(torch.equal(state, prev)):
            break  # a fixed point: every further round would repeat the last one
        prev = state
        fixed = torch.where(at_lo, lo, torch.where(at_hi, hi, zero))
        x, ok = ops.solve(free, fixed)
        w = torch.where(ok.unsqueeze(-1), x, best)
        grad = torch.where(free & ok.unsqueeze(-1), zero, ops.grad(w))
        cand = torch.minimum(torch.maximum(w, lo), hi)
        f = ops.objective(cand)
        better = f < best_f  # False for NaN
        best = torch.where(better.unsqueeze(-1), cand, best)
        best_f = torch.where(better, f, best_f)
    return best


def _polish(
    ops: _GramOps | _DataOps,
    w: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    max_rounds: int,
    check_every: int | None = 1,
) -> torch.Tensor:
    """Primal active-set refinement of a feasible box-QP iterate w [B, k]; never worse.

    Starts from the bounds w sits on, solves the free entries exactly, steps back to the
    box when the solve leaves it (fixing the entries that hit a bound), and releases the
    bound entries with a violated KKT sign (all of them for 8 rounds, then the worst one).
    Every `check_every` rounds (a host sync; None: never) it stops once every problem
    satisfies the KKT conditions: exact at the end whenever it converges within
    `max_rounds`. Finished problems do not move, so stopping early changes nothing.
    Returns a new tensor.
    """
    B = w.shape[0]
    zero = lo.new_zeros(())
    span = (hi - lo).clamp(max=1e30)
    hi_fin = torch.where(torch.isfinite(hi), hi.abs(), zero)
    eps = 1e-9 * torch.maximum(lo.abs(), hi_fin).clamp_min(1.0)
    eps = torch.minimum(eps, 0.25 * span.clamp_min(0))
    at_lo = w <= lo + eps
    at_hi = (w >= hi - eps) & ~at_lo
    w = torch.where(at_lo, lo, torch.where(at_hi, hi, w))
    done = torch.zeros(B, dtype=torch.bool, device=lo.device)
    vtol = 1e-9 * ops.grad(torch.zeros_like(w)).abs().amax(-1, keepdim=True).clamp_min(1e-30)
    block_rounds = 8
    two = torch.full_like(w, 2.0)
    for rounds in range(max_rounds):
        free = ~(at_lo | at_hi)
        fixed_val = torch.where(at_lo, lo, torch.where(at_hi, hi, zero))
        x, ok = ops.solve(free, fixed_val)
        inside = ((x >= lo) & (x <= hi)).all(-1) & ok
        # infeasible: move from w towards x as far as the box allows, fix what hits a bound
        d = x - w
        a_lo = torch.where(d < 0, (lo - w) / d.clamp(max=-1e-300), two)
        a_hi = torch.where(d > 0, (hi - w) / d.clamp(min=1e-300), two)
        alpha = torch.minimum(a_lo, a_hi).amin(-1).clamp(0.0, 1.0)
        step_rows = ~inside & ok & ~done
        w_step = w + alpha.unsqueeze(-1) * d
        hit_lo = step_rows.unsqueeze(-1) & free & (w_step <= lo + eps)
        hit_hi = step_rows.unsqueeze(-1) & free & (w_step >= hi - eps) & ~hit_lo
        move = (inside & ~done).unsqueeze(-1)
        w = torch.where(move, x, torch.where(step_rows.unsqueeze(-1), w_step, w))
        at_lo, at_hi = at_lo | hit_lo, at_hi | hit_hi
        w = torch.where(at_lo, lo, torch.where(at_hi, hi, w))
        # feasible solve: check KKT on the bound entries; release violators
        grad = ops.grad(w)
        viol = torch.where(at_lo, -grad, zero) + torch.where(at_hi, grad, zero)
        release_row = inside & ~done & (viol > vtol).any(-1)
        done = done | (inside & ~release_row) | ~ok
        # release every violator early on (fast), only the worst one later (finite)
        vmax = viol.amax(-1, keepdim=True)
        pick = (viol > vtol) if rounds < block_rounds else (viol >= vmax) & (viol > vtol)
        rel = pick & release_row.unsqueeze(-1)
        at_lo, at_hi = at_lo & ~rel, at_hi & ~rel
        if check_every and (rounds + 1) % check_every == 0 and bool(done.all()):
            break
    return w

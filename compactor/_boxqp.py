"""Box-constrained least squares machinery of :mod:`compactor.solvers` (private).

Shape legend: B problems (usually H_kv), k unknowns, m rows.

min 0.5 w'Gw - c'w subject to lo <= w <= hi, for B problems at once, either from the Gram
form (:class:`GramOps`: G [B, k, k], c [B, k]) or from the data when there are fewer rows
than unknowns (:class:`DataOps`: A [B, m, k], b [B, m], ridge lam [B]; free-set solves go
through the [m, m] kernel matrix). :func:`pdas` (primal-dual active set) and :func:`polish`
(primal active set, monotone) run on either; :func:`fixed_work` chains them with a fixed
budget of solves and no host sync but sparse convergence tests. On the CPU, where a host
sync costs nothing, a free-set solve factors only the free block (padded to the largest
free count) instead of the whole masked matrix. Nothing here mutates its inputs; every
tensor follows the device of an input.
"""

from __future__ import annotations

import math

import torch

__all__ = ["DataOps", "GramOps", "box", "fixed_work", "nnls_data", "pdas", "polish"]


class GramOps:
    """The box QP min 0.5 w'Gw - c'w given by G [B, k, k] and c [B, k] (for :func:`pdas`)."""

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
        sub = _free_subset(free)
        if sub is not None:  # the CPU: factor only the free block (padded to the largest)
            idx, valid = sub
            f = idx.shape[1]
            G = torch.gather(G, 1, idx.unsqueeze(-1).expand(-1, -1, G.shape[2]))
            G = torch.gather(G, 2, idx.unsqueeze(1).expand(-1, f, -1))
            rhs, part = torch.gather(rhs, 1, idx), valid
        else:
            part = free
        both = part.unsqueeze(1) & part.unsqueeze(2)
        diag = torch.where(part, self.jit[:, None], torch.ones((), dtype=G.dtype, device=G.device))
        Gf = torch.where(both, G, zero) + torch.diag_embed(diag)
        L, info = torch.linalg.cholesky_ex(Gf)
        x = torch.cholesky_solve(torch.where(part, rhs, zero).unsqueeze(-1), L).squeeze(-1)
        ok = (info == 0) & torch.isfinite(x).all(-1)
        if sub is not None:
            x = torch.zeros_like(fixed).scatter_(1, sub[0], torch.where(part, x, zero))
        return torch.where(free, x, fixed), ok

    def grad(self, w: torch.Tensor) -> torch.Tensor:
        return _mv(self.G, w) - self.c

    def objective(self, w: torch.Tensor) -> torch.Tensor:
        """0.5 w'Gw - c'w per problem: [B]."""
        return (w * (0.5 * _mv(self.G, w) - self.c)).sum(-1)


class DataOps:
    """The same QP from the data: min 0.5 ||A w - b||^2 + 0.5 lam ||w||^2, A [B, m, k] with
    m < k, b [B, m], lam [B] > 0 (for :func:`pdas`). A free-set solve goes through the
    kernel system (lam I + A_F A_F') [m, m] instead of the [k, k] Gram matrix."""

    def __init__(self, A: torch.Tensor, b: torch.Tensor, lam: torch.Tensor) -> None:
        self.A, self.b, self.lam = A, b, lam
        self.d = A.square().sum(1) + lam[:, None]  # diag of A'A + lam I: [B, k]
        self.eye = torch.eye(A.shape[1], dtype=A.dtype, device=A.device)

    def solve(self, free: torch.Tensor, fixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`GramOps.solve`: x_F = A_F' (lam I + A_F A_F')^-1 (b - A fixed)."""
        A = self.A
        sub = _free_subset(free)
        if sub is not None:  # the CPU: only the free columns
            idx, valid = sub
            AF = torch.gather(A, 2, idx.unsqueeze(1).expand(-1, A.shape[1], -1))
            AF = AF * valid.unsqueeze(1)
        else:
            AF = A * free.unsqueeze(1)
        K = torch.bmm(AF, AF.transpose(1, 2)) + self.lam[:, None, None] * self.eye
        L, info = torch.linalg.cholesky_ex(K)
        r = self.b - _mv(A, fixed)
        y = torch.cholesky_solve(r.unsqueeze(-1), L)
        x = torch.bmm(AF.transpose(1, 2), y).squeeze(-1)
        ok = (info == 0) & torch.isfinite(x).all(-1)
        if sub is not None:
            x = torch.zeros_like(fixed).scatter_(1, sub[0], torch.where(sub[1], x, 0.0))
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


def box(
    lower: float | torch.Tensor,
    upper: float | torch.Tensor | None,
    B: int,
    k: int,
    like: torch.Tensor,
    check_tensors: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) [B, k] in the dtype and on the device of `like`; ValueError when lower >
    upper (tested for tensor bounds only with `check_tensors`: a host sync). Scalar
    bounds are filled on the device (no host-to-device copy, which would sync)."""

    def full(x: float | torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            return x.to(like.device, like.dtype).expand(B, k).clone()
        return torch.full((B, k), float(x), dtype=like.dtype, device=like.device)

    lo = full(lower)
    hi = full(math.inf if upper is None else upper)
    if isinstance(lower, torch.Tensor) or isinstance(upper, torch.Tensor):
        if check_tensors and bool((lo > hi).any()):
            raise ValueError("nnls: lower bound above upper bound")
    elif upper is not None and lower > upper:
        raise ValueError(f"nnls: lower bound {lower} above upper bound {upper}")
    return lo, hi


def _free_subset(free: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """On the CPU, where a host sync costs nothing, when the free entries free [B, k] are
    at most 3/4 of k: (idx [B, f] the free indices first, then others as padding; valid
    [B, f]), f = the largest free count; else None (solve at full size, no sync)."""
    if free.device.type != "cpu":
        return None
    counts = free.sum(-1)
    f = max(1, int(counts.max()))
    if 4 * f > 3 * free.shape[1]:
        return None
    order = torch.sort((~free).to(torch.int8), dim=-1, stable=True).indices
    idx = order[:, :f]
    valid = torch.arange(f, device=free.device).unsqueeze(0) < counts.unsqueeze(1)
    return idx, valid


def _mv(M: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Batched matrix-vector product M [B, r, k] x [B, k] -> [B, r]."""
    if M.device.type == "cpu":  # CPU BLAS runs batched GEMV slowly: a fused multiply-sum
        return (M * x.unsqueeze(1)).sum(-1)
    return torch.bmm(M, x.unsqueeze(-1)).squeeze(-1)


def nnls_data(
    A: torch.Tensor,
    b: torch.Tensor,
    lower: float | torch.Tensor,
    upper: float | torch.Tensor | None,
    mask: torch.Tensor | None,
    ridge: float,
    rounds: int,
) -> torch.Tensor:
    """Fixed-work NNLS for A [B, m, k] with m < k, in fp64 through :class:`DataOps`; the
    ridge (at least 1e-9, as the Gram path's jitter would add) is relative to the mean
    diagonal of A'A with padded columns counted as 1, as in :func:`nnls_gram`."""
    B, _, k = A.shape
    A, b = A.double(), b.double()
    lo, hi = box(lower, upper, B, k, A, check_tensors=False)
    colsq = A.square().sum(1)
    if mask is not None:
        m = mask.to(torch.bool)
        zero = A.new_zeros(())
        A = A * m.unsqueeze(1)
        lo, hi = torch.where(m, lo, zero), torch.where(m, hi, zero)
        colsq = torch.where(m, colsq, torch.ones((), dtype=A.dtype, device=A.device))
    lam = max(ridge, 1e-9) * colsq.mean(-1).clamp_min(1e-30)
    return fixed_work(DataOps(A, b, lam), lo, hi, rounds)


def fixed_work(
    ops: GramOps | DataOps, lo: torch.Tensor, hi: torch.Tensor, rounds: int
) -> torch.Tensor:
    """At most `rounds` solves: PDAS for half of them (fast when it converges), then primal
    active-set rounds from its best iterate (monotone: never worse). Both stop early at
    convergence, tested every round on the CPU and every 4 rounds elsewhere (the only host
    syncs; stopping early gives the same result)."""
    first = (rounds + 1) // 2
    w = pdas(ops, lo, hi, first)
    check = 1 if lo.device.type == "cpu" else 4
    return polish(ops, w, lo, hi, rounds - first, check) if rounds > first else w


def pdas(ops: GramOps | DataOps, lo: torch.Tensor, hi: torch.Tensor, rounds: int) -> torch.Tensor:
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


def polish(
    ops: GramOps | DataOps,
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

"""The OMP engine of ``am-omp`` / ``am-omp-fast`` (private: see
:func:`compactor.methods.attention_matching.omp_select`, which drives it).

Shape legend: T prefix tokens, n reference queries, h KV heads of one block, K keys per
round (k * tau), S slots (capacity + K write-off slots).

Everything runs batched over the block's heads on the device of phi; host syncs happen
only between blocks of rounds (:meth:`OMPBlock.run`).
"""

from __future__ import annotations

import math

import torch

__all__ = ["OMPBlock"]


class OMPBlock:
    """OMP on one block of heads: phi [h, n, T], mass b [h, n], budgets [h].

    Slots hold the selected keys in insertion order: their features At [h, S, n], c = At b
    and the inverse Gram Hinv [h, S, S] of the live slots (identity on every other slot:
    dead, unused, and the K write-off slots at the end, which absorb the keys a head does
    not take); S = cap + K. All fp64: in fp32 the rounding of the near-singular Gram makes
    it indefinite. ``overflow`` flags an update that could not be made exactly (more than
    m keys pruned at once, a failed factorization): Hinv is then rebuilt at the next sync.
    Mutated by its methods.
    """

    def __init__(self, phi: torch.Tensor, b: torch.Tensor, budgets: list[int], kk: int, K: int):
        h, _, T = phi.shape
        dev = phi.device
        self.phi, self.b, self.kk, self.K = phi, b, kk, K
        self.bud = torch.as_tensor(budgets, dtype=torch.int64, device=dev)
        self.bud_max = max(budgets)
        self.inv_norm = torch.linalg.vector_norm(phi, dim=1).clamp_min(1e-15).reciprocal_()
        self.taken = torch.zeros(h, T, dtype=torch.bool, device=dev)  # picked now or before
        self.done = torch.zeros(h, dtype=torch.bool, device=dev)
        self.r = b.clone()
        self.m = 2 * K + 8  # largest active / pruned set handled exactly per refit
        self.overflow = torch.zeros((), dtype=torch.bool, device=dev)
        self._alloc(self.bud_max + K)

    def _alloc(self, cap: int) -> None:
        h, n, _ = self.phi.shape
        dev, S = self.phi.device, cap + self.K
        self.cap = cap
        self.At = torch.zeros(h, S, n, dtype=torch.float64, device=dev)
        eye = torch.eye(S, dtype=torch.float64, device=dev)
        self.Hinv = eye.expand(h, S, S).clone()
        self.c = torch.zeros(h, S, dtype=torch.float64, device=dev)
        self.idx = torch.zeros(h, S, dtype=torch.int64, device=dev)
        self.live = torch.zeros(h, S, dtype=torch.bool, device=dev)
        self.used = torch.zeros(h, dtype=torch.int64, device=dev)

    def run(self, tau: int, lo_w: float, ridge: float, iters: int) -> torch.Tensor:
        """All rounds; returns the kept keys as [h, T] bool. Host syncs only between
        blocks of rounds (every round on the CPU, where they cost nothing)."""
        T = self.phi.shape[2]
        max_rounds = -(-(4 * (self.bud_max // self.kk + 1) + T // self.kk) // tau)
        cpu = self.phi.device.type == "cpu"
        block = -(-self.bud_max // self.K)
        done_rounds = 0
        while done_rounds < max_rounds:
            for _ in range(min(block, max_rounds - done_rounds)):
                self._round(lo_w, ridge, iters)
                done_rounds += 1
                if cpu and bool(self.done.all()):
                    break
            remaining = self.bud - self.live.sum(-1)
            active = ~self.done & (remaining > 0)
            if not bool(active.any()):
                break
            block = -(-int(remaining[active].max()) // self.K)
            if int(self.used.max()) + block * self.K > self.cap:
                self._compact()
            if bool(self.overflow):
                self._rebuild(ridge)
        hits = torch.zeros(self.taken.shape, dtype=torch.int32, device=self.taken.device)
        return hits.scatter_add_(1, self.idx, self.live.to(torch.int32)) > 0

    def _round(self, lo_w: float, ridge: float, iters: int) -> None:
        """Pick up to K keys per head on one correlation pass, refit, prune."""
        K, kk = self.K, self.kk
        remaining = self.bud - self.live.sum(-1)
        self.done |= remaining <= 0
        corr = torch.bmm(self.r.unsqueeze(1), self.phi).squeeze(1).mul_(self.inv_norm)
        corr.masked_fill_(self.taken, -math.inf)
        top_val, top_idx = corr.topk(K, dim=-1)
        want = remaining.clamp(0, K)
        slot_ar = torch.arange(K, device=corr.device).unsqueeze(0)
        # as k keys per step: the head is done once the first key of a step it needs is <= 0
        last_step = ((want + kk - 1) // kk - 1).clamp_min(0) * kk
        self.done |= (want > 0) & ~(top_val.gather(1, last_step.unsqueeze(1)).squeeze(1) > 0)
        take = (slot_ar < want.unsqueeze(1)) & (top_val > 0) & ~self.done.unsqueeze(1)
        # no free slot (pruned slots are reclaimed at the next sync): not taken this round
        take &= (self.used.unsqueeze(1) + torch.cumsum(take, -1)) <= self.cap
        self.taken |= torch.zeros_like(self.taken).scatter_(1, top_idx, take)
        self._add(top_idx, take, ridge)
        w = self._solve(iters)
        weak = self.live & (w < lo_w)
        self._remove(weak)
        self.done &= ~weak.any(-1)  # a head that lost keys may pick again
        w = torch.where(self.live, w, w.new_zeros(()))
        self.r = (self.b - torch.bmm(w.unsqueeze(1), self.At).squeeze(1)).float()

    def _add(self, top_idx: torch.Tensor, take: torch.Tensor, ridge: float) -> None:
        """Append the taken keys top_idx [h, K] (take [h, K] bool) to the slots and the
        inverse Gram (a rank-K block update)."""
        h, n, _ = self.phi.shape
        K, cap = self.K, self.cap
        dev = self.phi.device
        slot_ar = torch.arange(K, device=dev).unsqueeze(0)
        pos = self.used.unsqueeze(1) + torch.cumsum(take, -1) - 1
        pos = torch.where(take, pos, cap + slot_ar)  # the write-off slots
        self.used += take.sum(-1)
        An = torch.gather(self.phi, 2, top_idx.unsqueeze(1).expand(-1, n, -1))  # [h, n, K]
        AnT = (An * take.unsqueeze(1)).transpose(1, 2).contiguous()  # [h, K, n]
        # fp64 Gram entries: fp32 rounding would make the near-singular Gram indefinite
        AnT = AnT.double()
        B = torch.bmm(AnT, self.At.transpose(1, 2)).transpose(1, 2)  # [h, S, K]
        B = B * self.live.unsqueeze(-1)
        D = torch.bmm(AnT, AnT.transpose(1, 2))  # [h, K, K]
        both = take.unsqueeze(1) & take.unsqueeze(2)
        eye = torch.eye(K, dtype=torch.float64, device=dev)
        D = torch.where(both, D, D.new_zeros(())) + torch.diag_embed(
            torch.where(take, ridge * torch.diagonal(D, dim1=1, dim2=2) + 1e-300, 1.0)
        )
        X = torch.bmm(self.Hinv, B)  # [h, S, K]
        Sc = D - torch.bmm(B.transpose(1, 2), X)  # Schur complement [h, K, K]
        Sc = 0.5 * (Sc + Sc.transpose(1, 2))
        L, info = torch.linalg.cholesky_ex(Sc)
        self.overflow |= (info != 0).any()
        L = torch.where((info == 0)[:, None, None], L, eye)
        # new Hinv = Hinv - E E' + Y Sc^-1 Y', Y = X - E (E: one-hot columns at pos)
        Y = X.scatter_add(1, pos.unsqueeze(1), X.new_full((h, 1, K), -1.0))
        M = torch.cholesky_solve(Y.transpose(1, 2), L)  # Sc^-1 Y'  [h, K, S]
        self.Hinv.baddbmm_(Y, M)
        diag = torch.diagonal(self.Hinv, dim1=1, dim2=2)
        diag.scatter_(1, pos, torch.gather(diag, 1, pos) - 1.0)
        self.At.scatter_(1, pos.unsqueeze(2).expand(-1, -1, n), AnT)
        cb = torch.bmm(AnT, self.b.double().unsqueeze(-1)).squeeze(-1)
        self.c.scatter_(1, pos, cb)
        self.idx.scatter_(1, pos, top_idx)
        self.live.scatter_(1, pos, take)
        self.live[:, cap:] = False
        self._reset_writeoff()

    def _reset_writeoff(self) -> None:
        """Keep the write-off slots decoupled (identity rows/cols, no features, c = 0)."""
        cap = self.cap
        self.Hinv[:, cap:, :] = 0.0
        self.Hinv[:, :, cap:] = 0.0
        torch.diagonal(self.Hinv[:, cap:, cap:], dim1=1, dim2=2).fill_(1.0)
        self.At[:, cap:] = 0.0
        self.c[:, cap:] = 0.0

    def _solve(self, iters: int) -> torch.Tensor:
        """NNLS weights [h, S] fp64 of the live slots (w >= 0; 0 elsewhere): least squares
        from Hinv, then ``iters`` active-set rounds on the keys held at 0 (at most m of
        them per head, solved through their Schur complement)."""
        Hv, live = self.Hinv, self.live
        zero = Hv.new_zeros(())
        c = torch.where(live, self.c, zero)
        u = torch.bmm(Hv, c.unsqueeze(-1)).squeeze(-1)  # unconstrained LS on the live set
        w = u
        S = u.shape[1]
        m = min(self.m, S)
        held = torch.zeros_like(live)
        lam = torch.zeros_like(u)
        eye = torch.eye(m, dtype=Hv.dtype, device=Hv.device)
        cpu = Hv.device.type == "cpu"
        for _ in range(iters):
            keep = held & (lam < 0)  # multipliers: these keys still want w < 0
            new = live & ~held & (w < 0)
            prio = torch.where(keep, math.inf, torch.where(new, -w, -math.inf))
            val, ci = prio.topk(m, dim=-1)
            valid = val > -math.inf  # [h, m]
            Z = torch.gather(Hv, 2, ci.unsqueeze(1).expand(-1, S, -1))  # [h, S, m]
            Z = Z * valid.unsqueeze(1)
            Scc = torch.gather(Z, 1, ci.unsqueeze(-1).expand(-1, -1, m))  # [h, m, m]
            vv = valid.unsqueeze(1) & valid.unsqueeze(2)
            Scc = torch.where(vv, Scc, eye)
            uc = torch.where(valid, torch.gather(u, 1, ci), zero)
            L, info = torch.linalg.cholesky_ex(Scc)
            lc = torch.cholesky_solve(uc.unsqueeze(-1), L).squeeze(-1)
            lc = torch.where((info == 0).unsqueeze(-1) & valid, lc, zero)
            w = u - torch.bmm(Z, lc.unsqueeze(-1)).squeeze(-1)
            new_held = torch.zeros_like(held).scatter_(1, ci, valid)
            lam = torch.zeros_like(lam).scatter_(1, ci, lc)
            w = torch.where(new_held, zero, w)
            if cpu and bool(torch.equal(new_held, held)):
                break  # the same keys held at 0: a fixed point
            held = new_held
        return torch.where(live, w.clamp_min(0.0), zero)

    def _remove(self, weak: torch.Tensor) -> None:
        """Drop the live slots weak [h, S] (bool): a Schur downdate of Hinv for up to m of
        them per head (more sets ``overflow``: Hinv is rebuilt at the next sync)."""
        Hv = self.Hinv
        S = Hv.shape[1]
        m = min(self.m, S)
        zero = Hv.new_zeros(())
        prio = torch.where(weak, 1.0, 0.0)
        val, ri = prio.topk(m, dim=-1)
        valid = val > 0
        self.overflow |= (weak.sum(-1) > m).any()
        Z = torch.gather(Hv, 2, ri.unsqueeze(1).expand(-1, S, -1)) * valid.unsqueeze(1)
        Srr = torch.gather(Z, 1, ri.unsqueeze(-1).expand(-1, -1, m))
        eye = torch.eye(m, dtype=Hv.dtype, device=Hv.device)
        vv = valid.unsqueeze(1) & valid.unsqueeze(2)
        Srr = torch.where(vv, Srr, eye)
        L, info = torch.linalg.cholesky_ex(Srr)
        self.overflow |= (info != 0).any()
        M = torch.cholesky_solve(Z.transpose(1, 2), L)  # [h, m, S]
        M = torch.where((info == 0)[:, None, None], M, zero)
        Hv.baddbmm_(Z, M, alpha=-1.0)
        gone = weak  # rows / cols of the removed slots back to identity
        keep2 = ~gone
        Hv.mul_(keep2.unsqueeze(1) & keep2.unsqueeze(2))
        torch.diagonal(Hv, dim1=1, dim2=2).add_(gone.to(Hv.dtype))
        self.live &= ~gone
        self.c = torch.where(gone, zero, self.c)

    def _compact(self) -> None:
        """Move the live slots first (in order) so that used = live count."""
        S = self.Hinv.shape[1]
        cap = self.cap
        body = (~self.live[:, :cap]).to(torch.int8)
        order = torch.sort(body, dim=-1, stable=True).indices  # [h, cap]
        tail = torch.arange(cap, S, device=order.device).expand(order.shape[0], -1)
        order = torch.cat([order, tail], 1)
        self.At = torch.gather(self.At, 1, order.unsqueeze(2).expand_as(self.At))
        Hv = torch.gather(self.Hinv, 1, order.unsqueeze(2).expand_as(self.Hinv))
        self.Hinv = torch.gather(Hv, 2, order.unsqueeze(1).expand_as(Hv))
        self.c = torch.gather(self.c, 1, order)
        self.idx = torch.gather(self.idx, 1, order)
        self.live = torch.gather(self.live, 1, order)
        self.used = self.live.sum(-1)
        dead = ~self.live
        self.At = self.At * self.live.unsqueeze(-1)
        eye_d = torch.diag_embed(dead.to(self.Hinv.dtype))
        keep = self.live.unsqueeze(1) & self.live.unsqueeze(2)
        self.Hinv = torch.where(keep, self.Hinv, self.Hinv.new_zeros(())) + eye_d

    def _rebuild(self, ridge: float) -> None:
        """Recompute Hinv from the live slots' features (after an overflow)."""
        At = self.At * self.live.unsqueeze(-1)
        G = torch.bmm(At, At.transpose(1, 2))
        dg = torch.diagonal(G, dim1=1, dim2=2)
        G = G + torch.diag_embed(torch.where(self.live, ridge * dg + 1e-300, 1.0))
        L, info = torch.linalg.cholesky_ex(G)
        ok = (info == 0)[:, None, None]
        self.Hinv = torch.where(ok, torch.cholesky_inverse(L), torch.linalg.pinv(G))
        self.overflow.zero_()

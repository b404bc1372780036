"""Attention Matching methods (arXiv 2602.16284): am-highest, am-omp, am-omp-fast, keep-only.

Shape legend: T prefix tokens, t kept (t_max = max over heads), n reference queries,
H_kv KV heads, D head dim, indptr [H_kv+1] int32.

Every method = a key selection (:meth:`pick`, on the layer's reference targets) followed by
the AM refit (:func:`compactor.methods.refit.refit`: NNLS beta on the attention mass +
least-squares values), with the method's bounds and ridge (:meth:`refit_spec`); the targets
are computed once per layer (``LayerInput.targets``) and shared by both steps.
``keep-only`` wraps any selecting method and skips the refit (beta = 0, original values):
the ablation that shows what the refit buys.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, cast

import torch

from compactor.methods.base import (
    CompactionMethod,
    LayerInput,
    Picked,
    RefitSpec,
    ScoreMethod,
    SelectingMethod,
    Selection,
    get_method,
    register_method,
    topk_selection,
)
from compactor.methods.refit import Targets, fit_beta_nnls_gram

__all__ = [
    "AMOMP",
    "AMHighest",
    "AMOMPFast",
    "KeepOnly",
    "highest_attention_scores",
    "highest_attention_select",
    "omp_select",
]


def highest_attention_scores(targets: Targets) -> torch.Tensor:
    """[H, T] RMS over the reference queries of each key's attention weight.

    targets: :func:`~compactor.methods.refit.reference_targets` of the layer.
    """
    attn = targets.phi / targets.mass.unsqueeze(-1)  # [H, n, T]
    return attn.square().mean(1).sqrt()


def highest_attention_select(targets: Targets, budgets: Sequence[int]) -> Selection:
    """Top-t_h keys per head by :func:`highest_attention_scores`; indices ascending."""
    return topk_selection(highest_attention_scores(targets), budgets)


def omp_select(
    targets: Targets,
    budgets: Sequence[int],
    *,
    k: int = 1,
    tau: int = 1,
    prune_beta: float | None = -7.0,
    nnls_ridge: float = 1e-6,
    nnls_iters: int = 10,
) -> Selection:
    """Orthogonal matching pursuit on the mass features, batched over KV heads.

    Each step adds (up to) k keys per head: those whose normalized feature column
    phi[:, j] correlates best with the mass residual r = mass - phi[:, S] w; every tau
    steps (and at the end) w is refit by NNLS and keys with log w < prune_beta are
    dropped and never picked again (paper's safeguard). A head stops early, keeping
    fewer than its budget, once no key correlates positively with its residual.

    Args:
        targets: :func:`reference_targets` of the layer (phi [H, n, T], mass [H, n]).
        budgets: t_h per head. k, tau: keys per step / steps per refit.

    Returns:
        Selection [H, t_max] (indices ascending); at most budgets[h] keys per head.
    """
    phi, b = targets.phi, targets.mass
    H, n, T = phi.shape
    dev = phi.device
    bud = torch.as_tensor(list(budgets), dtype=torch.int64, device=dev)
    bud_max = max(int(x) for x in budgets)
    kk = min(k, T)
    lo_w = 0.0 if prune_beta is None else math.exp(prune_beta)
    inv_norm = phi.square().sum(1).clamp_min(1e-30).rsqrt()  # [H, T]
    taken = torch.zeros(H, T, dtype=torch.bool, device=dev)  # selected now or pruned before
    st = _Slots(H, n, bud_max + 2 * kk, b)
    done = torch.zeros(H, dtype=torch.bool, device=dev)
    r = b.clone()
    step = 0
    max_steps = 4 * (bud_max // kk + 1) + T // kk
    slot_ar = torch.arange(kk, device=dev).unsqueeze(0)  # [1, kk]
    zero = phi.new_zeros(())
    while step < max_steps:
        remaining = bud - st.live.sum(-1)
        done |= remaining <= 0
        if bool(done.all()):
            break
        corr = torch.bmm(r.unsqueeze(1), phi).squeeze(1).mul_(inv_norm)  # [H, T]
        corr.masked_fill_(taken, -math.inf)
        top_val, top_idx = corr.topk(kk, dim=-1)
        done |= ~(top_val[:, 0] > 0)
        take = slot_ar < remaining.clamp(max=kk).unsqueeze(1)
        take &= (top_val > 0) & ~done.unsqueeze(1)
        taken |= torch.zeros_like(taken).scatter_(1, top_idx, take)
        st.add(top_idx, take, phi)
        step += 1
        finished = bool((done | (st.live.sum(-1) >= bud)).all())
        if step % tau and not finished:
            continue
        beta = fit_beta_nnls_gram(
            st.G,
            st.c,
            st.live,
            (None, None),
            max_iter=nnls_iters,
            ridge=nnls_ridge,
            polish_rounds=8,
        )
        w = torch.where(st.live, beta.exp(), zero)
        weak = st.live & (w < lo_w)
        if bool(weak.any()):
            st.live &= ~weak  # pruned keys stay in `taken`: never picked again
            done &= ~weak.any(-1)  # a head that lost keys may pick again
            w = torch.where(weak, zero, w)
        r = b - torch.bmm(w.unsqueeze(1), st.At).squeeze(1)
    return st.selection(T)


class _Slots:
    """OMP working set: feature columns stored as rows At [H, cap+1, n] in insertion
    order, their Gram G = A'A and c = A'mass, kept incrementally; slot ``cap`` is a
    write-off slot. Everything lives on the device of the mass ``b`` [H, n].
    Mutated by :meth:`add` (and compacted in place when full)."""

    def __init__(self, H: int, n: int, cap: int, b: torch.Tensor) -> None:
        self.cap, self.b = cap, b
        dev = b.device
        self.At = torch.zeros(H, cap + 1, n, device=dev)
        self.G = torch.zeros(H, cap + 1, cap + 1, device=dev)
        self.c = torch.zeros(H, cap + 1, device=dev)
        self.idx = torch.zeros(H, cap + 1, dtype=torch.int64, device=dev)
        self.live = torch.zeros(H, cap + 1, dtype=torch.bool, device=dev)
        self.used = torch.zeros(H, dtype=torch.int64, device=dev)

    def add(self, top_idx: torch.Tensor, take: torch.Tensor, phi: torch.Tensor) -> None:
        """Append the taken keys top_idx [H, kk] (take [H, kk] bool)."""
        if int((self.used + take.sum(-1)).max()) > self.cap:
            self._compact()
        pos = self.used.unsqueeze(1) + torch.cumsum(take, -1) - 1
        pos = torch.where(take, pos, torch.full_like(pos, self.cap))
        self.used += take.sum(-1)
        n = phi.shape[1]
        An = torch.gather(phi, 2, top_idx.unsqueeze(1).expand(-1, n, -1))
        AnT = (An * take.unsqueeze(1)).transpose(1, 2).contiguous()  # [H, kk, n]
        self.At.scatter_(1, pos.unsqueeze(2).expand(-1, -1, n), AnT)
        cross = torch.bmm(self.At, AnT.transpose(1, 2))  # [H, cap+1, kk]
        self.G.scatter_(2, pos.unsqueeze(1).expand(-1, self.cap + 1, -1), cross)
        self.G.scatter_(1, pos.unsqueeze(2).expand(-1, -1, self.cap + 1), cross.transpose(1, 2))
        self.c.scatter_(1, pos, torch.bmm(AnT, self.b.unsqueeze(-1)).squeeze(-1))
        self.idx.scatter_(1, pos, top_idx)
        self.live.scatter_(1, pos, take)
        self.live[:, self.cap] = False

    def _compact(self) -> None:
        order = torch.sort((~self.live).to(torch.int8), dim=-1, stable=True).indices
        self.At = torch.gather(self.At, 1, order.unsqueeze(2).expand_as(self.At))
        self.G = torch.gather(self.G, 1, order.unsqueeze(2).expand_as(self.G))
        self.G = torch.gather(self.G, 2, order.unsqueeze(1).expand_as(self.G))
        self.c = torch.gather(self.c, 1, order)
        self.idx = torch.gather(self.idx, 1, order)
        self.live = torch.gather(self.live, 1, order)
        self.used = self.live.sum(-1)

    def selection(self, T: int) -> Selection:
        """The live keys as a Selection (indices ascending)."""
        hits = torch.zeros(self.live.shape[0], T, dtype=torch.int32, device=self.live.device)
        hits.scatter_add_(1, self.idx, self.live.to(torch.int32))
        return Selection.from_mask(hits > 0)


@register_method("am-highest")
@dataclasses.dataclass
class AMHighest(ScoreMethod):
    """Keep the top-t keys by RMS attention, then the AM refit with beta in beta_bounds."""

    beta_bounds: tuple[float, float] = (-3.0, 3.0)
    value_ridge: float = 1e-3
    fit_values: bool = True

    def __post_init__(self) -> None:
        self.beta_bounds = _check_bounds(self.beta_bounds)
        _check_ridge(self.value_ridge)

    def score(self, x: LayerInput) -> torch.Tensor:
        """:func:`highest_attention_scores` of the layer."""
        return highest_attention_scores(x.targets)

    def refit_spec(self) -> RefitSpec:
        return RefitSpec(self.beta_bounds, self.fit_values, self.value_ridge)


@register_method("am-omp")
@dataclasses.dataclass
class AMOMP(SelectingMethod):
    """OMP key selection on the mass features (k keys per step, NNLS refit every tau
    steps, prune beta < prune_beta), then the AM refit (beta >= prune_beta)."""

    k: int = 1
    tau: int = 1
    prune_beta: float = -7.0
    value_ridge: float = 1e-3
    nnls_iters: int = 10
    fit_values: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"k (keys per OMP step) must be an int >= 1, got {self.k!r}")
        if isinstance(self.tau, bool) or not isinstance(self.tau, int) or self.tau < 1:
            raise ValueError(f"tau (steps per refit) must be an int >= 1, got {self.tau!r}")
        if not (math.isfinite(self.prune_beta) and self.prune_beta < 0):
            raise ValueError(f"prune_beta must be finite and < 0, got {self.prune_beta!r}")
        if self.nnls_iters < 0:
            raise ValueError(f"nnls_iters must be >= 0, got {self.nnls_iters!r}")
        _check_ridge(self.value_ridge)

    def pick(self, x: LayerInput) -> Picked:
        """:func:`omp_select` on the layer's targets."""
        sel = omp_select(
            x.targets,
            x.budgets,
            k=self.k,
            tau=self.tau,
            prune_beta=self.prune_beta,
            nnls_iters=self.nnls_iters,
        )
        return Picked(sel, {})

    def refit_spec(self) -> RefitSpec:
        return RefitSpec((self.prune_beta, None), self.fit_values, self.value_ridge)


@register_method("am-omp-fast")
@dataclasses.dataclass
class AMOMPFast(AMOMP):
    """am-omp with k=4 keys per step and an NNLS refit every tau=2 steps."""

    k: int = 4
    tau: int = 2


@register_method("keep-only")
@dataclasses.dataclass
class KeepOnly(SelectingMethod):
    """Ablation: the inner method's selection, beta = 0, original values (no refit).

    ``inner`` is a selecting method or its registered name (built with inner_params); its
    pick's report is passed on.
    """

    inner: SelectingMethod | str = "am-omp"
    inner_params: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        inner: object = self.inner
        if isinstance(inner, str):
            inner = get_method(inner, **self.inner_params)
        elif not isinstance(inner, CompactionMethod):
            raise ValueError(f"inner must be a CompactionMethod or a method name, got {inner!r}")
        if not isinstance(inner, SelectingMethod):
            raise ValueError(f"inner method {inner.name!r} does not select a key subset")
        self.inner = inner
        self.inner_params = inner.params()

    def pick(self, x: LayerInput) -> Picked:
        return cast(SelectingMethod, self.inner).pick(x)

    def params(self) -> dict[str, Any]:
        inner = cast(SelectingMethod, self.inner)  # a method after __post_init__
        return {"inner": inner.name, "inner_params": inner.params()}


# ---- private helpers -------------------------------------------------------------------


def _check_bounds(bounds: Any) -> tuple[float, float]:
    try:
        lo, hi = (float(x) for x in bounds)
    except (TypeError, ValueError):
        raise ValueError(f"beta_bounds must be a (lo, hi) pair, got {bounds!r}") from None
    if not (math.isfinite(lo) and math.isfinite(hi) and lo <= 0 <= hi):
        raise ValueError(f"beta_bounds must be finite with lo <= 0 <= hi, got {bounds!r}")
    return (lo, hi)


def _check_ridge(ridge: Any) -> None:
    if not (isinstance(ridge, int | float) and math.isfinite(ridge) and ridge >= 0):
        raise ValueError(f"value_ridge must be a finite float >= 0, got {ridge!r}")

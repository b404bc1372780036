"""Attention Matching methods (arXiv 2602.16284): am-highest, am-omp, am-omp-fast, keep-only.

Shape legend: T prefix tokens, t kept (t_max = max over heads), n reference queries,
H_kv KV heads, D head dim, indptr [H_kv+1] int32.

Every method = a key selection (:meth:`select`) followed by the AM refit
(:func:`compactor.methods.refit.refit`: NNLS beta on the attention mass + least-squares
values). ``keep-only`` wraps any selecting method and skips the refit (beta = 0,
original values): the ablation that shows what the refit buys.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, cast

import torch

from compactor.methods.base import (
    CompactionMethod,
    Selection,
    check_layer_inputs,
    get_method,
    pack_layer,
    register_method,
    resolve_sm_scale,
)
from compactor.methods.refit import (
    Targets,
    fit_beta_nnls_gram,
    reference_targets,
    refit,
    selection_from_budgets,
)
from compactor.types import CompactedLayer

__all__ = ["AMOMP", "AMHighest", "AMOMPFast", "KeepOnly", "highest_attention_select", "omp_select"]


def highest_attention_select(targets: Targets, budgets: Sequence[int]) -> Selection:
    """Top-t_h keys per head by RMS over reference queries of their attention weight.

    targets: :func:`reference_targets` of the layer. Returns indices sorted ascending.
    """
    attn = targets.phi / targets.mass.unsqueeze(-1)  # [H, n, T]
    score = attn.square().mean(1).sqrt()  # [H, T]
    top = score.topk(max(budgets), dim=-1).indices
    sel = selection_from_budgets(top, budgets)
    return _sorted(sel)


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
class AMHighest(CompactionMethod):
    """Keep the top-t keys by RMS attention, then the AM refit with beta in beta_bounds."""

    beta_bounds: tuple[float, float] = (-3.0, 3.0)
    value_ridge: float = 1e-3
    fit_values: bool = True

    def __post_init__(self) -> None:
        self.beta_bounds = _check_bounds(self.beta_bounds)
        _check_ridge(self.value_ridge)

    def select(self, keys, values, queries, budgets, sm_scale=None) -> Selection:  # type: ignore[no-untyped-def]
        budgets = check_layer_inputs(keys, values, queries, budgets)
        scale = resolve_sm_scale(sm_scale, keys.shape[-1])
        return highest_attention_select(reference_targets(keys, values, queries, scale), budgets)

    def compact_layer(self, keys, values, queries, budgets, sm_scale=None) -> CompactedLayer:  # type: ignore[no-untyped-def]
        budgets = check_layer_inputs(keys, values, queries, budgets)
        scale = resolve_sm_scale(sm_scale, keys.shape[-1])
        tg = reference_targets(keys, values, queries, scale)
        sel = highest_attention_select(tg, budgets)
        return refit(
            keys,
            values,
            queries,
            sel,
            sm_scale=scale,
            beta_bounds=self.beta_bounds,
            fit_values=self.fit_values,
            value_ridge=self.value_ridge,
            targets=tg,
        )


@register_method("am-omp")
@dataclasses.dataclass
class AMOMP(CompactionMethod):
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

    def _select(self, tg: Targets, budgets: list[int]) -> Selection:
        return omp_select(
            tg,
            budgets,
            k=self.k,
            tau=self.tau,
            prune_beta=self.prune_beta,
            nnls_iters=self.nnls_iters,
        )

    def select(self, keys, values, queries, budgets, sm_scale=None) -> Selection:  # type: ignore[no-untyped-def]
        budgets = check_layer_inputs(keys, values, queries, budgets)
        scale = resolve_sm_scale(sm_scale, keys.shape[-1])
        return self._select(reference_targets(keys, values, queries, scale), budgets)

    def compact_layer(self, keys, values, queries, budgets, sm_scale=None) -> CompactedLayer:  # type: ignore[no-untyped-def]
        budgets = check_layer_inputs(keys, values, queries, budgets)
        scale = resolve_sm_scale(sm_scale, keys.shape[-1])
        tg = reference_targets(keys, values, queries, scale)
        sel = self._select(tg, budgets)
        return refit(
            keys,
            values,
            queries,
            sel,
            sm_scale=scale,
            beta_bounds=(self.prune_beta, None),
            fit_values=self.fit_values,
            value_ridge=self.value_ridge,
            targets=tg,
        )


@register_method("am-omp-fast")
@dataclasses.dataclass
class AMOMPFast(AMOMP):
    """am-omp with k=4 keys per step and an NNLS refit every tau=2 steps."""

    k: int = 4
    tau: int = 2


@register_method("keep-only")
@dataclasses.dataclass
class KeepOnly(CompactionMethod):
    """Ablation: the inner method's selection, beta = 0, original values (no refit).

    ``inner`` is a selecting method or its registered name (built with inner_params).
    """

    inner: CompactionMethod | str = "am-omp"
    inner_params: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.inner, str):
            self.inner = get_method(self.inner, **self.inner_params)
        elif not isinstance(self.inner, CompactionMethod):
            raise ValueError(
                f"inner must be a CompactionMethod or a method name, got {self.inner!r}"
            )
        if type(self.inner).select is CompactionMethod.select:
            raise ValueError(f"inner method {self.inner.name!r} does not select a key subset")
        self.inner_params = self.inner.params()

    def select(self, keys, values, queries, budgets, sm_scale=None) -> Selection:  # type: ignore[no-untyped-def]
        return cast(CompactionMethod, self.inner).select(keys, values, queries, budgets, sm_scale)

    def compact_layer(self, keys, values, queries, budgets, sm_scale=None) -> CompactedLayer:  # type: ignore[no-untyped-def]
        sel = self.select(keys, values, queries, budgets, sm_scale)
        g = sel.indices.unsqueeze(-1).expand(-1, -1, keys.shape[-1])
        ck, cv = torch.gather(keys, 1, g), torch.gather(values, 1, g)
        beta = torch.zeros(sel.indices.shape, device=keys.device)
        return pack_layer(ck, cv, beta, sel, keys.dtype)

    def params(self) -> dict[str, Any]:
        inner = cast(CompactionMethod, self.inner)  # a method after __post_init__
        return {"inner": inner.name, "inner_params": inner.params()}


# ---- private helpers -------------------------------------------------------------------


def _sorted(sel: Selection) -> Selection:
    big = torch.iinfo(torch.int64).max
    key = torch.where(sel.mask, sel.indices, torch.full_like(sel.indices, big))
    idx = key.sort(-1).values
    return Selection(torch.where(sel.mask, idx, idx.new_zeros(())), sel.mask)


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

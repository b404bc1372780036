"""Attention Matching methods (arXiv 2602.16284): am-highest, am-omp, am-omp-fast, keep-only.

Shape legend: T prefix tokens, t kept (t_max = max over heads), n reference queries,
H_kv KV heads, D head dim, indptr [H_kv+1] int32.

Every method = a key selection (:meth:`pick`, on the layer's reference targets) followed by
the AM refit (:func:`compactor.methods.refit.refit`: NNLS beta on the attention mass +
least-squares values), with the method's bounds and ridge (:meth:`refit_spec`); the targets
are computed once per layer (``LayerInput.targets``, lazily and in bounded blocks) and
shared by both steps. Everything is batched over the KV heads of a layer on the keys'
device, with no host sync per OMP step or NNLS round (see :func:`omp_select` and
:func:`compactor.solvers.nnls_gram`).
``keep-only`` wraps any selecting method and skips the refit (beta = 0, original values):
the ablation that shows what the refit buys.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, ClassVar, cast

import torch

from compactor.methods._omp import OMPBlock
from compactor.methods.base import (
    CompactionMethod,
    LayerInput,
    Picked,
    RefitSpec,
    ScoreMethod,
    SelectingMethod,
    Selection,
    topk_selection,
)
from compactor.methods.registry import get_method, register_method
from compactor.methods.targets import Targets

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
    return targets.key_rms()


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
    nnls_iters: int = 4,
) -> Selection:
    """Orthogonal matching pursuit on the mass features, batched over KV heads.

    Each step adds (up to) k keys per head: those whose normalized feature column
    phi[:, j] correlates best with the mass residual r = mass - phi[:, S] w; every tau
    steps (and at the end) w is refit by NNLS and keys with log w < prune_beta are
    dropped and never picked again (paper's safeguard). A head stops early, keeping
    fewer than its budget, once no key correlates positively with its residual.

    The residual only changes at a refit, so the tau steps between two refits are one
    round that takes the next k * tau keys of one correlation pass. The NNLS runs on an
    inverse Gram matrix of the selected keys kept up to date (fp64; rank-k*tau updates
    as keys come, Schur downdates as they are pruned), with ``nnls_iters`` active-set
    rounds on the keys at w = 0: no factorization and no host sync per step. Heads are
    processed in blocks whose phi [n, T] and OMP state fit ``targets.block_bytes``.

    Args:
        targets: :func:`reference_targets` of the layer (phi [H, n, T], mass [H, n]).
        budgets: t_h per head. k, tau: keys per step / steps per refit.
        nnls_ridge: ridge of the inner NNLS, relative to each key's own ||phi_j||^2.
        nnls_iters: active-set rounds of each inner NNLS (exact once the keys at w = 0
            are found; a round costs O(t * m), m = 2 k tau + 8 at most at the bound).

    Returns:
        Selection [H, t_max] (indices ascending); at most budgets[h] keys per head.
    """
    H, n, T = targets.shape
    bud = [int(x) for x in budgets]
    if len(bud) != H:
        raise ValueError(f"omp_select: {len(bud)} budgets for {H} heads")
    kk = min(k, T)
    K = min(kk * tau, T)
    lo_w = 0.0 if prune_beta is None else math.exp(prune_beta)
    hits = torch.zeros(H, T, dtype=torch.bool, device=targets.keys.device)
    S = max(bud) + 2 * K  # slots of OMPBlock: its fp64 features and inverse Gram (+ copies)
    hb = max(1, targets.block_bytes // (4 * n * T + 8 * S * n + 24 * S * S))
    for h0 in range(0, H, hb):
        h1 = min(H, h0 + hb)
        omp = OMPBlock(targets.phi_heads(h0, h1), targets.mass[h0:h1], bud[h0:h1], kk, K)
        hits[h0:h1] = omp.run(tau, lo_w, nnls_ridge, nnls_iters)
    return Selection.from_mask(hits)


@register_method("am-highest")
@dataclasses.dataclass
class AMHighest(ScoreMethod):
    """Keep the top-t keys by RMS attention, then the AM refit with beta in beta_bounds."""

    heads_independent: ClassVar[bool] = True

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
    steps, prune beta < prune_beta), then the AM refit (beta >= prune_beta).

    nnls_iters: active-set rounds of each inner NNLS (:func:`omp_select`; 4 reach the
    exact answer on real heads, where at most a few keys sit at w = 0 per refit).
    """

    heads_independent: ClassVar[bool] = True

    k: int = 1
    tau: int = 1
    prune_beta: float = -7.0
    value_ridge: float = 1e-3
    nnls_iters: int = 4
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

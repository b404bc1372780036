"""The Attention Matching refit, usable after ANY key selection.

Shape legend: T prefix tokens, t kept (t_max = max over heads), n reference queries,
H_kv KV heads, D head dim, indptr [H_kv+1] int32.

Given kept keys C_k (a subset of the original keys), fit
  * beta = log w, with w = NNLS fit of the attention *mass*:
        sum_j w_j exp(q c_j * s - m(q))  ~  sum_i exp(q k_i * s - m(q))   for each ref. query q
    (m(q) = row max over the original logits; w box-bounded to exp(beta_bounds));
  * values C_v by ridge least squares so that softmax(q C_k' s + beta) C_v matches the
    original attention output softmax(q K' s) V.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from compactor.methods.selection import Selection, pack_layer
from compactor.solvers import lstsq_values, nnls, nnls_gram
from compactor.types import CompactedLayer

__all__ = [
    "Targets",
    "fit_beta_nnls",
    "fit_beta_nnls_gram",
    "reference_targets",
    "refit",
    "selection_from_budgets",
]


class Targets(NamedTuple):
    """What the compacted layer must reproduce, per KV head and reference query.

    phi: [H_kv, n, T] fp32 mass features exp(q K' s - rowmax) (in (0, 1]).
    mass: [H_kv, n] fp32, phi summed over T (>= 1).
    out: [H_kv, n, D] fp32 original attention outputs.
    """

    phi: torch.Tensor
    mass: torch.Tensor
    out: torch.Tensor


def reference_targets(
    keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, sm_scale: float
) -> Targets:
    """Targets of the original layer. keys/values [H_kv, T, D], queries [H_kv, n, D]."""
    phi = torch.bmm(queries.float(), keys.float().transpose(1, 2)).mul_(sm_scale)
    phi.sub_(phi.amax(-1, keepdim=True)).exp_()
    mass = phi.sum(-1)
    out = torch.bmm(phi, values.float()).div_(mass.unsqueeze(-1))
    return Targets(phi, mass, out)


def refit(
    keys: torch.Tensor,
    values: torch.Tensor,
    queries: torch.Tensor,
    selection: Selection,
    *,
    sm_scale: float | None = None,
    beta_bounds: tuple[float | None, float | None] = (-7.0, None),
    fit_beta: bool = True,
    fit_values: bool = True,
    value_ridge: float = 1e-3,
    nnls_ridge: float = 1e-6,
    targets: Targets | None = None,
) -> CompactedLayer:
    """NNLS beta + least-squares values for the kept keys of ``selection``.

    Args:
        keys, values: [H_kv, T, D] original layer (model dtype); queries [H_kv, n, D].
        selection: kept indices per head (padded [H_kv, t_max] + mask).
        beta_bounds: (lo, hi) bounds on beta (None = unbounded on that side; lo None
            allows w = 0, i.e. beta = -inf). Paper: [-3, 3] for highest-attention.
        fit_beta / fit_values: False keeps beta = 0 / the original values.
        value_ridge: ridge of the value solve, relative to mean diag(P'P), shrinking
            towards the original values of the kept keys.
        nnls_ridge: ridge of the mass NNLS (relative).
        targets: precomputed :func:`reference_targets` (saves one q K' product).

    Returns:
        CompactedLayer (keys = original kept keys in the input dtype, fitted values in
        the input dtype, beta fp32, kept_indices = selection indices).
    """
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(keys.shape[-1])
    idx, mask = selection.indices, selection.mask
    gather = idx.unsqueeze(-1).expand(-1, -1, keys.shape[-1])
    ck = torch.gather(keys, 1, gather)  # [H, t_max, D]
    cv0 = torch.gather(values, 1, gather).float()
    beta = torch.zeros(idx.shape, dtype=torch.float32, device=keys.device)
    cv = cv0
    tg = targets
    if tg is None and (fit_beta or fit_values):
        tg = reference_targets(keys, values, queries, scale)
    if fit_beta and tg is not None and idx.shape[1] > 0:
        A = torch.gather(tg.phi, 2, idx.unsqueeze(1).expand(-1, tg.phi.shape[1], -1))
        beta = fit_beta_nnls(A, tg.mass, mask, beta_bounds, ridge=nnls_ridge)
    if fit_values and tg is not None and idx.shape[1] > 0:
        logits = torch.bmm(queries.float(), ck.float().transpose(1, 2)).mul_(scale)
        logits = logits + beta.unsqueeze(1)
        logits = logits.masked_fill(~mask.unsqueeze(1), -math.inf)
        P = torch.softmax(logits, dim=-1).nan_to_num_(0.0)
        cv = lstsq_values(P, tg.out, ridge=value_ridge, prior=cv0, mask=mask)
        bad = ~torch.isfinite(cv).all(-1).all(-1)  # [H]: never ship a blown-up head
        if bool(bad.any()):
            cv = torch.where(bad[:, None, None], cv0, cv)
    return pack_layer(ck, cv, beta, selection, keys.dtype)


def fit_beta_nnls(
    A: torch.Tensor,
    mass: torch.Tensor,
    mask: torch.Tensor,
    beta_bounds: tuple[float | None, float | None],
    *,
    ridge: float = 1e-6,
    max_iter: int = 100,
    polish_rounds: int | None = None,
) -> torch.Tensor:
    """beta [H, t_max] = log w, w = box-NNLS of mass [H, n] on features A [H, n, t_max].

    Padded (mask False) entries get beta = 0 (they are dropped by pack_layer).
    """
    lo, hi = _weight_bounds(beta_bounds)
    w = nnls(
        A,
        mass,
        lower=lo,
        upper=hi,
        mask=mask,
        ridge=ridge,
        max_iter=max_iter,
        polish_rounds=polish_rounds,
    )
    beta = torch.log(w.float())
    return torch.where(mask, beta, beta.new_zeros(()))


def fit_beta_nnls_gram(
    G: torch.Tensor,
    c: torch.Tensor,
    mask: torch.Tensor,
    beta_bounds: tuple[float | None, float | None],
    *,
    ridge: float = 1e-6,
    max_iter: int = 100,
    polish_rounds: int | None = None,
) -> torch.Tensor:
    """As :func:`fit_beta_nnls` from the normal equations G [H, t, t] = A'A, c [H, t] = A'mass."""
    lo, hi = _weight_bounds(beta_bounds)
    w = nnls_gram(
        G,
        c,
        lower=lo,
        upper=hi,
        mask=mask,
        ridge=ridge,
        max_iter=max_iter,
        polish_rounds=polish_rounds,
    )
    beta = torch.log(w.float())
    return torch.where(mask, beta, beta.new_zeros(()))


def selection_from_budgets(indices: torch.Tensor, budgets: Sequence[int]) -> Selection:
    """Selection keeping the first budgets[h] entries of each row of indices [H, >=t_max]."""
    t_max = max(budgets)
    dev = indices.device
    ar = torch.arange(t_max, device=dev).unsqueeze(0)
    mask = ar < torch.as_tensor(list(budgets), device=dev).unsqueeze(1)
    idx = torch.where(mask, indices[:, :t_max], indices.new_zeros(()))
    return Selection(idx, mask)


def _weight_bounds(beta_bounds: tuple[float | None, float | None]) -> tuple[float, float | None]:
    """Box bounds on w = exp(beta) from bounds on beta (None: unbounded; w >= 0 always)."""
    lo_b, hi_b = beta_bounds
    return (0.0 if lo_b is None else math.exp(lo_b), None if hi_b is None else math.exp(hi_b))

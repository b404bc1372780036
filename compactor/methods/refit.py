"""The Attention Matching refit, usable after ANY key selection.

Shape legend: T prefix tokens, t kept (t_max = max over heads), n reference queries,
H_kv KV heads, D head dim, indptr [H_kv+1] int32.

Given kept keys C_k (a subset of the original keys), fit
  * beta = log w, with w = NNLS fit of the attention *mass*:
        sum_j w_j exp(q c_j * s - m(q))  ~  sum_i exp(q k_i * s - m(q))   for each ref. query q
    (m(q) = row max over the original logits; w box-bounded to exp(beta_bounds));
  * values C_v by ridge least squares so that softmax(q C_k' s + beta) C_v matches the
    original attention output softmax(q K' s) V.

The targets (mass and outputs of the original layer) come from
:mod:`compactor.methods.targets`, which never builds the [H_kv, n, T] fp32 mass features
beyond ``block_bytes`` at once.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import torch

from compactor.methods.selection import Selection, pack_layer
from compactor.methods.targets import Targets, reference_targets
from compactor.solvers import NNLS_SOLVERS, NNLSOptions, lstsq_values, nnls, nnls_projected
from compactor.types import CompactedLayer

__all__ = [
    "NNLS_ROUNDS",
    "NNLS_SOLVER",
    "PG_ITERS",
    "Stage",
    "fit_beta_nnls",
    "fit_layer_beta",
    "fit_layer_values",
    "nnls_solver_for",
    "no_stage",
    "refit",
    "selection_from_budgets",
]

# Fixed-work active-set rounds of the refit's NNLS (see compactor.solvers.nnls_gram).
NNLS_ROUNDS = 32
# Solver of the refit's beta NNLS (:func:`fit_beta_nnls`): "auto" or one of
# compactor.solvers.NNLS_SOLVERS: "active-set" (:func:`compactor.solvers.nnls`, fixed
# rounds) or "projected" (:func:`compactor.solvers.nnls_projected`: the reference's
# clamped least squares + PG_ITERS projected-gradient steps, one factorization, no host
# sync). "auto" (:func:`nnls_solver_for`) is "active-set" on the CPU (lower held-out mass
# error on SmolLM2, the same output error and log-ppl gap: benchmarks/offline/nnls_solvers.py)
# and "projected" on an accelerator, where the active set's host syncs and up to
# NNLS_ROUNDS + 1 factorizations per fit dominated a layer (H100: 5.1 s of 15.5 s at 32k).
NNLS_SOLVER = "auto"
PG_ITERS = 2

# A context manager per stage name ("beta", "values"), entered around that stage's work:
# a benchmark's clock; `no_stage` everywhere else.
Stage = Callable[[str], AbstractContextManager[object]]


def no_stage(name: str) -> AbstractContextManager[object]:
    """The :data:`Stage` that does nothing."""
    return contextlib.nullcontext()


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
    nnls_rounds: int | None = NNLS_ROUNDS,
    targets: Targets | None = None,
    verbatim: torch.Tensor | None = None,
    stage: Stage = no_stage,
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
        nnls_rounds: fixed active-set rounds of the NNLS (None: exact, with host syncs).
        targets: precomputed :func:`reference_targets` (saves one q K' product).
        verbatim: [H_kv, t_max] bool, kept entries that stay as they are (beta 0, their own
            values): the others' beta is fitted to the mass these leave, their values to
            the outputs these leave (None: every kept entry is fitted).
        stage: entered around the "beta" work (the gathers, the targets, the NNLS) and the
            "values" work (the value solve, the packing).

    Returns:
        CompactedLayer (keys = original kept keys in the input dtype, fitted values in
        the input dtype, beta fp32, kept_indices = selection indices).
    """
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(keys.shape[-1])
    idx = selection.indices
    with stage("beta"):
        gather = idx.unsqueeze(-1).expand(-1, -1, keys.shape[-1])
        ck = torch.gather(keys, 1, gather)  # [H, t_max, D]
        cv0 = torch.gather(values, 1, gather).float()
        beta = torch.zeros(idx.shape, dtype=torch.float32, device=keys.device)
        tg = targets
        if tg is None and (fit_beta or fit_values):
            tg = reference_targets(keys, values, queries, scale)
        if fit_beta and tg is not None and idx.shape[1] > 0:
            beta = fit_layer_beta(
                tg, selection, beta_bounds, ridge=nnls_ridge, rounds=nnls_rounds, verbatim=verbatim
            )
    with stage("values"):
        cv = cv0
        if fit_values and tg is not None and idx.shape[1] > 0:
            cv = fit_layer_values(
                queries, ck, beta, selection, tg, sm_scale=scale, ridge=value_ridge, prior=cv0,
                verbatim=verbatim,
            )  # fmt: skip
        return pack_layer(ck, cv, beta, selection, keys.dtype)


def fit_layer_beta(
    targets: Targets,
    selection: Selection,
    beta_bounds: tuple[float | None, float | None],
    *,
    ridge: float = 1e-6,
    rounds: int | None = NNLS_ROUNDS,
    verbatim: torch.Tensor | None = None,
) -> torch.Tensor:
    """beta [H, t_max] of the kept keys: box-NNLS of the mass on their mass features.

    rounds: fixed-work solver rounds (None: exact, see :func:`compactor.solvers.nnls_gram`).
    verbatim: [H, t_max] bool, entries held at beta = 0; the others fit the mass they leave.
    Heads are solved in blocks whose features and solver matrices stay within
    ``targets.block_bytes``. Padded entries get beta = 0.
    """
    idx, mask = selection.indices, selection.mask
    if verbatim is not None:
        return _fit_beta_around(targets, selection, verbatim, beta_bounds, ridge, rounds)
    H, t = idx.shape
    n = targets.shape[1]
    # per head: the features, then the solver's copies (fp64 kernel form when n < t)
    per_head = 4 * n * t + (24 * n * t + 32 * n * n if n < t else 20 * t * t)
    hb = max(1, targets.block_bytes // per_head)
    if hb >= H:
        return fit_beta_nnls(
            targets.features(idx), targets.mass, mask, beta_bounds, ridge=ridge, rounds=rounds
        )
    parts = []
    for h0 in range(0, H, hb):
        h1 = min(H, h0 + hb)
        A = targets.features(idx[h0:h1], h0, h1)
        mass = targets.mass[h0:h1]
        parts.append(fit_beta_nnls(A, mass, mask[h0:h1], beta_bounds, ridge=ridge, rounds=rounds))
    return torch.cat(parts)


def fit_layer_values(
    queries: torch.Tensor,
    ck: torch.Tensor,
    beta: torch.Tensor,
    selection: Selection,
    targets: Targets,
    *,
    sm_scale: float,
    ridge: float = 1e-3,
    prior: torch.Tensor | None = None,
    verbatim: torch.Tensor | None = None,
) -> torch.Tensor:
    """Values [H, t_max, D] fp32 of the kept keys ck [H, t_max, D] with beta [H, t_max]:
    ridge least squares of the original outputs on the compacted attention weights,
    shrunk towards ``prior`` (the original values), in blocks of heads within
    ``targets.block_bytes``. A head whose solve is not finite keeps ``prior`` (or 0).
    verbatim: [H, t_max] bool, entries that keep ``prior`` (required with it); the others
    fit the outputs left once these entries' share of them is taken out."""
    mask = selection.mask
    if verbatim is not None and prior is None:
        raise ValueError("fit_layer_values: verbatim entries need the prior values")
    free = mask if verbatim is None else mask & ~verbatim
    H, t = mask.shape
    n = queries.shape[1]
    # per head: logits / weights, then the solver's [t, t] (or fp64 [n, n] when n < t) copies
    per_head = 12 * n * t + (24 * n * n + 16 * n * t if n < t else 16 * t * t)
    hb = max(1, targets.block_bytes // per_head)
    out = targets.out
    parts = []
    for h0 in range(0, H, hb):
        h1 = min(H, h0 + hb)
        logits = torch.bmm(queries[h0:h1].float(), ck[h0:h1].float().transpose(1, 2))
        logits = logits.mul_(sm_scale) + beta[h0:h1].unsqueeze(1)
        logits = logits.masked_fill(~mask[h0:h1].unsqueeze(1), -math.inf)
        P = torch.softmax(logits, dim=-1).nan_to_num_(0.0)
        pr = None if prior is None else prior[h0:h1]
        y = out[h0:h1]
        if verbatim is not None and pr is not None:
            y = y - torch.bmm(P * verbatim[h0:h1].unsqueeze(1), pr)
        parts.append(lstsq_values(P, y, ridge=ridge, prior=pr, mask=free[h0:h1]))
    cv = parts[0] if len(parts) == 1 else torch.cat(parts)
    if verbatim is not None and prior is not None:
        cv = torch.where(verbatim.unsqueeze(-1), prior.to(cv.dtype), cv)
    bad = ~torch.isfinite(cv).all(-1).all(-1)  # [H]: never ship a blown-up head
    fallback = prior if prior is not None else torch.zeros_like(cv)
    return torch.where(bad[:, None, None], fallback.to(cv.dtype), cv)


def fit_beta_nnls(
    A: torch.Tensor,
    mass: torch.Tensor,
    mask: torch.Tensor,
    beta_bounds: tuple[float | None, float | None],
    *,
    ridge: float = 1e-6,
    rounds: int | None = NNLS_ROUNDS,
    polish_rounds: int | None = None,
    solver: str | None = None,
) -> torch.Tensor:
    """beta [H, t_max] = log w, w = box-NNLS of mass [H, n] on features A [H, n, t_max].

    rounds: fixed active-set rounds (None: exact, see :func:`compactor.solvers.nnls_gram`).
    solver: None = the module's NNLS_SOLVER; "auto" = :func:`nnls_solver_for` A's device;
    "projected" ignores rounds / polish_rounds and runs PG_ITERS projected-gradient steps
    (:func:`compactor.solvers.nnls_projected`). ValueError for an unknown name.
    Padded (mask False) entries get beta = 0 (they are dropped by pack_layer).
    """
    lo, hi = _weight_bounds(beta_bounds)
    name = nnls_solver_for(NNLS_SOLVER if solver is None else solver, A.device)
    opts = NNLSOptions(lo, hi, mask=mask, ridge=ridge, rounds=rounds, polish_rounds=polish_rounds)
    if name == "projected":
        w = nnls_projected(A, mass, opts, iters=PG_ITERS)
    else:
        w = nnls(A, mass, opts)
    beta = torch.log(w.float())
    return torch.where(mask, beta, beta.new_zeros(()))


def nnls_solver_for(name: str, device: torch.device | str) -> str:
    """The NNLS solver `name` runs as on `device`: "auto" is "active-set" on the CPU and
    "projected" elsewhere (no host sync); a name of NNLS_SOLVERS is itself.

    Raises ValueError for any other name.
    """
    if name == "auto":
        return "active-set" if torch.device(device).type == "cpu" else "projected"
    if name not in NNLS_SOLVERS:
        raise ValueError(f"unknown NNLS solver {name!r}; expected 'auto' or one of {NNLS_SOLVERS}")
    return name


def selection_from_budgets(indices: torch.Tensor, budgets: Sequence[int]) -> Selection:
    """Selection keeping the first budgets[h] entries of each row of indices [H, >=t_max]."""
    t_max = max(budgets)
    dev = indices.device
    ar = torch.arange(t_max, device=dev).unsqueeze(0)
    mask = ar < torch.as_tensor(list(budgets), device=dev).unsqueeze(1)
    idx = torch.where(mask, indices[:, :t_max], indices.new_zeros(()))
    return Selection(idx, mask)


# ---- private helpers -------------------------------------------------------------------


def _fit_beta_around(
    targets: Targets,
    selection: Selection,
    verbatim: torch.Tensor,
    beta_bounds: tuple[float | None, float | None],
    ridge: float,
    rounds: int | None,
) -> torch.Tensor:
    """:func:`fit_layer_beta` with the `verbatim` entries at beta = 0: the others' NNLS
    fits the mass left once the verbatim entries' own is taken out (head by head block)."""
    idx, mask = selection.indices, selection.mask
    free = mask & ~verbatim
    H, t = idx.shape
    n = targets.shape[1]
    per_head = 8 * n * t + (24 * n * t + 32 * n * n if n < t else 20 * t * t)
    hb = max(1, targets.block_bytes // per_head)
    parts = []
    for h0 in range(0, H, hb):
        h1 = min(H, h0 + hb)
        A = targets.features(idx[h0:h1], h0, h1)
        held = (A * (verbatim[h0:h1] & mask[h0:h1]).unsqueeze(1)).sum(-1)
        left = (targets.mass[h0:h1] - held).clamp_min(0.0)
        parts.append(fit_beta_nnls(A, left, free[h0:h1], beta_bounds, ridge=ridge, rounds=rounds))
    return torch.cat(parts)


def _weight_bounds(beta_bounds: tuple[float | None, float | None]) -> tuple[float, float | None]:
    """Box bounds on w = exp(beta) from bounds on beta (None: unbounded; w >= 0 always)."""
    lo_b, hi_b = beta_bounds
    return (0.0 if lo_b is None else math.exp(lo_b), None if hi_b is None else math.exp(hi_b))

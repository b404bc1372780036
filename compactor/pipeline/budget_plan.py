"""The budget strategy of a compaction: per-head budgets of every (layer, chunk).

Shape legend: T prefix tokens, s sink tokens, L layers, H_kv KV heads.

Uniform: every KV head keeps t entries (sinks included), the T - s non-sink tokens split
into chunks whose budgets add up to t - s (:func:`split_budget`). Sensitivity head budgets
(``spec.head_budgets`` "auto" or a curves path) move budget between (layer, head) pairs with
the same total (:func:`compactor.head_budgets.curves.allocate`). A ``LayerBudgetPlanner`` method
(KVCompose) sets its own per-layer budgets once the queries are drawn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from compactor import hf
from compactor.head_budgets.allocate import allocate
from compactor.head_budgets.curves import SensitivityCurves, resolve_curves
from compactor.pipeline.inputs import resolve_fingerprint
from compactor.spec import CompactionSpec

__all__ = ["BudgetPlan", "head_budget_curves", "plan_budgets", "split_budget"]


@dataclass(frozen=True)
class BudgetPlan:
    """Kept entries per KV head of each (layer, chunk), sinks excluded.

    Attributes:
        sinks: s, kept verbatim before every chunk.
        budget: t, the uniform per-head budget (sinks included).
        bounds: chunk spans [a, b) over the T - s non-sink tokens.
        chunk_budgets: uniform per-head budget of each chunk (sums to t - s).
        head_table: [L][H_kv] non-sink budgets from sensitivity curves (None: uniform).
        source: where `head_table` came from ("uniform", a curves path or "curves").
        layer_budgets: [L] per-layer budgets of a LayerBudgetPlanner (None: none).
    """

    sinks: int
    budget: int
    bounds: list[tuple[int, int]]
    chunk_budgets: list[int]
    head_table: list[list[int]] | None = None
    source: str = "uniform"
    layer_budgets: list[int] | None = None

    def per_head(self, layer: int, chunk: int, num_kv_heads: int) -> list[int]:
        """Budgets [H_kv] of `chunk` of `layer`."""
        if self.head_table is not None:
            return self.head_table[layer]
        a, b = self.bounds[chunk]
        tb = self.chunk_budgets[chunk]
        if self.layer_budgets is not None:
            tb = min(b - a, self.layer_budgets[layer])
        return [tb] * num_kv_heads

    def with_layer_budgets(
        self,
        meth: Any,
        keys: Sequence[torch.Tensor],
        queries: dict[int, torch.Tensor],
        sm_scale: float,
        on_policy: bool,
        suffix_lse: dict[int, torch.Tensor] | None = None,
    ) -> BudgetPlan:
        """Add a LayerBudgetPlanner method's per-layer budgets (off-policy, one chunk only).

        keys: per layer [H_kv, T, D] (the non-sink part is planned); queries: per layer
        [H_kv, n, D]; suffix_lse: per layer [H_kv, n] or None / empty (``LayerInput``).
        Returns this plan when the method plans nothing.
        """
        from compactor.methods.context import LayerBudgetPlanner

        if not isinstance(meth, LayerBudgetPlanner) or on_policy or len(self.bounds) != 1:
            return self
        s = self.sinks
        planned = meth.plan_layer_budgets(
            [k[:, s:] for k in keys],
            [queries[li] for li in range(len(keys))],
            self.budget - s,
            sm_scale,
            [k[:, :s] for k in keys] if s else None,
            [suffix_lse[li] for li in range(len(keys))] if suffix_lse else None,
        )
        return replace(self, layer_budgets=planned)


def plan_budgets(
    model: Any,
    spec: CompactionSpec,
    meth: Any,
    T: int,
    model_fingerprint: str,
) -> BudgetPlan:
    """The uniform or sensitivity budgets of `spec` for a T-token prefix.

    Raises ValueError: a bad curves file or combination (see :func:`head_budget_curves`),
    sensitivity budgets with more than one chunk or a LayerBudgetPlanner method.
    """
    s = spec.sink_tokens(T)
    budget = spec.budget_per_head(T, s)
    rest = T - s
    step = spec.chunk_size or rest
    bounds = [(a, min(a + step, rest)) for a in range(0, rest, step)]
    plan = BudgetPlan(s, budget, bounds, split_budget(budget - s, [b - a for a, b in bounds]))
    curves, source = head_budget_curves(model, meth.name, spec.head_budgets, model_fingerprint)
    if curves is None:
        return plan
    table = _sensitivity_budgets(curves, meth, hf.model_info(model), budget - s, rest, plan, spec)
    return replace(plan, head_table=table, source=source)


def split_budget(total: int, lengths: Sequence[int]) -> list[int]:
    """Split `total` kept entries over chunks of `lengths` in proportion (largest remainder).

    Every chunk gets at least 1 and at most its length. Raises ValueError when `total` is
    outside [len(lengths), sum(lengths)].
    """
    if not lengths or any(n < 1 for n in lengths):
        raise ValueError(f"chunk lengths must be >= 1, got {list(lengths)}")
    if not len(lengths) <= total <= sum(lengths):
        raise ValueError(
            f"budget {total} outside [{len(lengths)}, {sum(lengths)}] for chunks {list(lengths)}"
        )
    size = sum(lengths)
    exact = [total * n / size for n in lengths]
    out = [min(n, max(1, int(e))) for n, e in zip(lengths, exact)]
    order = sorted(range(len(lengths)), key=lambda i: exact[i] - int(exact[i]), reverse=True)
    while sum(out) < total:
        for i in order:
            if sum(out) < total and out[i] < lengths[i]:
                out[i] += 1
    while sum(out) > total:
        for i in reversed(order):
            if sum(out) > total and out[i] > 1:
                out[i] -= 1
    return out


def head_budget_curves(
    model: Any,
    method: str,
    head_budgets: str | Path | SensitivityCurves | None,
    model_fingerprint: str | None = None,
) -> tuple[SensitivityCurves | None, str]:
    """Resolve `head_budgets` (None / "uniform", "auto", a curves path, or SensitivityCurves)
    for `model` and method name `method`.

    Returns (curves or None for uniform, their source: "uniform", a path or "curves").
    Raises ValueError: a missing / malformed file, curves whose (L, H_kv) differ from the
    model's, or curves whose meta names another model fingerprint.
    """
    curves, source = resolve_curves(
        head_budgets, getattr(model, "compactor_model_dir", None), method
    )
    if curves is None:
        return None, source
    info = hf.model_info(model)
    want = (info.num_layers, info.num_kv_heads)
    if curves.shape[:2] != want:
        raise ValueError(
            f"sensitivity curves {source} have (L, H_kv) = {curves.shape[:2]}, the model has {want}"
        )
    cfp = curves.meta.get("model_fingerprint")
    if cfp:
        fp = model_fingerprint or resolve_fingerprint(model)
        if cfp != fp:
            raise ValueError(
                f"sensitivity curves {source} were measured on model {cfp!r}, not {fp!r}"
            )
    return curves, source


def _sensitivity_budgets(
    curves: SensitivityCurves,
    meth: Any,
    info: hf.ModelInfo,
    per_head: int,
    rest: int,
    plan: BudgetPlan,
    spec: CompactionSpec,
) -> list[list[int]]:
    """Non-sink budgets [L][H_kv] summing to L * H_kv * per_head; ValueError if unsupported."""
    from compactor.methods.context import LayerBudgetPlanner

    if len(plan.bounds) > 1:
        raise ValueError(
            f"non-uniform head budgets need one chunk; chunk_size={spec.chunk_size} splits the "
            f"{rest} non-sink tokens into {len(plan.bounds)} chunks"
        )
    name = meth.name
    if isinstance(meth, LayerBudgetPlanner):
        raise ValueError(
            f"method {name!r} plans its own per-layer budgets; use uniform head budgets"
        )
    L, H = info.num_layers, info.num_kv_heads
    return allocate(curves, L * H * per_head, rest, min_tokens=1)

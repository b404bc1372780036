"""KVCompose (arXiv 2509.05165): composite tokens with a global layer-adaptive budget.

Shape legend: L layers, T prefix tokens, n reference queries, H_kv KV heads, G query heads
per KV head, D head dim, indptr [H_kv+1] int32.

Per layer and KV head, a token's score is its attention aggregated over the reference
queries (``agg_task``, per query head) and then over the head's G query heads
(``agg_group``); optionally the layer's mean over heads is added (``add_mean_across_heads``).
Each head sorts its own scores: the i-th *composite token* of a layer is the i-th best
token of every head (structured: every head keeps the same count, different tokens).
The composite score of rank i in layer l is the mean over heads of their i-th best score;
a global top-k over all (layer, rank) composite scores, with the total budget of all
layers, decides how many composite tokens each layer keeps (layer 0's composite scores
are raised to the max over layers, as in the reference implementation). That global step
is :meth:`KVCompose.plan_layer_budgets` (the pipeline calls it once per prefix, see
``compactor.methods.context.LayerBudgetPlanner``); ``compact`` alone keeps the budget it
is given.
"""

from __future__ import annotations

import dataclasses

import torch

from compactor.methods._scoring import (
    RefitOption,
    attention_probs,
    check_positive_int,
    group_view,
)
from compactor.methods.base import LayerInput, ScoreMethod, resolve_sm_scale
from compactor.methods.context import LayerBudgetPlanner, PlannerInput
from compactor.methods.registry import register_method

__all__ = ["KVCompose", "kvcompose_scores"]

_AGG = ("max", "mean")


def kvcompose_scores(
    keys: torch.Tensor,
    queries: torch.Tensor,
    scale: float,
    *,
    group_size: int = 1,
    agg_task: str = "max",
    agg_group: str = "mean",
    add_mean_across_heads: bool = True,
) -> torch.Tensor:
    """Token scores [H_kv, T] of one layer (see the module docstring)."""
    probs = group_view(attention_probs(keys, queries, scale), group_size)  # [H, G, n, T]
    per_q = probs.amax(2) if agg_task == "max" else probs.mean(2)  # [H, G, T]
    scores = per_q.amax(1) if agg_group == "max" else per_q.mean(1)  # [H, T]
    if add_mean_across_heads:
        scores = scores + scores.mean(0, keepdim=True)
    return scores


@register_method("kvcompose")
@dataclasses.dataclass
class KVCompose(RefitOption, ScoreMethod, LayerBudgetPlanner):
    """Structured KVCompose: per-head top tokens, the same count per head of a layer.

    group_size: G query heads per KV head in the pooled queries (1 treats the pooled
    queries as one head; the pipeline's model has G = 3). min_per_layer: floor of the
    per-layer budget in :meth:`plan_layer_budgets`.
    """

    group_size: int = 1
    agg_task: str = "max"
    agg_group: str = "mean"
    add_mean_across_heads: bool = True
    min_per_layer: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int("group_size", self.group_size)
        check_positive_int("min_per_layer", self.min_per_layer)
        for name in ("agg_task", "agg_group"):
            if getattr(self, name) not in _AGG:
                raise ValueError(f"{name} must be one of {_AGG}, got {getattr(self, name)!r}")

    def score(self, x: LayerInput) -> torch.Tensor:
        """Token scores [H_kv, T] (:func:`kvcompose_scores`); the top t_h per head are kept."""
        return self._scores(x.keys, x.queries, x.sm_scale)

    def _scores(
        self, keys: torch.Tensor, queries: torch.Tensor, sm_scale: float | None
    ) -> torch.Tensor:
        scale = resolve_sm_scale(sm_scale, keys.shape[-1])
        return kvcompose_scores(
            keys,
            queries,
            scale,
            group_size=self.group_size,
            agg_task=self.agg_task,
            agg_group=self.agg_group,
            add_mean_across_heads=self.add_mean_across_heads,
        )

    def plan_layers(self, x: PlannerInput) -> list[int]:
        """Per-layer budget per KV head from the global top-k of composite scores.

        x.budget: mean kept per head and layer (total kept = L * budget composite tokens).
        Host-side planning: the result is a list (one host sync).
        """
        T, budget = x.T, x.budget
        comp = torch.stack(
            [
                self._scores(k, q, x.sm_scale).sort(-1, descending=True).values.mean(0)
                for k, q in zip(x.keys, x.queries)
            ]
        )  # [L, T]
        comp[0] = comp.max(0).values
        kept = comp.flatten().topk(x.L * budget).indices // T
        out = torch.bincount(kept, minlength=x.L).clamp(min=self.min_per_layer, max=T)
        return [int(n) for n in out.tolist()]  # one host sync

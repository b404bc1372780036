"""KV-Compress (Rehg 2024, arXiv 2410.00161): squared-attention eviction with variable
budgets per layer and KV head under one total.

Shape legend: L layers, T prefix tokens (of the keys handed in), t the uniform per-head
budget, t_h kept entries of KV head h, n reference queries per query head, H_kv KV heads,
G query heads per KV head (pooled rows G*n), w window tokens, D head dim.

The paper's definitions, as implemented here:

* **Metric.** Each KV is scored by its *squared* attention summed over the observed
  queries (an L2 aggregation; H2O's heavy hitters sum the plain attention)::

      m[h, i] = sum_{g in group(h)} sum_{q in Q_obs} a[g, q, i] ** 2,
      a[g, q, :] = softmax(q . K[h]' * s)        (query q of query head g, scale s).

  Squaring favours a key that few queries attend to strongly over one that many queries
  attend to weakly with the same total attention.
* **Query-group compression.** With grouped-query attention a KV is evicted from its KV
  head, never per query head (no repeat of the KV heads): the metric of a KV sums over the
  G query heads that share it. The reference queries arrive pooled per KV head
  (``[H_kv, G*n, D]``, see :mod:`compactor.methods._scoring`), so the sum over all pooled
  rows is the sum over the group's query heads and their queries.
* **Observed queries.** The paper observes the queries of the last prompt tokens (a
  limited observation window, as SnapKV). In the shared-prefix setting the observed
  queries are the layer's reference queries (``LayerInput.queries``: continuations after
  the prefix, drawn by the spec's query sources; on-policy ones when ``spec.on_policy``).
  ``window > 0`` instead takes the prefix's own last w tokens' queries (``[H_kv, G*w,
  D]``, causally masked), and those w tokens are protected (always kept, as SnapKV keeps
  its window).
* **Variable eviction rates.** The lowest-metric (layer, head, position) entries are
  evicted until the total kept equals the total budget every method gets (L * H_kv * t);
  every (layer, head) keeps at least ``max(1, floor(min_fraction * t))`` (within a layer:
  of that layer's mean budget per head). Across layers
  this is :meth:`KVCompress.plan_layer_budgets` (a ``LayerBudgetPlanner``: the pipeline
  calls it once per prefix, off-policy with one chunk): the global ranking's share of
  each layer, as a per-head mean rounded by largest remainder so the layers' budgets
  still add up to L * t. Within a layer, :meth:`KVCompress.pick` ranks the entries of all
  heads together under the layer's total sum(budgets). Together they make the global
  eviction, up to each layer's share being rounded to a multiple of H_kv. Elsewhere
  (on-policy, chunks) each layer keeps its uniform total and only its heads trade budget.

Not reproduced: the paged block granularity (the paper evicts whole cache blocks of the
lowest-metric KVs of a head to free physical memory; a compacted prefix is ragged per head
already) and the repeated eviction while decoding (a prefix is compacted once).

``refit``: ``"none"`` keeps the selected keys and values as they are (beta 0); ``"am"``
applies the Attention-Matching refit on the reference queries (NNLS beta within
``refit_beta_bounds`` + least-squares values, :func:`compactor.methods.refit.refit`).

Peer check: no NVIDIA kvpress press computes this score (``ObservedAttentionPress`` and
``SnapKVPress`` average the plain attention; ``AdaKVPress`` ranks across the heads of a
layer with a safeguard fraction, not across layers), so there is no kvpress cross-check.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from compactor.methods._scoring import (
    REFIT_MODES,
    RefitOption,
    attention_probs,
    check_positive_int,
    global_topk_budgets,
    refit_spec_for,
    topk_selection,
)
from compactor.methods.base import LayerInput, Picked, RefitSpec, ScoreMethod, resolve_sm_scale
from compactor.methods.context import LayerBudgetPlanner, PlannerInput
from compactor.methods.registry import register_method

__all__ = ["REFIT_VALUES", "KVCompress", "kv_compress_scores", "round_layer_shares"]

REFIT_VALUES = ("none", *REFIT_MODES)


def kv_compress_scores(
    keys: torch.Tensor, queries: torch.Tensor, scale: float, window: int = 0
) -> torch.Tensor:
    """The KV-Compress metric [H_kv, T] fp32 of one layer (see the module docstring).

    keys [H_kv, T, D]; queries [H_kv, G*n, D] pooled per KV head (the sum over all rows is
    the sum over the group's query heads). window > 0: the queries are the last ``window``
    tokens' own (causal) and those tokens score +inf (protected).
    """
    probs = attention_probs(keys, queries, scale, window)  # [H_kv, G*n, T]
    scores = probs.square_().sum(1)
    if window > 0:
        scores[:, keys.shape[1] - window :] = math.inf
    return scores


def round_layer_shares(counts: Sequence[int], num_heads: int, total: int) -> list[int]:
    """Per-layer mean budgets per head from kept counts per layer (summed over its heads).

    Largest-remainder rounding of counts[l] / num_heads so that the result sums to
    ``total`` (= sum(counts) / num_heads when every layer kept a multiple of num_heads).
    Each budget stays within [floor, ceil] of its exact share. Host-side (plain ints).
    """
    out = [int(c) // num_heads for c in counts]
    order = sorted(range(len(out)), key=lambda i: int(counts[i]) % num_heads, reverse=True)
    for i in order[: max(0, total - sum(out))]:
        out[i] += 1
    return out


@register_method("kv-compress")
@dataclasses.dataclass
class KVCompress(ScoreMethod, LayerBudgetPlanner):
    """KV-Compress (arXiv 2410.00161): squared attention summed over the observed queries and
    the query heads of each KV group; the lowest entries of all layers and heads are evicted
    under one total budget, so budgets vary per layer and head.

    window: 0 observes the reference queries; w > 0 the prefix's last w tokens (causal, and
    those w tokens are kept). min_fraction: every (layer, head) keeps at least
    max(1, floor(min_fraction * t)) of the uniform budget t. per_head: heads of a layer
    trade budget (False: each head keeps its given budget). across_layers: layers trade
    budget in :meth:`plan_layer_budgets` (False: every layer keeps t per head on average).
    refit: "none" (selected keys and values as they are, beta 0), "am" (AM refit of beta
    within refit_beta_bounds and of the values), or one half of it, "beta" or "values"
    (``REFIT_MODES``). Report: {"budgets": kept per KV head}.
    """

    window: int = 0
    min_fraction: float = 0.0
    per_head: bool = True
    across_layers: bool = True
    refit: str = "none"
    refit_beta_bounds: tuple[float, float] = (-3.0, 3.0)

    def __post_init__(self) -> None:
        if self.refit is None:  # the other methods' spelling of "none"
            self.refit = "none"
        if self.refit not in REFIT_VALUES:
            raise ValueError(f"refit must be one of {REFIT_VALUES}, got {self.refit!r}")
        # the bounds are checked (and made a float pair) as for every other method
        self.refit_beta_bounds = RefitOption(None, self.refit_beta_bounds).refit_beta_bounds
        check_positive_int("window", self.window, 0)
        m = self.min_fraction
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0.0 <= m <= 1.0:
            raise ValueError(f"min_fraction must be a number in [0, 1], got {m!r}")
        for name in ("per_head", "across_layers"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def refit_spec(self) -> RefitSpec | None:
        """None (keep as is) or the AM refit with refit_beta_bounds (``REFIT_MODES``)."""
        return refit_spec_for(self.refit, self.refit_beta_bounds)

    def min_per_head(self, budget: float) -> int:
        """The fewest entries a head keeps when the uniform per-head budget is ``budget``."""
        return max(1, int(self.min_fraction * budget))

    def score(self, x: LayerInput) -> torch.Tensor:
        """The metric [H_kv, T] (:func:`kv_compress_scores`; window tokens +inf)."""
        self._check_window(x.T)
        return kv_compress_scores(x.keys, x.queries, x.scale, self.window)

    def pick(self, x: LayerInput) -> Picked:
        """The top entries of the layer's heads ranked together (``per_head``), keeping
        sum(budgets) in all and at least :meth:`min_per_head` per head; report: the budgets."""
        scores = self.score(x)
        b = list(x.budgets)
        if self.per_head:
            b = global_topk_budgets(scores, sum(b), self.min_per_head(sum(b) / x.H))
        return Picked(topk_selection(scores, b), {"budgets": list(b)})

    def plan_layers(self, x: PlannerInput) -> list[int]:
        """Per-layer budget per KV head from the global ranking of every layer's metric.

        x.queries[l] [H_kv, n, D] has n = G*w with a window; x.budget: t, the mean kept per
        head and layer. The lowest-metric (layer, head, position) entries are evicted until
        L * H_kv * t are kept (each (layer, head) keeps >= min_per_head(t)); each layer's
        kept count becomes its mean per head (:func:`round_layer_shares`: the result sums to
        L * t). Host-side planning: one host sync.
        """
        keys, queries, budget = x.keys, x.queries, x.budget
        H, T, L = x.H, x.T, x.L
        if not self.across_layers:
            return [int(budget)] * L
        self._check_window(T)
        scale = resolve_sm_scale(x.sm_scale, int(keys[0].shape[-1]))
        scores = torch.stack(
            [kv_compress_scores(k, q, scale, self.window) for k, q in zip(keys, queries)]
        )  # [L, H_kv, T]
        kept = global_topk_budgets(
            scores.reshape(L * H, T), L * H * budget, self.min_per_head(budget)
        )
        per_layer = [sum(kept[li * H : (li + 1) * H]) for li in range(L)]
        return round_layer_shares(per_layer, H, L * budget)

    # ---- private -----------------------------------------------------------------------
    def _check_window(self, T: int) -> None:
        if self.window >= T:
            raise ValueError(f"window={self.window} must be < T={T}")

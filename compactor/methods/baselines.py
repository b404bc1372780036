"""Token-eviction baselines: snapkv, h2o (one-shot), streamingllm, kvzip.

Shape legend: T prefix tokens (of the keys handed in), t kept, n reference queries,
H_kv KV heads, G query heads per KV head, w window tokens, D head dim, indptr [H_kv+1] int32.

Each method scores the keys (``score``), keeps the top t_h per head (or a fixed pattern:
``pick``), and then either keeps them as they are (``refit=None``: beta 0, original values)
or applies the Attention-Matching refit (``refit="am"``). What plays the role of the paper's
observation queries:

* the pipeline's reference queries (repeat-prefill, self-study, ... — all *after* the
  prefix, so no causal mask), which is how these methods run in the shared-prefix setting;
* with ``window > 0`` (snapkv, h2o), the queries are instead the prefix's own last ``w``
  tokens (``[H_kv, G*w, D]``), causally masked, and those ``w`` tokens are always kept —
  the original SnapKV / kvpress setting, used by the kvpress cross-check.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import ClassVar

import torch

from compactor.methods._scoring import (
    RefitOption,
    attention_probs,
    avg_pool,
    check_positive_int,
    global_topk_budgets,
    topk_selection,
)
from compactor.methods.base import (
    LayerInput,
    Picked,
    ScoreMethod,
    SelectingMethod,
    Selection,
    resolve_sm_scale,
)
from compactor.methods.context import LayerBudgetPlanner, PlannerInput
from compactor.methods.registry import register_method

__all__ = ["H2O", "KVzip", "SnapKV", "StreamingLLM", "snapkv_scores"]


def snapkv_scores(
    keys: torch.Tensor, queries: torch.Tensor, scale: float, window: int, kernel: int
) -> torch.Tensor:
    """SnapKV scores [H, T]: mean attention over the observation queries, average-pooled.

    window > 0: queries are the last ``window`` tokens' own (causal); their keys get
    score max + 1 so they are always kept (as in kvpress).
    """
    probs = attention_probs(keys, queries, scale, window)  # [H, n, T]
    T = keys.shape[1]
    if window <= 0:
        return avg_pool(probs.mean(1), kernel)
    body = avg_pool(probs[..., : T - window].mean(1), kernel)
    top = body.max() + 1 if body.numel() else body.new_ones(())
    return torch.cat([body, top.expand(body.shape[0], window)], dim=-1)


@register_method("snapkv")
@dataclasses.dataclass
class SnapKV(RefitOption, ScoreMethod):
    """SnapKV (arXiv 2404.14469): mean attention of the observation queries, pooled with an
    odd ``kernel`` (zero padding), top-t_h per KV head (GQA: the group's queries pooled)."""

    window: int = 0
    kernel: int = 5

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int("window", self.window, 0)
        check_positive_int("kernel", self.kernel)
        if self.kernel % 2 == 0:
            raise ValueError(f"kernel must be odd (same-length pooling), got {self.kernel}")

    def score(self, x: LayerInput) -> torch.Tensor:
        if self.window >= x.T:
            raise ValueError(f"window={self.window} must be < T={x.T}")
        return snapkv_scores(x.keys, x.queries, x.scale, self.window, self.kernel)


@register_method("h2o")
@dataclasses.dataclass
class H2O(RefitOption, ScoreMethod):
    """One-shot H2O (arXiv 2306.14048): ``recent_fraction`` of each budget goes to the most
    recent tokens, the rest to the heavy hitters by attention summed over the queries."""

    recent_fraction: float = 0.5
    window: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= float(self.recent_fraction) <= 1.0:
            raise ValueError(f"recent_fraction must be in [0, 1], got {self.recent_fraction!r}")
        check_positive_int("window", self.window, 0)

    def score(self, x: LayerInput) -> torch.Tensor:
        """Heavy-hitter scores [H, T]: attention summed over the queries."""
        if self.window >= x.T:
            raise ValueError(f"window={self.window} must be < T={x.T}")
        return attention_probs(x.keys, x.queries, x.scale, self.window).sum(1)

    def pick(self, x: LayerInput) -> Picked:
        heavy, T = self.score(x), x.T
        keep = torch.zeros(x.H, T, dtype=torch.bool, device=x.keys.device)
        for h, t in enumerate(x.budgets):
            n_recent = round(t * self.recent_fraction)
            keep[h, T - n_recent :] = True
            rest = heavy[h].masked_fill(keep[h], -1.0)
            keep[h, rest.topk(t - n_recent).indices] = True
        return Picked(Selection.from_mask(keep), {})


@register_method("streamingllm")
@dataclasses.dataclass
class StreamingLLM(RefitOption, SelectingMethod):
    """StreamingLLM (arXiv 2309.17453): the first ``n_sink`` tokens + the most recent ones.

    Note: the pipeline already keeps its own sink tokens and hands the method the keys
    after them; use ``n_sink=0`` there for the plain recent-window baseline.
    """

    n_sink: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int("n_sink", self.n_sink, 0)

    def pick(self, x: LayerInput) -> Picked:
        T = x.T
        keep = torch.zeros(x.H, T, dtype=torch.bool, device=x.keys.device)
        for h, t in enumerate(x.budgets):
            s = min(self.n_sink, t)
            keep[h, :s] = True
            if t > s:
                keep[h, T - (t - s) :] = True
        return Picked(Selection.from_mask(keep), {})


# How KVzip reduces a key's attention over the reference queries to its score.
_REDUCTIONS = ("max", "rms")


@register_method("kvzip")
@dataclasses.dataclass
class KVzip(RefitOption, ScoreMethod, LayerBudgetPlanner):
    """KVzip-style (arXiv 2505.23416) context-reconstruction scoring.

    Score of a key = max over the reference queries (meant to be repeat-prefill ones:
    the model re-reading the context) and over the group's query heads of its attention,
    the softmax taken with the verbatim sink keys in it (as in the model: a query that mostly
    reads the sinks gives the other keys little), and with the query's mass over its own
    continuation's keys (``LayerInput.suffix_lse``; as in KVzip's context reconstruction: a
    query that mostly reads the tokens just repeated gives the prefix little).
    ``layerwise=False`` (KVzip's default): the prefix's whole budget is split over layers by a
    global top-k of the scores of every layer's heads (:meth:`plan_layers`), so a layer whose
    heads read a few keys sharply keeps more of them than one that reads everything a little.
    ``non_uniform=True``: a layer's budget sum(t_h) is split over its KV heads the same way
    (each head keeps >= 1). ``reduce="rms"``: a key's score is the root mean square of its
    attention over the queries (Attention Matching's highest-attention score) instead of the
    max, the softmax and the splits as above. Report: {"budgets": the kept count per KV head}.
    """

    needs_suffix_lse: ClassVar[bool] = True

    non_uniform: bool = True
    layerwise: bool = False
    reduce: str = "max"

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("non_uniform", "layerwise"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.reduce not in _REDUCTIONS:
            raise ValueError(f"reduce must be one of {_REDUCTIONS}, got {self.reduce!r}")

    def score(self, x: LayerInput) -> torch.Tensor:
        """Max (or RMS) attention [H, T] over the reference queries (and the group's heads)."""
        return self._reduce(
            attention_probs(x.keys, x.queries, x.scale, sinks=x.sinks, suffix_lse=x.suffix_lse)
        )

    def _reduce(self, probs: torch.Tensor) -> torch.Tensor:
        """[H, n, T] attention -> [H, T] key scores, by ``reduce`` over the queries."""
        if self.reduce == "rms":
            return probs.square().mean(1).sqrt()
        return probs.amax(1)

    def pick(self, x: LayerInput) -> Picked:
        scores = self.score(x)
        b = list(x.budgets)
        if self.non_uniform:
            b = global_topk_budgets(scores, sum(b))
        return Picked(topk_selection(scores, b), {"budgets": list(b)})

    def plan_layers(self, x: PlannerInput) -> list[int]:
        """Per-layer budget per KV head: of the L * H_kv * budget best scores over every
        layer and head, how many each layer holds (/ H_kv, at least 1); `budget` for every
        layer when ``layerwise``. One host sync."""
        if self.layerwise:
            return [x.budget] * x.L
        scale = resolve_sm_scale(x.sm_scale, x.keys[0].shape[-1])
        sinks: Sequence[torch.Tensor | None] = x.sinks or [None] * x.L
        suffix: Sequence[torch.Tensor | None] = x.suffix_lse or [None] * x.L
        scores = torch.stack(
            [
                self._reduce(attention_probs(k, q, scale, sinks=sk, suffix_lse=lse))
                for k, q, sk, lse in zip(x.keys, x.queries, sinks, suffix, strict=True)
            ]
        )  # [L, H_kv, T]
        kept = scores.flatten().topk(x.L * x.H * x.budget).indices // (x.H * x.T)
        per_head = torch.bincount(kept, minlength=x.L).div(x.H).round()
        return [int(n) for n in per_head.clamp(min=1, max=x.T).tolist()]

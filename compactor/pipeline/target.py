"""A budget chosen by measured error (``spec.target_error``): hold out, try ratios, pick one.

Shape legend: T prefix tokens, n held-out queries, H_kv KV heads, D head dim, L layers.

Some continuations are held OUT of the fit (:func:`split_held_out`: every 4th follow-up,
at least one when there are >= 2; without two follow-ups, the self-study answers the same
way). The prefix is compacted at each candidate ratio (``spec.candidate_ratios()``,
ascending) on the other continuations, exactly as ``compact_prefix`` would (same budgets,
chunks, sinks, on-policy stream). A candidate's error is the relative attention-output
error of the held-out queries against the full prefix:

    err(r) = mean_l mean_h mean_q ||o_c(q) - o(q)|| / ||o(q)||

(``compactor.attention_metrics.attention_errors``' ``output_rel_err``: over the prefix block, so
it is what decides the whole attention with the new tokens added; see
``compactor.pipeline``), the held-out queries being recorded on the full prefix: one cheap
attention per layer, no extra forward pass. The smallest candidate with err <= target is
chosen (the largest when none is); ``compact_prefix`` then refits at that ratio on ALL
continuations, so the returned prefix was fitted to the held-out queries too and its
error on them is at most about the estimate.

One ratio for the whole prefix (the layers are compacted on-policy one after another, so
a per-layer choice would change the queries of every later layer). Cost: the candidates
tried (it stops at the first that meets the target: 1 for a loose target, all of them for
a tight one) times one compaction, plus the refit, plus one forward pass of the
continuations (the split query sets, off-policy).

Measured (SmolLM2-135M, am-omp-fast on-policy, follow-ups with 16 answer tokens; 143 /
600-token documents with 5 / 8 follow-ups, so 1 / 2 held out): targets 0.3, 0.2, 0.15, 0.1,
0.07 chose 0.05, 0.1, 0.2, 0.2, 0.3 / 0.05, 0.05, 0.1, 0.2, 0.3, every estimate met. The
estimate comes from a few held-out questions: on self-study queries that no fit saw, the
refit's error was 0.19 vs the estimate 0.16 (143 tokens, ratio 0.1), 0.12 vs 0.13 (600).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from compactor import hf
from compactor.attention_metrics import attention_errors
from compactor.methods.context import wants_suffix_lse
from compactor.pipeline.budget_plan import plan_budgets
from compactor.pipeline.inputs import Inputs
from compactor.pipeline.layers import compact_layers
from compactor.pipeline.timing import Stopwatch
from compactor.query_capture import Continuation, QueryPlan, collect_queries, collect_reference
from compactor.spec import CompactionSpec
from compactor.types import CompactedLayer

__all__ = ["HOLD_OUT_EVERY", "RatioChoice", "choose_ratio", "held_out_error", "split_held_out"]

# One continuation in this many of the held-out source is held out of the fit.
HOLD_OUT_EVERY = 4
# Sources whose continuations may be held out, in order of preference.
HOLD_OUT_SOURCES = ("follow-up", "self-study")


@dataclass(frozen=True)
class RatioChoice:
    """What :func:`choose_ratio` found.

    Attributes:
        ratio: the chosen ratio (the smallest candidate meeting the target, else the largest).
        estimated_error: its held-out error (fit without the held-out continuations).
        target_error: the target.
        candidate_errors: (ratio, held-out error) of every candidate tried, ascending.
        held_out: how many continuations were held out, and of which `held_out_source`.
        seconds: wall seconds of the search (candidates and their queries).
    """

    ratio: float
    estimated_error: float
    target_error: float
    candidate_errors: tuple[tuple[float, float], ...]
    held_out: int
    held_out_source: str
    seconds: float

    @property
    def met(self) -> bool:
        """Whether the chosen ratio meets the target."""
        return self.estimated_error <= self.target_error

    def as_params(self) -> dict[str, Any]:
        """The JSON-able record in the prefix's ``budget.search``."""
        return {
            "target_error": self.target_error,
            "chosen_ratio": self.ratio,
            "estimated_error": self.estimated_error,
            "met": self.met,
            "candidates": [{"ratio": r, "error": e} for r, e in self.candidate_errors],
            "held_out": self.held_out,
            "held_out_source": self.held_out_source,
            "seconds": self.seconds,
        }


def split_held_out(plan: QueryPlan) -> tuple[QueryPlan, QueryPlan, str]:
    """(fit plan, held-out plan, held-out source) of `plan`.

    The held-out source is the first of ``HOLD_OUT_SOURCES`` with >= 2 continuations; of
    its continuations, every ``HOLD_OUT_EVERY``-th (indices 3, 7, ...) is held out, or the
    last one when there are fewer than 4. The held-out plan has no prefix-side queries
    (context-prefill, random): only its continuations. Raises ValueError when no source
    has two continuations (e.g. one follow-up and no self-study).
    """
    for source in HOLD_OUT_SOURCES:
        idx = [i for i, c in enumerate(plan.continuations) if c.source == source]
        if len(idx) >= 2:
            held = set(idx[HOLD_OUT_EVERY - 1 :: HOLD_OUT_EVERY]) or {idx[-1]}
            break
    else:
        counts = {s: sum(c.source == s for c in plan.continuations) for s in HOLD_OUT_SOURCES}
        raise ValueError(
            "target_error holds some reference queries out of the fit: it needs >= 2 "
            f"follow-ups or >= 2 self-study prompts, got {counts}"
        )
    fit: list[Continuation] = [c for i, c in enumerate(plan.continuations) if i not in held]
    out: list[Continuation] = [c for i, c in enumerate(plan.continuations) if i in held]
    fit_plan = dataclasses.replace(plan, continuations=fit)
    held_plan = dataclasses.replace(plan, continuations=out, context_queries=None, query_norms=None)
    return fit_plan, held_plan, source


def held_out_error(
    layers: Sequence[CompactedLayer],
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    queries: dict[int, torch.Tensor],
    sm_scale: float,
) -> float:
    """Mean over layers and KV heads of the relative attention-output error of `queries`
    ({layer: [H_kv, n, D]}) on the compacted `layers` vs the full prefix (`keys`, `values`:
    per layer [H_kv, T, D])."""
    errs = [
        attention_errors(queries[li], keys[li].float(), values[li].float(), layer, sm_scale)
        .output_rel_err.mean()
        .item()
        for li, layer in enumerate(layers)
    ]
    return float(sum(errs) / len(errs))


def choose_ratio(
    model: Any,
    spec: CompactionSpec,
    meth: Any,
    inputs: Inputs,
    contexts: Sequence[Any] | None,
    model_fingerprint: str,
    watch: Stopwatch,
    before_layer: Callable[[int], None] | None = None,
    checkpoint: Callable[[str], None] | None = None,
) -> RatioChoice:
    """Choose `spec`'s ratio by held-out error (module docstring); `inputs` is not changed.

    Times the candidates' query collection and compaction into `watch` ("queries",
    "compaction"). `before_layer` / `checkpoint` are the cancellation points of the
    candidates' layer loops and of query collection (``Hooks``). Raises ValueError when
    `spec.target_error` is None or nothing can be held out (:func:`split_held_out`).
    """
    if spec.target_error is None:
        raise ValueError("choose_ratio needs spec.target_error")
    start = time.perf_counter()
    info = hf.model_info(model)
    pre, T = inputs.prefill, inputs.prefill.keys[0].shape[1]
    fit_plan, held_plan, source = split_held_out(inputs.plan)
    with watch.measure("queries"):
        full = hf.PrefixState.full(pre)
        held_q = collect_queries(model, full, held_plan, checkpoint=checkpoint)
        fit_q, fit_lse = (
            ({}, {})
            if spec.on_policy
            else collect_reference(model, full, fit_plan, None, checkpoint, wants_suffix_lse(meth))
        )
    tried: list[tuple[float, float]] = []
    for ratio in spec.candidate_ratios():
        cand = spec.with_budget(ratio=ratio)
        stream = None
        if spec.on_policy:
            with watch.measure("queries"):
                stream = hf.LayerStream(model, T, [c.tokens for c in fit_plan.continuations])
        fit_inputs = Inputs(pre, fit_plan, dict(fit_q), stream, dict(fit_lse))
        plan = plan_budgets(model, cand, meth, T, model_fingerprint).with_layer_budgets(
            meth, pre.keys, fit_q, info.sm_scale, spec.on_policy, fit_lse
        )
        layers, _ = compact_layers(
            model, meth, fit_inputs, plan, contexts, watch, {}, before_layer, progress=False
        )
        with watch.measure("compaction"):
            err = held_out_error(layers, pre.keys, pre.values, held_q, info.sm_scale)
        tried.append((ratio, err))
        if err <= spec.target_error:
            break
    ratio, err = tried[-1]
    return RatioChoice(
        ratio=ratio,
        estimated_error=err,
        target_error=float(spec.target_error),
        candidate_errors=tuple(tried),
        held_out=len(held_plan.continuations),
        held_out_source=source,
        seconds=time.perf_counter() - start,
    )

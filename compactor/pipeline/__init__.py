"""Compact one prefix end to end: prefill -> reference queries -> method per layer -> validate.

Shape legend: T prefix tokens, s sink tokens, t_h kept entries of KV head h (sinks
included), n reference queries, H_kv KV heads, D head dim.

Stages (one module each): :mod:`.inputs` (prefill, query plan, off-policy queries, the
``reuse`` cache), :mod:`.budget_plan` (uniform / sensitivity / per-layer planned budgets per
layer and chunk), :mod:`.target` (``spec.target_error``: the ratio chosen by held-out
error, then a refit), :mod:`.layers` (the layer loop: chunks, sinks, on-policy stream),
:mod:`.timing` (StageTimes and the wall/CPU stopwatch).

Why per-block compaction is exact in structure (sinks and chunks): for one query q the
attention over the prefix splits over disjoint key blocks B_1..B_m as

    out(q) = sum_b M_b(q) * o_b(q) / sum_b M_b(q),   M_b(q) = sum_{j in B_b} exp(q.k_j*scale + beta_j)

with o_b the block's own softmax output. A compacted block that reproduces both its local
output o_b and its mass M_b reproduces the whole prefix (and, with the new tokens as one more
block, the whole attention). So sinks are kept verbatim (beta 0: their o and M are
untouched), and a long prefix can be cut into KV chunks that are compacted independently
(each fitted to the same reference queries, whose masses per chunk simply add) and
concatenated per head. Reference queries all come after the prefix (except the
``context-prefill`` source, which is not restricted per chunk: an approximation there).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from compactor import hf
from compactor.pipeline.budget_plan import (
    BudgetPlan,
    head_budget_curves,
    plan_budgets,
    split_budget,
)
from compactor.pipeline.inputs import prepare_inputs, resolve_fingerprint
from compactor.pipeline.layers import assemble_layer, compact_layers
from compactor.pipeline.target import RatioChoice, choose_ratio
from compactor.pipeline.timing import StageTimes, Stopwatch
from compactor.spec import CompactionSpec
from compactor.types import CompactedPrefix, prefix_hash

__all__ = [
    "Hooks",
    "RatioChoice",
    "StageTimes",
    "assemble_layer",
    "compact_prefix",
    "head_budget_curves",
    "resolve_fingerprint",
    "split_budget",
]


@dataclass(frozen=True)
class Hooks:
    """How a caller takes part in one compaction (none of it changes the result).

    Attributes:
        progress: show a per-layer progress bar.
        before_layer: called with each layer index before that layer is compacted (the
            service's cancellation point: it may raise to abort).
        checkpoint: called with a stage name ("self-study generation", "follow-up answer
            generation", "query collection") once per generated token and once per
            continuation whose queries are collected, i.e. inside the stages before the
            layer loop that may take long (the service's cancellation point there: it may
            raise to abort). Not called for a ``reuse`` hit (nothing runs then).
        reuse: a dict the call may read and fill (mutated) with the prefill, the query plan
            and the off-policy reference queries, keyed by (prefix, query config, follow-ups,
            on_policy): a sweep over methods and ratios of one prefix then prefills and draws
            queries once (the reused stages then report ~0 s).
        model_fingerprint: the model's fingerprint (default: from its directory).
        method: a prebuilt CompactionMethod to use instead of building ``spec.method`` (its
            name must be ``spec.method``; ``spec.method_params`` is then not used).
    """

    progress: bool = True
    before_layer: Callable[[int], None] | None = None
    checkpoint: Callable[[str], None] | None = None
    reuse: dict[Any, Any] | None = None
    model_fingerprint: str | None = None
    method: Any = None


def compact_prefix(
    model: Any,
    tokenizer: Any,
    token_ids: Sequence[int],
    spec: CompactionSpec,
    follow_ups: Sequence[Sequence[int]] | None = None,
    hooks: Hooks | None = None,
) -> tuple[CompactedPrefix, StageTimes]:
    """Compact the prefix `token_ids` [T] for `model` as `spec` says; returns (prefix, times).

    Runs on the model's device (prefill, queries and every layer's fit); the returned
    prefix holds CPU tensors whatever that device is (it crosses Ray and is serialized).
    `follow_ups` are the token sequences of the ``follow-up`` query source. With
    ``spec.target_error`` the ratio is chosen by held-out error first (:mod:`.target`; it
    multiplies the compaction time by up to the number of candidates + 1) and recorded in
    ``params["chosen_ratio"]`` / ``params["budget_search"]``.

    Raises:
        ValueError: a bad spec (``spec.validate()`` runs first; the budget must be set: "auto"
            is the service's), an empty prefix; with head budgets: a missing curves file,
            curves for another model shape or fingerprint, more than one chunk, or a
            LayerBudgetPlanner method (KVCompose); with ``spec.target_error``: fewer than two
            follow-ups and self-study prompts to hold out (:func:`.target.split_held_out`).
    """
    from compactor.methods import get_method
    from compactor.methods.context import build_layer_contexts, wants_context, wants_suffix_lse

    hooks = hooks or Hooks()
    watch = Stopwatch()
    with watch.measure("prefill"):  # setup is counted with the prefill, as it always was
        spec.validate(check_method=hooks.method is None)
        if hooks.method is not None and hooks.method.name != spec.method:
            raise ValueError(f"hooks.method is {hooks.method.name!r}, spec.method {spec.method!r}")
        ids = [int(x) for x in token_ids]
        T = len(ids)
        if T < 2:
            raise ValueError(f"prefix too short to compact: T={T}")
        # target_error: check the budgets at the ceiling now, choose the ratio below
        ceiling = spec if spec.target_error is None else spec.with_budget(ratio=_ceiling(spec))
        ceiling.budget_per_head(T, spec.sink_tokens(T))  # ValueError for budget "auto"
        meth = hooks.method or get_method(spec.method, **spec.method_params)
        fp = hooks.model_fingerprint or resolve_fingerprint(model)
        info = hf.model_info(model)
        plan = plan_budgets(model, ceiling, meth, T, fp)
    inputs = prepare_inputs(
        model,
        tokenizer,
        ids,
        spec,
        follow_ups,
        hooks.reuse,
        watch,
        hooks.checkpoint,
        wants_suffix_lse(meth),
    )
    # Methods that need the layer's inputs (GVote, CompressKV) get a LayerContext per layer
    # (one extra prefill); a LayerBudgetPlanner (KVCompose) sets per-layer budgets up front.
    contexts = (
        build_layer_contexts(model, ids, model_dir=getattr(model, "compactor_model_dir", None))
        if wants_context(meth)
        else None
    )
    choice = None
    if spec.target_error is not None:  # then refit on every continuation at the chosen ratio
        choice = choose_ratio(
            model, spec, meth, inputs, contexts, fp, watch, hooks.before_layer, hooks.checkpoint
        )
        spec = spec.with_budget(ratio=choice.ratio)
        with watch.measure("prefill"):
            plan = plan_budgets(model, spec, meth, T, fp)
    plan = plan.with_layer_budgets(
        meth, inputs.prefill.keys, inputs.queries, info.sm_scale, spec.on_policy, inputs.suffix_lse
    )
    report: dict[str, Any] = {}
    layers, per_layer = compact_layers(
        model, meth, inputs, plan, contexts, watch, report, hooks.before_layer, hooks.progress
    )
    layers = [layer.to("cpu") for layer in layers]  # the result is host-side (see docstring)
    prefix = CompactedPrefix(
        model_fingerprint=fp,
        logical_length=T,
        prefix_hash=prefix_hash(ids),
        method=meth.name,
        params=_params(spec, meth, plan, report, choice),
        layers=layers,
        head_dim=info.head_dim,
        num_kv_heads=info.num_kv_heads,
        dtype=inputs.prefill.keys[0].dtype,
    )
    prefix.validate(
        expected_fingerprint=fp,
        num_layers=info.num_layers,
        num_kv_heads=info.num_kv_heads,
        head_dim=info.head_dim,
    )
    return prefix, watch.times(per_layer)


def _ceiling(spec: CompactionSpec) -> float:
    """The largest candidate ratio of a target_error spec."""
    return spec.candidate_ratios()[-1]


def _params(
    spec: CompactionSpec,
    meth: Any,
    plan: BudgetPlan,
    report: dict[str, Any],
    choice: RatioChoice | None = None,
) -> dict[str, Any]:
    """The prefix's ``params`` record (what ran, with which budget). With a target_error
    `choice`, "chosen_ratio" is its ratio and "budget_search" its record."""
    s, table = plan.sinks, plan.head_table
    extra = {} if choice is None else {"budget_search": choice.as_params()}
    chosen = report.get("chosen_ratio") if choice is None else choice.ratio
    return {
        "method": meth.params(),
        "ratio": spec.ratio,
        "tokens": spec.tokens,
        "budget_per_head": plan.budget,
        "query_sources": list(spec.queries.sources),
        "max_queries_per_head": spec.queries.max_queries_per_head,
        "chunk_size": spec.chunk_size,
        "on_policy": spec.on_policy,
        "keep_sink_tokens": s,
        "method_report": report.get("method_report"),
        "chosen_ratio": chosen,
        "head_budgets": "uniform" if table is None else "sensitivity",
        # [L][H_kv] entries per head, sinks included (None: uniform budget_per_head)
        "head_budget_table": None if table is None else [[s + x for x in row] for row in table],
        "head_budget_source": None if table is None else plan.source,
        "target_error": spec.target_error,
        **extra,
    }

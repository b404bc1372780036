"""`compact_prefix`: one prefix through the stages of :mod:`compactor.pipeline`, and `Hooks`.

Shape legend: :mod:`compactor.pipeline`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from compactor import hf
from compactor.budget_report import BudgetReport
from compactor.pipeline.budget_plan import BudgetPlan, plan_budgets
from compactor.pipeline.inputs import prepare_inputs, resolve_fingerprint
from compactor.pipeline.layers import compact_layers
from compactor.pipeline.target import RatioChoice, choose_ratio
from compactor.pipeline.timing import StageTimes, Stopwatch
from compactor.spec import CompactionSpec
from compactor.types import CompactedPrefix, prefix_hash

__all__ = ["Hooks", "compact_prefix"]


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
    the prefix's `budget` (`BudgetReport`: `ratio_chosen`, `estimated_error`, `search`).

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
        if spec.target_error is None:  # planned once: here, or at the ratio chosen below
            plan = plan_budgets(model, spec, meth, T, fp)
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
        params=_params(spec, meth, plan, report),
        budget=_budget(spec, plan, report, choice),
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
    spec: CompactionSpec, meth: Any, plan: BudgetPlan, report: dict[str, Any]
) -> dict[str, Any]:
    """The prefix's ``params`` record: what the method ran with (its budget: `_budget`)."""
    return {
        "method": meth.params(),
        "query_sources": list(spec.queries.sources),
        "max_queries_per_head": spec.queries.max_queries_per_head,
        "chunk_size": spec.chunk_size,
        "on_policy": spec.on_policy,
        "keep_sink_tokens": plan.sinks,
        "method_report": report.get("method_report"),
    }


def _budget(
    spec: CompactionSpec,
    plan: BudgetPlan,
    report: dict[str, Any],
    choice: RatioChoice | None = None,
) -> BudgetReport:
    """What was asked and what was used (with a target error, `spec` is the chosen ratio's
    and `choice` the search; a method's own choice is in `report["chosen_ratio"]`)."""
    s, table = plan.sinks, plan.head_table
    chosen = report.get("chosen_ratio") if choice is None else choice.ratio
    return BudgetReport(
        ratio_asked=spec.ratio if choice is None else None,
        tokens_asked=spec.tokens,
        ratio_chosen=chosen,
        budget_per_head=plan.budget,
        head_table=None if table is None else [[s + x for x in row] for row in table],
        head_source=None if table is None else plan.source,
        target_error=spec.target_error,
        estimated_error=None if choice is None else choice.estimated_error,
        search=None if choice is None else choice.as_params(),
    )

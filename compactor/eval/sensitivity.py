"""Measure a model's sensitivity curves (``compactor sensitivity``) for non-uniform budgets.

Shape legend: T prefix tokens, s sink tokens, n fit / n' held-out queries, L layers,
H_kv KV heads, D head dim, F kept fractions.

One document (a needle-in-a-haystack case cut from the shipped filler, see
:func:`sensitivity_case`) is prefilled once. Each layer's non-sink KV [H_kv, T - s, D] is
compacted at every kept fraction with queries from the *fit* sources (default
repeat-prefill) and scored on DIFFERENT, held-out queries: the eval harness's future
queries (:func:`compactor.eval.harness.build_reference`: the full model's greedy answers to
the document's questions). The resulting :class:`~compactor.head_budgets.curves.SensitivityCurves`
feed :func:`compactor.head_budgets.curves.allocate` through ``compact_prefix(head_budgets=...)``.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence
from typing import Any

from compactor import hf
from compactor.eval.harness import EvalCase, build_reference
from compactor.head_budgets.curves import SensitivityCurves, sensitivity_curve
from compactor.query_capture import collect_queries, plan_queries
from compactor.spec import CompactionSpec

__all__ = [
    "DEFAULT_FRACTIONS",
    "check_fractions",
    "measure_sensitivity",
    "sensitivity_case",
]

DEFAULT_FRACTIONS: tuple[float, ...] = (0.05, 0.1, 0.2, 0.4)


def check_fractions(fractions: Sequence[float]) -> list[float]:
    """`fractions` as floats; ValueError unless non-empty, strictly increasing, in (0, 1]."""
    fr = [float(x) for x in fractions]
    if not fr or any(not 0 < x <= 1 for x in fr) or fr != sorted(set(fr)):
        raise ValueError(f"fractions must be increasing values in (0, 1], got {fr}")
    return fr


def sensitivity_case(tokenizer: Any, num_tokens: int = 1024, seed: int = 0) -> EvalCase:
    """A multi-key needle document of about `num_tokens` tokens with its questions.

    The questions (needle questions plus one open question) produce the held-out queries.
    Raises ValueError when `tokenizer` is None or `num_tokens` < 64.
    """
    from compactor.eval.runner import make_niah_cases

    if tokenizer is None:
        raise ValueError("the sensitivity document needs a tokenizer (the model has none)")
    return make_niah_cases(tokenizer, 1, num_tokens, kinds=("multi-key",), seed=seed)[0]


def measure_sensitivity(
    model: Any,
    tokenizer: Any,
    case: EvalCase,
    spec: CompactionSpec,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    *,
    answer_tokens: int = 16,
    progress: bool = True,
    model_fingerprint: str | None = None,
) -> SensitivityCurves:
    """Curves errors [L][H_kv][F] of `spec`'s method on `case` (see the module docstring).

    Args:
        case: the document (prefix_ids [T]) and the questions whose answers give held-out
            queries; ``tokenizer`` may be None when the case is given as token ids.
        spec: the method and its parameters, the fit queries (``spec.queries``: sources,
            ``max_queries_per_head`` also caps the held-out queries) and
            ``keep_sink_tokens`` s (the first s tokens are left out as the pipeline keeps
            them); its budget, chunking, policy and head budgets are not used.
        fractions: [F] increasing kept fractions of the T - s non-sink tokens, in (0, 1].
    Raises:
        ValueError: a bad spec (unknown method or parameters, bad query sources), a method
            that needs per-layer context (GVote, CompressKV), bad fractions, a prefix too
            short.
    """
    from compactor.methods import get_method
    from compactor.methods.context import wants_context
    from compactor.pipeline import resolve_fingerprint

    t0 = time.perf_counter()
    spec.validate()
    meth = get_method(spec.method, **spec.method_params)
    if wants_context(meth):
        raise ValueError(
            f"method {meth.name!r} needs per-layer context; sensitivity curves support "
            "methods that compact from (keys, values, queries) alone"
        )
    fr = check_fractions(fractions)
    qcfg = spec.queries
    max_queries = qcfg.max_queries_per_head
    fp = model_fingerprint or resolve_fingerprint(model)
    info = hf.model_info(model)
    ids = list(case.prefix_ids)
    T = len(ids)
    s = spec.sink_tokens(T)
    if T - s < 2:
        raise ValueError(f"prefix too short: T={T} with {s} sink tokens")

    ref = build_reference(model, tokenizer, case, answer_tokens, max_heldout=max_queries)
    need_q = bool({"context-prefill", "random"} & set(qcfg.sources))
    pre = hf.prefill(model, ids, with_queries=True) if need_q else ref.prefill
    plan = plan_queries(model, tokenizer, ids, pre, qcfg)
    fit = collect_queries(model, hf.PrefixState.full(pre), plan)

    it: Any = range(info.num_layers)
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc=f"sensitivity {meth.name}", unit="layer")
    errors: list[list[list[float]]] = []
    for li in it:
        err = sensitivity_curve(
            ref.prefill.keys[li][:, s:].float(),
            ref.prefill.values[li][:, s:].float(),
            fit[li],
            fr,
            meth,
            sm_scale=info.sm_scale,
            eval_queries=ref.heldout[li],
        )
        errors.append(err.tolist())
    meta = {
        "model_fingerprint": fp,
        "model_dir": getattr(model, "compactor_model_dir", None),
        "method_params": meth.params(),
        "document": case.name,
        "T": T,
        "keep_sink_tokens": s,
        "fit_query_sources": list(qcfg.sources),
        "eval_query_source": "held-out future queries (compactor.eval.harness.build_reference)",
        "fit_queries_per_head": int(fit[0].shape[1]),
        "eval_queries_per_head": int(ref.heldout[0].shape[1]),
        "answer_tokens": answer_tokens,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    return SensitivityCurves(fr, errors, method=meth.name, meta=meta)

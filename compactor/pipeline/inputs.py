"""Stage 1 of a compaction: prefill the prefix, plan the reference queries, draw them.

Shape legend: T prefix tokens, n reference queries, H_kv KV heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from compactor import hf
from compactor.pipeline.timing import Stopwatch
from compactor.query_capture import Checkpoint, QueryPlan, collect_reference, plan_queries
from compactor.spec import CompactionSpec

__all__ = ["Inputs", "prepare_inputs", "resolve_fingerprint"]


@dataclass
class Inputs:
    """What the layer loop compacts from.

    prefill: keys/values per layer [H_kv, T, D]. plan: the fixed query continuations.
    queries: off-policy reference queries ``{layer: [H_kv, n, D]}`` fp32 (a private copy the
    loop may pop from; empty on-policy). stream: the on-policy ``hf.LayerStream`` (or None).
    suffix_lse: ``{layer: [H_kv, n]}`` each off-policy query's log mass after the prefix
    (``compactor.query_capture.suffix_lse``), for a method that reads it; else empty.
    """

    prefill: hf.PrefillResult
    plan: QueryPlan
    queries: dict[int, torch.Tensor]
    stream: hf.LayerStream | None
    suffix_lse: dict[int, torch.Tensor] = field(default_factory=dict)


def prepare_inputs(
    model: Any,
    tokenizer: Any,
    ids: list[int],
    spec: CompactionSpec,
    follow_ups: Sequence[Sequence[int]] | None,
    reuse: dict[Any, Any] | None,
    watch: Stopwatch,
    checkpoint: Checkpoint | None = None,
    with_suffix_lse: bool = False,
) -> Inputs:
    """Prefill `ids` [T] and draw the reference queries of `spec.queries`.

    `reuse` (mutated) caches (prefill, plan, off-policy queries, their suffix lse or None) per
    (prefix, query config, follow-ups, on_policy): a hit skips both stages (they then time
    ~0 s), except the query collection when the suffix lse is asked for and the hit has none
    (it is then collected, with the queries, once more and cached). Times the "prefill" and
    "queries" stages into `watch`. `checkpoint` is called per generated token and per
    collected continuation (``compactor.query_capture``): it may raise to abort.
    `with_suffix_lse`: also each off-policy query's log mass after the prefix (the method
    reads it: ``compactor.methods.context.wants_suffix_lse``).
    """
    qcfg = spec.queries
    need_q = bool({"context-prefill", "random"} & set(qcfg.sources))
    key = (tuple(ids), qcfg, tuple(map(tuple, follow_ups or ())), spec.on_policy)
    hit = reuse.get(key) if reuse is not None else None
    with watch.measure("prefill"):
        pre = hit[0] if hit is not None else hf.prefill(model, ids, with_queries=need_q)
    with watch.measure("queries"):
        want_suffix = with_suffix_lse and not spec.on_policy
        if hit is not None and (hit[3] is not None or not want_suffix):
            _, plan, all_queries, suffix = hit
        else:
            plan = (
                hit[1]
                if hit is not None
                else plan_queries(model, tokenizer, ids, pre, qcfg, follow_ups, checkpoint)
            )
            all_queries, suffix = (
                ({}, {})
                if spec.on_policy
                else collect_reference(
                    model, hf.PrefixState.full(pre), plan, None, checkpoint, want_suffix
                )
            )
            if reuse is not None:
                reuse[key] = (pre, plan, all_queries, suffix if want_suffix else None)
        stream = (
            hf.LayerStream(model, len(ids), [c.tokens for c in plan.continuations])
            if spec.on_policy
            else None
        )
    return Inputs(pre, plan, dict(all_queries), stream, dict(suffix or {}) if want_suffix else {})


def resolve_fingerprint(model: Any) -> str:
    """`compactor.models.fingerprint` of the directory `model` was loaded from.

    Raises ValueError when that directory is unknown.
    """
    from pathlib import Path

    from compactor.models import fingerprint

    for cand in (getattr(model, "compactor_model_dir", None), getattr(model, "name_or_path", None)):
        if cand and (Path(cand) / "config.json").is_file():
            return fingerprint(cand)
    raise ValueError(
        "cannot fingerprint the model: load it with compactor.hf.load_model or pass model_fingerprint"
    )

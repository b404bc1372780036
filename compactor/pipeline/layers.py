"""Stage 2 of a compaction: the layer loop (chunks, sinks, the on-policy stream).

Shape legend: T prefix tokens, s sink tokens, t_h kept entries of KV head h (sinks
included), n reference queries, H_kv KV heads, D head dim.

Each layer's non-sink KV is cut into the plan's chunks; each chunk is compacted by the
method against the layer's reference queries (:func:`_run_method`) and the chunks are
concatenated per head after the verbatim sinks (:func:`assemble_layer`). On-policy, layer
l's queries come from the ``hf.LayerStream`` advanced through the layers compacted so far.

A method with ``heads_independent`` (and no contexts) gets the chunks of one length in one
call, stacked along the head dim (C chunks of H_kv heads: C * H_kv heads, chunk-major,
each with the layer's queries and its own budget), and the result is split back per chunk
(:func:`_split_heads`): the same per-head problems in C times fewer, C times larger
batched calls (one selection pass, one NNLS, one value solve per length instead of per
chunk), which is what bounds a layer's time on an accelerator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from compactor import hf
from compactor.methods import LayerInput
from compactor.pipeline.budget_plan import BudgetPlan
from compactor.pipeline.inputs import Inputs
from compactor.pipeline.timing import Stopwatch
from compactor.query_capture import pool_queries
from compactor.types import CompactedLayer

__all__ = ["assemble_layer", "chunk_groups", "compact_layers"]


def compact_layers(
    model: Any,
    meth: Any,
    inputs: Inputs,
    plan: BudgetPlan,
    contexts: Sequence[Any] | None,
    watch: Stopwatch,
    report: dict[str, Any],
    before_layer: Callable[[int], None] | None = None,
    progress: bool = False,
) -> tuple[list[CompactedLayer], tuple[float, ...]]:
    """Compact every layer in order; returns (layers on the model's device, wall s per layer).

    Mutates: `inputs.queries` and `inputs.suffix_lse` (each layer's are dropped once used;
    on-policy the queries are pooled from `inputs.stream`, which advances), `watch`
    ("queries" and "compaction" stages) and `report` (the method's report, see
    :func:`_run_method`). `before_layer` is called with each layer index first (the
    service's cancellation point: it may raise).
    """
    info = hf.model_info(model)
    pre, queries, stream, s = inputs.prefill, inputs.queries, inputs.stream, plan.sinks
    layers: list[CompactedLayer] = []
    per_layer: list[float] = []
    it: Any = range(info.num_layers)
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc=f"compact {meth.name}", unit="layer")
    fold = contexts is None and bool(getattr(meth, "heads_independent", False))
    groups = chunk_groups(plan.bounds, fold)
    for li in it:
        if before_layer is not None:
            before_layer(li)
        if stream is not None:
            with watch.measure("queries"):
                queries[li] = pool_queries(model, inputs.plan, stream.queries(), li)[0]
        with watch.measure("compaction") as lap:
            k, v, q = pre.keys[li], pre.values[li], queries[li]
            lse = inputs.suffix_lse.get(li)
            done: dict[int, CompactedLayer] = {}
            for group in groups:
                spans = [(s + plan.bounds[ci][0], s + plan.bounds[ci][1]) for ci in group]
                ctx = contexts[li].for_span(*spans[0]) if contexts else None
                per_head = [x for ci in group for x in plan.per_head(li, ci, info.num_kv_heads)]
                kc, vc, qc = _stack_chunks(k, v, q, spans)
                lc = None if lse is None else lse.repeat(len(group), 1)
                sinks = k[:, :s] if s and len(group) == 1 else None
                res = _run_method(meth, kc, vc, qc, per_head, info.sm_scale, ctx, sinks, report, lc)
                done.update(zip(group, _split_heads(res, len(group))))
            parts = [(s + a, done[ci]) for ci, (a, _) in enumerate(plan.bounds)]
            layers.append(assemble_layer((k[:, :s], v[:, :s]) if s else None, parts))
        per_layer.append(lap.wall)
        if stream is not None and li + 1 < info.num_layers:
            with watch.measure("queries"):
                stream.advance(*layers[-1].padded(max(layers[-1].head_lengths()), k.dtype))
        queries.pop(li, None)
        inputs.suffix_lse.pop(li, None)
    return layers, tuple(per_layer)


def chunk_groups(bounds: Sequence[tuple[int, int]], fold: bool) -> list[list[int]]:
    """The chunks (indices into `bounds`, spans [a, b)) compacted by one method call each:
    with `fold`, all chunks of one length together (in order, first-seen length first),
    else one chunk per call."""
    if not fold:
        return [[ci] for ci in range(len(bounds))]
    by_len: dict[int, list[int]] = {}
    for ci, (a, b) in enumerate(bounds):
        by_len.setdefault(b - a, []).append(ci)
    return list(by_len.values())


def _stack_chunks(
    k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, spans: Sequence[tuple[int, int]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys / values [C * H_kv, T_c, D] of the C equal spans [a, b) of k / v [H_kv, T, D]
    (chunk-major) and the queries [H_kv, n, D] repeated C times; views for one span."""
    if len(spans) == 1:
        ((a, b),) = spans
        return k[:, a:b], v[:, a:b], q
    kc = torch.cat([k[:, a:b] for a, b in spans])
    vc = torch.cat([v[:, a:b] for a, b in spans])
    return kc, vc, q.repeat(len(spans), 1, 1)


def _split_heads(layer: CompactedLayer, parts: int) -> list[CompactedLayer]:
    """Cut a layer of `parts` * H_kv heads (part-major) into `parts` layers of H_kv heads
    (views of its rows; one host sync: the indptr). The layer itself for parts == 1."""
    if parts == 1:
        return [layer]
    heads = layer.num_kv_heads // parts
    if heads * parts != layer.num_kv_heads:
        raise ValueError(f"{layer.num_kv_heads} heads do not split into {parts} parts")
    ip = layer.indptr.tolist()
    out = []
    for c in range(parts):
        lo, hi = ip[c * heads], ip[(c + 1) * heads]
        ki = layer.kept_indices
        out.append(
            CompactedLayer(
                layer.keys[lo:hi],
                layer.values[lo:hi],
                layer.beta[lo:hi],
                layer.indptr[c * heads : (c + 1) * heads + 1] - lo,
                None if ki is None else ki[lo:hi],
            )
        )
    return out


def _run_method(
    meth: Any,
    keys: torch.Tensor,
    values: torch.Tensor,
    queries: torch.Tensor,
    per_head: list[int],
    sm_scale: float,
    context: Any,
    sinks: torch.Tensor | None,
    report: dict[str, Any],
    suffix_lse: torch.Tensor | None = None,
) -> CompactedLayer:
    """The one call into the method: compact one chunk, then record the method's report.

    keys, values [H_kv, T_c, D] of the chunk; queries [H_kv, n, D]; per_head [H_kv] budgets;
    context: the chunk's LayerContext or None; sinks [H_kv, s, D] the verbatim sink keys
    (None: none, or several chunks stacked as heads); suffix_lse [H_kv, n] or None (see
    ``LayerInput``). Mutates `report`: a non-empty report of the method (GVote: kept counts
    and "ratio") is appended to ``report["method_report"]`` (one per layer and chunk that
    reported), and "chosen_ratio" is the mean "ratio" of those reports when every one has it
    (methods that pick their own budget), else None.
    """
    x = LayerInput(keys, values, queries, tuple(per_head), sm_scale, context, sinks, suffix_lse)
    res = meth.compact(x)
    if res.report:
        report.setdefault("method_report", []).append(res.report)
    done = report.get("method_report") or []
    ratios = [r["ratio"] for r in done if "ratio" in r]
    report["chosen_ratio"] = (
        sum(ratios) / len(ratios) if done and len(ratios) == len(done) else None
    )
    return res.layer


def assemble_layer(
    sinks: tuple[torch.Tensor, torch.Tensor] | None, parts: Sequence[tuple[int, CompactedLayer]]
) -> CompactedLayer:
    """Concatenate per head: sink rows (beta 0) then each chunk's rows (in order).

    Args:
        sinks: (keys [H_kv, s, D], values [H_kv, s, D]) kept verbatim at positions 0..s-1, or None.
        parts: (offset, layer) per chunk; `offset` is added to the chunk's kept_indices.

    Returns the layer on the chunks' device (one host sync per chunk: its indptr).
    """
    if not parts:
        raise ValueError("assemble_layer: no compacted chunks")
    hkv = parts[0][1].num_kv_heads
    dev = parts[0][1].keys.device
    ptrs = [layer.indptr.tolist() for _, layer in parts]
    ks, vs, bs, ids, counts = [], [], [], [], []
    for h in range(hkv):
        n = 0
        if sinks is not None:
            sk, sv = sinks
            s = sk.shape[1]
            ks.append(sk[h])
            vs.append(sv[h])
            bs.append(torch.zeros(s, device=dev))
            ids.append(torch.arange(s, dtype=torch.int64, device=dev))
            n += s
        for (offset, layer), ip in zip(parts, ptrs):
            lo, hi = ip[h], ip[h + 1]
            k, v, b = layer.keys[lo:hi], layer.values[lo:hi], layer.beta[lo:hi]
            ki = layer.kept_indices
            ids.append(
                ki[lo:hi] + offset
                if ki is not None
                else torch.full((hi - lo,), -1, dtype=torch.int64, device=dev)
            )
            ids[-1] = torch.where(ids[-1] >= offset, ids[-1], torch.full_like(ids[-1], -1))
            ks.append(k)
            vs.append(v.to(k.dtype))
            bs.append(b.float())
            n += hi - lo
        counts.append(n)
    indptr = torch.zeros(hkv + 1, dtype=torch.int32, device=dev)
    indptr[1:] = torch.cumsum(torch.tensor(counts, device=dev), 0).to(torch.int32)
    return CompactedLayer(torch.cat(ks), torch.cat(vs), torch.cat(bs), indptr, torch.cat(ids))

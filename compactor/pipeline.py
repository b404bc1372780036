"""Compact one prefix end to end: prefill -> reference queries -> method per layer -> validate.

Shape legend: T prefix tokens, s sink tokens, t_h kept entries of KV head h (sinks
included), n reference queries, H_kv KV heads, D head dim.

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

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from compactor import hf
from compactor.budgets import SensitivityCurves, allocate, resolve_curves
from compactor.queries import QueryConfig, collect_queries, plan_queries, pool_queries
from compactor.types import CompactedLayer, CompactedPrefix, prefix_hash

__all__ = [
    "StageTimes",
    "assemble_layer",
    "compact_prefix",
    "head_budget_curves",
    "resolve_fingerprint",
    "split_budget",
]


@dataclass(frozen=True)
class StageTimes:
    """Wall seconds per stage; `per_layer` is selection+fit of each layer.

    `cpu_*` are process CPU seconds of the same stages (all threads summed): with one torch
    thread they show the cost free of the wait for a core on a busy machine.
    """

    prefill: float
    queries: float
    compaction: float
    total: float
    per_layer: tuple[float, ...] = field(default_factory=tuple)
    cpu_prefill: float = 0.0
    cpu_queries: float = 0.0
    cpu_compaction: float = 0.0
    cpu_total: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "prefill": self.prefill,
            "queries": self.queries,
            "compaction": self.compaction,
            "total": self.total,
            "cpu_prefill": self.cpu_prefill,
            "cpu_queries": self.cpu_queries,
            "cpu_compaction": self.cpu_compaction,
            "cpu_total": self.cpu_total,
        }


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


def resolve_fingerprint(model: Any) -> str:
    """`compactor.models.fingerprint` of the directory `model` was loaded from.

    Raises ValueError when that directory is unknown.
    """
    from compactor.models import fingerprint

    for cand in (getattr(model, "compactor_model_dir", None), getattr(model, "name_or_path", None)):
        if cand and (Path(cand) / "config.json").is_file():
            return fingerprint(cand)
    raise ValueError(
        "cannot fingerprint the model: load it with compactor.hf.load_model or pass model_fingerprint"
    )


def head_budget_curves(
    model: Any,
    method: str,
    head_budgets: str | Path | SensitivityCurves | None,
    model_fingerprint: str | None = None,
) -> tuple[SensitivityCurves | None, str]:
    """Resolve `head_budgets` (see :func:`compact_prefix`) for `model` and method name `method`.

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


def compact_prefix(
    model: Any,
    tokenizer: Any,
    token_ids: Sequence[int],
    method: Any,
    ratio: float | None = None,
    tokens: int | None = None,
    query_sources: Sequence[str] | QueryConfig = ("repeat-prefill", "self-study"),
    follow_ups: Sequence[Sequence[int]] | None = None,
    chunk_size: int | None = None,
    on_policy: bool = False,
    progress: bool = True,
    keep_sink_tokens: int = 4,
    method_params: dict[str, Any] | None = None,
    model_fingerprint: str | None = None,
    reuse: dict[Any, Any] | None = None,
    head_budgets: str | Path | SensitivityCurves | None = None,
    before_layer: Callable[[int], None] | None = None,
) -> tuple[CompactedPrefix, StageTimes]:
    """Compact the prefix `token_ids` [T] for `model`; returns (prefix, stage times).

    Runs on the model's device (prefill, queries and every layer's fit); the returned
    prefix holds CPU tensors whatever that device is (it crosses Ray and is serialized).

    Args:
        method: a registered name (built with `method_params`) or a CompactionMethod.
        ratio / tokens: exactly one; per-KV-head budget t = round(ratio*T) or `tokens`,
            sinks included, clamped to [s+1, T].
        query_sources: source names or a full QueryConfig (see compactor.queries).
        follow_ups: token sequences for the ``follow-up`` source.
        chunk_size: compact the non-sink KV in chunks of this many tokens (None: one chunk).
        on_policy: compact layers in order; queries for layer l are recorded with layers < l
            already compacted (the continuations advance layer by layer through an
            ``hf.LayerStream``: about the cost of off-policy query collection).
        keep_sink_tokens: the first s tokens are kept verbatim with beta 0.
        reuse: a dict this call may read and fill (mutated) with the prefill, the query
            plan and the off-policy reference queries, keyed by (prefix, query config,
            follow-ups, on_policy): a sweep over
            methods and ratios of one prefix then prefills and draws queries once (the
            reused stages then report ~0 s).
        head_budgets: None / "uniform": every KV head keeps t entries. Otherwise per-(layer,
            KV head) budgets from sensitivity curves (``compactor.budgets``): "auto" loads
            ``sensitivity_path(model_dir, method name)``, another string a curves JSON
            path, or pass SensitivityCurves. The total stays the uniform one,
            L * H_kv * (t - s) non-sink entries, split by :func:`compactor.budgets.allocate`
            (each head keeps its s sinks plus >= 1 entry).
        before_layer: called with each layer index before that layer is compacted (the
            service's cancellation point: it may raise to abort).
    Raises:
        ValueError: bad ratio/tokens/chunk_size/keep_sink_tokens, empty prefix, unknown method;
            with head_budgets: a missing curves file, curves for another model shape or
            fingerprint, more than one chunk, or a LayerBudgetPlanner method (KVCompose).
    """
    from compactor.methods import CompactionMethod, LayerInput, get_method
    from compactor.methods.context import LayerBudgetPlanner, build_layer_contexts, wants_context

    t0, c0 = time.perf_counter(), time.process_time()
    ids = [int(x) for x in token_ids]
    T = len(ids)
    if T < 2:
        raise ValueError(f"prefix too short to compact: T={T}")
    if (ratio is None) == (tokens is None):
        raise ValueError(f"give exactly one of ratio ({ratio}) and tokens ({tokens})")
    if ratio is not None and not 0 < ratio <= 1:
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    if tokens is not None and tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    if keep_sink_tokens < 0:
        raise ValueError(f"keep_sink_tokens must be >= 0, got {keep_sink_tokens}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    s = min(keep_sink_tokens, T - 1)
    budget = round(ratio * T) if ratio is not None else int(tokens or 0)
    budget = min(T, max(s + 1, budget))
    meth = (
        method
        if isinstance(method, CompactionMethod)
        else get_method(str(method), **(method_params or {}))
    )
    qcfg = (
        query_sources
        if isinstance(query_sources, QueryConfig)
        else QueryConfig(sources=tuple(query_sources))
    )
    fp = model_fingerprint or resolve_fingerprint(model)
    info = hf.model_info(model)
    rest = T - s
    bounds = [(a, min(a + (chunk_size or rest), rest)) for a in range(0, rest, chunk_size or rest)]
    curves, curves_source = head_budget_curves(model, meth.name, head_budgets, fp)
    plan_budgets = (
        None
        if curves is None
        else _sensitivity_budgets(curves, meth, info, budget - s, rest, len(bounds), chunk_size)
    )

    need_q = bool({"context-prefill", "random"} & set(qcfg.sources))
    key = (tuple(ids), qcfg, tuple(map(tuple, follow_ups or ())), on_policy)
    hit = reuse.get(key) if reuse is not None else None
    if hit is not None:
        pre, plan, all_queries = hit
        t_prefill, c_prefill = time.perf_counter(), time.process_time()
    else:
        pre = hf.prefill(model, ids, with_queries=need_q)
        t_prefill, c_prefill = time.perf_counter(), time.process_time()
        plan = plan_queries(model, tokenizer, ids, pre, qcfg, follow_ups)
        all_queries = {} if on_policy else collect_queries(model, hf.PrefixState.full(pre), plan)
        if reuse is not None:
            reuse[key] = (pre, plan, all_queries)
    queries = dict(all_queries)
    stream = hf.LayerStream(model, T, [c.tokens for c in plan.continuations]) if on_policy else None
    t_queries = time.perf_counter() - t_prefill
    c_queries = time.process_time() - c_prefill
    t_compact = c_compact = 0.0
    chunk_budgets = split_budget(budget - s, [b - a for a, b in bounds])
    # Methods that need the layer's inputs (GVote, CompressKV) get a LayerContext per layer
    # (one extra prefill); a LayerBudgetPlanner (KVCompose) sets per-layer budgets up front.
    contexts = (
        build_layer_contexts(model, ids, model_dir=getattr(model, "compactor_model_dir", None))
        if wants_context(meth)
        else None
    )
    layer_budgets: list[int] | None = None
    if isinstance(meth, LayerBudgetPlanner) and not on_policy and len(bounds) == 1:
        layer_budgets = meth.plan_layer_budgets(
            [pre.keys[li][:, s:] for li in range(info.num_layers)],
            [queries[li] for li in range(info.num_layers)],
            budget - s,
            info.sm_scale,
        )
    layers: list[CompactedLayer] = []
    reports: list[dict[str, Any]] = []
    per_layer: list[float] = []
    it = range(info.num_layers)
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc=f"compact {meth.name}", unit="layer")
    for li in it:
        if before_layer is not None:
            before_layer(li)  # the service's cancellation point (may raise)
        if stream is not None:
            tq, cq = time.perf_counter(), time.process_time()
            queries[li] = pool_queries(model, plan, stream.queries(), li)
            t_queries += time.perf_counter() - tq
            c_queries += time.process_time() - cq
        tl, cl = time.perf_counter(), time.process_time()
        k, v, q = pre.keys[li], pre.values[li], queries[li]
        parts = []
        for (a, b), tb in zip(bounds, chunk_budgets):
            ctx = contexts[li].for_span(s + a, s + b) if contexts else None
            tbl = tb if layer_budgets is None else min(b - a, layer_budgets[li])
            per_head = [tbl] * info.num_kv_heads if plan_budgets is None else plan_budgets[li]
            x = LayerInput(
                k[:, s + a : s + b], v[:, s + a : s + b], q, tuple(per_head), info.sm_scale, ctx
            )
            res = meth.compact(x)
            layer = res.layer
            if res.report:  # what the method decided (GVote: kept counts, "ratio")
                reports.append(res.report)
            parts.append((s + a, layer))
        sinks = (k[:, :s], v[:, :s]) if s else None
        layers.append(assemble_layer(sinks, parts))
        per_layer.append(time.perf_counter() - tl)
        t_compact += per_layer[-1]
        c_compact += time.process_time() - cl
        if stream is not None and li + 1 < info.num_layers:
            tq, cq = time.perf_counter(), time.process_time()
            stream.advance(*layers[-1].padded(max(layers[-1].head_lengths()), k.dtype))
            t_queries += time.perf_counter() - tq
            c_queries += time.process_time() - cq
        queries.pop(li, None)
    layers = [layer.to("cpu") for layer in layers]  # the result is host-side (see docstring)
    params = {
        "method": meth.params(),
        "ratio": ratio,
        "tokens": tokens,
        "budget_per_head": budget,
        "query_sources": list(qcfg.sources),
        "max_queries_per_head": qcfg.max_queries_per_head,
        "chunk_size": chunk_size,
        "on_policy": on_policy,
        "keep_sink_tokens": s,
        "method_report": reports or None,  # one per layer (and chunk) that reported
        "chosen_ratio": (  # methods that pick their own budget (GVote): mean kept fraction
            sum(r["ratio"] for r in reports) / len(reports)
            if reports and all("ratio" in r for r in reports)
            else None
        ),
        "head_budgets": "uniform" if plan_budgets is None else "sensitivity",
        # [L][H_kv] entries per head, sinks included (None: uniform budget_per_head)
        "head_budget_table": (
            None if plan_budgets is None else [[s + x for x in row] for row in plan_budgets]
        ),
        "head_budget_source": None if plan_budgets is None else curves_source,
    }
    prefix = CompactedPrefix(
        model_fingerprint=fp,
        logical_length=T,
        prefix_hash=prefix_hash(ids),
        method=meth.name,
        params=params,
        layers=layers,
        head_dim=info.head_dim,
        num_kv_heads=info.num_kv_heads,
        dtype=pre.keys[0].dtype,
    )
    prefix.validate(
        expected_fingerprint=fp,
        num_layers=info.num_layers,
        num_kv_heads=info.num_kv_heads,
        head_dim=info.head_dim,
    )
    total = time.perf_counter() - t0
    times = StageTimes(
        t_prefill - t0,
        t_queries,
        t_compact,
        total,
        tuple(per_layer),
        cpu_prefill=c_prefill - c0,
        cpu_queries=c_queries,
        cpu_compaction=c_compact,
        cpu_total=time.process_time() - c0,
    )
    return prefix, times


def _sensitivity_budgets(
    curves: SensitivityCurves,
    meth: Any,
    info: hf.ModelInfo,
    per_head: int,
    rest: int,
    num_chunks: int,
    chunk_size: int | None,
) -> list[list[int]]:
    """Non-sink budgets [L][H_kv] summing to L * H_kv * per_head; ValueError if unsupported."""
    from compactor.methods.context import LayerBudgetPlanner

    if num_chunks > 1:
        raise ValueError(
            f"non-uniform head budgets need one chunk; chunk_size={chunk_size} splits the "
            f"{rest} non-sink tokens into {num_chunks} chunks"
        )
    name = meth.name
    if isinstance(meth, LayerBudgetPlanner):
        raise ValueError(
            f"method {name!r} plans its own per-layer budgets; use uniform head budgets"
        )
    L, H = info.num_layers, info.num_kv_heads
    return allocate(curves, L * H * per_head, rest, min_tokens=1)

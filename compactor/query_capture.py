"""Reference queries: what the compacted prefix is fitted to answer.

Shape legend: T prefix tokens, n queries, H_q / H_kv query / KV heads, G = H_q // H_kv,
D head dim. Every query here is post-RoPE and pooled per KV head (``hf.pool_gqa``: query
heads i*G..i*G+G-1 -> KV head i, concatenated along n), i.e. ``[H_kv, n, D]``.

Every source but ``context-prefill`` and ``random`` is a *continuation*: tokens appended
after the prefix, fixed once by :func:`compactor.query_plan.plan_queries` (re-exported here;
the sources are listed there). :func:`collect_queries` runs them on top of any
:class:`~compactor.hf.PrefixState` and records the queries; for on-policy compaction the
pipeline instead advances them layer by layer through an ``hf.LayerStream`` over the layers
compacted so far, and :func:`pool_queries` turns either recording into reference queries.
Collection takes a `checkpoint` callback, called with "query collection" once per
continuation collected; it may raise to abort (the service's cancellation).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from compactor import hf
from compactor.query_plan import Checkpoint, Continuation, QueryPlan, plan_queries  # re-exported
from compactor.spec import QUERY_SOURCES, SELF_STUDY_PROMPTS, QueryConfig  # re-exported

__all__ = [
    "QUERY_SOURCES",
    "SELF_STUDY_PROMPTS",
    "Checkpoint",
    "Continuation",
    "QueryConfig",
    "QueryPlan",
    "collect_queries",
    "collect_reference",
    "plan_queries",
    "pool_queries",
    "random_queries",
    "reservoir",
    "suffix_lse",
]

# Bytes of one block of :func:`suffix_lse`'s logits [H_q, rows, m] fp32: on the CPU, and on an
# accelerator (where a 32k-token continuation would otherwise run as thousands of small blocks).
SUFFIX_LSE_BYTES = 64 << 20
SUFFIX_LSE_BYTES_ACCEL = 1 << 30


def reservoir(queries: torch.Tensor, cap: int, seed: int = 0, group_size: int = 1) -> torch.Tensor:
    """Uniform subsample without replacement along n: [H_kv, n, D] -> [H_kv, <=cap, D].

    GQA-pooled queries are head-major (see `hf.pool_gqa`: the rows of query head g of a group
    are [g*n/G, (g+1)*n/G)); with ``group_size`` G the same tokens are kept for every query head
    of the group (cap // G each), so the layout survives. G=1 is a plain subsample.
    Deterministic for a given (n, cap, seed, G); keeps the original order of the chosen rows.
    """
    if queries.dim() != 3:
        raise ValueError(f"queries must be [H_kv, n, D], got shape {tuple(queries.shape)}")
    if cap < 1:
        raise ValueError(f"cap must be >= 1, got {cap}")
    h, n, d = queries.shape
    if group_size < 1 or n % group_size:
        raise ValueError(f"n={n} pooled rows do not split into group_size={group_size} heads")
    if n <= cap:
        return queries
    per, keep = n // group_size, max(1, cap // group_size)
    g = torch.Generator().manual_seed(seed)  # drawn on the CPU: the same rows on any device
    idx = torch.randperm(per, generator=g, device="cpu")[:keep].sort().values.to(queries.device)
    return queries.reshape(h, group_size, per, d)[:, :, idx].reshape(h, group_size * keep, d)


def cat_pooled(parts: Sequence[torch.Tensor], group_size: int) -> torch.Tensor:
    """Concatenate GQA-pooled query blocks [H_kv, G*n_j, D] -> [H_kv, G*sum(n_j), D], head-major.

    A plain ``torch.cat`` along n would interleave the blocks of the query heads; methods that
    look at one query head's rows (CompressKV's retrieval heads, KVCompose with group_size > 1)
    need query head g's rows contiguous, as `hf.pool_gqa` lays them out.
    """
    if not parts:
        raise ValueError("cat_pooled: no parts")
    h, d = parts[0].shape[0], parts[0].shape[-1]
    for p in parts:
        if p.shape[1] % group_size:
            raise ValueError(f"{p.shape[1]} pooled rows do not split into {group_size} heads")
    views = [p.reshape(h, group_size, -1, d) for p in parts]
    return torch.cat(views, dim=2).reshape(h, -1, d)


def random_queries(norms: torch.Tensor, n: int, head_dim: int, seed: int = 0) -> torch.Tensor:
    """Gaussian queries [H_kv, n, D], each row rescaled to its head's norm `norms` [H_kv].

    Drawn on the CPU (the same draws on any device), returned on the device of `norms`.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(norms.shape[0], n, head_dim, generator=g, device="cpu").to(norms.device)
    q = q / q.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return q * norms.float().reshape(-1, 1, 1)


def collect_queries(
    model: Any,
    state: hf.PrefixState,
    plan: QueryPlan,
    layers: Sequence[int] | None = None,
    checkpoint: Checkpoint | None = None,
) -> dict[int, torch.Tensor]:
    """Run the plan on top of `state` (forked, not mutated); ``{layer: [H_kv, n, D]}`` fp32.

    Each source is capped at ``max_queries_per_head`` (reservoir), then the concatenation.
    `checkpoint` is called with "query collection" before each continuation runs.
    """
    return collect_reference(model, state, plan, layers, checkpoint)[0]


def collect_reference(
    model: Any,
    state: hf.PrefixState,
    plan: QueryPlan,
    layers: Sequence[int] | None = None,
    checkpoint: Checkpoint | None = None,
    with_suffix_lse: bool = False,
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """:func:`collect_queries`, and with `with_suffix_lse` each query's :func:`suffix_lse`
    over its own continuation's keys, pooled and drawn alike: ``({layer: [H_kv, n, D]},
    {layer: [H_kv, n]})`` (the second empty without it)."""
    info = hf.model_info(model)
    wanted = list(range(info.num_layers)) if layers is None else list(layers)
    recorded: dict[int, list[torch.Tensor]] = {layer: [] for layer in wanted}
    lse: dict[int, list[torch.Tensor]] = {layer: [] for layer in wanted}
    for cont in plan.continuations:
        if checkpoint is not None:
            checkpoint("query collection")
        run = state.fork()
        with hf.record_queries(model, wanted) as rec:
            run.forward(model, cont.tokens, last_only=True)
        for layer in wanted:  # a long continuation runs as several forward calls
            calls = rec[layer]
            q = calls[0] if len(calls) == 1 else torch.cat(calls, dim=1)
            recorded[layer].append(q)
            if with_suffix_lse:
                lse[layer].append(suffix_lse(q, run.appended_keys(layer), info.sm_scale))
    pooled = {
        layer: pool_queries(model, plan, recorded[layer], layer, lse[layer] or None)
        for layer in wanted
    }
    suffix = {layer: p[1] for layer, p in pooled.items() if p[1] is not None}
    return {layer: p[0] for layer, p in pooled.items()}, suffix


def suffix_lse(queries: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """log sum_{j <= i} exp(scale * q_i . k_j): [H_q, m] fp32, for the queries [H_q, m, D] and
    keys [H_kv, m, D] of the same m appended tokens (query head h reads KV head h // G).

    The log of the softmax mass (before normalising) that each token's query gives the
    tokens after the prefix up to itself; computed in blocks of query rows whose logits stay
    within SUFFIX_LSE_BYTES (SUFFIX_LSE_BYTES_ACCEL off the CPU).
    """
    hq, m, _ = queries.shape
    if keys.dim() != 3 or keys.shape[1] != m or hq % keys.shape[0]:
        raise ValueError(
            f"keys must be [H_kv | {hq}, m={m}, D], got {tuple(keys.shape)} "
            f"for queries {tuple(queries.shape)}"
        )
    k = keys.float().repeat_interleave(hq // keys.shape[0], dim=0)  # [H_q, m, D]
    budget = SUFFIX_LSE_BYTES if queries.device.type == "cpu" else SUFFIX_LSE_BYTES_ACCEL
    rows = max(1, budget // (4 * hq * m))
    pos = torch.arange(m, device=queries.device)
    out = []
    for a in range(0, m, rows):
        b = min(m, a + rows)
        logits = torch.bmm(queries[:, a:b].float(), k[:, :b].transpose(1, 2)).mul_(scale)
        logits.masked_fill_(pos[None, :b] > pos[a:b, None], -math.inf)
        out.append(logits.logsumexp(-1))
    return torch.cat(out, dim=1)


def pool_queries(
    model: Any,
    plan: QueryPlan,
    recorded: Sequence[torch.Tensor],
    layer: int,
    recorded_lse: Sequence[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One layer's reference queries [H_kv, n, D] fp32 from the continuations' own queries,
    and their suffix log-sum-exp [H_kv, n] when `recorded_lse` is given (else None).

    `recorded` holds the post-RoPE queries [H_q, n_j, D] of every continuation of `plan`,
    in order (from :func:`collect_reference` or an on-policy ``hf.LayerStream``), and
    `recorded_lse` their :func:`suffix_lse` [H_q, n_j]; the prefix-side sources
    (``context-prefill``, ``random``) are added here (with no mass after the prefix: -inf).
    Each source is capped at ``max_queries_per_head`` (reservoir), then the concatenation;
    a query and its log-sum-exp travel as one row.
    """
    if len(recorded) != len(plan.continuations):
        raise ValueError(
            f"{len(recorded)} recorded query sets for {len(plan.continuations)} continuations"
        )
    if recorded_lse is not None and len(recorded_lse) != len(recorded):
        raise ValueError(f"{len(recorded_lse)} suffix lse sets for {len(recorded)} query sets")
    info = hf.model_info(model)
    cfg = plan.config
    cap, seed, group = cfg.max_queries_per_head, cfg.seed, info.group_size

    def row(q: torch.Tensor, lse: torch.Tensor | None) -> torch.Tensor:
        """[.., n, D] queries, with their log-sum-exp as column D when it is asked for."""
        if recorded_lse is None:
            return q
        lse = torch.full_like(q[..., 0], -math.inf) if lse is None else lse.float()
        return torch.cat([q, lse.unsqueeze(-1)], dim=-1)

    parts = []
    for j, (cont, q) in enumerate(zip(plan.continuations, recorded)):
        lse = None if recorded_lse is None else recorded_lse[j][:, cont.keep_from :]
        pooled = hf.pool_gqa(row(q[:, cont.keep_from :].float(), lse), info.num_kv_heads)
        parts.append(reservoir(pooled, cap, seed + 1 + j, group))
    if "context-prefill" in cfg.sources and plan.context_queries is not None:
        parts.append(reservoir(row(plan.context_queries[layer], None), cap, seed, group))
    if "random" in cfg.sources and plan.query_norms is not None:
        norms = plan.query_norms[layer]
        count = -(-cfg.random_count // group) * group  # a multiple of G keeps the layout
        parts.append(row(random_queries(norms, count, info.head_dim, seed + layer), None))
    out = reservoir(cat_pooled(parts, group), cap, seed, group)
    if recorded_lse is None:
        return out, None
    return out[..., :-1].contiguous(), out[..., -1].contiguous()

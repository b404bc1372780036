"""Cascade attention of a mixed batch: each compacted prefix once per node, then every tail.

Legend: B requests, n = sum_b q_b new (query) tokens, H_q / H_kv heads, D head dim, S pool
slots, R x C the `req_to_token` table, P node groups, n_p new tokens of compacted requests.
Request b owns row `req_pool_indices[b]`, whose first n_b = `seq_lens[b]` entries are its KV
slots and whose last q_b = `q_lens[b]` entries are its new tokens. A request on a compacted
node (a `PackedLayout`: N physical slots, logical length T, t_{l,h} entries per layer and KV
head; `sglang_ext.packing`) has the row

    [0, N)       the node's physical slots (its entries packed in their cells)
    [N, T)       ALIAS_SLOT copies (beta -inf: they hold positions, never attention mass)
    [T, n_b)     its own tail, ending in its q_b new tokens;

a plain request has none. Every new token sees the whole prefix, so the batch is
attended as a cascade whose parts are merged by LSE (`compaction_kernels.merge_state`):

    prefix  one kernel request per node group (the requests whose rows start on the same
            N slots with the same (N, T)): all the group's new tokens are its queries and
            its KV the group's entries of the layer, gathered by the caller ragged, head by
            head (`PrefixKV`, `PackedLayout.read_ragged`), so KV head h reads its t_{l,h}
            entries and no padding; planned per layer (the lengths differ per layer), read
            once per group; aliases are never read;
    tail    request b over its entries [T, n_b), causal, built like `attention.paged`
            (blocks + diagonal); plain requests attend their whole row here.

A token of a plain request has no prefix part: its prefix state is out = 0, lse = -inf,
which `merge_state` treats as an empty side (the result is the tail's state).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from compaction_kernels.biased_attention.triton import BiasedPagedAttention
from compaction_kernels.merge_state.triton import merge_state
from sglang_ext.attention.paged import (
    Lengths,
    check_batch,
    gather_slots,
    plan_causal,
    run_causal,
)
from sglang_ext.kv_store import ALIAS_SLOT
from sglang_ext.packing import PackedLayout

__all__ = [
    "CascadePlan",
    "PrefixKV",
    "PrefixPlans",
    "Prefixes",
    "plan_cascade",
    "run_cascade",
    "stack_groups",
]

Prefixes = Sequence[PackedLayout | None]


class PrefixKV(NamedTuple):
    """One layer's entries of every node group, in group order, each group's head by head
    (`PackedLayout.read_ragged`): keys, values [E, D], beta [E] fp32 (`stack_groups`)."""

    keys: torch.Tensor
    values: torch.Tensor
    beta: torch.Tensor


def stack_groups(parts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> PrefixKV:
    """Concatenate each group's ragged layer (k, v [E_g, D], beta [E_g]) in group order."""
    return PrefixKV(*(torch.cat([part[i] for part in parts]) for i in range(3)))


class PrefixPlans:
    """The prefix calls of `plan_cascade`, kept across forwards (a bounded LRU).

    A prefix call depends only on its node groups' layouts, the new tokens of each group, the
    scale and the heads; never on a row or a sequence length. A decode batch of the same
    requests asks the same key at every step, so its L per-layer calls are planned (each a
    few host syncs) once, not once per step. Layouts are compared by identity, so a fit
    installed again gets new plans; a key of a freed layout is never asked again and ages out.
    `made` counts the keys planned (each: one call per layer).
    """

    def __init__(self, capacity: int = 64):
        if capacity < 1:
            raise ValueError(f"PrefixPlans capacity must be >= 1, got {capacity}")
        self.capacity, self.made = capacity, 0
        self._plans: OrderedDict[tuple[object, ...], tuple[BiasedPagedAttention, ...]] = (
            OrderedDict()
        )

    def __len__(self) -> int:
        return len(self._plans)

    def get(
        self,
        layouts: Sequence[PackedLayout],
        group_tokens: Sequence[int],
        device: torch.device,
        sm_scale: float | None,
        heads: dict[str, int],
    ) -> tuple[BiasedPagedAttention, ...]:
        """The per-layer prefix calls for groups with these layouts and new-token counts."""
        key = (*layouts, *group_tokens, str(device), sm_scale, *sorted(heads.items()))
        plans = self._plans.get(key)
        if plans is not None:
            self._plans.move_to_end(key)
            return plans
        qo_indptr = torch.zeros(len(group_tokens) + 1, dtype=torch.int32)
        qo_indptr[1:] = torch.cumsum(torch.tensor(list(group_tokens)), 0)
        plans = _plan_prefix(layouts, qo_indptr.to(device), sm_scale, heads)
        self.made += 1
        self._plans[key] = plans
        if len(self._plans) > self.capacity:
            self._plans.popitem(last=False)
        return plans


@dataclass(frozen=True)
class CascadePlan:
    """The planned kernel calls of one cascade batch (device tables inside the wrappers).

    `prefix` has one planned call per layer (empty: no compacted request), one kernel request
    per node group over its `PrefixKV` rows, ragged per KV head; `prefix_tokens` [n_p] int64
    (q's device) are the batch token ids of its query rows, group by group; `groups` are the
    requests of each group, in batch order, and `layouts` their prefixes. `blocks` and
    `diagonal` are the tail calls as in `paged.BatchPlan`.
    """

    num_tokens: int
    groups: tuple[tuple[int, ...], ...]
    layouts: tuple[PackedLayout, ...]
    prefix: tuple[BiasedPagedAttention, ...]
    prefix_tokens: torch.Tensor | None
    blocks: BiasedPagedAttention
    diagonal: BiasedPagedAttention | None

    def slots_read(self) -> torch.Tensor:
        """The distinct pool slot ids [k] int64 that the planned tail calls read (sorted, on
        the tables' device): a compacted request's prefix (read from its `PrefixKV`) and
        aliases are never among them."""
        calls = (self.blocks, self.diagonal)
        parts = [c.planned.kv_indices for c in calls if c is not None]
        return torch.unique(torch.cat([p.long() for p in parts if p is not None]))


def plan_cascade(
    req_to_token: torch.Tensor,
    req_pool_indices: Lengths,
    seq_lens: Lengths,
    q_lens: Lengths,
    prefixes: Prefixes,
    *,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    sm_scale: float | None = None,
    causal_block: int = 64,
    cache: PrefixPlans | None = None,
) -> CascadePlan:
    """Group the compacted requests by node and plan the prefix and tail calls (module legend).

    Args:
        req_to_token: [R, W] int32/int64 slot table (SGLang's `req_to_token_pool`).
        req_pool_indices, seq_lens, q_lens: [B] ints (tensors on any device, or lists).
        prefixes: [B] the layout of the compacted prefix request b's row starts on, or None
            (plain: it attends its whole row in the tail call; aliases in it would be read,
            masked by their -inf beta: correct, but not cheaper).
        sm_scale: logit scale (None: 1/sqrt(D)).
        causal_block: C, new tokens of one tail block call (>= 1).
        cache: where the prefix calls are kept across forwards (None: planned afresh).
    Returns:
        The plan; reads `req_to_token` on the device and syncs a few times (host tables, and
        a few per layer for prefix calls not found in `cache`).
    Raises:
        ValueError: bad lengths or shapes, a prefix with T > n_b - q_b, layouts of
            different layer counts or KV heads, or rows that break the compacted layout (a
            group whose first N slots differ, an alias inside [0, N), a non-alias inside
            [N, T)); the message names them.
    """
    rows, lens, qls = check_batch(req_to_token, req_pool_indices, seq_lens, q_lens)
    table = _prefix_table(prefixes, rows.numel())
    n_slots, t_log = table[:, 0], table[:, 1]
    comp = torch.nonzero(t_log != 0).flatten()
    bad = t_log[comp] > (lens - qls)[comp]  # (N <= T: the layout holds to it)
    if bool(bad.any()):
        b = int(comp[torch.nonzero(bad)[0, 0]])
        raise ValueError(
            f"request {b}: a compacted prefix needs T <= seq_len - q_len = "
            f"{int(lens[b] - qls[b])}, got N={int(n_slots[b])} T={int(t_log[b])}"
        )
    heads = dict(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    blocks, diagonal = plan_causal(
        req_to_token, rows, t_log, lens, qls, sm_scale, causal_block, **heads
    )
    num_tokens = int(qls.sum())
    if comp.numel() == 0:
        return CascadePlan(num_tokens, (), (), (), None, blocks, diagonal)
    groups = _group(req_to_token, rows, n_slots, t_log, comp)
    layouts = tuple(p for g in groups if (p := prefixes[g[0]]) is not None)
    group_tokens = [int(qls[list(g)].sum()) for g in groups]
    cache = PrefixPlans(1) if cache is None else cache
    prefix = cache.get(layouts, group_tokens, req_to_token.device, sm_scale, heads)
    tok_start = torch.cumsum(qls, 0) - qls
    members = torch.tensor([b for g in groups for b in g])
    tokens = torch.repeat_interleave(tok_start[members], qls[members])
    tokens += torch.arange(tokens.numel()) - torch.repeat_interleave(
        torch.cumsum(qls[members], 0) - qls[members], qls[members]
    )
    prefix_tokens = tokens.to(req_to_token.device)
    return CascadePlan(num_tokens, tuple(groups), layouts, prefix, prefix_tokens, blocks, diagonal)


def run_cascade(
    plan: CascadePlan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    beta_layer: torch.Tensor,
    layer: int = 0,
    prefix_kv: PrefixKV | None = None,
) -> torch.Tensor:
    """q [n, H_q, D] over the tails in k_cache/v_cache [S, H_kv, D] (pool layer `layer`)
    with beta_layer [S, H_kv] fp32, and over `prefix_kv` (that layer's node groups in the
    plan's order; needed when the plan has a compacted request).

    Returns out [n, H_q, D] in q's dtype; mutates nothing. ValueError when q does not have
    the plan's n tokens, `prefix_kv` does not hold the groups' entries of the layer, or on
    shapes the kernel wrappers refuse.
    """
    if q.dim() != 3 or q.shape[0] != plan.num_tokens:
        raise ValueError(f"q must be [n={plan.num_tokens}, H_q, D], got {tuple(q.shape)}")
    tail = run_causal(plan.blocks, plan.diagonal, q, k_cache, v_cache, beta_layer)
    if not plan.prefix or plan.prefix_tokens is None:
        return tail.out
    rows = sum(int(p.counts[layer].sum()) for p in plan.layouts)
    if prefix_kv is None or prefix_kv.keys.shape[0] != rows or prefix_kv.beta.shape[0] != rows:
        got = None if prefix_kv is None else tuple(prefix_kv.keys.shape)
        raise ValueError(
            f"prefix_kv must hold the groups' {rows} entries of layer {layer}, got {got}"
        )
    idx = plan.prefix_tokens.to(q.device)
    part = plan.prefix[layer].run(q.index_select(0, idx), *prefix_kv)
    out = q.new_zeros(q.shape).index_copy_(0, idx, part.out)
    lse = torch.full(q.shape[:2], float("-inf"), device=q.device).index_copy_(0, idx, part.lse)
    return merge_state(out, lse, tail.out, tail.lse, out_dtype=q.dtype).out


def _prefix_table(prefixes: Prefixes, num_req: int) -> torch.Tensor:
    """(N, T) per request as a host int64 [B, 2] tensor (plain: 0, 0)."""
    if len(prefixes) != num_req:
        raise ValueError(f"prefixes has {len(prefixes)} entries for B={num_req} requests")
    pairs = [(0, 0) if p is None else (p.num_slots, p.logical_length) for p in prefixes]
    return torch.tensor(pairs, dtype=torch.long).reshape(num_req, 2)


def _plan_prefix(
    layouts: Sequence[PackedLayout],
    qo_indptr: torch.Tensor,
    sm_scale: float | None,
    heads: dict[str, int],
) -> tuple[BiasedPagedAttention, ...]:
    """One ragged call per layer: group g's queries (qo_indptr [P+1], on the KV's device)
    over its t_{l,h} entries of KV head h (ValueError: layouts of other shapes)."""
    shapes = {tuple(p.counts.shape) for p in layouts}
    if len(shapes) != 1 or next(iter(shapes))[1] != heads["num_kv_heads"]:
        raise ValueError(
            f"compacted prefixes of one batch need one [L, H_kv={heads['num_kv_heads']}] "
            f"shape, got {sorted(shapes)}"
        )
    counts = torch.stack([p.counts for p in layouts], 1)  # [L, P, H_kv]
    calls = []
    for per_layer in counts:
        kv_indptr = torch.zeros(per_layer.numel() + 1, dtype=torch.int32)
        kv_indptr[1:] = torch.cumsum(per_layer.reshape(-1), 0)
        call = BiasedPagedAttention()
        call.plan(kv_indptr.to(qo_indptr.device), None, qo_indptr=qo_indptr, sm_scale=sm_scale,
                  **heads)  # fmt: skip
        calls.append(call)
    return tuple(calls)


def _group(
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    n_slots: torch.Tensor,
    t_log: torch.Tensor,
    comp: torch.Tensor,
) -> list[tuple[int, ...]]:
    """Group the compacted requests `comp` [c] by (first slot, N, T) and check each row's
    layout against its group's first request on the device (one sync; ValueError)."""
    first = req_to_token[rows[comp].to(req_to_token.device), 0].cpu().tolist()
    by_key: dict[tuple[int, int, int], list[int]] = {}
    for b, slot in zip(comp.tolist(), first):
        by_key.setdefault((slot, int(n_slots[b]), int(t_log[b])), []).append(b)
    groups = [tuple(g) for g in by_key.values()]
    rep = torch.empty_like(rows)
    for g in groups:
        rep[list(g)] = g[0]
    zeros = torch.zeros_like(comp)
    ind_ptr, own = gather_slots(req_to_token, rows[comp], zeros, n_slots[comp])
    _, theirs = gather_slots(req_to_token, rows[rep[comp]], zeros, n_slots[comp])
    alias_ptr, aliases = gather_slots(
        req_to_token, rows[comp], n_slots[comp], (t_log - n_slots)[comp]
    )
    checks = ((own != theirs), (own == ALIAS_SLOT), (aliases != ALIAS_SLOT))
    found = torch.stack([c.any() for c in checks]).cpu().tolist()
    if not any(found):
        return groups
    which = found.index(True)
    ptr = alias_ptr if which == 2 else ind_ptr
    pos = int(torch.nonzero(checks[which])[0, 0])
    host_ptr = ptr.cpu().long()
    m = int(torch.searchsorted(host_ptr, torch.tensor(pos), right=True)) - 1
    b = int(comp[m])
    col = pos - int(host_ptr[m]) + (int(n_slots[b]) if which == 2 else 0)
    slot = int(req_to_token[int(rows[b]), col])
    what = (
        f"differs from request {int(rep[b])}'s, whose row starts on the same slot with the "
        "same (N, T)",
        f"is ALIAS_SLOT={ALIAS_SLOT} inside the physical slots [0, N={int(n_slots[b])})",
        f"is not ALIAS_SLOT={ALIAS_SLOT} inside the aliases [N, T)="
        f"[{int(n_slots[b])}, {int(t_log[b])})",
    )[which]
    raise ValueError(f"request {b}: row entry {col} (slot {slot}) {what}")

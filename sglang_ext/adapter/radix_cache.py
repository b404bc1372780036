"""`CompactionRadixCache`: SGLang's Python radix tree with compacted shared prefixes.

A compacted prefix of T tokens is one node `K` hanging off the root under a private child
key, beside the ordinary tree. Its value is T slot indices: t_max physical slots then
`ALIAS_SLOT` (see `sglang_ext.kv_store`), so requests that match it get a KV row T long and
their positions continue at T (the node itself: `sglang_ext.compacted_node`). Rules:

- Match whole or not at all: a key whose first T tokens equal K's goes through K (the
  longest such K wins); any other key sees only the ordinary tree.
- Accounting is physical: K counts t_max in evictable/protected sizes; eviction frees its
  t_max slots (never the alias) and resets their beta.
- The original path is retired at install: its nodes that are unlocked leaves are freed at
  once, locked ones when their last request lets go. A path that runs through a shorter
  compacted node K0 (a document under a compacted system prompt) is compacted whole from the
  root; its ordinary nodes below K0 are retired, K0 stays for its other requests until
  evicted. The install's range check reads what is left of the original KV: the ordinary
  path from the root and below K0, plus K0's own slots (kept original keys, fitted values).
- A request that started before the install (its row does not begin with K's slots) is
  kept off K: its checkpoints leave the tree alone and it frees only its own slots.
- A refit of an installed prefix (`fit_round` n > 0) is installed beside it and then takes
  its place at once: new requests match the refit; the old node stops matching, its
  requests in flight finish on it, and it and its descendants are freed when they let go
  (`_superseded`, `_retired`).
- Hits: SGLang's insert counts one hit per request and node; `sglang_ext.trigger` decides
  which path is sent for compaction (branch points with enough hits and enough distinct
  short continuations, once per document, failed ones retried with backoff then cooled
  down).

Mutations happen in the scheduler only: `poll_compactions()` installs finished results at a safe point.
"""

from __future__ import annotations

import logging
import time
from array import array
from typing import Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
)
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

from compactor.types import prefix_hash
from sglang_ext.compacted_node import (
    CompactionInfo,
    compaction_info,
    covering,
    path_tokens,
    physical_size,
)
from sglang_ext.compactors import PoolShape
from sglang_ext.config import CompactionConfig
from sglang_ext.guard import HookGuard
from sglang_ext.installer import PendingInstall
from sglang_ext.kv_store import BetaStore
from sglang_ext.lifecycle import InstallLifecycle
from sglang_ext.metrics import CompactionStats, PrometheusExporter
from sglang_ext.trigger import CompactionTrigger

__all__ = ["CompactionInfo", "CompactionRadixCache"]

logger = logging.getLogger(__name__)


class CompactionRadixCache(InstallLifecycle, RadixCache):
    """RadixCache + compacted prefixes (see the module docstring)."""

    def __init__(
        self,
        params: Any,
        config: CompactionConfig,
        fingerprint: str | None,
        runner: Any = None,
        exporter: PrometheusExporter | None = None,
    ):
        if params.page_size != 1 or params.is_eagle:
            raise ValueError(
                f"CompactionRadixCache needs page_size 1 and no EAGLE, got "
                f"page_size={params.page_size} is_eagle={params.is_eagle}"
            )
        self.config = config
        self.fingerprint: str | None = fingerprint
        self.runner = runner
        self.exporter = exporter
        self.stats = CompactionStats()
        self.trigger = CompactionTrigger(config)
        self.guard = HookGuard(self.trip)
        self._compacted: dict[str, TreeNode] = {}
        self._retired: set[TreeNode] = set()
        self._dropped: dict[str, TreeNode] = {}  # compacted for old weights, freed when unlocked
        self._superseded: set[TreeNode] = set()  # replaced by a refit, freed when unlocked
        self._pending: list[PendingInstall] = []
        super().__init__(params)
        kvcache = self.token_to_kv_pool_allocator.get_kvcache()
        self.kvcache = kvcache
        self.pool_shape = PoolShape.of(kvcache)  # what results must fit (fixed for the pool)
        self.beta_store = BetaStore.for_pool(kvcache)
        if runner is not None:
            runner.check = self.check_result

    # ---- public: compaction lifecycle (install steps: sglang_ext.lifecycle) --------
    def compacted_nodes(self) -> list[TreeNode]:
        return list(self._compacted.values())

    # ---- SGLang API overrides ---------------------------------------------------------
    def reset(self) -> None:
        store = getattr(self, "beta_store", None)  # None during __init__
        if store is not None:
            for node in [*self._compacted.values(), *self._dropped.values(), *self._superseded]:
                info = compaction_info(node)
                if info is not None:
                    store.clear(info.slots)
            for pending in self._pending:
                store.clear(pending.slots)
            held: Any
            for held in (
                self._compacted,
                self._dropped,
                self._superseded,
                self._pending,
                self._retired,
            ):
                held.clear()
            self.trigger.reset()
            if self.runner is not None:  # results in flight were asked of the flushed tree
                self.runner.new_epoch()
            if self.tp is not None:
                self.tp.clear()
        super().reset()
        if store is not None:
            self._refresh_gauges()
            self._export()

    def checkpoint(self, req: Any, *, up_to: int) -> None:
        if self.disable:
            return
        token_ids = req.full_untruncated_fill_ids[:up_to]
        rkey = RadixKey(token_ids, req.extra_key, cache_salt=req.cache_salt)
        if self._dropped and covering(self._dropped.values(), rkey) is not None:
            self.stats.skipped_checkpoints += 1  # computed on a prefix of the old weights
            return
        k = self._covering(rkey)
        if k is not None:
            row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : len(k.value)]
            if not torch.equal(row.to(torch.int64), k.value.to(row.device)):
                self.stats.skipped_checkpoints += 1
                return
        if req.cache_salt is None and req.extra_key is None:
            # a request that opted out of sharing (cache salt) or runs another adapter (LoRA
            # extra key) never feeds the fit of a shared path
            self.trigger.remember(req.rid, req.origin_input_ids)
        self.trigger.candidates.clear()
        super().checkpoint(req, up_to=up_to)
        self._maybe_submit()

    def evict(self, params: EvictParams) -> EvictResult:
        if self.disable:
            return EvictResult()
        import heapq

        start = time.perf_counter()
        heap = [(self.eviction_strategy.get_priority(n), n) for n in self.evictable_leaves]
        heapq.heapify(heap)
        evicted = 0
        while evicted < params.num_tokens and heap:
            _, x = heapq.heappop(heap)
            evicted += self._free_node(x)
            if len(x.parent.children) == 0 and x.parent.lock_ref == 0:
                heapq.heappush(heap, (self.eviction_strategy.get_priority(x.parent), x.parent))
        self.update_eviction_metrics(evicted, start)
        return EvictResult(num_tokens_evicted=evicted)

    def inc_lock_ref(self, node: Any) -> IncLockRefResult:
        if self.disable:
            return IncLockRefResult(delta=0)
        delta = 0
        while node != self.root_node:
            if node.lock_ref == 0:
                n = physical_size(node)
                self.evictable_size_ -= n
                self.protected_size_ += n
                delta -= n
            node.lock_ref += 1
            self._update_leaf_status(node)
            node = node.parent
        return IncLockRefResult(delta=delta)

    def dec_lock_ref(self, node: Any, params: DecLockRefParams | None = None) -> DecLockRefResult:
        if self.disable:
            return DecLockRefResult(delta=0)
        delta = 0
        while node != self.root_node:
            if node.lock_ref == 1:
                n = physical_size(node)
                self.evictable_size_ += n
                self.protected_size_ -= n
                delta += n
            node.lock_ref -= 1
            self._update_leaf_status(node)
            node = node.parent
        return DecLockRefResult(delta=delta)

    def total_size(self) -> int:
        total, stack = 0, [self.root_node]
        while stack:
            node = stack.pop()
            total += physical_size(node) if node is not self.root_node else 0
            stack.extend(c for c in node.children.values() if not c.evicted)
        return total

    # ---- tree internals ---------------------------------------------------------------
    def _match_prefix_helper(self, node: TreeNode, key: RadixKey) -> tuple[list, TreeNode]:
        if node is self.root_node:
            k = self._covering(key)
            if k is not None:
                k.last_access_time = time.monotonic()
                rest = key[len(k.key) :]
                if len(rest) == 0:
                    return [k.value], k
                value, last = super()._match_prefix_helper(k, rest)
                return [k.value, *value], last
        return super()._match_prefix_helper(node, key)

    def _insert_helper(self, node, key, value, priority=0, inserted_len=0):  # type: ignore[no-untyped-def]
        if node is self.root_node:
            k = self._covering(key)
            if k is not None:
                T = len(k.key)
                k.last_access_time = time.monotonic()
                n, last = super()._insert_helper(
                    k, key[T:], value[T:], priority, max(0, inserted_len - T)
                )
                return T + n, last
        return super()._insert_helper(node, key, value, priority, inserted_len)

    def _inc_hit_count(self, node: TreeNode) -> None:
        super()._inc_hit_count(node)
        if compaction_info(node) is None:
            self.trigger.on_hit(node)

    def _delete_leaf(self, node: TreeNode) -> None:
        info = compaction_info(node)
        if info is None:
            super()._delete_leaf(node)
            return
        node.parent.children.pop(info.child_key, None)
        for held in (self._compacted, self._dropped):
            if held.get(info.prefix_hash) is node:
                del held[info.prefix_hash]
        self._superseded.discard(node)
        self.evictable_size_ -= info.t_max
        self.evictable_leaves.discard(node)
        self._update_leaf_status(node.parent)

    # ---- helpers ----------------------------------------------------------------------
    def _covering(self, key: RadixKey) -> TreeNode | None:
        """The longest compacted node whose whole key is a prefix of `key`."""
        return covering(self._compacted.values(), key) if self._compacted else None

    def _alloc(self, n: int) -> torch.Tensor:
        alloc = self.token_to_kv_pool_allocator
        if alloc.available_size() < n:
            self.evict(EvictParams(num_tokens=n - alloc.available_size()))
        slots = alloc.alloc(n) if alloc.available_size() >= n else None
        if slots is None:
            raise RuntimeError(f"KV pool cannot hold a compacted prefix of {n} slots")
        return slots.to(torch.int64)

    def _free_node(self, node: TreeNode) -> int:
        """Free an unlocked leaf's slots and delete it; returns slots freed."""
        info = compaction_info(node)
        if info is not None:
            self.token_to_kv_pool_allocator.free(info.slots)
            self.beta_store.clear(info.slots)
            n = info.t_max
            if node not in self._superseded:  # (a replaced fit is freed, not evicted)
                self.stats.evicted += 1
                self.trigger.forget(info.prefix_hash)  # may be compacted again after new hits
        else:
            self.token_to_kv_pool_allocator.free_segment(node.value, start_pos=0)
            n = len(node.value)
        self._delete_leaf(node)
        self.kv_events.record_remove(node)
        if info is not None:
            self._refresh_gauges()
            self._export()
        return n

    def _retire_original(self, key: RadixKey) -> None:
        """Mark the ordinary path of `key` (and what hangs below its end) for freeing: from
        the root and below every shorter compacted node whose key starts `key`."""
        self._retire_below(self.root_node, key)
        for node in list(self._compacted.values()):
            T = len(node.key)
            if len(key) > T and node.key.match(key) == T:
                self._retire_below(node, key[T:])

    def _retire_below(self, node: TreeNode, key: RadixKey) -> None:
        path = []
        while len(key) > 0:
            child = node.children.get(key.child_key(self.page_size))
            if child is None:
                break
            m = child.key.match(key)
            if m < len(child.key):
                if m < len(key):
                    break  # the tree diverges from the prefix inside this node
                child = self._split_node(child.key, child, m)  # prefix ends inside it
            path.append(child)
            node, key = child, key[m:]
        self._retired.update(path)
        if len(key) == 0 and path:
            self._retire_descendants(path[-1])

    def _original_slots(self, ids: list[int]) -> torch.Tensor:
        """Slots [n] int64 holding what is left of path `ids`'s original KV, for the
        install's range check: its ordinary path from the root and, when a compacted node K0
        covers its front (whose original KV is gone: a shorter one, or the fit a refit
        replaces), K0's slots and the ordinary nodes below K0. Empty when nothing of it is
        cached."""
        key = RadixKey(array("q", ids), None)
        parts, _ = RadixCache._match_prefix_helper(self, self.root_node, key)
        k0 = self._covering(key)
        info = None if k0 is None else compaction_info(k0)
        if k0 is not None and info is not None:
            parts = [*parts, info.slots]
            if len(k0.key) < len(ids):
                below, _ = RadixCache._match_prefix_helper(self, k0, key[len(k0.key) :])
                parts += below
        return torch.cat(parts).to(torch.int64) if parts else torch.empty(0, dtype=torch.int64)

    def _reap(self) -> None:
        """Free retired nodes and dropped compacted ones that are now unlocked leaves
        (repeats up the path)."""
        for node in [*self._dropped.values(), *self._superseded]:
            if node.lock_ref == 0 and not node.children:
                self._free_node(node)
        progress = True
        while progress and self._retired:
            progress = False
            for node in list(self._retired):
                parent = node.parent
                attached = (
                    parent is not None
                    and parent.children.get(node.key.child_key(self.page_size)) is node
                )
                if not attached:
                    self._retired.discard(node)
                elif node.lock_ref == 0 and not node.children:
                    self.stats.retired_tokens_freed += self._free_node(node)
                    self._retired.discard(node)
                    progress = True

    def _maybe_submit(self) -> None:
        trigger = self.trigger
        if self.runner is None or self.fingerprint is None:
            return
        if not trigger.candidates and not trigger.refit_asked:
            return
        if self.runner.pending + len(self._pending) >= self.config.max_in_flight:
            self.stats.deferred += bool(trigger.candidates)
            trigger.candidates.clear()  # back-pressure: found again at its next hit
            return
        picked = trigger.next_refit() or trigger.pick(
            lambda node: path_tokens(node, self.root_node)
        )
        if picked is None:
            return
        self.stats.requested += 1
        logger.info(
            "sglang_ext: compaction requested T=%d hash=%s follow_ups=%d%s",
            len(picked.tokens), prefix_hash(picked.tokens)[:12], len(picked.follow_ups),
            f" (refit {picked.fit_round})" if picked.fit_round else "",
        )  # fmt: skip
        self.runner.submit(picked.tokens, picked.follow_ups, fit_round=picked.fit_round)
        self._export()

    def _refresh_gauges(self) -> None:
        kv = self.kvcache
        k0 = kv.get_key_buffer(kv.start_layer)
        per_slot = 2 * kv.layer_num * k0.shape[1] * k0.shape[2] * k0.element_size()
        logical = sum(len(n.key) for n in self._compacted.values())
        physical = sum(physical_size(n) for n in self._compacted.values())
        self.stats.logical_tokens, self.stats.physical_tokens = logical, physical
        self.stats.bytes_saved = (logical - physical) * per_slot
        store = self.beta_store
        self.stats.beta_slots = int(store.compacted.sum()) - int(store.alias_ready)

    def _export(self, latency_s: float | None = None) -> None:
        if self.exporter is not None:
            self.exporter.update(self.stats, latency_s)

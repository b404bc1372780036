"""`CompactionRadixCache`: SGLang's Python radix tree with compacted shared prefixes.

A compacted prefix of T tokens is one node `K` hanging off the root under a private child
key, beside the ordinary tree. Its value is T slot indices: N physical slots then
`ALIAS_SLOT` (see `sglang_ext.kv_store`), so requests that match it get a KV row T long and
their positions continue at T (the node itself: `sglang_ext.adapter.compacted_node`). What is
installed, superseded, dropped or retired, and when, is decided by the cache's
`lifecycle` (`sglang_ext.lifecycle.InstallLifecycle`, SGLang-free), which reaches this tree
through `RadixTreeOps` (`sglang_ext.adapter.tree_ops`). Rules:

- Match whole or not at all: a key whose first T tokens equal K's goes through K (the
  longest such K wins); any other key sees only the ordinary tree.
- Accounting is physical: K counts its N slots (its entries packed, `sglang_ext.packing`)
  in evictable/protected sizes; eviction frees them (never the alias) and resets their beta.
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
  (the lifecycle's superseded and retired nodes).
- Hits: SGLang's insert counts one hit per request and node; `sglang_ext.trigger` decides
  which path is sent for compaction (branch points with enough hits and enough distinct
  short continuations, once per document, failed ones retried with backoff then cooled
  down).

Mutations happen in the scheduler only: `poll_compactions()` installs finished results at a safe point.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Generic, TypeVar, overload

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
)
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

from compactor import CompactedPrefix
from sglang_ext.adapter.compacted_node import (
    CompactionInfo,
    beta_store_of,
    child_key,
    compaction_info,
    covering,
    path_tokens,
    physical_size,
)
from sglang_ext.adapter.tree_ops import RadixTreeOps
from sglang_ext.config import CompactionConfig
from sglang_ext.guard import HookGuard
from sglang_ext.kv_store import BetaStore
from sglang_ext.lifecycle import InstallLifecycle
from sglang_ext.metrics import CompactionStats, PrometheusExporter
from sglang_ext.pool_shape import PoolShape
from sglang_ext.trigger import CompactionTrigger

__all__ = ["CompactionInfo", "CompactionRadixCache"]

logger = logging.getLogger(__name__)
T = TypeVar("T")


class _FromLifecycle(Generic[T]):
    """A read-only attribute of a :class:`CompactionRadixCache`: its lifecycle's attribute of
    the same name (RuntimeError while the cache is being built, AttributeError on a set)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, cache: None, owner: type) -> _FromLifecycle[T]: ...
    @overload
    def __get__(self, cache: CompactionRadixCache, owner: type) -> T: ...
    def __get__(self, cache: CompactionRadixCache | None, owner: type) -> T | _FromLifecycle[T]:
        if cache is None:
            return self
        value: T = getattr(cache._lc, self.name)
        return value

    def __set__(self, cache: CompactionRadixCache, value: T) -> None:
        raise AttributeError(f"{self.name} is the lifecycle's, read-only here")


class CompactionRadixCache(RadixCache):
    """RadixCache + compacted prefixes (see the module docstring); `lifecycle` holds them."""

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
        self.lifecycle: InstallLifecycle[TreeNode] | None = None  # None during __init__
        super().__init__(params)
        kvcache = self.token_to_kv_pool_allocator.get_kvcache()
        self.lifecycle = InstallLifecycle(
            RadixTreeOps(self), config, fingerprint, kvcache, beta_store_of(kvcache),
            PoolShape.of(kvcache), runner=runner, exporter=exporter,
        )  # fmt: skip

    # ---- the lifecycle's public face (what hooks, tests and benchmarks use) --------------
    @property
    def _lc(self) -> InstallLifecycle[TreeNode]:
        lc = self.lifecycle
        if lc is None:  # only while RadixCache.__init__ runs
            raise RuntimeError("CompactionRadixCache is still being built")
        return lc

    stats = _FromLifecycle[CompactionStats]()
    trigger = _FromLifecycle[CompactionTrigger]()
    guard = _FromLifecycle[HookGuard]()
    runner = _FromLifecycle[Any]()
    config = _FromLifecycle[CompactionConfig]()
    fingerprint = _FromLifecycle[str | None]()
    tp = _FromLifecycle[Any]()
    beta_store = _FromLifecycle[BetaStore]()
    kvcache = _FromLifecycle[Any]()

    def poll_compactions(self, idle: bool = False) -> int:
        """The scheduler's safe point (`InstallLifecycle.poll`)."""
        return self._lc.poll(idle)

    def install(self, token_ids: Any, prefix: CompactedPrefix) -> TreeNode:
        return self._lc.install(token_ids, prefix)

    def on_weights_updated(self, fingerprint: str | None) -> None:
        self._lc.on_weights_updated(fingerprint)

    def trip(self, reason: str) -> None:
        self._lc.trip(reason)

    def compacted_nodes(self) -> list[TreeNode]:
        return list(self._lc.installed.values())

    def covering_node(self, key: RadixKey) -> TreeNode | None:
        """The longest installed compacted node whose whole key is a prefix of `key`."""
        installed = self._lc.installed
        return covering(installed.values(), key) if installed else None

    def free_node(self, node: TreeNode) -> int:
        """Free an unlocked leaf's slots and delete it; returns slots freed."""
        info = compaction_info(node)
        if info is not None:
            self.token_to_kv_pool_allocator.free(info.slots)
            self._lc.freeing(node, info)
            n = info.num_slots
        else:
            self.token_to_kv_pool_allocator.free_segment(node.value, start_pos=0)
            n = len(node.value)
        self._delete_leaf(node)
        self.kv_events.record_remove(node)
        if info is not None:
            self._lc.refresh_gauges()
            self._lc.export()
        return n

    # ---- SGLang API overrides ---------------------------------------------------------
    def reset(self) -> None:
        lc = self.lifecycle
        if lc is not None:
            lc.reset()
        super().reset()
        if lc is not None:
            lc.refresh_gauges()
            lc.export()

    def checkpoint(self, req: Any, *, up_to: int) -> None:
        if self.disable:
            return
        lc = self._lc
        token_ids = req.full_untruncated_fill_ids[:up_to]
        rkey = RadixKey(token_ids, req.extra_key, cache_salt=req.cache_salt)
        if lc.dropped and covering(lc.dropped.values(), rkey) is not None:
            self.stats.skipped_checkpoints += 1  # computed on a prefix of the old weights
            return
        k = self.covering_node(rkey)
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
        lc.submit_next(lambda node: path_tokens(node, self.root_node))

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
            evicted += self.free_node(x)
            if len(x.parent.children) == 0 and x.parent.lock_ref == 0:
                heapq.heappush(heap, (self.eviction_strategy.get_priority(x.parent), x.parent))
        self.update_eviction_metrics(evicted, start)
        return EvictResult(num_tokens_evicted=evicted)

    def inc_lock_ref(self, node: Any) -> IncLockRefResult:
        if self.disable:
            return IncLockRefResult(delta=0)
        return IncLockRefResult(delta=self._lock_path(node, 1))

    def dec_lock_ref(self, node: Any, params: DecLockRefParams | None = None) -> DecLockRefResult:
        if self.disable:
            return DecLockRefResult(delta=0)
        return DecLockRefResult(delta=self._lock_path(node, -1))

    def _lock_path(self, node: Any, step: int) -> int:
        """Add `step` (1: lock, -1: unlock) to the lock count of `node` and its ancestors up
        to the root. A node that becomes locked moves its physical size from the evictable
        to the protected size, one that becomes unlocked moves it back. Returns the change
        of the evictable size."""
        delta = 0
        first = 0 if step > 0 else 1  # the count at which this step (un)locks the node
        while node != self.root_node:
            if node.lock_ref == first:
                n = physical_size(node) * step
                self.evictable_size_ -= n
                self.protected_size_ += n
                delta -= n
            node.lock_ref += step
            self._update_leaf_status(node)
            node = node.parent
        return delta

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
            k = self.covering_node(key)
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
            k = self.covering_node(key)
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
        children, ck = node.parent.children, child_key(info.prefix_hash, info.fit_round)
        if children.get(ck) is node:  # a re-install of the same fit may hold the key now
            del children[ck]
        if self.lifecycle is not None:
            self.lifecycle.removed(node, info)
        self.evictable_size_ -= info.num_slots
        self.evictable_leaves.discard(node)
        self._update_leaf_status(node.parent)

"""`RadixTreeOps`: the lifecycle's `TreeOps` over SGLang's radix tree and KV pool.

`sglang_ext.lifecycle.InstallLifecycle` decides; this carries its decisions out on the
`CompactionRadixCache` it belongs to: slots from and back to SGLang's allocator, the tree's
evictable / protected accounting, compacted nodes attached under the root, the original path
of a prefix found (and split where the prefix ends), nodes freed.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

from sglang_ext.adapter.compacted_node import compaction_info, new_compacted_node
from sglang_ext.prefix_tree import CompactionInfo, PoolFull

__all__ = ["RadixTreeOps"]


class RadixTreeOps:
    """`sglang_ext.prefix_tree.TreeOps` of `cache`, the `CompactionRadixCache` that owns it
    (mutates it as each method says; typed `Any`, as the cache imports this module)."""

    def __init__(self, cache: Any):
        self.cache = cache

    def alloc(self, n: int) -> torch.Tensor:
        alloc = self.cache.token_to_kv_pool_allocator
        if alloc.available_size() < n:
            self.cache.evict(EvictParams(num_tokens=n - alloc.available_size()))
        slots = alloc.alloc(n) if alloc.available_size() >= n else None
        if slots is None:
            raise PoolFull(f"KV pool cannot hold a compacted prefix of {n} slots")
        return slots.to(torch.int64)

    def free(self, slots: torch.Tensor) -> None:
        self.cache.token_to_kv_pool_allocator.free(slots)

    def hold(self, n: int) -> None:
        self.cache.protected_size_ += n

    def slot_counts(self) -> tuple[int, int, int]:
        cache = self.cache
        alloc = cache.token_to_kv_pool_allocator
        tree = cache.evictable_size_ + cache.protected_size_
        return tree, int(alloc.available_size()), int(alloc.size)

    def original_slots(self, ids: list[int]) -> torch.Tensor:
        """What is left of path `ids`'s original KV: its ordinary path from the root and,
        when a compacted node K0 covers its front (whose original KV is gone: a shorter one,
        or the fit a refit replaces), K0's slots and the ordinary nodes below K0."""
        cache = self.cache
        key = RadixKey(array("q", ids), None)
        parts, _ = RadixCache._match_prefix_helper(cache, cache.root_node, key)
        k0 = cache.covering_node(key)
        info = None if k0 is None else compaction_info(k0)
        if k0 is not None and info is not None:
            parts = [*parts, info.slots]
            if len(k0.key) < len(ids):
                below, _ = RadixCache._match_prefix_helper(cache, k0, key[len(k0.key) :])
                parts += below
        return torch.cat(parts).to(torch.int64) if parts else torch.empty(0, dtype=torch.int64)

    def add_node(self, ids: list[int], info: CompactionInfo) -> TreeNode:
        cache = self.cache
        node = new_compacted_node(cache.root_node, ids, info)
        cache.protected_size_ -= info.num_slots
        cache.evictable_size_ += info.num_slots
        cache._update_leaf_status(node)
        cache._update_leaf_status(cache.root_node)
        return node

    def original_path(self, ids: list[int]) -> list[TreeNode]:
        """From the root and below every shorter compacted node whose key starts `ids`."""
        cache = self.cache
        key = RadixKey(array("q", ids), None)
        nodes = self._path_below(cache.root_node, key)
        for node in cache.compacted_nodes():
            T = len(node.key)
            if len(key) > T and node.key.match(key) == T:
                nodes += self._path_below(node, key[T:])
        return nodes

    def descendants(self, node: TreeNode) -> Iterable[TreeNode]:
        out, stack = [], list(node.children.values())
        while stack:
            child = stack.pop()
            out.append(child)
            stack.extend(child.children.values())
        return out

    def info(self, node: TreeNode) -> CompactionInfo | None:
        return compaction_info(node)

    def attached(self, node: TreeNode) -> bool:
        parent = node.parent
        if parent is None:
            return False
        info = compaction_info(node)
        if info is not None:
            return node in parent.children.values()
        return parent.children.get(node.key.child_key(self.cache.page_size)) is node

    def unlocked_leaf(self, node: TreeNode) -> bool:
        return node.lock_ref == 0 and not node.children

    def free_node(self, node: TreeNode) -> int:
        return self.cache.free_node(node)

    def _path_below(self, node: TreeNode, key: RadixKey) -> list[TreeNode]:
        """The nodes below `node` along `key` (the last split where `key` ends inside it),
        and everything below the last when `key` ends there."""
        cache, path = self.cache, []
        while len(key) > 0:
            child = node.children.get(key.child_key(cache.page_size))
            if child is None:
                break
            m = child.key.match(key)
            if m < len(child.key):
                if m < len(key):
                    break  # the tree diverges from the prefix inside this node
                child = cache._split_node(child.key, child, m)  # prefix ends inside it
            path.append(child)
            node, key = child, key[m:]
        if len(key) == 0 and path:
            path += self.descendants(path[-1])
        return path

"""Compacted prefixes on SGLang's objects: the tree node that holds one, and the pool's beta.

A compacted prefix of T tokens is a `CompactedTreeNode` (SGLang's `TreeNode` with a typed
`compaction: CompactionInfo`) hanging off the root under `child_key(prefix_hash, fit_round)`,
beside the ordinary tree. A refit of the same prefix hangs beside the fit it replaces
(another round, another key) until that one's requests let go. Its value is T slot indices:
the N physical slots, then `ALIAS_SLOT` (see `sglang_ext.kv_store`).
`sglang_ext.adapter.radix_cache.CompactionRadixCache` owns these nodes; the functions here
only read nodes, except `new_compacted_node`, which attaches one.

`beta_store_of(kvcache)`: the `BetaStore` beside SGLang's KV pool, which the radix cache
(writer) and the attention backend (reader) share in the scheduler. SGLang builds the two
through separate factories, the pool being the one object both are given, so the store is
attached to the pool (`kvcache.compaction_beta`).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import Any

import torch
from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

from sglang_ext.kv_store import ALIAS_SLOT, BetaStore
from sglang_ext.prefix_tree import CompactionInfo

__all__ = [
    "CompactedTreeNode",
    "CompactionInfo",
    "beta_store_of",
    "child_key",
    "compacted_ancestor",
    "compaction_info",
    "covering",
    "new_compacted_node",
    "path_tokens",
    "physical_size",
]

_BETA_ATTR = "compaction_beta"


class CompactedTreeNode(TreeNode):
    """A radix-tree node that is a compacted prefix (`compaction`: what it holds)."""

    def __init__(self, info: CompactionInfo):
        super().__init__()
        self.compaction = info


def compaction_info(node: TreeNode) -> CompactionInfo | None:
    """The node's `CompactionInfo`, or None for an ordinary node."""
    return node.compaction if isinstance(node, CompactedTreeNode) else None


def compacted_ancestor(node: TreeNode | None) -> CompactionInfo | None:
    """The `CompactionInfo` of the compacted node on the path from the root to `node` (a
    request's `last_node`: the node itself or one of its ancestors), else None. Host only:
    a walk up the parents, a few nodes."""
    while node is not None:
        info = compaction_info(node)
        if info is not None:
            return info
        node = node.parent
    return None


def child_key(phash: str, fit_round: int = 0) -> tuple[str, str, int]:
    """The root's child key of the compacted node for prefix hash `phash`, fit `fit_round`
    (no token key)."""
    return ("__compacted__", phash, fit_round)


def physical_size(node: TreeNode) -> int:
    """KV slots the node holds: N for a compacted node, its key length otherwise."""
    info = compaction_info(node)
    return info.num_slots if info is not None else len(node.key)


def new_compacted_node(root: TreeNode, ids: list[int], info: CompactionInfo) -> TreeNode:
    """Attach a compacted node for tokens `ids` [T] holding `info.slots` [N] int64 under
    `root`.

    Mutates `root.children` only; the caller does the tree's size and leaf bookkeeping.
    """
    T, slots = len(ids), info.slots
    node = CompactedTreeNode(info)
    node.parent = root
    node.key = RadixKey(array("q", ids), None)
    alias = torch.full((T - info.num_slots,), ALIAS_SLOT, dtype=slots.dtype, device=slots.device)
    node.value = torch.cat([slots, alias])  # on the pool's device, as SGLang's own values
    root.children[child_key(info.prefix_hash, info.fit_round)] = node
    return node


def beta_store_of(kvcache: Any) -> BetaStore:
    """The `BetaStore` attached to SGLang's KV pool `kvcache`, created on first use (mutates
    `kvcache`: see the module docstring for why it is attached there)."""
    store = getattr(kvcache, _BETA_ATTR, None)
    if isinstance(store, BetaStore):
        return store
    store = BetaStore.of_pool(kvcache)
    setattr(kvcache, _BETA_ATTR, store)
    return store


def covering(compacted: Iterable[TreeNode], key: RadixKey) -> TreeNode | None:
    """The longest of the `compacted` nodes whose whole key is a prefix of `key`.

    None for a namespaced (`extra_key`), salted or bigram key: those never match one.
    """
    if key.extra_key is not None or key.cache_salt is not None or key.is_bigram:
        return None
    best: TreeNode | None = None
    for node in compacted:
        T = len(node.key)
        fits = len(key) >= T and (best is None or len(best.key) < T)
        if fits and node.key.match(key) == T:
            best = node
    return best


def path_tokens(node: TreeNode, root: TreeNode) -> list[int] | None:
    """The tokens from `root` down to `node`, or None when the path cannot be compacted.

    A path through a compacted node is its whole key (the T tokens from the root it stands
    for) then the ordinary tokens below it. None when the path goes through a namespace
    (`extra_key`) or a salted node.
    """
    parts = []
    while node is not root:
        if node.key.extra_key is not None or node.key.cache_salt is not None:
            return None  # namespaced or salted: never compacted
        parts.append(node.key.token_ids[: len(node.key)])
        if compaction_info(node) is not None:
            break  # its key is the whole path from the root
        node = node.parent
    return [t for part in reversed(parts) for t in part]

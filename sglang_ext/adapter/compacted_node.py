"""Compacted-prefix tree nodes: what marks one, how one is built, how one is found.

A compacted prefix of T tokens is a `TreeNode` hanging off the root under
`child_key(prefix_hash, fit_round)`, beside the ordinary tree; its `compaction` attribute is
a `CompactionInfo`. A refit of the same prefix hangs beside the fit it replaces (another
round, another key) until that one's requests let go. Its value is T slot indices: the t_max physical slots, then `ALIAS_SLOT`
(see `sglang_ext.kv_store`). `sglang_ext.radix_cache.CompactionRadixCache` owns these nodes;
the functions here only read nodes, except `new_compacted_node`, which attaches one.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

import torch
from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

from sglang_ext.kv_store import ALIAS_SLOT

__all__ = [
    "CompactionInfo",
    "child_key",
    "compacted_ancestor",
    "compaction_info",
    "covering",
    "new_compacted_node",
    "path_tokens",
    "physical_size",
]


class CompactionInfo:
    """What makes a tree node a compacted prefix."""

    __slots__ = ("fit_round", "logical_length", "method", "prefix_hash", "slots", "t_max")

    def __init__(
        self, slots: torch.Tensor, logical_length: int, phash: str, method: str, fit_round: int
    ):
        self.slots = slots  # [t_max] int64 physical slots
        self.t_max = int(slots.numel())
        self.logical_length = logical_length
        self.prefix_hash = phash
        self.method = method
        self.fit_round = fit_round  # 0: the first fit, n: the n-th refit

    @property
    def child_key(self) -> tuple[str, str, int]:
        return child_key(self.prefix_hash, self.fit_round)


def compaction_info(node: TreeNode) -> CompactionInfo | None:
    """The node's `CompactionInfo`, or None for an ordinary node."""
    return getattr(node, "compaction", None)


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
    """KV slots the node holds: t_max for a compacted node, its key length otherwise."""
    info = compaction_info(node)
    return info.t_max if info is not None else len(node.key)


def new_compacted_node(
    root: TreeNode,
    ids: list[int],
    slots: torch.Tensor,
    phash: str,
    method: str,
    fit_round: int = 0,
) -> TreeNode:
    """Attach a compacted node for tokens `ids` [T] holding `slots` [t_max] int64 under `root`
    (`fit_round`: 0 for a first fit, n for the n-th refit).

    Mutates `root.children` only; the caller does the tree's size and leaf bookkeeping.
    """
    T, t_max = len(ids), int(slots.numel())
    node = TreeNode()
    node.parent = root
    node.key = RadixKey(array("q", ids), None)
    node.value = torch.cat([slots, torch.full((T - t_max,), ALIAS_SLOT, dtype=torch.int64)])
    info = CompactionInfo(slots, T, phash, method, fit_round)
    node.compaction = info  # type: ignore[attr-defined]
    root.children[info.child_key] = node
    return node


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

"""What the install lifecycle needs of a radix tree: `TreeOps`, and `CompactionInfo`.

`sglang_ext.lifecycle.InstallLifecycle` decides what becomes, stays and stops being a
compacted prefix; the tree it installs into is reached only through `TreeOps`, whose nodes
it treats as opaque hashable handles. The plugin's adapter implements it over SGLang's
`RadixCache` (`sglang_ext.adapter.tree_ops.RadixTreeOps`); tests implement it with a few dicts.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Protocol, TypeVar

import torch

from sglang_ext.packing import PackedLayout

__all__ = ["CompactionInfo", "N", "PoolFull", "TreeOps"]

N = TypeVar("N", bound=Hashable)


class PoolFull(RuntimeError):
    """The KV pool cannot give a compacted prefix its slots, even after eviction (a result
    may wait for them: `sglang_ext.lifecycle`)."""


class CompactionInfo:
    """What makes a tree node a compacted prefix: its `layout` (`sglang_ext.packing`: the N
    physical `slots` [N] int64 and where each layer's entries sit in them), logical length T,
    prefix hash, method and fit round (0: the first fit, n: the n-th refit). `kept_entries`
    is sum t_{l,h}, the entries the fit keeps; the N slots hold N x L x H_kv of them, the
    rest (less than one slot) unused."""

    __slots__ = (
        "fit_round", "kept_entries", "layout", "logical_length", "method", "num_slots",
        "prefix_hash", "slots",
    )  # fmt: skip

    def __init__(self, layout: PackedLayout, phash: str, method: str, fit_round: int):
        self.layout = layout
        self.slots = layout.slots
        self.num_slots = layout.num_slots
        self.kept_entries = layout.kept_entries
        self.logical_length = layout.logical_length
        self.prefix_hash = phash
        self.method = method
        self.fit_round = fit_round


class TreeOps(Protocol[N]):
    """The tree operations of a compacted-prefix cache (nodes `N`: the tree's own nodes).

    Slot counts are physical: a compacted node counts its N slots, never its aliases.
    """

    def alloc(self, n: int) -> torch.Tensor:
        """`n` free KV slots [n] int64, evicting unlocked leaves first.
        Raises `PoolFull` when the pool cannot give them."""
        ...

    def free(self, slots: torch.Tensor) -> None:
        """Give `slots` (held by no node) back to the pool's allocator."""
        ...

    def hold(self, n: int) -> None:
        """Count `n` more slots (fewer when negative) as protected: held, not evictable."""
        ...

    def slot_counts(self) -> tuple[int, int, int]:
        """(slots the tree holds: evictable + protected, free slots, the pool's size)."""
        ...

    def original_slots(self, ids: list[int]) -> torch.Tensor:
        """Slots [n] int64 holding what is left of path `ids`'s original KV (empty: none)."""
        ...

    def add_node(self, ids: list[int], info: CompactionInfo) -> N:
        """Attach a compacted node for tokens `ids` [T] holding `info.slots`; its N slots
        move from protected to evictable."""
        ...

    def original_path(self, ids: list[int]) -> list[N]:
        """The ordinary nodes of path `ids` (from the root, and below every shorter compacted
        node that starts it; the last split where `ids` ends) and every node below its end."""
        ...

    def descendants(self, node: N) -> Iterable[N]:
        """Every node below `node`."""
        ...

    def info(self, node: N) -> CompactionInfo | None:
        """The node's `CompactionInfo`; None for an ordinary node."""
        ...

    def attached(self, node: N) -> bool:
        """Whether `node` is still in the tree (not removed by a split or an eviction)."""
        ...

    def unlocked_leaf(self, node: N) -> bool:
        """Whether no request holds `node` and nothing hangs below it."""
        ...

    def free_node(self, node: N) -> int:
        """Free an unlocked leaf's slots and remove it; returns the slots freed. For a
        compacted node the tree calls the lifecycle's `freeing(node, info)` once its slots
        are freed and `removed(node, info)` once it left the tree (also when the tree removes
        one on its own)."""
        ...

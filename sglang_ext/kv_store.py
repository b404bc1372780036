"""Per-cell logit biases beside SGLang's KV pool, and writing a compacted prefix into it.

Legend: L layers, S pool rows (slots, row 0 is SGLang's padding slot), H_kv KV heads,
D head dim, N slots of one compacted prefix, T its logical length.

An installed prefix's entries are packed into the cells (layer, slot, KV head) of its N slots
(`sglang_ext.packing.PackedLayout`), beta in the same cells of `BetaStore.beta`. The tree node
keeps T entries: the N slots then T - N copies of `ALIAS_SLOT` (SGLang's padding slot 0),
whose beta is -inf in every layer and head, so aliases hold positions without memory and are
masked out; attention reads the prefix through its layout, never through the row.

One `BetaStore` per KV pool is shared by the radix cache (writer, in the scheduler) and the
attention backend (reader, same process); the adapter keeps it beside SGLang's pool
(`sglang_ext.adapter.compacted_node.beta_store_of`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from compactor import CompactedPrefix
from sglang_ext.packing import PackedLayout

__all__ = ["ALIAS_SLOT", "BetaStore", "head_counts", "write_layers"]

ALIAS_SLOT = 0


class BetaStore:
    """beta [L, S, H_kv] fp32 (0 for ordinary slots) and `compacted` [S] bool, on the pool's
    device, and `prefixes` on the host: first slot -> `PackedLayout` of each written
    compacted prefix.

    Attention adds beta only for requests whose KV row starts on a compacted prefix; every
    other request runs the stock path, bit for bit. A compacted prefix hangs off the radix
    root, so a row starts on one iff its first slot is a key of `prefixes`: a look-up of one
    slot per request, no scan of the row.
    """

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, device: Any):
        if min(num_layers, num_slots, num_kv_heads) < 1:
            raise ValueError(
                f"BetaStore needs positive sizes, got layers={num_layers} slots={num_slots} "
                f"kv_heads={num_kv_heads}"
            )
        self.beta = torch.zeros(num_layers, num_slots, num_kv_heads, dtype=torch.float32,
                                device=device)  # fmt: skip
        self.compacted = torch.zeros(num_slots, dtype=torch.bool, device=device)
        self.prefixes: dict[int, PackedLayout] = {}
        # forwards whose host marks disagreed with the rows' first slots (checked on CPU)
        self.mark_mismatches = 0
        self.marks_seen = False  # a ForwardBatch was marked (logged once)
        self.alias_ready = False
        # forwards that read a compacted prefix, and the request rows among them that did
        # (counted by the attention backend, exported by the radix cache's poll)
        self.compacted_forwards = 0
        self.compacted_rows = 0
        # compacted batches that ran eagerly, by why no graph served them
        self.eager_batches: Counter[str] = Counter()

    @classmethod
    def of_pool(cls, kvcache: Any) -> BetaStore:
        """A new store sized for the KV pool `kvcache` (its layers, slots and KV heads)."""
        k0 = kvcache.get_key_buffer(kvcache.start_layer)
        return cls(kvcache.layer_num, k0.shape[0], k0.shape[1], k0.device)

    def enable_alias(self) -> None:
        """Mask the alias slot in every layer and head (done at the first install)."""
        self.beta[:, ALIAS_SLOT, :] = float("-inf")
        self.compacted[ALIAS_SLOT] = True
        self.alias_ready = True

    def clear(self, slots: torch.Tensor) -> None:
        """Give slots back to ordinary use: beta 0, not compacted, no prefix starting on one
        of them (mutates the store)."""
        self.beta[:, slots, :] = 0.0
        self.compacted[slots] = False
        if self.prefixes:
            for slot in slots.reshape(-1).tolist():
                self.prefixes.pop(slot, None)

    def mark_prefix(self, layout: PackedLayout) -> None:
        """Record that a compacted prefix is laid out as `layout` (its rows start on its first
        slot; mutates `prefixes`)."""
        self.prefixes[int(layout.slots[0])] = layout

    def prefix_of(self, first_slot: int) -> PackedLayout | None:
        """The layout of the compacted prefix whose rows start on `first_slot`, else None."""
        return self.prefixes.get(first_slot)


def head_counts(prefix: CompactedPrefix) -> torch.Tensor:
    """t_{l,h} as an [L, H_kv] int64 tensor."""
    return torch.tensor([layer.head_lengths() for layer in prefix.layers], dtype=torch.int64)


def write_layers(
    kvcache: Any,
    store: BetaStore,
    prefix: CompactedPrefix,
    layout: PackedLayout,
    layers: range | None = None,
    check: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None,
) -> None:
    """Write `layers` (default all) of `prefix` into the cells `layout` gives them in
    `kvcache` and `store` (mutates both; marks the layout's slots compacted and records the
    prefix, `mark_prefix`).

    `check(i, k, v, beta)` sees each layer cast to the pool's dtype and on its device (k, v
    [E_i, D], beta [E_i], head by head) before it is written; what it raises stops the write
    there. A layer that keeps no entry is neither checked nor written.

    Raises:
        ValueError: the prefix does not fit the pool or `layout`.
    """
    if prefix.num_layers != kvcache.layer_num:
        raise ValueError(f"prefix has {prefix.num_layers} layers, pool {kvcache.layer_num}")
    if not store.alias_ready:
        store.enable_alias()
    start = kvcache.start_layer
    k0 = kvcache.get_key_buffer(start)
    if k0.shape[1:] != (prefix.num_kv_heads, prefix.head_dim):
        raise ValueError(
            f"pool layers hold [S, {k0.shape[1]}, {k0.shape[2]}], prefix "
            f"[N, {prefix.num_kv_heads}, {prefix.head_dim}]"
        )
    dev, dtype = k0.device, k0.dtype
    for i in range(prefix.num_layers) if layers is None else layers:
        layer = prefix.layers[i]
        if layer.head_lengths() != layout.counts[i].tolist():
            raise ValueError(f"layer {i}: per-head counts differ from the layout's")
        if layer.keys.shape[0] == 0:
            continue
        # a result arrives on the host: all three move to the pool's device before `check`
        k, v = layer.keys.to(dev, dtype), layer.values.to(dev, dtype)
        beta = layer.beta.to(dev, torch.float32)
        if check is not None:
            check(i, k, v, beta)
        layout.write(
            i, k, v, beta,
            lambda j: kvcache.get_key_buffer(start + j),
            lambda j: kvcache.get_value_buffer(start + j),
            store.beta,
        )  # fmt: skip
    store.compacted[layout.slots.to(store.compacted.device)] = True
    store.mark_prefix(layout)

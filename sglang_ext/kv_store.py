"""Per-slot logit biases beside SGLang's KV pool, and writing a compacted prefix into it.

Legend: L layers, S pool rows (slots, row 0 is SGLang's padding slot), H_kv KV heads,
D head dim, t_max physical slots of one compacted prefix, T its logical length.

Layout of one installed prefix with per-(layer, head) counts t_{l,h}: t_max = max t_{l,h}
slots are allocated; in layer l, head h writes its rows into slots [0, t_{l,h}) and the rest
of the slots get K = V = 0 and beta = -inf. The tree node keeps T entries: the t_max slots
then T - t_max copies of `ALIAS_SLOT` (SGLang's padding slot 0), whose beta is -inf in every
layer and head, so aliases hold positions without memory and are masked out.

One `BetaStore` per KV pool is shared by the radix cache (writer, in the scheduler) and the
attention backend (reader, same process); the adapter keeps it beside SGLang's pool
(`sglang_ext.adapter.compacted_node.beta_store_of`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from compactor import CompactedPrefix

__all__ = ["ALIAS_SLOT", "BetaStore", "head_counts", "write_layers"]

ALIAS_SLOT = 0


class BetaStore:
    """beta [L, S, H_kv] fp32 (0 for ordinary slots) and `compacted` [S] bool, on the pool's
    device, and `prefixes` on the host: first physical slot -> (t_max, T) of each written
    compacted prefix.

    Attention adds beta only for requests whose KV row touches a `compacted` slot; every
    other request runs the stock path, bit for bit. A compacted prefix hangs off the radix
    root, so a row touches one iff its first slot is a key of `prefixes`: a look-up of one
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
        self.prefixes: dict[int, tuple[int, int]] = {}
        # forwards whose host marks disagreed with the rows' first slots (checked on CPU)
        self.mark_mismatches = 0
        self.marks_seen = False  # a ForwardBatch was marked (logged once)
        self.alias_ready = False

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

    def mark_prefix(self, slots: torch.Tensor, logical_length: int) -> None:
        """Record that a compacted prefix of logical length T = `logical_length` holds
        `slots` [t_max] (its rows start on `slots[0]`; mutates `prefixes`)."""
        t_max = int(slots.numel())
        if not 1 <= t_max <= logical_length:
            raise ValueError(f"a compacted prefix needs 1 <= t_max={t_max} <= T={logical_length}")
        self.prefixes[int(slots[0])] = (t_max, int(logical_length))

    def prefix_of(self, first_slot: int) -> tuple[int, int] | None:
        """(t_max, T) of the compacted prefix whose rows start on `first_slot`, else None."""
        return self.prefixes.get(first_slot)


def head_counts(prefix: CompactedPrefix) -> torch.Tensor:
    """t_{l,h} as an [L, H_kv] int64 tensor."""
    return torch.tensor([layer.head_lengths() for layer in prefix.layers], dtype=torch.int64)


def write_layers(
    kvcache: Any,
    store: BetaStore,
    prefix: CompactedPrefix,
    slots: torch.Tensor,
    layers: range | None = None,
    check: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None,
) -> None:
    """Write `layers` (default all) of `prefix` into `slots` [t_max] int64 (t_max = the
    longest head of any layer, `head_counts(prefix).max()`) of `kvcache` and
    `store` (mutates both; marks `slots` compacted and records the prefix, `mark_prefix`).

    `check(i, k, v, beta)` sees each layer cast to the pool's dtype and on its device (k, v
    [H_kv, t_max, D], beta [H_kv, t_max]) before it is written; what it raises stops the write there.

    Raises:
        ValueError: a head keeps more entries than `slots`, or the prefix does not fit the
            pool.
    """
    t_max = int(slots.numel())  # each layer's padded() refuses a head longer than that
    if prefix.num_layers != kvcache.layer_num:
        raise ValueError(f"prefix has {prefix.num_layers} layers, pool {kvcache.layer_num}")
    if not store.alias_ready:
        store.enable_alias()
    dev_slots = slots.to(kvcache.get_key_buffer(kvcache.start_layer).device)
    for i in range(prefix.num_layers) if layers is None else layers:
        layer_id = kvcache.start_layer + i
        k_buf = kvcache.get_key_buffer(layer_id)  # [S, H_kv, D]
        v_buf = kvcache.get_value_buffer(layer_id)
        if k_buf.shape[1:] != (prefix.num_kv_heads, prefix.head_dim):
            raise ValueError(
                f"pool layer {layer_id} holds [S, {k_buf.shape[1]}, {k_buf.shape[2]}], prefix "
                f"[N, {prefix.num_kv_heads}, {prefix.head_dim}]"
            )
        k, v, beta = prefix.layers[i].padded(t_max, k_buf.dtype)  # [H_kv, t_max, D], [H_kv, t_max]
        # a result arrives on the host: all three move to the pool's device before `check`
        dev = k_buf.device
        k, v, beta = k.to(dev), v.to(dev, v_buf.dtype), beta.to(dev)
        if check is not None:
            check(i, k, v, beta)
        k_buf[dev_slots] = k.transpose(0, 1)
        v_buf[dev_slots] = v.transpose(0, 1)
        store.beta[i, dev_slots] = beta.t().to(store.beta.device)
    store.compacted[slots.to(store.compacted.device)] = True
    store.mark_prefix(slots, prefix.logical_length)

"""Where a compacted prefix's entries sit in SGLang's KV pool: packed, with no head padding.

Legend: L layers, H_kv KV heads (this pool's), D head dim, S pool slots, N slots of one
compacted prefix, t_{l,h} entries kept by layer l and KV head h, E_l = sum_h t_{l,h} (layer
l's entries), W = max t_{l,h} (the longest head), T logical length.

One SGLang slot holds a K and a V row for every layer and KV head: L x H_kv *cells*. A
compacted prefix takes N = ceil(sum t_{l,h} / (L H_kv)) slots and fills their cells in order:
cell c (0 <= c < N L H_kv) is

    (layer c // (N H_kv), slot slots[(c // H_kv) % N], KV head c % H_kv)

and a layer's entries go in (index, head) order: the first entry of every head, then the
second of every head that keeps two, and so on. So layer l's entries are the cells
[C_l, C_l + E_l), C_l = E_0 + ... + E_{l-1}, which lie in one or a few layers' buffers (a
layer's entries may sit in another layer's buffer); with one budget t for every layer and
head, N = t and entry i of head h sits in slot i, head h of its own layer, as a token's KV. What is
left unused is less than one slot whatever the budgets; padding every head to the longest
one would cost W L H_kv cells. beta lives in the same cells of `BetaStore.beta` [L, S, H_kv].

Attention reads layer l by gathering its entries, ragged head by head (`read_ragged`, for
kernels that take per-head lengths) or padded to [H_kv, W, D] (`read`, a head's unused tail
zero with beta = -inf): padding exists only while attending, never in the pool.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

__all__ = ["LayerCells", "PackedLayout", "slots_needed"]


def slots_needed(counts: torch.Tensor) -> int:
    """N: the slots that hold `counts` [L, H_kv] entries packed (at least 1)."""
    cells = int(counts.shape[0]) * int(counts.shape[1])
    return max(1, -(-int(counts.sum()) // cells))


class LayerCells(NamedTuple):
    """One layer's entries that sit in one layer's buffer: its ragged entries (head by head)
    `rows` [k] are the cells (`buffer_layer`, `slot_ids` [k], `head_ids` [k]). Indices are
    int64 on the slots' device."""

    buffer_layer: int
    rows: torch.Tensor
    slot_ids: torch.Tensor
    head_ids: torch.Tensor


@dataclass(eq=False)
class PackedLayout:
    """A compacted prefix's cells (module docstring): `counts` [L, H_kv] int64 t_{l,h} (host),
    `slots` [N] int64 (the pool's device), `logical_length` T. Compared by identity.

    Raises:
        ValueError: N L H_kv cells cannot hold sum t_{l,h}, a count is negative, a head
            keeps more than T entries, or N > T.
    """

    counts: torch.Tensor
    slots: torch.Tensor
    logical_length: int
    _cells: list[list[LayerCells]] = field(init=False, repr=False)
    _dense: list[torch.Tensor] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.counts = self.counts.detach().cpu().to(torch.int64)
        if self.counts.dim() != 2 or self.slots.dim() != 1 or self.slots.numel() < 1:
            raise ValueError(
                f"a packed layout needs counts [L, H_kv] and slots [N >= 1], got "
                f"{tuple(self.counts.shape)} and {tuple(self.slots.shape)}"
            )
        L, H = self.counts.shape
        if bool((self.counts < 0).any()) or self.width > self.logical_length:
            raise ValueError(
                f"per-head counts must be in [0, T={self.logical_length}], got "
                f"{int(self.counts.min())}..{self.width}"
            )
        if self.num_slots > self.logical_length:  # the row holds the slots, then aliases
            raise ValueError(
                f"a compacted prefix needs N={self.num_slots} <= T={self.logical_length} slots"
            )
        if self.kept_entries > self.num_slots * L * H:
            raise ValueError(
                f"{self.num_slots} slots hold {self.num_slots * L * H} cells, the prefix keeps "
                f"{self.kept_entries} entries ({slots_needed(self.counts)} slots needed)"
            )
        self._cells, self._dense = self._place()

    @classmethod
    def allocate(
        cls,
        counts: torch.Tensor,
        logical_length: int,
        alloc: Callable[[int], torch.Tensor],
        free: Callable[[torch.Tensor], None],
        num_slots: int | None = None,
    ) -> PackedLayout:
        """The layout of `counts` [L, H_kv] in `num_slots` (default `slots_needed`) slots from
        `alloc(n)`, given back through `free` if the layout is refused.

        Raises:
            ValueError: no entry, a head longer than T = `logical_length`, more slots than T
                or too few for the entries (before anything is allocated where it can tell).
            RuntimeError: from `alloc`, when the pool cannot give the slots.
        """
        n = slots_needed(counts) if num_slots is None else num_slots
        width = int(counts.max()) if counts.numel() else 0
        if not (0 < width <= logical_length and 0 < n <= logical_length):
            raise ValueError(
                f"compacted prefix keeps up to {width} entries per head in {n} slots, "
                f"T={logical_length}"
            )  # (W = T saves nothing: an identity fit, for checks)
        slots = alloc(n)
        try:
            return cls(counts, slots, logical_length)
        except ValueError:
            free(slots)
            raise

    @property
    def num_slots(self) -> int:
        """N, the pool slots the prefix holds."""
        return int(self.slots.numel())

    @property
    def width(self) -> int:
        """W, the longest head's entries (what `read` pads every head to)."""
        return int(self.counts.max()) if self.counts.numel() else 0

    @property
    def kept_entries(self) -> int:
        """sum t_{l,h}: the entries the prefix keeps, summed over layers and KV heads."""
        return int(self.counts.sum())

    def cells(self, layer: int) -> list[LayerCells]:
        """Where layer `layer`'s entries sit (0 <= layer < L), one part per buffer."""
        return self._cells[layer]

    def read_ragged(
        self, layer: int, key_buffer: Any, value_buffer: Any, beta: torch.Tensor, dtype: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer `layer`'s entries gathered head by head, as the result held them: (k, v
        [E_l, D] in `dtype`, beta [E_l] fp32; head h's are rows sum_{h'<h} t_{l,h'} onwards).
        `key_buffer(i)` / `value_buffer(i)` give buffer layer i [S, H_kv, D]; `beta` is
        [L, S, H_kv]. Reads only, no host sync."""
        k0 = key_buffer(0)
        e, dim, dev = int(self.counts[layer].sum()), int(k0.shape[2]), k0.device
        k = torch.empty(e, dim, dtype=dtype, device=dev)
        v = torch.empty(e, dim, dtype=dtype, device=dev)
        b = torch.empty(e, dtype=torch.float32, device=beta.device)
        for part in self._cells[layer]:
            src = (part.slot_ids, part.head_ids)
            k[part.rows] = key_buffer(part.buffer_layer)[src].to(dtype)
            v[part.rows] = value_buffer(part.buffer_layer)[src].to(dtype)
            b[part.rows.to(b.device)] = beta[part.buffer_layer][src].float()
        return k, v, b

    def read(
        self, layer: int, key_buffer: Any, value_buffer: Any, beta: torch.Tensor, dtype: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer `layer`'s entries padded per head: (k, v [H_kv, W, D] in `dtype`, beta
        [H_kv, W] fp32, zero K/V and beta -inf past each head's t_{l,h}); arguments as
        `read_ragged`."""
        k_r, v_r, b_r = self.read_ragged(layer, key_buffer, value_buffer, beta, dtype)
        H, W, dim = int(self.counts.shape[1]), self.width, k_r.shape[1]
        pos = self._dense[layer].to(k_r.device)
        k = k_r.new_zeros(H * W, dim).index_copy_(0, pos, k_r)
        v = v_r.new_zeros(H * W, dim).index_copy_(0, pos, v_r)
        b = torch.full((H * W,), float("-inf"), device=b_r.device)
        b.index_copy_(0, pos.to(b.device), b_r)
        return k.view(H, W, dim), v.view(H, W, dim), b.view(H, W)

    def addresses(
        self, key_buffer: Any, value_buffer: Any, beta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The entries as byte addresses, for kernels that read them where they sit, in any
        layer's buffer (arguments as `read_ragged`). Returns (indptr [L * (H_kv + 1)] int64:
        layer l, head h's entries are [indptr[l(H_kv+1)+h], indptr[l(H_kv+1)+h+1]) of the
        prefix's list, layer by layer, each layer head by head as `read_ragged` gives them;
        cells [3, E] int64: the addresses of each entry's K row, V row and fp32 beta), on
        the slots' device. Device arithmetic and one non-blocking upload: no host sync. The
        addresses hold while the buffers do: SGLang allocates its pool once."""
        num_layers, heads = self.counts.shape
        dev = self.slots.device
        layer_start = torch.cumsum(self.counts.sum(1), 0) - self.counts.sum(1)
        indptr = torch.zeros(num_layers, heads + 1, dtype=torch.int64)
        indptr[:, 1:] = torch.cumsum(self.counts, 1)
        indptr += layer_start[:, None]
        cells = torch.zeros(3, self.kept_entries, dtype=torch.int64, device=dev)
        for layer, parts in enumerate(self._cells):
            for part in parts:
                at = int(layer_start[layer]) + part.rows
                buffers = (
                    key_buffer(part.buffer_layer),
                    value_buffer(part.buffer_layer),
                    beta[part.buffer_layer],
                )
                for i, buf in enumerate(buffers):
                    offset = part.slot_ids * buf.stride(0) + part.head_ids * buf.stride(1)
                    cells[i, at] = buf.data_ptr() + offset.to(dev) * buf.element_size()
        flat = indptr.reshape(-1)
        if dev.type == "cuda":  # built in a graph replay's preparation: no blocking copy
            return flat.pin_memory().to(dev, non_blocking=True), cells
        return flat.to(dev), cells

    def write(
        self,
        layer: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        beta_rows: torch.Tensor,
        key_buffer: Any,
        value_buffer: Any,
        beta: torch.Tensor,
    ) -> None:
        """Write layer `layer`'s ragged entries (keys, values [E_l, D] in the pool's dtype and
        on its device, head by head; beta_rows [E_l] fp32) into their cells (mutates the
        buffers and `beta` [L, S, H_kv])."""
        n = int(self.counts[layer].sum())
        if keys.shape[0] != n or values.shape[0] != n or beta_rows.shape[0] != n:
            raise ValueError(
                f"layer {layer} keeps {n} entries, got keys {tuple(keys.shape)}, values "
                f"{tuple(values.shape)}, beta {tuple(beta_rows.shape)}"
            )
        for part in self._cells[layer]:
            src = (part.slot_ids, part.head_ids)
            rows = part.rows.to(keys.device)
            key_buffer(part.buffer_layer)[src] = keys[rows]
            value_buffer(part.buffer_layer)[src] = values[rows]
            beta[part.buffer_layer][src] = beta_rows[rows].to(beta.device)

    def _place(self) -> tuple[list[list[LayerCells]], list[torch.Tensor]]:
        """Every layer's `LayerCells` and the padded position (h * W + i) of each of its
        ragged rows, built once (host arithmetic, one copy to the device)."""
        H, N, W = int(self.counts.shape[1]), self.num_slots, self.width
        dev = self.slots.device
        slots = self.slots.to(torch.int64)
        cells: list[list[LayerCells]] = []
        dense: list[torch.Tensor] = []
        start = 0
        for cnt in self.counts:
            e = int(cnt.sum())
            head = torch.repeat_interleave(torch.arange(H), cnt)  # ragged row -> its head
            index = torch.arange(e) - torch.repeat_interleave(torch.cumsum(cnt, 0) - cnt, cnt)
            rows = torch.argsort(index * H + head)  # ragged rows in cell order
            cell = start + torch.arange(e)
            layer_of = cell // (N * H)
            parts = []
            for buf in torch.unique(layer_of).tolist():
                sel = torch.nonzero(layer_of == buf).flatten()
                c = cell[sel]
                parts.append(LayerCells(
                    int(buf), rows[sel].to(dev), slots[((c // H) % N).to(dev)], (c % H).to(dev)
                ))  # fmt: skip
            cells.append(parts)
            dense.append((head * W + index).to(dev))
            start += e
        return cells, dense

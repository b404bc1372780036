"""Kept-key selections and packing them into a CompactedLayer (no method logic here).

Shape legend: T prefix tokens, t kept (t_max = max over heads), H_kv KV heads, D head dim,
indptr [H_kv+1] int32.

Every tensor built here follows the device of an input.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from compactor.types import CompactedLayer

__all__ = ["Selection", "keep_selected", "pack_layer", "topk_selection"]


class Selection(NamedTuple):
    """Kept token indices per KV head, padded to t_max.

    indices: [H_kv, t_max] int64 (padding entries are 0); mask: [H_kv, t_max] bool
    (True = kept). Valid entries of a row are distinct.
    """

    indices: torch.Tensor
    mask: torch.Tensor

    @classmethod
    def from_lists(
        cls,
        per_head: Sequence[Sequence[int] | torch.Tensor],
        device: torch.device | str | None = None,
    ) -> Selection:
        """Build from one index list per KV head (ragged).

        device: where the Selection lives (default: that of the first tensor row, else CPU).
        """
        if device is None:
            device = next((x.device for x in per_head if isinstance(x, torch.Tensor)), "cpu")
        t_max = max((len(x) for x in per_head), default=0)
        idx = torch.zeros(len(per_head), t_max, dtype=torch.int64, device=device)
        mask = torch.zeros(len(per_head), t_max, dtype=torch.bool, device=device)
        for h, x in enumerate(per_head):
            row = torch.as_tensor(x, dtype=torch.int64, device=device).reshape(-1)
            idx[h, : row.numel()] = row
            mask[h, : row.numel()] = True
        return cls(idx, mask)

    @classmethod
    def from_mask(cls, selected: torch.Tensor) -> Selection:
        """[H_kv, T] bool (True = kept) -> Selection with ascending indices, on its device.

        One host sync (t_max), whatever H_kv.
        """
        counts = selected.sum(-1)
        t_max = int(counts.max()) if counts.numel() else 0
        order = torch.sort(selected.to(torch.int8), dim=-1, descending=True, stable=True).indices
        idx = order[:, :t_max]
        mask = torch.arange(t_max, device=selected.device).unsqueeze(0) < counts.unsqueeze(1)
        return cls(torch.where(mask, idx, idx.new_zeros(())), mask)

    def budgets(self) -> list[int]:
        """t_h per head."""
        return self.mask.sum(-1).tolist()

    def per_head(self) -> list[torch.Tensor]:
        """Ragged list of [t_h] int64 index tensors."""
        return [self.indices[h][self.mask[h]] for h in range(self.indices.shape[0])]


def topk_selection(scores: torch.Tensor, budgets: Sequence[int]) -> Selection:
    """Keep the budgets[h] highest scores [H, T] of each head; indices ascending."""
    t_max = max(budgets)
    top = scores.topk(t_max, dim=-1).indices
    dev = scores.device
    bud = torch.as_tensor(list(budgets), device=dev)
    mask = torch.arange(t_max, device=dev).unsqueeze(0) < bud.unsqueeze(1)
    big = torch.iinfo(torch.int64).max
    idx = torch.where(mask, top, torch.full_like(top, big)).sort(-1).values
    return Selection(torch.where(mask, idx, idx.new_zeros(())), mask)


def pack_layer(
    keys: torch.Tensor,
    values: torch.Tensor,
    beta: torch.Tensor,
    sel: Selection,
    dtype: torch.dtype,
) -> CompactedLayer:
    """Ragged-pack padded per-head results into a CompactedLayer.

    Args:
        keys, values: [H_kv, t_max, D] (any float dtype; cast to ``dtype``).
        beta: [H_kv, t_max] (cast to fp32).
        sel: the Selection whose mask marks valid rows; indices become kept_indices.
    """
    m = sel.mask
    counts = m.sum(-1)
    indptr = torch.zeros(m.shape[0] + 1, dtype=torch.int32, device=m.device)
    indptr[1:] = torch.cumsum(counts, 0).to(torch.int32)
    return CompactedLayer(
        keys=keys[m].to(dtype).contiguous(),
        values=values[m].to(dtype).contiguous(),
        beta=beta[m].to(torch.float32).contiguous(),
        indptr=indptr,
        kept_indices=sel.indices[m].to(torch.int64).contiguous(),
    )


def keep_selected(keys: torch.Tensor, values: torch.Tensor, sel: Selection) -> CompactedLayer:
    """The selected keys and values of keys/values [H_kv, T, D] as they are, beta 0."""
    g = sel.indices.unsqueeze(-1).expand(-1, -1, keys.shape[-1])
    ck, cv = torch.gather(keys, 1, g), torch.gather(values, 1, g)
    beta = torch.zeros(sel.indices.shape, device=keys.device)
    return pack_layer(ck, cv, beta, sel, keys.dtype)

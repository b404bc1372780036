"""Packed compacted prefixes (`sglang_ext.packing`): N = ceil(sum t / (L H_kv)) slots, every
entry in its own cell, read back per layer exactly, whatever the per-(layer, head) budgets."""

from __future__ import annotations

import pytest
import torch

from sglang_ext.packing import PackedLayout, slots_needed

L, H, D, S = 4, 3, 8, 64


def _pool(seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(S, H, D, generator=g) for _ in range(L)]
    values = [torch.randn(S, H, D, generator=g) for _ in range(L)]
    return keys, values, torch.zeros(L, S, H)


def _entries(counts: torch.Tensor, seed: int = 1) -> list[tuple[torch.Tensor, ...]]:
    """Per layer ragged keys, values [E_l, D] and beta [E_l], head by head."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for e in counts.sum(1).tolist():
        out.append((torch.randn(e, D, generator=g), torch.randn(e, D, generator=g),
                    torch.randn(e, generator=g)))  # fmt: skip
    return out


def _write_all(layout: PackedLayout, entries, keys, values, beta) -> None:  # type: ignore[no-untyped-def]
    for i, (k, v, b) in enumerate(entries):
        layout.write(i, k, v, b, keys.__getitem__, values.__getitem__, beta)


@pytest.mark.parametrize(
    "counts",
    [
        [[5, 5, 5], [5, 5, 5], [5, 5, 5], [5, 5, 5]],  # uniform: N = t, no cell left over
        [[1, 9, 0], [3, 3, 3], [12, 2, 1], [0, 0, 7]],  # per head and per layer, a head of 0
        [[20, 0, 0], [1, 0, 0], [0, 0, 0], [0, 0, 1]],  # one layer's entries span 2 buffers
    ],
)
def test_every_entry_reads_back_from_its_own_cell(counts: list[list[int]]) -> None:
    c = torch.tensor(counts)
    n = slots_needed(c)
    assert n == -(-int(c.sum()) // (L * H))
    slots = torch.randperm(S - 1)[:n] + 1
    layout = PackedLayout(c, slots, logical_length=40)
    keys, values, beta = _pool()
    before = [k.clone() for k in keys]
    entries = _entries(c)
    _write_all(layout, entries, keys, values, beta)
    W = int(c.max())
    for i, (k, v, b) in enumerate(entries):
        rk, rv, rb = layout.read_ragged(
            i, keys.__getitem__, values.__getitem__, beta, torch.float32
        )
        assert torch.equal(rk, k) and torch.equal(rv, v) and torch.equal(rb, b)
        gk, gv, gb = layout.read(i, keys.__getitem__, values.__getitem__, beta, torch.float32)
        assert gk.shape == (H, W, D) and gb.shape == (H, W)
        lo = 0
        for h, t in enumerate(counts[i]):
            assert torch.equal(gk[h, :t], k[lo : lo + t]) and torch.equal(gv[h, :t], v[lo : lo + t])
            assert torch.equal(gb[h, :t], b[lo : lo + t])
            assert (gb[h, t:] == float("-inf")).all() and (gk[h, t:] == 0).all()
            lo += t
    # only the layout's slots were written, and no two entries share a cell
    other = torch.ones(S, dtype=torch.bool)
    other[slots] = False
    for i in range(L):
        assert torch.equal(keys[i][other], before[i][other])
    cells = {
        (p.buffer_layer, s, h)
        for i in range(L)
        for p in layout.cells(i)
        for s, h in zip(p.slot_ids.tolist(), p.head_ids.tolist())
    }
    assert len(cells) == int(c.sum()) and {s for _, s, _ in cells} <= set(slots.tolist())


def test_packing_holds_the_budgets_where_padding_heads_would_not() -> None:
    """gvote-like budgets: the longest head is 8x the mean. Packed, the prefix takes
    ceil(sum / (L H)) slots; padded to the longest head it took max t."""
    c = torch.tensor([[2, 2, 16], [2, 2, 2], [2, 2, 2], [2, 2, 2]])
    layout = PackedLayout(c, torch.arange(1, 1 + slots_needed(c)), logical_length=64)
    assert layout.num_slots == 4 and layout.width == 16 and layout.kept_entries == 38
    assert layout.num_slots * L * H < layout.kept_entries + L * H  # less than one slot unused


def test_bad_layouts_are_refused_before_anything_is_allocated() -> None:
    c = torch.tensor([[4, 4, 4]] * L)
    taken: list[int] = []

    def alloc(n: int) -> torch.Tensor:
        taken.append(n)
        return torch.arange(1, 1 + n)

    with pytest.raises(ValueError, match="entries per head"):
        PackedLayout.allocate(c, 3, alloc, lambda s: None)  # a head longer than T
    with pytest.raises(ValueError, match="entries per head"):
        PackedLayout.allocate(torch.zeros(L, H, dtype=torch.int64), 8, alloc, lambda s: None)
    assert taken == []
    freed: list[torch.Tensor] = []
    with pytest.raises(ValueError, match="cells"):
        PackedLayout.allocate(c * 2, 16, alloc, freed.append, num_slots=1)  # too few slots
    assert taken == [1] and len(freed) == 1  # given back
    layout = PackedLayout.allocate(c, 16, alloc, freed.append, num_slots=6)  # TP: more is fine
    assert layout.num_slots == 6 and layout.kept_entries == 48


def test_a_write_of_the_wrong_size_is_refused() -> None:
    c = torch.tensor([[2, 1, 0]] * L)
    layout = PackedLayout(c, torch.tensor([5]), logical_length=8)
    keys, values, beta = _pool()
    with pytest.raises(ValueError, match="layer 1 keeps 3 entries"):
        layout.write(1, torch.zeros(4, D), torch.zeros(4, D), torch.zeros(4),
                     keys.__getitem__, values.__getitem__, beta)  # fmt: skip

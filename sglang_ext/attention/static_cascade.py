"""Decode over compacted prefixes in shapes fixed by the batch size: what a CUDA graph captures.

Legend: bs the batch size of one graph (B <= bs real requests, the rest padding), H_q / H_kv
heads (G = H_q // H_kv), D head dim, L layers, S pool slots, W the `req_to_token` width, P
node groups (the requests sharing one compacted prefix; at most `max_groups`).

The eager cascade (`sglang_ext.attention.cascade`) plans each batch on the host from device
tables (host syncs) and launches ~18 kernels a layer whose grids follow the batch. Here every
buffer is allocated once, at capture, and each layer is three launches whose grids depend on
bs alone:

    prefix   one kernel request per node group with all of the group's tokens as queries:
             the compacted prefix is read once per group, where its entries sit in the pool
             (through the layout's address table, `PackedLayout.addresses`, built once per
             installed layout); padding tiles store nothing;
    tails    each request over its own slots [T_b, n_b) (a plain request: its whole row),
             gathered once per step from `req_to_token` (`gather_tails`, inside the graph
             and before SGLang's read-done marker);
    combine  the partials merged by LSE; a token without a group has no prefix partial.

What changes between batches is written into device tables, never into a launch:
`prepare` (out of the graph, on the host) fills one pinned host buffer and copies it with
one non-blocking copy; it reads nothing from the device, so a step makes no device-to-host
synchronisation. The tails' lengths come from SGLang's own `seq_lens` buffer, inside the
graph.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from compaction_kernels.biased_attention.static import (
    KernelRequests,
    StaticAttention,
    gather_slots,
)
from sglang_ext.packing import PackedLayout

__all__ = ["PrefixTables", "StaticCascade"]

Prefixes = Sequence[PackedLayout | None]
# (what, tensors by name, scalars by name): one record per launch or in-graph op (`trace`)
Record = tuple[str, dict[str, torch.Tensor], dict[str, Any]]


class PrefixTables:
    """Each compacted prefix's address table (`PackedLayout.addresses` over the pool's
    buffers), built at its first use and kept while its layout lives (weakly keyed: a freed
    layout's table goes with it). `key_buffer(i)`, `value_buffer(i)` give buffer layer i
    [S, H_kv, D]; `beta` is [L, S, H_kv] fp32."""

    def __init__(self, key_buffer: Callable[[int], Any], value_buffer: Callable[[int], Any],
                 beta: torch.Tensor):  # fmt: skip
        self._buffers = (key_buffer, value_buffer, beta)
        self._tables: weakref.WeakKeyDictionary[PackedLayout, tuple[torch.Tensor, ...]] = (
            weakref.WeakKeyDictionary()
        )
        self.built = 0  # tables built: one per layout, however many steps read it

    def get(self, layout: PackedLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """(indptr [L * (H_kv + 1)], cells [3, E]) int64 of `layout`, on the pool's device."""
        table = self._tables.get(layout)
        if table is None:
            table = self._tables[layout] = layout.addresses(*self._buffers)
            self.built += 1
        return table[0], table[1]


class StaticCascade:
    """The fixed buffers of compacted decode steps up to `max_bs` requests, and the step.

    Args:
        shape: the launch shape (heads, head dim, tiles, splits).
        num_layers: L, the layers a layout must have.
        max_bs, max_groups: the largest batch and the most node groups one step serves.
        width: W, `req_to_token`'s row width (a tail is at most W slots).
        tables: the prefixes' address tables.
        device: where the buffers live (`meta` for the no-sync check).
    """

    def __init__(self, shape: StaticAttention, *, num_layers: int, max_bs: int,
                 max_groups: int, width: int, tables: PrefixTables,
                 device: torch.device | str):  # fmt: skip
        if min(num_layers, max_bs, max_groups, width) < 1:
            raise ValueError(
                f"num_layers, max_bs, max_groups, width must be >= 1, got {num_layers}, "
                f"{max_bs}, {max_groups}, {width}"
            )
        self.shape, self.tables = shape, tables
        self.num_layers, self.max_bs, self.max_groups = num_layers, max_bs, max_groups
        self.device = torch.device(device)
        self.trace: list[Record] | None = None  # set to a list to record every launch
        tiles = shape.prefix_tiles(max_bs, max_groups)
        # the plan: one int64 table, filled by `prepare` in one copy; views by name
        sizes = {"req_t": max_bs, "tok_group": max_bs, "group_qo": max_groups + 1,
                 "prefix_tok": max_bs, "seg_a": max_groups, "seg_b": max_groups,
                 "seg_c": max_groups, "tile_req": tiles, "tile_start": tiles}  # fmt: skip
        self.plan = torch.zeros(sum(sizes.values()), dtype=torch.int64, device=self.device)
        self._views, at = {}, 0
        for name, n in sizes.items():
            self._views[name] = (at, n)
            at += n
        dev, i64, f32 = self.device, torch.int64, torch.float32
        self.tail_indptr = torch.zeros(max_bs + 1, dtype=i64, device=dev)
        self.tail_indices = torch.zeros(max_bs * width, dtype=torch.int32, device=dev)
        self._arange = torch.arange(max_bs + 1, dtype=i64, device=dev)
        self._zeros = torch.zeros(max_bs, dtype=i64, device=dev)
        parts = (shape.splits, max_bs, shape.num_qo_heads)
        self.o_part = torch.empty(*parts, shape.head_dim, dtype=f32, device=dev)
        self.l_part = torch.empty(*parts, dtype=f32, device=dev)
        self.lse = torch.empty(max_bs, shape.num_qo_heads, dtype=f32, device=dev)
        self._live: list[tuple[torch.Tensor, torch.Tensor]] = []  # the tables this step reads

    def nbytes(self) -> int:
        """Bytes of the buffers allocated here (logged at capture)."""
        bufs = (self.plan, self.tail_indptr, self.tail_indices, self._arange, self._zeros,
                self.o_part, self.l_part, self.lse)  # fmt: skip
        return sum(b.numel() * b.element_size() for b in bufs)

    def view(self, name: str, n: int | None = None) -> torch.Tensor:
        """The plan's table `name` (its first `n` entries)."""
        at, size = self._views[name]
        return self.plan[at : at + (size if n is None else n)]

    # ---- out of the graph: the host ---------------------------------------------------
    def refusal(self, prefixes: Prefixes) -> str | None:
        """Why a batch with these prefixes cannot be served here (None: it can): `batch_size`
        over max_bs, `groups` over max_groups, `layout` not [L, H_kv]."""
        if len(prefixes) > self.max_bs:
            return "batch_size"
        layouts = {id(p): p for p in prefixes if p is not None}
        if len(layouts) > self.max_groups:
            return "groups"
        want = (self.num_layers, self.shape.num_kv_heads)
        if any(tuple(p.counts.shape) != want for p in layouts.values()):
            return "layout"
        return None

    def prepare(self, bs: int, prefixes: Prefixes) -> None:
        """Write the plan of a batch of bs slots whose first B = len(prefixes) requests sit
        on these prefixes (None: plain; padding slots are plain): host work and one
        non-blocking host-to-device copy. ValueError: a batch `refusal` names."""
        why = self.refusal(prefixes)
        if why is not None or not len(prefixes) <= bs <= self.max_bs:
            raise ValueError(
                f"a static decode step of bs={bs} cannot serve {len(prefixes)} requests "
                f"({why or 'B <= bs <= max_bs'}; max_bs={self.max_bs}, "
                f"max_groups={self.max_groups})"
            )
        host = {name: [0] * size for name, (_, size) in self._views.items()}
        host["tok_group"] = [-1] * self.max_bs
        host["tile_req"] = [-1] * self._views["tile_req"][1]
        order: dict[int, int] = {}
        members: list[list[int]] = []
        live: list[tuple[torch.Tensor, torch.Tensor]] = []
        for b, p in enumerate(prefixes):
            if p is None:
                continue
            g = order.setdefault(id(p), len(order))
            if g == len(members):
                members.append([])
                indptr, cells = self.tables.get(p)
                host["seg_a"][g], host["seg_b"][g] = indptr.data_ptr(), cells.data_ptr()
                host["seg_c"][g] = cells.shape[1]
                live.append((indptr, cells))
            members[g].append(b)
            host["req_t"][b], host["tok_group"][b] = p.logical_length, g
        tile, tok, block = 0, 0, self.shape.block_m
        for g, group in enumerate(members):
            host["group_qo"][g] = tok
            host["prefix_tok"][tok : tok + len(group)] = group
            tok += len(group)
            for start in range(0, len(group) * self.shape.group, block):
                host["tile_req"][tile], host["tile_start"][tile] = g, start
                tile += 1
        host["group_qo"][len(members) :] = [tok] * (self.max_groups + 1 - len(members))
        flat = torch.tensor([v for name in self._views for v in host[name]], dtype=torch.int64)
        if self.device.type == "cuda":
            flat = flat.pin_memory()  # the host allocator keeps it until the copy ran
        self.plan.copy_(flat, non_blocking=True)
        self._live = live

    # ---- inside the graph -------------------------------------------------------------
    def gather_tails(self, bs: int, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     seq_lens: torch.Tensor) -> None:  # fmt: skip
        """Gather each of the bs requests' tail slots (row `req_pool_indices[b]`, entries
        [T_b, seq_lens[b])) into the tail tables: the step's only read of `req_to_token`.
        Static shapes, no host sync. Mutates the tail tables."""
        req_t = self.view("req_t", bs)
        lens = seq_lens[:bs].to(torch.int64) - req_t
        torch.cumsum(lens, 0, out=self.tail_indptr[1 : bs + 1])
        indptr = self.tail_indptr[: bs + 1]
        self._record("gather_tails", dict(req_to_token=req_to_token, rows=req_pool_indices,
                                          seq_lens=seq_lens, req_t=req_t, indptr=indptr,
                                          out=self.tail_indices), bs=bs)  # fmt: skip
        gather_slots(req_to_token, req_pool_indices[:bs], req_t, indptr, self.tail_indices)

    def attend(self, bs: int, layer: int, q: torch.Tensor, kv: tuple[torch.Tensor, ...],
               sm_scale: float | None) -> torch.Tensor:  # fmt: skip
        """q [bs, H_q, D] over pool layer `layer` (k, v [S, H_kv, D], beta [S, H_kv] fp32)
        and the groups' compacted prefixes: out [bs, H_q, D] in q's dtype. Mutates the
        partial buffers only."""
        if q.dim() != 3 or q.shape[0] != bs:
            raise ValueError(f"q must be [bs={bs}, H_q, D], got {tuple(q.shape)}")
        k, v, beta = kv
        parts = (self.o_part, self.l_part)
        tiles = self.shape.prefix_tiles(bs, self.max_groups)
        prefix = KernelRequests(
            self.view("tile_req", tiles), self.view("tile_start", tiles), self.view("group_qo"),
            self.view("prefix_tok"), self.view("seg_a"), self.view("seg_b"), self.view("seg_c"),
        )  # fmt: skip
        tails = KernelRequests(
            self._arange[:bs], self._zeros[:bs], self._arange, self._arange,
            self.tail_indptr[: bs + 1], self.tail_indices, self.tail_indptr,
        )  # fmt: skip
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        scalars = dict(bs=bs, layer=layer, sm_scale=sm_scale)
        for name, requests in (("prefix", prefix), ("tails", tails)):
            self._record(name, dict(q=q, k=k, v=v, beta=beta, **requests._asdict(),
                                    o_part=self.o_part, l_part=self.l_part), **scalars)  # fmt: skip
            self.shape.attend(q, (k, v, beta), requests, parts, layer=layer,
                              sm_scale=sm_scale, addressed=name == "prefix")  # fmt: skip
        tok_group = self.view("tok_group", bs)
        self._record("combine", dict(o_part=self.o_part, l_part=self.l_part, lse=self.lse,
                                     tok_group=tok_group), **scalars)  # fmt: skip
        self.shape.combine(parts, out, self.lse[:bs], tok_group)
        return out

    def _record(self, what: str, tensors: dict[str, torch.Tensor], **scalars: Any) -> None:
        if self.trace is not None:
            self.trace.append((what, tensors, scalars))

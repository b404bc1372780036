"""Decode batches over real CPU pools with two compacted prefixes installed packed (A: its
layer 0 spills into layer 1's buffer; B: another shape), for the static cascade's tests:
the pool, the rows, the eager cascade and the dense reference a decode step must match."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from compaction_kernels.biased_attention.static import StaticAttention
from sglang_ext.adapter.compacted_node import beta_store_of
from sglang_ext.attention.cascade import plan_cascade, run_cascade, stack_groups
from sglang_ext.attention.sdpa import biased_sdpa
from sglang_ext.attention.static_cascade import PrefixTables, StaticCascade
from sglang_ext.kv_store import ALIAS_SLOT
from sglang_ext.packing import PackedLayout
from tests.sglang_ext._attention import H_KV, LAYERS, D, real_runner

G, SCALE = 2, 0.3
H_Q = H_KV * G
# name: (counts [L, H_kv], slots, T); A packs 12 entries into 3 slots (4 cells each), so
# layer 0's last entry sits in layer 1's buffer; B packs 8 into 2
PREFIXES = {"A": ([[6, 1], [2, 3]], [50, 51, 52], 13), "B": ([[2, 2], [1, 3]], [54, 55], 9)}


def pool_with_prefixes(seed: int = 0) -> tuple[Any, dict[str, PackedLayout]]:
    """A real runner's pools with A and B written into their cells (random entries)."""
    torch.manual_seed(seed)
    runner = real_runner()
    pool = runner.token_to_kv_pool
    store = beta_store_of(pool)
    store.enable_alias()
    layouts = {}
    for name, (counts, slots, t_log) in PREFIXES.items():
        layout = PackedLayout(torch.tensor(counts), torch.tensor(slots), t_log)
        for i in range(LAYERS):
            e = int(layout.counts[i].sum())
            layout.write(i, torch.randn(e, D), torch.randn(e, D), torch.randn(e),
                         pool.get_key_buffer, pool.get_value_buffer, store.beta)  # fmt: skip
        store.compacted[layout.slots] = True
        store.mark_prefix(layout)
        layouts[name] = layout
    return runner, layouts


def write_rows(runner: Any, layouts: dict[str, PackedLayout],
               requests: list[tuple[str | None, list[int]]]) -> list[list[int]]:  # fmt: skip
    """Request b (table row b + 1): its prefix's slots and aliases (None: none), then its
    own slots. Mutates the req_to_token table; returns the rows."""
    rows = []
    for b, (name, own) in enumerate(requests):
        row = list(own)
        if name is not None:
            lay = layouts[name]
            head = lay.slots.tolist() + [ALIAS_SLOT] * (lay.logical_length - lay.num_slots)
            row = head + row
        runner.req_to_token_pool.req_to_token[b + 1, : len(row)] = torch.tensor(row)
        rows.append(row)
    return rows


def kv(runner: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    pool = runner.token_to_kv_pool
    beta = beta_store_of(pool).beta[layer]
    return pool.get_key_buffer(layer), pool.get_value_buffer(layer), beta


def dense_reference(runner: Any, layer: int, q: torch.Tensor, rows: list[list[int]],
                    prefixes: list[PackedLayout | None]) -> torch.Tensor:  # fmt: skip
    """Each decode token over its prefix's entries (padded per head, `PackedLayout.read`)
    and its row's slots past T: `biased_sdpa` in fp32. q [B, H_q, D]."""
    pool, store = runner.token_to_kv_pool, beta_store_of(runner.token_to_kv_pool)
    out = torch.empty_like(q)
    for b, (row, lay) in enumerate(zip(rows, prefixes)):
        slots = torch.tensor(row[lay.logical_length :] if lay is not None else row)
        k, v, beta = (x[slots] for x in kv(runner, layer))
        k, v = k.movedim(0, 1), v.movedim(0, 1)  # [H_kv, n, D]
        if lay is not None:
            pk, pv, pb = lay.read(layer, pool.get_key_buffer, pool.get_value_buffer,
                                  store.beta, k.dtype)  # fmt: skip
            k, v, beta = torch.cat([pk, k], 1), torch.cat([pv, v], 1), torch.cat([pb.t(), beta])
        out[b] = biased_sdpa(q[b : b + 1].movedim(0, 1), k, v, beta, k.shape[1] - 1,
                             SCALE).movedim(0, 1)[0]  # fmt: skip
    return out


def eager_cascade(runner: Any, layer: int, q: torch.Tensor, rows: list[list[int]],
                  prefixes: list[PackedLayout | None]) -> torch.Tensor:  # fmt: skip
    """Today's eager path (`plan_cascade` + `run_cascade`) on the same decode batch."""
    pool, store = runner.token_to_kv_pool, beta_store_of(runner.token_to_kv_pool)
    plan = plan_cascade(
        runner.req_to_token_pool.req_to_token, list(range(1, len(rows) + 1)),
        [len(r) for r in rows], [1] * len(rows), prefixes, num_qo_heads=H_Q,
        num_kv_heads=H_KV, head_dim=D, sm_scale=SCALE,
    )  # fmt: skip
    bufs = (pool.get_key_buffer, pool.get_value_buffer, store.beta)
    ragged = [p.read_ragged(layer, *bufs, q.dtype) for p in plan.layouts]
    prefix_kv = stack_groups(ragged) if ragged else None
    return run_cascade(plan, q, *kv(runner, layer), layer, prefix_kv)


SHAPE = StaticAttention(H_Q, H_KV, D, prefix_splits=2, tail_splits=2)  # CPU-sized tiles


def static_cascade(runner: Any, max_bs: int, max_groups: int = 2) -> StaticCascade:
    """A static cascade over the runner's pools."""
    pool = runner.token_to_kv_pool
    tables = PrefixTables(pool.get_key_buffer, pool.get_value_buffer,
                          beta_store_of(pool).beta)  # fmt: skip
    r2t = runner.req_to_token_pool.req_to_token
    return StaticCascade(SHAPE, num_layers=LAYERS, max_bs=max_bs, max_groups=max_groups,
                         width=r2t.shape[1], tables=tables, device=r2t.device)  # fmt: skip


def step(cascade: StaticCascade, runner: Any, bs: int, rows: list[list[int]],
         prefixes: list[PackedLayout | None], q: torch.Tensor) -> list[torch.Tensor]:  # fmt: skip
    """One static decode step of a batch padded to bs (padding: row 0, one slot, as SGLang's
    graph buffers hold it): prepare, gather the tails, attend every layer. Returns each
    layer's output for the B real tokens."""
    cascade.prepare(bs, prefixes)
    pad = bs - len(rows)
    pool_rows = torch.tensor(list(range(1, len(rows) + 1)) + [0] * pad)
    seq_lens = torch.tensor([len(r) for r in rows] + [1] * pad)
    cascade.gather_tails(bs, runner.req_to_token_pool.req_to_token, pool_rows, seq_lens)
    q_pad = torch.cat([q, torch.zeros(pad, *q.shape[1:])])
    return [cascade.attend(bs, i, q_pad, kv(runner, i), SCALE)[: len(rows)]
            for i in range(LAYERS)]  # fmt: skip


def queries(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, H_Q, D, generator=torch.Generator().manual_seed(seed))


# ops that read a tensor's data on the host: each is a device-to-host synchronisation when
# the tensor lives on a GPU
HOST_READS = ("aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.is_nonzero",
              "aten.equal", "aten.allclose")  # fmt: skip


class OpTrace(TorchDispatchMode):
    """Every aten op run under it: (name, the shapes of its tensor arguments), and the ops
    that read data on the host with the devices their tensors live on."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[tuple[int, ...], ...]]] = []
        self.reads: list[tuple[str, frozenset[str]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        flat = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        name = str(func.overloadpacket)
        self.ops.append((name, tuple(tuple(a.shape) for a in flat)))
        if name in HOST_READS:
            self.reads.append((name, frozenset(a.device.type for a in flat)))
        return func(*args, **(kwargs or {}))

    def host_reads(self, device_only: bool = False) -> list[str]:
        """The host reads (`device_only`: of tensors that are not on the CPU)."""
        return [n for n, devs in self.reads if not device_only or devs - {"cpu"}]

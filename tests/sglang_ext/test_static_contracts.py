"""What lets SGLang capture the static decode cascade in a CUDA graph and replay it without a
host sync: the in-graph part runs the same ops on the same buffers for any batch of one
size, and the replay preparation reads nothing from the device (run on `meta` tensors, where
any device-to-host read raises). Today's eager plan is the before."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sglang_ext.attention.cascade import plan_cascade
from sglang_ext.attention.static_cascade import PrefixTables, StaticCascade
from sglang_ext.packing import PackedLayout
from tests.sglang_ext._static import (
    H_KV,
    LAYERS,
    PREFIXES,
    SHAPE,
    D,
    OpTrace,
    kv,
    pool_with_prefixes,
    queries,
    static_cascade,
    write_rows,
)

BS = 4
BATCHES = [  # two different batches of the same size: prefixes, groups, lengths all differ
    [("A", [70, 71]), ("A", [72]), (None, [10, 11]), ("B", [73])],
    [("B", [80, 81, 82, 83]), (None, [20]), (None, [21, 22, 23, 24, 25])],
]


def in_graph_part(cascade: Any, runner: Any, rows: torch.Tensor, seq_lens: torch.Tensor,
                  q: torch.Tensor) -> tuple[OpTrace, list[Any]]:  # fmt: skip
    """The part of a step a graph captures (gather the tails, attend every layer), traced:
    the aten ops and the kernel launches with their tensors' addresses and shapes."""
    cascade.trace = []
    with OpTrace() as ops:
        cascade.gather_tails(BS, runner.req_to_token_pool.req_to_token, rows, seq_lens)
        for layer in range(LAYERS):
            cascade.attend(BS, layer, q, kv(runner, layer), 0.3)
    launches = [
        (what, {n: (t.data_ptr(), tuple(t.shape), t.dtype) for n, t in tensors.items()}, scalars)
        for what, tensors, scalars in cascade.trace
    ]
    cascade.trace = None
    return ops, launches


def test_two_batches_of_one_size_run_the_same_ops_on_the_same_buffers() -> None:
    runner, lay = pool_with_prefixes()
    cascade = static_cascade(runner, max_bs=8)
    # SGLang's graph buffers: one rows / seq_lens / q tensor per graph, refilled each replay
    rows, seq_lens = torch.zeros(8, dtype=torch.int64), torch.ones(8, dtype=torch.int64)
    q = torch.zeros(BS, 2 * H_KV, D)
    traces = []
    for i, requests in enumerate(BATCHES):
        table = write_rows(runner, lay, requests)
        cascade.prepare(BS, [None if n is None else lay[n] for n, _ in requests])
        rows[: len(table)] = torch.arange(1, len(table) + 1)
        seq_lens[: len(table)] = torch.tensor([len(r) for r in table])
        q.copy_(
            torch.cat([queries(len(table), seed=i), torch.zeros(BS - len(table), *q.shape[1:])])
        )
        traces.append(in_graph_part(cascade, runner, rows[:BS], seq_lens[:BS], q))
    (ops_a, launches_a), (ops_b, launches_b) = traces
    assert ops_a.ops == ops_b.ops and ops_a.ops  # same aten ops, same shapes
    assert ops_a.host_reads() == ops_b.host_reads() == []
    assert launches_a == launches_b  # same launches, scalars, buffers (address and shape)
    assert len(launches_a) == 1 + 3 * LAYERS  # the tails' gather, then 3 launches a layer


def meta_prefixes() -> dict[str, PackedLayout]:
    return {
        name: PackedLayout(torch.tensor(c), torch.tensor(slots, device="meta"), t)
        for name, (c, slots, t) in PREFIXES.items()
    }


def test_replay_preparation_reads_nothing_from_the_device() -> None:
    slots, width = 97, 128
    bufs = [tuple(torch.empty(slots, H_KV, D, device="meta") for _ in "kv") for _ in range(LAYERS)]
    beta = torch.empty(LAYERS, slots, H_KV, device="meta")
    tables = PrefixTables(lambda i: bufs[i][0], lambda i: bufs[i][1], beta)
    cascade = StaticCascade(SHAPE, num_layers=LAYERS, max_bs=BS, max_groups=2, width=width,
                            tables=tables, device="meta")  # fmt: skip
    lay = meta_prefixes()
    for round_ in range(2):  # the first round also builds each layout's address table
        for requests in BATCHES:
            prefixes = [None if n is None else lay[n] for n, _ in requests]
            with OpTrace() as ops:
                cascade.prepare(BS, prefixes)  # raises on any read of a device tensor's data
            assert ops.host_reads(device_only=True) == []
            copies = [shapes for name, shapes in ops.ops if name == "aten.copy_"]
            if round_:  # a step: one upload of the plan, nothing else
                assert copies == [((cascade.plan.numel(),), (cascade.plan.numel(),))]
    assert cascade.tables.built == 2


def test_todays_eager_plan_reads_the_device_before() -> None:
    """The before: `plan_cascade` reads device data on the host (on a GPU each read is a
    blocking transfer), and on `meta` tables it cannot run at all."""
    runner, lay = pool_with_prefixes()
    requests = BATCHES[0]
    table = write_rows(runner, lay, requests)
    prefixes = [None if n is None else lay[n] for n, _ in requests]
    args = ([1, 2, 3, 4], [len(r) for r in table], [1] * 4, prefixes)
    heads = dict(num_qo_heads=2 * H_KV, num_kv_heads=H_KV, head_dim=D, sm_scale=0.3)
    r2t = runner.req_to_token_pool.req_to_token
    with OpTrace() as ops:
        plan_cascade(r2t, *args, **heads)
    assert len(ops.host_reads()) >= 10, ops.host_reads()
    with pytest.raises((NotImplementedError, RuntimeError)):
        plan_cascade(r2t.to("meta"), *args, **heads)

"""GraphDecodePlan: fixed buffers refilled on the device, no host sync, aliases never read,
results equal to `biased_sdpa` over the whole rows (aliases at beta -inf). CPU under
TRITON_INTERPRET=1; the `gpu` tests also capture and replay a real CUDA graph."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels.biased_attention.reference import compacted_slot_table
from sglang_ext.graph_decode import GraphDecodePlan
from sglang_ext.kv_store import ALIAS_SLOT
from sglang_ext.sdpa import biased_sdpa

S, H_KV, G, D, R, W = 80, 2, 2, 16, 5, 40
H_Q = H_KV * G
SCALE = 0.3
MAX_BS, MAX_CONTEXT = 4, 40
# Two batches: per request (physical slots p, alias columns, own tokens) and its table row.
BATCH_A = ([(6, 5, 4), (0, 0, 9), (3, 10, 2)], [3, 0, 4])
BATCH_B = ([(0, 0, 20), (5, 8, 7)], [1, 2])
aten = torch.ops.aten


def make_pool(seed: int = 0) -> SimpleNamespace:
    """k, v [S, H_kv, D], beta [S, H_kv] (random, -inf on the alias slot), junk r2t [R, W]."""
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(S, H_KV, D, generator=g), torch.randn(S, H_KV, D, generator=g)
    beta = torch.randn(S, H_KV, generator=g)
    beta[ALIAS_SLOT] = float("-inf")
    beta[torch.arange(1, S, 7), 1] = float("-inf")  # some entries one head dropped
    r2t = torch.randint(1, S, (R, W), generator=g, dtype=torch.int32)
    return SimpleNamespace(
        k=k, v=v, beta=beta, r2t=r2t, free=torch.randperm(S - 1, generator=g) + 1
    )


def fill_rows(
    pool: SimpleNamespace, batch: tuple[list[tuple[int, int, int]], list[int]]
) -> dict[str, Any]:
    """Write the batch's rows into pool.r2t (mutates it); return the device-side arguments."""
    layout, rows = batch
    used = 0
    seq_lens, phys, logical = [], [], []
    for (p, alias, own), row in zip(layout, rows):
        mine = pool.free[used : used + p + own]
        used += p + own
        slots = torch.cat([mine[:p], torch.full((alias,), ALIAS_SLOT), mine[p:]])
        pool.r2t[row, : slots.numel()] = slots.int()
        seq_lens.append(slots.numel())
        phys.append(p)
        logical.append(p + alias if p else 0)
    ints = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    return dict(req_to_token=pool.r2t, req_pool_indices=ints(rows), seq_lens=ints(seq_lens),
                prefix_physical=ints(phys), prefix_logical=ints(logical), bs=len(rows))  # fmt: skip


def reference(pool: SimpleNamespace, args: dict[str, Any], q: torch.Tensor) -> torch.Tensor:
    """`biased_sdpa` per request over its full row [0, n_b), aliases included (beta -inf)."""
    outs = []
    for b, (row, n) in enumerate(zip(args["req_pool_indices"].tolist(), args["seq_lens"].tolist())):
        slots = pool.r2t[row, :n].long()
        k, v = pool.k[slots].movedim(0, 1), pool.v[slots].movedim(0, 1)
        outs.append(biased_sdpa(q[b, :, None], k, v, pool.beta[slots], n - 1, SCALE)[:, 0])
    return torch.stack(outs)


def new_plan(device: str = "cpu", **kw: Any) -> GraphDecodePlan:
    return GraphDecodePlan(MAX_BS, MAX_CONTEXT, H_Q, H_KV, D, device, sm_scale=SCALE, **kw)


class NoHostSync(TorchDispatchMode):
    """Raises on every aten op that reads device data on the host or whose output shape
    depends on tensor data; records the ops it saw.

    Forbidden: `_local_scalar_dense` (what .item(), .tolist(), int(), bool() of a tensor
    call), `nonzero`, `masked_select`, `unique*`, `repeat_interleave` without output_size,
    and any copy (`_to_copy`, `copy_`) from a non-CPU tensor to the CPU. On a CPU-only
    machine the last rule cannot fire, the others still do. Triton launches are not aten
    ops: on CUDA they are invisible here, under the interpreter their own host copies are
    CPU-to-CPU and pass (so nothing is exempted).
    """

    DATA_SHAPED: ClassVar[set[str]] = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
                   "unique_consecutive", "argwhere"}  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        self.seen.add(name)
        if func is aten._local_scalar_dense.default:
            raise AssertionError("host sync: _local_scalar_dense")
        if name in self.DATA_SHAPED:
            raise AssertionError(f"data-dependent output shape: {name}")
        if name == "repeat_interleave" and kwargs.get("output_size") is None:
            raise AssertionError("repeat_interleave without output_size")
        if name in ("_to_copy", "copy_"):
            src = args[1] if name == "copy_" else args[0]
            dst = args[0].device if name == "copy_" else kwargs.get("device", src.device)
            if torch.device(dst).type == "cpu" and src.device.type != "cpu":
                raise AssertionError(f"device-to-host copy: {name}")
        return func(*args, **kwargs)


def test_refill_keeps_buffers_and_matches_reference() -> None:
    pool, plan = make_pool(), new_plan()
    buffers = {name: (t.data_ptr(), tuple(t.shape)) for name, t in
               (("indptr", plan.kv_indptr), ("indices", plan.kv_indices))}  # fmt: skip
    g = torch.Generator().manual_seed(1)
    for batch in (BATCH_A, BATCH_B):
        args = fill_rows(pool, batch)
        plan.fill(**args)
        assert {name: (t.data_ptr(), tuple(t.shape)) for name, t in
                (("indptr", plan.kv_indptr), ("indices", plan.kv_indices))} == buffers  # fmt: skip
        want_indptr, want_indices = compacted_slot_table(
            *(args[k] for k in ("req_to_token", "req_pool_indices", "seq_lens",
                                "prefix_physical", "prefix_logical")))  # fmt: skip
        bs = args["bs"]
        total = int(want_indptr[-1])
        assert plan.kv_indptr[: bs + 1].tolist() == want_indptr.tolist()
        assert plan.kv_indptr[bs:].tolist() == [total] * (MAX_BS + 1 - bs)  # padding rows empty
        assert torch.equal(plan.kv_indices[:total], want_indices)
        q = torch.randn(bs, H_Q, D, generator=g)
        torch.testing.assert_close(plan.run(q, pool.k, pool.v, pool.beta),
                                   reference(pool, args, q), atol=2e-5, rtol=1e-4)  # fmt: skip
        # A graph padded to MAX_BS rows: the filled rows agree, the padding rows are 0.
        q_pad = torch.cat([q, torch.randn(MAX_BS - bs, H_Q, D, generator=g)])
        out_pad = plan.run(q_pad, pool.k, pool.v, pool.beta)
        torch.testing.assert_close(out_pad[:bs], reference(pool, args, q), atol=2e-5, rtol=1e-4)
        assert not out_pad[bs:].any()


def test_compacted_tables_never_read_the_alias() -> None:
    pool, plan = make_pool(), new_plan()
    args = fill_rows(pool, BATCH_A)
    plan.fill(**args)
    indptr = plan.kv_indptr.tolist()
    for b, p in enumerate(args["prefix_physical"].tolist()):
        mine = plan.kv_indices[indptr[b] : indptr[b + 1]]
        row = pool.r2t[args["req_pool_indices"][b], : args["seq_lens"][b]]
        assert ALIAS_SLOT not in mine.tolist()
        assert mine.numel() == int((row != ALIAS_SLOT).sum())  # every non-alias entry, once
        if p:
            assert ALIAS_SLOT in row.tolist()  # the row itself does hold aliases


def test_fill_and_run_do_not_sync_the_host() -> None:
    pool, plan = make_pool(), new_plan()
    args = fill_rows(pool, BATCH_A)
    q = torch.randn(MAX_BS, H_Q, D, generator=torch.Generator().manual_seed(2))
    with NoHostSync() as mode:
        plan.fill(**args)
        out = plan.run(q, pool.k, pool.v, pool.beta)
    assert {"cumsum", "sub", "copy_"} <= mode.seen  # the mode did watch the torch part
    torch.testing.assert_close(out[:3], reference(pool, args, q), atol=2e-5, rtol=1e-4)
    with pytest.raises(AssertionError, match="_local_scalar_dense"), NoHostSync():
        bool(args["seq_lens"].sum())  # the check itself fires
    with pytest.raises(AssertionError, match="nonzero"), NoHostSync():
        torch.nonzero(args["seq_lens"])


def test_check_refuses_bad_batches_on_the_host() -> None:
    plan = new_plan()
    plan.check(3, [15, 9, 15], [6, 0, 3], [11, 0, 13])
    with pytest.raises(ValueError, match=r"bs=5 must lie in \[0, max_bs=4\]"):
        plan.check(5, [1] * 5)
    with pytest.raises(ValueError, match=r"request 1: .* got seq_len=41"):
        plan.check(2, torch.tensor([3, 41]))
    with pytest.raises(ValueError, match=r"request 0: .* prefix_physical=7 prefix_logical=5"):
        plan.check(1, [9], [7], [5])
    with pytest.raises(ValueError, match="host copy"):
        plan.check(1, torch.tensor([3], device="meta"))
    pool = make_pool()
    args = fill_rows(pool, BATCH_B)
    with pytest.raises(ValueError, match=r"bs=5 must lie"):
        plan.fill(**{**args, "bs": 5})
    with pytest.raises(ValueError, match=r"seq_lens must be 1-D ints with >= bs=2"):
        plan.fill(**{**args, "seq_lens": args["seq_lens"][:1]})
    with pytest.raises(ValueError, match=r"q must be \[n <= max_bs=4"):
        plan.run(torch.zeros(5, H_Q, D), pool.k, pool.v, pool.beta)
    with pytest.raises(ValueError, match="num_splits must be >= 1"):
        new_plan(num_splits=0)


@pytest.mark.gpu
def test_cuda_graph_replay_follows_refills() -> None:
    pool, plan = make_pool(), new_plan("cuda", num_splits=3, block_n=16)  # 3 splits
    k, v, beta = pool.k.cuda().bfloat16(), pool.v.cuda().bfloat16(), pool.beta.cuda()
    q = torch.randn(MAX_BS, H_Q, D, device="cuda", dtype=torch.bfloat16)
    args_a = fill_rows(pool, BATCH_A)

    def cuda_args(a: dict[str, Any]) -> dict[str, Any]:
        return {n: x.cuda() if isinstance(x, torch.Tensor) else x for n, x in a.items()}

    plan.fill(**cuda_args(args_a))
    plan.run(q, k, v, beta)  # warm-up (compiles) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = plan.run(q, k, v, beta)
    for batch in (BATCH_A, BATCH_B):
        args = fill_rows(pool, batch)
        with NoHostSync():
            plan.fill(**cuda_args(args))
        graph.replay()
        bs = args["bs"]
        pool_bf = SimpleNamespace(k=pool.k.bfloat16().float(), v=pool.v.bfloat16().float(),
                                  beta=pool.beta, r2t=pool.r2t)  # fmt: skip
        want = reference(pool_bf, args, q[:bs].float().cpu())
        torch.testing.assert_close(out[:bs].float().cpu(), want, atol=2e-2, rtol=2e-2)
        assert not out[bs:].any()

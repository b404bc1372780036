"""`sglang_ext.attention.cascade` on mixed batches (compacted + plain requests) against `biased_sdpa`
over each compacted node's own entries + the request's tail, and plain requests' whole rows
(CPU under TRITON_INTERPRET=1, and CUDA)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from compaction_kernels.biased_attention.triton import BiasedPagedAttention
from compaction_kernels.merge_state.triton import merge_state
from sglang_ext.attention.cascade import (
    CascadePlan,
    Prefixes,
    PrefixKV,
    PrefixPlans,
    plan_cascade,
    run_cascade,
    stack_groups,
)
from sglang_ext.attention.sdpa import biased_sdpa
from sglang_ext.kv_store import ALIAS_SLOT
from sglang_ext.packing import PackedLayout, slots_needed

S, H_KV, G, D = 80, 2, 2, 24
H_Q = H_KV * G
SCALE = 0.35
# node: (entries per KV head, T); one layer, packed: A holds 8 entries in N = 4 slots, B 4 in
# N = 2 (its head 1 keeps none: that head's prefix part is empty)
NODES = {"A": ([5, 3], 9), "B": ([4, 0], 6)}
# Per request: its node (None: plain) and its own tokens (the tail, or the whole plain row).
REQUESTS = [("A", 7), (None, 8), ("A", 5), ("B", 6), (None, 3)]
POOL_ROWS = [3, 0, 5, 1, 4]
HEADS = dict(num_qo_heads=H_Q, num_kv_heads=H_KV, head_dim=D)


class Batch(SimpleNamespace):
    k: torch.Tensor  # [S, H_kv, D]
    v: torch.Tensor
    beta: torch.Tensor  # [S, H_kv] fp32
    r2t: torch.Tensor  # [6, 24] int32
    rows: list[torch.Tensor]  # per request: its full row [n_b] (aliases included)
    nodes: list[str | None]
    layouts: dict[str, PackedLayout]
    entries: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # ragged k, v, beta
    prefixes: list[PackedLayout | None]


def make_batch(seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Batch:
    """Shuffled slots; each node's entries packed into its slots (random K/V/beta); the alias
    slot has random K/V (so reading it would show) and beta -inf."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(S, H_KV, D, generator=g).to(device, dtype)
    v = torch.randn(S, H_KV, D, generator=g).to(device, dtype)
    beta = torch.zeros(S, H_KV, device=device)
    beta[ALIAS_SLOT] = float("-inf")
    free = (torch.randperm(S - 1, generator=g) + 1).tolist()
    layouts, entries = {}, {}
    for name, (counts, t_log) in NODES.items():
        c = torch.tensor([counts])
        # the node's slots on the pool's device, as an install leaves them
        slots = torch.tensor([free.pop() for _ in range(slots_needed(c))], device=device)
        layouts[name] = layout = PackedLayout(c, slots, t_log)
        e = sum(counts)
        entries[name] = (torch.randn(e, D, generator=g), torch.randn(e, D, generator=g),
                         torch.randn(e, generator=g))  # fmt: skip
        ek, ev, eb = (x.to(device) for x in entries[name])
        layout.write(0, ek.to(dtype), ev.to(dtype), eb, lambda _: k, lambda _: v,
                     beta.unsqueeze(0))  # fmt: skip
    r2t = torch.randint(1, S, (6, 24), generator=g, dtype=torch.int32)  # junk past seq_len
    rows, prefixes = [], []
    for (node, n_own), pool_row in zip(REQUESTS, POOL_ROWS):
        own = torch.tensor([free.pop() for _ in range(n_own)])
        if node is None:
            row, prefix = own, None
        else:
            lay = layouts[node]
            aliases = torch.full((lay.logical_length - lay.num_slots,), ALIAS_SLOT)
            row = torch.cat([lay.slots.cpu(), aliases, own])
            prefix = lay
        r2t[pool_row, : row.numel()] = row.int()
        rows.append(row)
        prefixes.append(prefix)
    return Batch(k=k, v=v, beta=beta, r2t=r2t.to(device), rows=rows, nodes=[n for n, _ in REQUESTS],
                 layouts=layouts, entries=entries, prefixes=prefixes)  # fmt: skip


def prefix_kv(b: Batch, plan: CascadePlan) -> PrefixKV | None:
    """The plan's node groups read from their packed cells (what the backend passes)."""
    assert plan.layouts == tuple(b.layouts[b.nodes[g[0]] or ""] for g in plan.groups)
    beta = b.beta.unsqueeze(0)
    parts = [p.read_ragged(0, lambda _: b.k, lambda _: b.v, beta, b.k.dtype) for p in plan.layouts]
    return stack_groups(parts) if parts else None


def full_row_reference(b: Batch, q: torch.Tensor, q_lens: list[int]) -> torch.Tensor:
    """`biased_sdpa` per request, fp32 on the CPU: a compacted request over its node's own
    entries (each head's, from `entries`, not the pool) then its row's tail [T, n); a plain
    request over its whole row."""
    outs, start = [], 0
    for slots, node, q_len in zip(b.rows, b.nodes, q_lens):
        qr = q[start : start + q_len].float().cpu().movedim(0, 1)  # [H_q, q, D]
        if node is not None:
            slots = slots[NODES[node][1] :]
        k = b.k.float().cpu()[slots].movedim(0, 1)  # [H_kv, n, D]
        v = b.v.float().cpu()[slots].movedim(0, 1)
        beta = b.beta.cpu()[slots]
        if node is not None:
            counts, W = NODES[node][0], max(NODES[node][0])
            pk, pv = torch.zeros(H_KV, W, D), torch.zeros(H_KV, W, D)
            pb = torch.full((W, H_KV), float("-inf"))
            ek, ev, eb = b.entries[node]
            lo = 0
            for h, t in enumerate(counts):
                pk[h, :t], pv[h, :t], pb[:t, h] = ek[lo : lo + t], ev[lo : lo + t], eb[lo : lo + t]
                lo += t
            k, v, beta = torch.cat([pk, k], 1), torch.cat([pv, v], 1), torch.cat([pb, beta])
        outs.append(biased_sdpa(qr, k, v, beta, k.shape[1] - q_len, SCALE).movedim(0, 1))
        start += q_len
    return torch.cat(outs)


def q_lens_for(mode: str) -> list[int]:
    if mode == "decode":
        return [1] * len(REQUESTS)
    if mode == "extend":  # every tail (plain: whole row) is new
        return [n_own for _, n_own in REQUESTS]
    return [3, 5, 5, 2, 1]  # chunked prefill: requests 0, 1, 3, 4 have part of the tail cached


def plan_for(
    b: Batch, q_lens: list[int], causal_block: int = 64, prefixes: Prefixes | None = None
) -> CascadePlan:
    seq_lens = [r.numel() for r in b.rows]
    return plan_cascade(b.r2t, torch.tensor(POOL_ROWS), seq_lens, q_lens,
                        b.prefixes if prefixes is None else prefixes, sm_scale=SCALE,
                        causal_block=causal_block, **HEADS)  # fmt: skip


@pytest.mark.parametrize(
    ("mode", "causal_block"),
    [("decode", 64), ("extend", 2), ("extend", 64), ("chunked", 2), ("chunked", 64)],
)
def test_matches_full_row_reference(mode: str, causal_block: int) -> None:
    b = make_batch()
    q_lens = q_lens_for(mode)
    q = torch.randn(sum(q_lens), H_Q, D, generator=torch.Generator().manual_seed(1))
    plan = plan_for(b, q_lens, causal_block)
    got = run_cascade(plan, q, b.k, b.v, b.beta, 0, prefix_kv(b, plan))
    assert got.shape == (sum(q_lens), H_Q, D) and got.dtype == q.dtype
    torch.testing.assert_close(got, full_row_reference(b, q, q_lens), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("mode", ["decode", "extend", "chunked"])
def test_plan_reads_no_alias_and_one_prefix_call_per_node(mode: str) -> None:
    b = make_batch()
    q_lens = q_lens_for(mode)
    plan = plan_for(b, q_lens, causal_block=2)
    assert plan.groups == ((0, 2), (3,))
    assert len(plan.prefix) == 1 and plan.prefix_tokens is not None  # one call per layer
    prefix = plan.prefix[0].planned
    assert prefix.qo_indptr.numel() - 1 == 2  # node A once (requests 0 and 2), node B once
    assert prefix.kv_indptr.tolist() == [0, 5, 8, 12, 12]  # A's heads keep 5, 3; B's 4, 0
    group_a = q_lens[0] + q_lens[2]
    assert prefix.qo_indptr.tolist() == [0, group_a, group_a + q_lens[3]]
    starts = [sum(q_lens[:i]) for i in range(len(q_lens))]
    want_tokens = [starts[i] + j for i in (0, 2, 3) for j in range(q_lens[i])]
    assert plan.prefix_tokens.tolist() == want_tokens
    slots = plan.slots_read()
    assert ALIAS_SLOT not in slots.tolist()
    tails = [r if n is None else r[NODES[n][1] :] for r, n in zip(b.rows, b.nodes)]
    assert torch.equal(slots.cpu(), torch.unique(torch.cat(tails)))  # tails, all of them


def test_decode_steps_plan_the_prefix_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three decode steps of the same requests (each row one token longer per step): the
    prefix call is planned at the first step only, the tail at every step, and every step
    still matches the full-row reference. A new group composition plans its prefix anew."""
    b = make_batch()
    planned: list[int | None] = []
    real_plan = BiasedPagedAttention.plan

    def counting(self: BiasedPagedAttention, kv_indptr: torch.Tensor, kv_indices, **kw):  # type: ignore[no-untyped-def]
        planned.append(None if kv_indices is None else int(kv_indices.numel()))
        return real_plan(self, kv_indptr, kv_indices, **kw)

    monkeypatch.setattr(BiasedPagedAttention, "plan", counting)
    cache = PrefixPlans()
    used = set(torch.cat(b.rows).tolist()) | {ALIAS_SLOT}
    spare = [x for x in range(S) if x not in used]
    q_lens = q_lens_for("decode")
    for step in range(3):
        for i, pool_row in enumerate(POOL_ROWS):  # the step's new token gets a slot
            b.rows[i] = torch.cat([b.rows[i], torch.tensor([spare.pop()])])
            b.r2t[pool_row, b.rows[i].numel() - 1] = int(b.rows[i][-1])
        planned.clear()
        plan = plan_cascade(b.r2t, torch.tensor(POOL_ROWS), [r.numel() for r in b.rows], q_lens,
                            b.prefixes, sm_scale=SCALE, cache=cache, **HEADS)  # fmt: skip
        # the ragged prefix call (no slot table: None) at the first step only; one tail each
        assert planned.count(None) == (0 if step else 1), planned
        assert len(planned) - planned.count(None) == 1, planned
        q = torch.randn(len(REQUESTS), H_Q, D, generator=torch.Generator().manual_seed(step))
        got = run_cascade(plan, q, b.k, b.v, b.beta, 0, prefix_kv(b, plan))
        torch.testing.assert_close(got, full_row_reference(b, q, q_lens), atol=2e-5, rtol=1e-4)
    assert cache.made == 1 and len(cache) == 1
    # request 2 leaves node A's group: (A: 1 token, B: 1 token) is another composition
    rest = [p if i != 2 else None for i, p in enumerate(b.prefixes)]
    b.rows[2] = b.rows[2][NODES["A"][1] :]
    b.r2t[POOL_ROWS[2], : b.rows[2].numel()] = b.rows[2].int()
    b.nodes[2] = None
    plan_cascade(b.r2t, torch.tensor(POOL_ROWS), [r.numel() for r in b.rows], q_lens, rest,
                 sm_scale=SCALE, cache=cache, **HEADS)  # fmt: skip
    assert cache.made == 2 and len(cache) == 2
    with pytest.raises(ValueError, match="capacity must be >= 1, got 0"):
        PrefixPlans(0)


def test_plain_batch_has_no_prefix_part() -> None:
    b = make_batch()
    b.prefixes = [None] * len(REQUESTS)
    q_lens = q_lens_for("chunked")
    b.nodes = [None] * len(REQUESTS)
    plan = plan_for(b, q_lens, prefixes=b.prefixes)
    assert plan.prefix == () and plan.groups == ()
    q = torch.randn(sum(q_lens), H_Q, D, generator=torch.Generator().manual_seed(2))
    assert ALIAS_SLOT in plan.slots_read().tolist()  # plain rows are read whole
    got = run_cascade(plan, q, b.k, b.v, b.beta)
    torch.testing.assert_close(got, full_row_reference(b, q, q_lens), atol=2e-5, rtol=1e-4)


def test_merge_with_empty_prefix_side_is_the_tail() -> None:
    """A plain token's prefix state (out 0, lse -inf) leaves the tail state as it is; both
    sides empty (a fully masked head) gives 0, not NaN."""
    g = torch.Generator().manual_seed(4)
    tail_out, tail_lse = torch.randn(3, H_Q, D, generator=g), torch.randn(3, H_Q, generator=g)
    tail_lse[2, 1] = -math.inf
    tail_out[2, 1] = 0.0
    empty, no_lse = torch.zeros(3, H_Q, D), torch.full((3, H_Q), -math.inf)
    got = merge_state(empty, no_lse, tail_out, tail_lse)
    assert torch.equal(got.out, tail_out)
    torch.testing.assert_close(got.lse, tail_lse)
    assert got.lse[2, 1] == -math.inf and not got.out.isnan().any()


def test_rejects_bad_prefixes_and_rows() -> None:
    b = make_batch()
    q_lens = q_lens_for("extend")
    bad = list(b.prefixes)
    a = b.layouts["A"]
    bad[2] = PackedLayout(a.counts, a.slots, 12)  # T past seq_len - q_len = 9
    with pytest.raises(ValueError, match=r"request 2: .*seq_len - q_len = 9, got N=4 T=12"):
        plan_for(b, q_lens, prefixes=bad)
    with pytest.raises(ValueError, match=r"prefixes has 4 entries for B=5"):
        plan_for(b, q_lens, prefixes=b.prefixes[:4])
    bad[2] = PackedLayout(torch.tensor([[5, 3, 0]]), a.slots, 9)  # another shape than A's
    r2t = b.r2t.clone()
    r2t[POOL_ROWS[2], 0] = 1  # (a group of its own)
    with pytest.raises(ValueError, match=r"one \[L, H_kv=2\] shape, got \[\(1, 2\), \(1, 3\)\]"):
        plan_cascade(r2t, POOL_ROWS, [r.numel() for r in b.rows], q_lens, bad, **HEADS)
    r2t = b.r2t.clone()
    r2t[POOL_ROWS[2], 3] = r2t[POOL_ROWS[1], 0]  # request 2's node slot 3 is not A's
    with pytest.raises(ValueError, match=r"request 2: row entry 3 .* differs from request 0's"):
        plan_cascade(r2t, POOL_ROWS, [r.numel() for r in b.rows], q_lens, b.prefixes, **HEADS)
    r2t = b.r2t.clone()
    r2t[POOL_ROWS[3], 5] = 11  # inside node B's aliases [2, 6)
    with pytest.raises(ValueError, match=r"request 3: row entry 5 \(slot 11\) is not ALIAS_SLOT"):
        plan_cascade(r2t, POOL_ROWS, [r.numel() for r in b.rows], q_lens, b.prefixes, **HEADS)
    r2t = b.r2t.clone()
    r2t[POOL_ROWS[3], 1] = ALIAS_SLOT
    with pytest.raises(ValueError, match=r"request 3: row entry 1 \(slot 0\) is ALIAS_SLOT"):
        plan_cascade(r2t, POOL_ROWS, [r.numel() for r in b.rows], q_lens, b.prefixes, **HEADS)
    plan = plan_for(b, q_lens)
    with pytest.raises(ValueError, match=r"q must be \[n=29, H_q, D\]"):
        run_cascade(plan, torch.zeros(28, H_Q, D), b.k, b.v, b.beta)
    with pytest.raises(ValueError, match=r"the groups' 12 entries of layer 0, got None"):
        run_cascade(plan, torch.zeros(29, H_Q, D), b.k, b.v, b.beta)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["decode", "chunked"])
def test_matches_full_row_reference_on_cuda(mode: str) -> None:
    b = make_batch(device="cuda", dtype=torch.bfloat16)
    q_lens = q_lens_for(mode)
    q = torch.randn(sum(q_lens), H_Q, D, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.tensor([r.numel() for r in b.rows], device="cuda")
    plan = plan_cascade(b.r2t, torch.tensor(POOL_ROWS, device="cuda"), seq_lens,
                        torch.tensor(q_lens, device="cuda"),
                        b.prefixes,
                        sm_scale=SCALE, causal_block=2, **HEADS)  # fmt: skip
    assert ALIAS_SLOT not in plan.slots_read().tolist()
    got = run_cascade(plan, q, b.k, b.v, b.beta, 0, prefix_kv(b, plan))
    assert got.device.type == "cuda" and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float().cpu(), full_row_reference(b, q, q_lens),
                               atol=2e-2, rtol=2e-2)  # fmt: skip


@pytest.mark.gpu
def test_static_cascade_replays_from_a_cuda_graph_without_a_sync() -> None:
    """The static decode cascade captured in a CUDA graph, replayed for two different batches
    under `set_sync_debug_mode("error")` (any host sync in the replay preparation raises):
    each replay equals the eager cascade in bf16."""
    from sglang_ext.adapter.graph_variant import static_shape
    from sglang_ext.attention.static_cascade import PrefixTables, StaticCascade

    b = make_batch(device="cuda", dtype=torch.bfloat16)
    bs, n = 8, len(REQUESTS)
    tables = PrefixTables(lambda _: b.k, lambda _: b.v, b.beta.unsqueeze(0))
    static = StaticCascade(static_shape(H_Q, H_KV, D, cuda=True), num_layers=1, max_bs=bs,
                           max_groups=2, width=b.r2t.shape[1], tables=tables,
                           device="cuda")  # fmt: skip
    rows = torch.zeros(bs, dtype=torch.int64, device="cuda")  # the graph's input buffers
    seq_lens = torch.ones(bs, dtype=torch.int64, device="cuda")
    q = torch.zeros(bs, H_Q, D, device="cuda", dtype=torch.bfloat16)
    got: dict[str, torch.Tensor] = {}

    def body() -> None:
        static.gather_tails(bs, b.r2t, rows, seq_lens)
        got["out"] = static.attend(bs, 0, q, (b.k, b.v, b.beta), SCALE)

    static.prepare(bs, [])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    q_lens = q_lens_for("decode")
    for seed, prefixes in ((1, b.prefixes), (2, [None, None, *b.prefixes[2:]])):
        rows[:n] = torch.tensor(POOL_ROWS)
        seq_lens[:n] = torch.tensor([r.numel() for r in b.rows])
        q[:n] = torch.randn(n, H_Q, D, generator=torch.Generator().manual_seed(seed)).to(q)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            static.prepare(bs, prefixes)
            graph.replay()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        plan = plan_for(b, q_lens, prefixes=prefixes)
        want = run_cascade(plan, q[:n], b.k, b.v, b.beta, 0, prefix_kv(b, plan))
        torch.testing.assert_close(got["out"][:n].float(), want.float(), atol=2e-2, rtol=2e-2)

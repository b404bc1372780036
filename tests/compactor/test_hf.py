"""compactor.hf: KV extraction, query recording, decoding from (compacted) prefixes."""

from __future__ import annotations

import pytest
import torch

from compactor import hf
from tests._tiny import random_ids
from tests.compactor._fixtures import prefix_from


def test_model_info_and_pool_gqa(tiny):
    info = hf.model_info(tiny)
    assert (info.num_layers, info.num_q_heads, info.num_kv_heads, info.head_dim) == (2, 4, 2, 16)
    q = torch.arange(4 * 3 * 2, dtype=torch.float32).reshape(4, 3, 2)
    pooled = hf.pool_gqa(q, 2)
    assert pooled.shape == (2, 6, 2)
    assert torch.equal(pooled[1, :3], q[2]) and torch.equal(pooled[1, 3:], q[3])
    with pytest.raises(ValueError, match="multiple"):
        hf.pool_gqa(q, 3)


def test_prefill_matches_cache_and_full_logits(tiny):
    ids = random_ids(40)
    pre = hf.prefill(tiny, ids[:30])
    assert pre.keys[0].shape == (2, 30, 16)
    full = tiny(input_ids=torch.tensor([ids])).logits[0]
    state = hf.PrefixState.full(pre)
    out = state.forward(tiny, ids[30:])
    torch.testing.assert_close(out, full[30:], atol=1e-4, rtol=0)
    torch.testing.assert_close(pre.last_logits, full[29], atol=1e-4, rtol=0)


def test_identity_compaction_equals_full_logits(tiny):
    ids = random_ids(45, seed=1)
    pre = hf.prefill(tiny, ids[:32])
    full = tiny(input_ids=torch.tensor([ids])).logits[0, 32:]
    state = hf.PrefixState.from_compacted(prefix_from(pre))
    assert state.slots == 32
    torch.testing.assert_close(state.forward(tiny, ids[32:40]), full[:8], atol=1e-4, rtol=0)
    # decoding continues with the right positions and the growing cache
    torch.testing.assert_close(state.forward(tiny, ids[40:]), full[8:], atol=1e-4, rtol=0)


def test_ragged_heads_equal_masked_full_cache(tiny):
    ids = random_ids(36, seed=2)
    pre = hf.prefill(tiny, ids[:30])
    keep = [list(range(0, 30, 2)), list(range(30))]  # head 0 keeps 15, head 1 all 30
    state = hf.PrefixState.from_compacted(prefix_from(pre, keep))
    bias = torch.zeros(2, 2, 30)
    bias[:, 0, 1::2] = float("-inf")
    ref = hf.PrefixState(list(pre.keys), list(pre.values), bias, 30)
    torch.testing.assert_close(
        state.forward(tiny, ids[30:]), ref.forward(tiny, ids[30:]), atol=1e-4, rtol=0
    )


def test_beta_shifts_attention_like_duplicate_keys(tiny):
    """beta = log 2 on a row == that row present twice (mass doubles)."""
    ids = random_ids(26, seed=3)
    pre = hf.prefill(tiny, ids[:20])
    beta = torch.zeros(40)
    beta[torch.tensor([5, 25])] = float(torch.log(torch.tensor(2.0)))
    a = hf.PrefixState.from_compacted(prefix_from(pre, beta=beta)).forward(tiny, ids[20:])
    dup = [[*list(range(20)), 5], [*list(range(20)), 5]]
    b = hf.PrefixState.from_compacted(prefix_from(pre, dup)).forward(tiny, ids[20:])
    torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_logical_positions_after_compaction(tiny):
    """Keep the first 10 of T=24 rows: new tokens must sit at positions 24.., not 10.."""
    ids = random_ids(30, seed=4)
    T, k = 24, 10
    pre = hf.prefill(tiny, ids[:T])
    state = hf.PrefixState.from_compacted(prefix_from(pre, [list(range(k))] * 2))
    got = state.forward(tiny, ids[T:])
    L = len(ids)
    mask = torch.full((L, L), float("-inf")).triu(1)
    mask[T:, k:T] = float("-inf")  # new tokens see only the first k prefix tokens
    ref = tiny(
        input_ids=torch.tensor([ids]),
        attention_mask=mask[None, None],
        position_ids=torch.arange(L)[None],
    ).logits[0, T:]
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    wrong = tiny(input_ids=torch.tensor([ids[:k] + ids[T:]])).logits[0, k:]  # positions k.. instead
    assert (wrong - got).abs().max() > 1e-3


def test_record_queries_reproduce_attention(tiny):
    ids = random_ids(20, seed=5)
    captured = {}
    attn = tiny.model.layers[1].self_attn
    h = attn.o_proj.register_forward_pre_hook(lambda m, a: captured.setdefault("x", a[0]))
    try:
        with hf.record_queries(tiny, [1]) as rec:
            pre = hf.prefill(tiny, ids)
    finally:
        h.remove()
    q = rec[1][0]  # [H_q, T, D]
    assert q.shape == (4, 20, 16)
    k = pre.keys[1].repeat_interleave(2, dim=0)
    v = pre.values[1].repeat_interleave(2, dim=0)
    logits = q @ k.transpose(1, 2) / 4.0 + torch.full((20, 20), float("-inf")).triu(1)
    out = (torch.softmax(logits, -1) @ v).transpose(0, 1).reshape(20, 64)
    torch.testing.assert_close(out, captured["x"][0], atol=1e-5, rtol=0)


def test_greedy_generate_and_errors(tiny):
    ids = random_ids(20, seed=6)
    pre = hf.prefill(tiny, ids[:16])
    out = hf.greedy_generate(tiny, hf.PrefixState.full(pre), ids[16:], 5)
    ref = tiny.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False)[0, 20:].tolist()
    assert out == ref
    with pytest.raises(ValueError, match="max_new_tokens"):
        hf.greedy_generate(tiny, hf.PrefixState.full(pre), ids[16:], -1)
    with pytest.raises(ValueError, match="bias"):
        hf.PrefixState(list(pre.keys), list(pre.values), torch.zeros(2, 16), 16)
    with pytest.raises(ValueError, match="logical_length"):
        hf.PrefixState(list(pre.keys), list(pre.values), torch.zeros(2, 2, 16), 0)


def test_batched_generate_matches_one_by_one(tiny):
    ids = random_ids(30, seed=7)
    pre = hf.prefill(tiny, ids[:20])
    state = hf.PrefixState.full(pre)
    prompts = [ids[20:23], ids[20:30], ids[25:26]]
    got = hf.batched_generate(tiny, state.fork(), prompts, 4)
    want = [hf.greedy_generate(tiny, state.fork(), p, 4) for p in prompts]
    assert got == want
    with pytest.raises(ValueError, match="non-empty"):
        hf.batched_generate(tiny, state.fork(), [[]], 4)

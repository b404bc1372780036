"""Triton biased attention against the torch reference (CPU: under TRITON_INTERPRET=1).

Small odd sizes (T=37, t=5, D=64, GQA 3); fp32 inputs so the interpreter is exact to
rounding. Split-K is forced (num_splits > 1) with small KV blocks so chunk edges, empty
chunks, empty heads and fully masked heads are all exercised.
"""

from __future__ import annotations

import math

import pytest
import torch

from compaction_kernels.biased_attention import PagedKV, RaggedKV, ragged_to_paged
from compaction_kernels.biased_attention import reference as ref
from compaction_kernels.biased_attention import triton as tri
from compaction_kernels.merge_state import triton as merge_tri

D, H_KV, G = 64, 3, 3
H_Q = H_KV * G
COUNTS = [5, 0, 12, 37, 1, 7]  # B=2 requests x 3 KV heads, one empty head
TOL = dict(atol=2e-5, rtol=2e-5)


def _close(got, want):
    torch.testing.assert_close(got.out.float(), want.out, **TOL)
    torch.testing.assert_close(got.lse, want.lse, **TOL)


def _q(n, seed):
    return torch.randn(n, H_Q, D, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_reference(make_ragged, num_splits):
    kv = make_ragged(COUNTS, H_KV, D)
    beta = kv.beta.clone()
    beta[[2, 20, 30]] = -math.inf
    beta[kv.indptr[4] : kv.indptr[5]] = -math.inf  # request 1, head 1 fully masked
    q = _q(2, 1)
    got = tri.decode(q, RaggedKV(kv.keys, kv.values, beta, kv.indptr), num_splits=num_splits)
    want = ref.decode(q, RaggedKV(kv.keys, kv.values, beta, kv.indptr))
    _close(got, want)
    assert torch.all(got.lse[1, G : 2 * G] == -math.inf)
    assert torch.all(got.out[1, G : 2 * G] == 0)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_extend_matches_reference(make_ragged, num_splits):
    counts = [*COUNTS, 3, 37, 0]  # B=3; request 1 has no query tokens
    kv = make_ragged(counts, H_KV, D, seed=3)
    q = _q(8, 2)
    qo_indptr = torch.tensor([0, 5, 5, 8], dtype=torch.int32)
    got = tri.extend(q, kv.ragged, qo_indptr, num_splits=num_splits)
    _close(got, ref.extend(q, kv.ragged, qo_indptr))


def test_beta_zero_equals_plain_attention(make_ragged, sdpa):
    kv = make_ragged([37] * H_KV, H_KV, D, seed=4)
    q = _q(5, 3)
    got = tri.extend(q, RaggedKV(kv.keys, kv.values, torch.zeros_like(kv.beta), kv.indptr))
    for h in range(H_KV):
        rows = slice(37 * h, 37 * (h + 1))
        for g in range(G):
            out, lse = sdpa(q[:, h * G + g], kv.keys[rows], kv.values[rows], torch.zeros(37))
            torch.testing.assert_close(got.out[:, h * G + g], out, **TOL)
            torch.testing.assert_close(got.lse[:, h * G + g], lse, **TOL)


def test_beta_minus_inf_equals_removing_entries(make_ragged):
    kv = make_ragged([37, 5, 12], H_KV, D, seed=5)
    drop = torch.zeros(kv.beta.shape[0], dtype=torch.bool)
    drop[[0, 17, 36, 37, 41, 50]] = True
    seg = torch.repeat_interleave(torch.arange(H_KV), torch.tensor([37, 5, 12]))
    indptr = torch.zeros(H_KV + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.bincount(seg[~drop], minlength=H_KV), 0)
    q = _q(1, 4)
    got = tri.decode(
        q,
        RaggedKV(kv.keys, kv.values, kv.beta.masked_fill(drop, -math.inf), kv.indptr),
        num_splits=2,
    )
    want = tri.decode(q, RaggedKV(kv.keys[~drop], kv.values[~drop], kv.beta[~drop], indptr))
    torch.testing.assert_close(got.out, want.out, **TOL)
    torch.testing.assert_close(got.lse, want.lse, **TOL)


def test_ragged_equals_per_head_loop(make_ragged, per_head_check):
    kv = make_ragged(COUNTS, H_KV, D, seed=6)
    q = _q(2, 5)
    got = tri.decode(q, kv.ragged, num_splits=2)
    per_head_check(got, q, kv, **TOL)


def test_lse_merge_of_two_halves_equals_whole(make_ragged):
    kv = make_ragged([37, 5, 12], H_KV, D, seed=7)
    q = _q(5, 6)
    whole = tri.extend(q, kv.ragged)
    # half 1: entries [0, 20) of head 0 only; half 2: everything else (ragged + an empty head)
    first = torch.zeros(kv.beta.shape[0], dtype=torch.bool)
    first[:20] = True
    ip1 = torch.tensor([0, 20, 20, 20], dtype=torch.int32)
    ip2 = torch.tensor([0, 17, 22, 34], dtype=torch.int32)
    a = tri.extend(q, RaggedKV(kv.keys[first], kv.values[first], kv.beta[first], ip1))
    b = tri.extend(q, RaggedKV(kv.keys[~first], kv.values[~first], kv.beta[~first], ip2))
    assert torch.all(a.lse[:, G:] == -math.inf)
    merged = merge_tri.merge_state(a.out, a.lse, b.out, b.lse)
    assert not torch.isnan(merged.out).any()
    torch.testing.assert_close(merged.out, whole.out, **TOL)
    torch.testing.assert_close(merged.lse, whole.lse, **TOL)


@pytest.mark.parametrize("decode", [True, False])
def test_paged_matches_reference(make_ragged, decode):
    kv = make_ragged(COUNTS, H_KV, D, seed=8)
    pool = ragged_to_paged(kv.keys, kv.values, kv.beta, kv.indptr, H_KV)
    k_cache, v_cache, beta_cache, kv_indptr, kv_indices = pool
    # shuffle the slots and add 4 unused garbage slots, as a real pool would have
    perm = torch.randperm(k_cache.shape[0] + 4, generator=torch.Generator().manual_seed(9))
    big = lambda x: torch.cat([x, torch.full_like(x[:4], 1e4)])[torch.argsort(perm)]  # noqa: E731
    k_cache, v_cache, beta_cache = big(k_cache), big(v_cache), big(beta_cache)
    kv_indices = perm[kv_indices.long()].to(torch.int32)
    # check the gather really moved rows
    assert torch.equal(k_cache[kv_indices[0]], pool[0][0])
    paged = PagedKV(k_cache, v_cache, beta_cache, kv_indptr, kv_indices)
    if decode:
        q = _q(2, 7)
        got = tri.paged_decode(q, paged, num_splits=2)
        want = ref.decode(q, kv.ragged)
    else:
        q, qo = _q(6, 8), torch.tensor([0, 5, 6], dtype=torch.int32)
        got = tri.paged_extend(q, qo, paged)
        want = ref.extend(q, kv.ragged, qo)
    _close(got, want)


def test_plan_once_run_many(make_ragged):
    kv = make_ragged(COUNTS, H_KV, D, seed=10)
    wrapper = tri.BiasedPagedAttention()  # ragged: the identity slot table (kv_indices None)
    plan = wrapper.plan(kv.indptr, None, H_Q, H_KV, D, num_splits=3, sm_scale=0.2)
    assert plan.num_splits == 3 and plan.chunk_size % plan.block_n == 0
    for seed in (11, 12):
        q = _q(2, seed)
        got = wrapper.run(q, kv.keys, kv.values, kv.beta)
        _close(got, ref.decode(q, kv.ragged, sm_scale=0.2))


def test_errors(make_ragged, monkeypatch):
    kv = make_ragged(COUNTS, H_KV, D)
    with pytest.raises(RuntimeError, match="plan"):
        tri.BiasedPagedAttention().run(_q(2, 0), kv.keys, kv.values, kv.beta)
    wrapper = tri.BiasedPagedAttention()
    wrapper.plan(kv.indptr, None, H_Q, H_KV, D)
    with pytest.raises(ValueError, match=r"q must be \[n=2"):
        wrapper.run(_q(3, 0), kv.keys, kv.values, kv.beta)
    with pytest.raises(ValueError, match="not a multiple of H_kv=4"):
        wrapper.plan(kv.indptr, None, 8, 4, D)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        wrapper.plan(kv.indptr, None, H_Q, H_KV, D, block_n=24)
    with pytest.raises(ValueError, match="kv_indices must lie in"):
        tri.paged_decode(
            _q(1, 0),
            PagedKV(
                torch.zeros(4, H_KV, D),
                torch.zeros(4, H_KV, D),
                torch.zeros(4, H_KV),
                torch.tensor([0, 2], dtype=torch.int32),
                torch.tensor([1, 4], dtype=torch.int32),
            ),
        )
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        wrapper.run(_q(2, 0), kv.keys, kv.values, kv.beta)

"""Torch reference for biased ragged attention: checked against plain dense attention.

Sizes are small and odd (T=37 prefix tokens, t=5 kept, D=64, GQA group 3) so no layout
accident can hide behind a power of two.
"""

from __future__ import annotations

import itertools
import math
import subprocess
import sys

import pytest
import torch

from compaction_kernels.biased_attention import PagedKV, RaggedKV, ragged_to_paged
from compaction_kernels.biased_attention import reference as ref
from compaction_kernels.merge_state import reference as merge_ref

D, H_KV, G = 64, 3, 3
H_Q = H_KV * G


def _split_halves(kv):
    """Split every segment into its first half and the rest: two ragged sets."""
    host = kv.indptr.tolist()
    first, second = [], []
    for s, e in itertools.pairwise(host):
        mid = s + (e - s) // 2
        first.append((s, mid))
        second.append((mid, e))

    def gather(ranges):
        rows = [torch.arange(s, e) for s, e in ranges]
        idx = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
        indptr = torch.zeros(len(ranges) + 1, dtype=torch.int32)
        indptr[1:] = torch.cumsum(torch.tensor([e - s for s, e in ranges]), 0)
        return kv.keys[idx], kv.values[idx], kv.beta[idx], indptr

    return gather(first), gather(second)


def test_beta_zero_equals_plain_attention(make_ragged, sdpa):
    kv = make_ragged([37] * H_KV, H_KV, D)
    beta = torch.zeros_like(kv.beta)
    q = torch.randn(5, H_Q, D, generator=torch.Generator().manual_seed(1))
    got = ref.extend(q, RaggedKV(kv.keys, kv.values, beta, kv.indptr))
    for h in range(H_KV):
        k = kv.keys[37 * h : 37 * (h + 1)]
        v = kv.values[37 * h : 37 * (h + 1)]
        for g in range(G):
            out, lse = sdpa(q[:, h * G + g], k, v, torch.zeros(37))
            torch.testing.assert_close(got.out[:, h * G + g], out, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got.lse[:, h * G + g], lse, atol=1e-5, rtol=1e-5)


def test_beta_minus_inf_equals_removing_entries(make_ragged):
    kv = make_ragged([37, 5, 11], H_KV, D)
    masked = torch.zeros(kv.beta.shape[0], dtype=torch.bool)
    masked[[0, 3, 36, 37, 40, 45, 52]] = True
    beta = kv.beta.masked_fill(masked, -math.inf)
    keep = ~masked
    seg = torch.repeat_interleave(torch.arange(H_KV), torch.tensor([37, 5, 11]))
    counts = torch.bincount(seg[keep], minlength=H_KV)
    indptr = torch.zeros(H_KV + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(counts, 0)
    q = torch.randn(1, H_Q, D, generator=torch.Generator().manual_seed(2))
    got = ref.decode(q, RaggedKV(kv.keys, kv.values, beta, kv.indptr))
    want = ref.decode(q, RaggedKV(kv.keys[keep], kv.values[keep], kv.beta[keep], indptr))
    torch.testing.assert_close(got.out, want.out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got.lse, want.lse, atol=1e-6, rtol=1e-6)


def test_ragged_equals_per_head_loop(make_ragged, per_head_check):
    counts = [5, 0, 12, 37, 1, 7]  # B=2: request 1 head 1 has no entries
    kv = make_ragged(counts, H_KV, D)
    q = torch.randn(2, H_Q, D, generator=torch.Generator().manual_seed(3))
    got = ref.decode(q, kv.ragged)
    per_head_check(got, q, kv, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("counts", [[37, 5, 12], [1, 0, 37]])
def test_lse_merge_of_halves_equals_whole(make_ragged, counts):
    kv = make_ragged(counts, H_KV, D)
    q = torch.randn(5, H_Q, D, generator=torch.Generator().manual_seed(4))
    whole = ref.extend(q, kv.ragged)
    (k1, v1, b1, i1), (k2, v2, b2, i2) = _split_halves(kv)
    part1 = ref.extend(q, RaggedKV(k1, v1, b1, i1))
    part2 = ref.extend(q, RaggedKV(k2, v2, b2, i2))
    merged = merge_ref.merge_state(part1.out, part1.lse, part2.out, part2.lse)
    assert not torch.isnan(merged.out).any()
    torch.testing.assert_close(merged.out, whole.out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged.lse, whole.lse, atol=1e-5, rtol=1e-5)


def test_merge_state_handles_minus_inf_on_either_side():
    gen = torch.Generator().manual_seed(5)
    v_a, v_b = torch.randn(2, 4, 8, generator=gen), torch.randn(2, 4, 8, generator=gen)
    s_a, s_b = torch.randn(2, 4, generator=gen), torch.randn(2, 4, generator=gen)
    s_a[0, :2] = -math.inf  # a empty
    s_b[0, 1:3] = -math.inf  # b empty (row 0, head 1: both)
    got = merge_ref.merge_state(v_a, s_a, v_b, s_b)
    assert not torch.isnan(got.out).any() and not torch.isnan(got.lse).any()
    torch.testing.assert_close(got.out[0, 0], v_b[0, 0])
    torch.testing.assert_close(got.out[0, 2], v_a[0, 2])
    assert torch.all(got.out[0, 1] == 0) and got.lse[0, 1] == -math.inf
    want = torch.logaddexp(s_a[1], s_b[1])
    torch.testing.assert_close(got.lse[1], want)


def test_paged_matches_ragged_with_shuffled_slots(make_ragged):
    counts = [5, 0, 12, 37, 1, 7]
    kv = make_ragged(counts, H_KV, D)
    q = torch.randn(7, H_Q, D, generator=torch.Generator().manual_seed(6))
    qo_indptr = torch.tensor([0, 5, 7], dtype=torch.int32)
    want = ref.extend(q, kv.ragged, qo_indptr)
    k_cache, v_cache, beta_cache, kv_indptr, kv_indices = ragged_to_paged(
        kv.keys, kv.values, kv.beta, kv.indptr, H_KV
    )
    perm = torch.randperm(k_cache.shape[0], generator=torch.Generator().manual_seed(7))
    inv = torch.argsort(perm)
    slots = inv[kv_indices.long()].to(torch.int32)
    got = ref.paged_extend(
        q,
        qo_indptr,
        PagedKV(k_cache[perm], v_cache[perm], beta_cache[perm], kv_indptr, slots),
    )
    torch.testing.assert_close(got.out, want.out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got.lse, want.lse, atol=1e-6, rtol=1e-6)


def test_explicit_sm_scale(make_ragged):
    kv = make_ragged([37, 5, 12], H_KV, D)
    q = torch.randn(1, H_Q, D, generator=torch.Generator().manual_seed(8))
    got = ref.decode(q, kv.ragged, sm_scale=0.5)
    want = ref.decode(q * 0.5 * math.sqrt(D), kv.ragged)
    torch.testing.assert_close(got.out, want.out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.lse, want.lse, atol=1e-5, rtol=1e-5)


def _bad_cases():
    base = dict(
        q=torch.zeros(1, H_Q, D),
        keys=torch.zeros(6, D),
        values=torch.zeros(6, D),
        beta=torch.zeros(6),
        indptr=torch.tensor([0, 2, 4, 6], dtype=torch.int32),
    )
    yield "values shape", {**base, "values": torch.zeros(5, D)}
    yield "beta must be float32", {**base, "beta": torch.zeros(6, dtype=torch.float64)}
    yield "indptr must be int32", {**base, "indptr": base["indptr"].long()}
    yield "non-decreasing", {**base, "indptr": torch.tensor([0, 4, 2, 6], dtype=torch.int32)}
    yield (
        r"indptr\[-1\]=5 must equal 6",
        {**base, "indptr": torch.tensor([0, 2, 4, 5], dtype=torch.int32)},
    )
    yield "head dim 32", {**base, "q": torch.zeros(1, H_Q, 32)}
    yield "H_q=8", {**base, "q": torch.zeros(1, 8, D)}
    yield "sm_scale", {**base, "sm_scale": -1.0}


@pytest.mark.parametrize(("match", "kwargs"), list(_bad_cases()), ids=lambda x: str(x)[:20])
def test_invalid_inputs_raise_value_error(match, kwargs):
    kw = dict(kwargs)
    q, sm_scale = kw.pop("q"), kw.pop("sm_scale", None)
    with pytest.raises(ValueError, match=match):
        ref.decode(q, RaggedKV(**kw), sm_scale=sm_scale)


def test_merge_state_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="v_b shape"):
        merge_ref.merge_state(
            torch.zeros(2, 3, 4), torch.zeros(2, 3), torch.zeros(2, 3, 5), torch.zeros(2, 3)
        )
    with pytest.raises(ValueError, match="s_b must be float32"):
        merge_ref.merge_state(
            torch.zeros(2, 3, 4),
            torch.zeros(2, 3),
            torch.zeros(2, 3, 4),
            torch.zeros(2, 3, dtype=torch.float16),
        )


def test_importing_kernels_loads_no_triton_flashinfer_or_project_code():
    # kernels is a leaf package: compactor and sglang_ext import it, never the reverse
    code = (
        "import sys, compaction_kernels, compaction_kernels.biased_attention, compaction_kernels.merge_state\n"
        "from compaction_kernels.biased_attention import reference\n"
        "from compaction_kernels.merge_state import reference\n"
        "bad = [m for m in ('triton', 'flashinfer', 'compactor', 'sglang_ext') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)

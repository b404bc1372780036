"""The dense torch reference ``biased_attention``: its fused (SDPA, no LSE) and explicit fp32
(with LSE) evaluations agree, GQA equals repeating the KV heads, the causal tail equals
slicing each query's visible keys, and the extra float mask adds to beta.

Odd sizes: H_kv=3, G=2, m=5 queries, t=13 keys, D=24.
"""

from __future__ import annotations

import math

import pytest
import torch

from compaction_kernels.biased_attention.reference import (
    attention_bias,
    biased_attention,
    biased_attention_lse,
)

H_KV, G, M, T, D = 3, 2, 5, 13, 24
TOL = dict(atol=1e-5, rtol=1e-5)


def _inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, H_KV * G, M, D, generator=gen)
    k = torch.randn(2, H_KV, T, D, generator=gen)
    v = torch.randn(2, H_KV, T, D, generator=gen)
    beta = torch.randn(2, H_KV, T, generator=gen)
    beta[0, 1, [0, 4, 12]] = -math.inf
    return q, k, v, beta


@pytest.mark.parametrize("causal_offset", [None, T - M, 2])
def test_fused_and_explicit_paths_agree(causal_offset):
    q, k, v, beta = _inputs()
    bias = torch.randn(2, 1, M, T, generator=torch.Generator().manual_seed(1))
    kw = dict(sm_scale=0.3, causal_offset=causal_offset, bias=bias)
    fused = biased_attention(q, k, v, beta, **kw)
    exact = biased_attention_lse(q, k, v, beta, **kw)
    assert fused.dtype == torch.float32 and exact.lse.shape == (2, H_KV * G, M)
    torch.testing.assert_close(fused, exact.out, **TOL)


def test_gqa_equals_repeated_kv_heads_and_causal_equals_slicing():
    q, k, v, beta = _inputs(2)
    got = biased_attention_lse(q, k, v, beta, causal_offset=T - M)
    rep = [x.repeat_interleave(G, dim=1) for x in (k, v, beta)]
    for i in range(M):
        n = T - M + i + 1  # keys query i sees
        want = biased_attention_lse(
            q[:, :, i : i + 1], rep[0][:, :, :n], rep[1][:, :, :n], rep[2][:, :, :n]
        )
        torch.testing.assert_close(got.out[:, :, i], want.out[:, :, 0], **TOL)
        torch.testing.assert_close(got.lse[:, :, i], want.lse[:, :, 0], **TOL)


def test_explicit_path_matches_logsumexp_and_softmax():
    q, k, v, beta = _inputs(3)
    got = biased_attention_lse(q[0, :H_KV], k[0], v[0], beta[0])
    logits = q[0, :H_KV] @ k[0].transpose(-1, -2) / math.sqrt(D) + beta[0][:, None, :]
    torch.testing.assert_close(got.lse, torch.logsumexp(logits, -1), **TOL)
    torch.testing.assert_close(got.out, torch.softmax(logits, -1) @ v[0], **TOL)


def test_fully_masked_and_empty_rows_give_zero_and_minus_inf():
    q, k, v, beta = _inputs(4)
    beta[:, 2] = -math.inf  # KV head 2 fully masked -> q heads 4, 5
    got = biased_attention_lse(q, k, v, beta)
    assert torch.all(got.out[:, 2 * G :] == 0) and torch.all(got.lse[:, 2 * G :] == -math.inf)
    assert torch.isfinite(got.lse[:, : 2 * G]).all()
    empty = biased_attention_lse(q[0, 0], k[0, 0, :0], v[0, 0, :0], beta[0, 0, :0])
    assert torch.all(empty.out == 0) and torch.all(empty.lse == -math.inf)


def test_attention_bias_repeats_heads_and_masks_the_future():
    beta = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])  # [H_kv=2, t=4]
    mask = attention_bias(beta, 2, group=2, causal_offset=1, dtype=torch.float64)
    assert mask.shape == (4, 2, 4) and mask.dtype == torch.float64
    inf = -math.inf
    want_h0 = torch.tensor([[1.0, 2.0, inf, inf], [1.0, 2.0, 3.0, inf]], dtype=torch.float64)
    torch.testing.assert_close(mask[0], want_h0)
    torch.testing.assert_close(mask[1], want_h0)
    assert torch.equal(mask[3, 1], torch.tensor([5.0, 6.0, 7.0, inf], dtype=torch.float64))
    assert attention_bias(beta, 3).shape == (2, 1, 4)  # no causal: broadcast over queries


def test_bad_shapes_raise_value_error():
    q, k, v, beta = _inputs()
    with pytest.raises(ValueError, match="H_q=6 must be a multiple of H_kv=4"):
        biased_attention(q, torch.zeros(2, 4, T, D), torch.zeros(2, 4, T, D))
    with pytest.raises(ValueError, match=r"must be \[..., H_kv=3 or 1, t\] under GQA"):
        biased_attention(q, k, v, beta[:, 0])
    with pytest.raises(ValueError, match="head dim"):
        biased_attention(q, k[..., :8], v)
    with pytest.raises(ValueError, match="sm_scale"):
        biased_attention(q, k, v, beta, sm_scale=0.0)

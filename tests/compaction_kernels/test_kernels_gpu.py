"""GPU checks (marker ``gpu``, skipped without CUDA): the Triton kernels against the fp32
torch reference at bf16 tolerances on long, ragged prefixes."""

from __future__ import annotations

import math

import pytest
import torch

from compaction_kernels.biased_attention import ragged_to_paged
from compaction_kernels.biased_attention import reference as ref

pytestmark = pytest.mark.gpu

D, H_KV, G = 128, 8, 4
H_Q = H_KV * G
BF16 = dict(atol=2e-2, rtol=2e-2)
LSE_TOL = dict(atol=2e-2, rtol=1e-3)


def _counts(num_req: int, max_len: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(1, max_len + 1, (num_req * H_KV,), generator=gen)
    counts[1] = 0  # one empty head
    counts[2] = max_len  # one full-length head
    return counts.tolist()


def _assert_matches(got, want):
    assert not torch.isnan(got.out).any() and not torch.isnan(got.lse).any()
    torch.testing.assert_close(got.out.float(), want.out, **BF16)
    finite = torch.isfinite(want.lse)
    assert torch.equal(torch.isfinite(got.lse), finite)
    torch.testing.assert_close(got.lse[finite], want.lse[finite], **LSE_TOL)


def _ragged(make_ragged, counts, seed=0):
    kv = make_ragged(counts, H_KV, D, seed=seed, dtype=torch.bfloat16, device="cuda")
    beta = kv.beta.clone()
    beta[::17] = -math.inf  # sprinkle masked entries
    return kv._replace(beta=beta)


@pytest.mark.parametrize(("num_req", "max_len"), [(1, 131072), (4, 32768), (32, 4096)])
def test_triton_decode_long_ragged(make_ragged, num_req, max_len):
    from compaction_kernels.biased_attention import triton as tri

    kv = _ragged(make_ragged, _counts(num_req, max_len, 1))
    q = torch.randn(num_req, H_Q, D, device="cuda", dtype=torch.bfloat16)
    got = tri.decode(q, kv.ragged)
    _assert_matches(got, ref.decode(q, kv.ragged))


def test_triton_extend_and_paged(make_ragged):
    from compaction_kernels.biased_attention import triton as tri

    kv = _ragged(make_ragged, _counts(3, 8192, 2), seed=2)
    qo = torch.tensor([0, 37, 38, 101], dtype=torch.int32, device="cuda")
    q = torch.randn(101, H_Q, D, device="cuda", dtype=torch.bfloat16)
    want = ref.extend(q, kv.ragged, qo)
    _assert_matches(tri.extend(q, kv.ragged, qo), want)
    pool = ragged_to_paged(kv.keys, kv.values, kv.beta, kv.indptr, H_KV)
    _assert_matches(tri.paged_extend(q, qo, pool), want)
    qd = q[qo[1:].long() - 1].contiguous()
    _assert_matches(tri.paged_decode(qd, pool), ref.decode(qd, kv.ragged))


def test_triton_merge_state_bf16():
    from compaction_kernels.merge_state import reference as merge_ref
    from compaction_kernels.merge_state import triton as merge_tri

    v_a, v_b = (torch.randn(64, H_Q, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    s_a, s_b = (torch.randn(64, H_Q, device="cuda") * 4 for _ in range(2))
    s_a[0] = -math.inf
    got = merge_tri.merge_state(v_a, s_a, v_b, s_b)
    want = merge_ref.merge_state(v_a, s_a, v_b, s_b)
    torch.testing.assert_close(got.out.float(), want.out, **BF16)
    torch.testing.assert_close(got.lse, want.lse)

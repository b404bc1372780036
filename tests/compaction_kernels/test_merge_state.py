"""merge_state: Triton (CPU: interpreter) against the reference and a direct computation."""

from __future__ import annotations

import math

import pytest
import torch

from compaction_kernels.merge_state import reference as merge_ref
from compaction_kernels.merge_state import triton as merge_tri


def _states(seed):
    gen = torch.Generator().manual_seed(seed)
    v_a, v_b = torch.randn(5, 9, 64, generator=gen), torch.randn(5, 9, 64, generator=gen)
    s_a, s_b = torch.randn(5, 9, generator=gen) * 3, torch.randn(5, 9, generator=gen) * 3
    s_a[0, :4] = -math.inf
    s_b[0, 2:6] = -math.inf  # [0, 2:4] empty on both sides
    s_b[1] = -math.inf
    return v_a, s_a, v_b, s_b


def test_triton_matches_reference():
    v_a, s_a, v_b, s_b = _states(0)
    got = merge_tri.merge_state(v_a, s_a, v_b, s_b)
    want = merge_ref.merge_state(v_a, s_a, v_b, s_b)
    assert not torch.isnan(got.out).any() and not torch.isnan(got.lse).any()
    torch.testing.assert_close(got.out, want.out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got.lse, want.lse, atol=1e-6, rtol=1e-6)
    assert torch.all(got.out[0, 2:4] == 0) and torch.all(got.lse[0, 2:4] == -math.inf)
    torch.testing.assert_close(got.out[1], v_a[1])


def test_merge_of_softmax_halves_equals_softmax_of_whole():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 4, 37, generator=gen) * 2
    values = torch.randn(37, 64, generator=gen)

    def part(sl):
        lg = logits[..., sl]
        return torch.softmax(lg, -1) @ values[sl], torch.logsumexp(lg, -1)

    (v_a, s_a), (v_b, s_b) = part(slice(0, 20)), part(slice(20, 37))
    got = merge_tri.merge_state(v_a, s_a, v_b, s_b)
    torch.testing.assert_close(got.out, torch.softmax(logits, -1) @ values, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.lse, torch.logsumexp(logits, -1), atol=1e-5, rtol=1e-5)


def test_triton_rejects_bad_shapes():
    with pytest.raises(ValueError, match="s_a must be"):
        merge_tri.merge_state(
            torch.zeros(2, 3, 4), torch.zeros(3, 2), torch.zeros(2, 3, 4), torch.zeros(2, 3)
        )

"""The ragged case of `benchmarks/gpu/decode_attention.py` (GPU-only timings): its per-head split
keeps each request's entries, uneven over the KV heads."""

from __future__ import annotations

import torch

from benchmarks.gpu.decode_attention import KERNELS, ragged_indptr


def test_ragged_split_keeps_the_entries_of_each_request_uneven_over_heads() -> None:
    ip = ragged_indptr(batch=3, length=1000, heads=8)
    assert ip.dtype == torch.int32 and ip.shape == (3 * 8 + 1,) and int(ip[0]) == 0
    per_head = torch.diff(ip.long()).reshape(3, 8)
    assert (per_head.sum(1) == 1000 * 8).all()  # the same entries as the uniform case
    assert (per_head == per_head[0]).all()  # every request alike
    assert (torch.diff(per_head[0]) > 0).all()  # head h keeps more than head h - 1
    assert int(per_head[0, -1]) > 3 * int(per_head[0, 0])
    assert "triton_beta_ragged" in KERNELS

"""The CPU stand-in for sgl_kernel against plain tensor indexing."""

from __future__ import annotations

import pytest
import torch

# scripts/setup.sh installs the stand-in only where torch sees no CUDA device (a GPU machine
# uses the real sgl_kernel); without one, a missing or real sgl_kernel is a broken install.
if torch.cuda.is_available():
    pytest.skip("CUDA device: the CPU stand-in is not installed here", allow_module_level=True)

import sgl_kernel  # after the CUDA skip: a GPU machine may have none

assert getattr(sgl_kernel, "__standin__", False), (
    f"{sgl_kernel.__file__} is not the CPU stand-in (third_party/sgl-kernel-cpu): run make setup"
)


def _pool(layers: int, slots: int, heads: int, dim: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(slots, heads, dim, generator=g).to(dtype) for _ in range(2 * layers)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("loc_dtype", [torch.int64, torch.int32])
def test_copy_all_layer_kv_cache_matches_indexing(
    dtype: torch.dtype, loc_dtype: torch.dtype
) -> None:
    bufs = _pool(layers=3, slots=37, heads=3, dim=5, dtype=dtype)
    expected = [b.clone() for b in bufs]
    tgt = torch.tensor([4, 9, 30, 2], dtype=loc_dtype)
    src = torch.tensor([9, 4, 1, 36], dtype=loc_dtype)  # overlapping: 4<->9 swap
    for e in expected:
        e[tgt.long()] = e[src.long()].clone()
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    strides = torch.tensor([b[0].numel() * b.element_size() for b in bufs], dtype=torch.int64)

    sgl_kernel.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)

    for got, want in zip(bufs, expected, strict=True):
        assert torch.equal(got, want)


def test_copy_all_layer_kv_cache_empty_and_errors() -> None:
    bufs = _pool(layers=1, slots=4, heads=1, dim=2, dtype=torch.float32)
    before = [b.clone() for b in bufs]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    strides = torch.tensor([8, 8], dtype=torch.int64)
    empty = torch.tensor([], dtype=torch.int64)
    sgl_kernel.copy_all_layer_kv_cache_cpu(ptrs, strides, empty, empty)
    assert all(torch.equal(a, b) for a, b in zip(bufs, before, strict=True))
    with pytest.raises(ValueError, match="entries"):
        sgl_kernel.copy_all_layer_kv_cache_cpu(ptrs, strides[:1], empty, empty)
    with pytest.raises(ValueError, match="non-negative"):
        sgl_kernel.copy_all_layer_kv_cache_cpu(ptrs, strides, torch.tensor([-1]), torch.tensor([0]))


def test_assign_req_to_token_pool_matches_indexing() -> None:
    req_to_token = torch.zeros(5, 11, dtype=torch.int32)
    req_pool_indices = torch.tensor([3, 0, 4])
    start = torch.tensor([2, 0, 7])
    end = torch.tensor([5, 1, 11])
    out_cache_loc = torch.arange(100, 108)  # 3 + 1 + 4 slots
    expected = req_to_token.clone()
    expected[3, 2:5] = torch.tensor([100, 101, 102], dtype=torch.int32)
    expected[0, 0:1] = torch.tensor([103], dtype=torch.int32)
    expected[4, 7:11] = torch.tensor([104, 105, 106, 107], dtype=torch.int32)

    sgl_kernel.assign_req_to_token_pool_cpu(
        req_pool_indices, req_to_token, start, end, out_cache_loc, req_to_token.shape[1]
    )

    assert torch.equal(req_to_token, expected)


def test_assign_req_to_token_pool_rejects_bad_span() -> None:
    table = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="bad span"):
        sgl_kernel.assign_req_to_token_pool_cpu(
            torch.tensor([0]), table, torch.tensor([2]), torch.tensor([6]), torch.arange(4), 4
        )


def test_unsupported_ops_fail_loudly() -> None:
    with pytest.raises(NotImplementedError, match="speculative"):
        sgl_kernel.verify_tree_greedy_cpu()
    with pytest.raises(AttributeError, match="stand-in"):
        _ = sgl_kernel.merge_state_v2

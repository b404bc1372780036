"""Pure-torch stand-in for `sgl_kernel` on CPU (see README.md of this distribution).

Only the ops SGLang calls on CPU for llama-family models are provided; anything else raises
AttributeError (so `from sgl_kernel import x` raises ImportError) naming this stand-in.
"""

from __future__ import annotations

import ctypes

import torch

__standin__ = True
__all__ = ["assign_req_to_token_pool_cpu", "copy_all_layer_kv_cache_cpu"]


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """For every K/V buffer b: `buf_b[tgt_loc[i], :] = buf_b[src_loc[i], :]` for all i.

    Args:
        data_ptrs: [num_bufs] uint64, base address of each buffer (one per layer for K and V).
        strides: [num_bufs] int64, bytes per slot row of each buffer.
        tgt_loc, src_loc: [num_locs] int32/int64 slot indices (same dtype).

    Mutates the buffers in place. Overlapping `tgt_loc`/`src_loc` are safe: all source rows of
    a buffer are gathered before any target row is written (as in the C++ op).
    """
    if data_ptrs.numel() != strides.numel():
        raise ValueError(
            f"data_ptrs has {data_ptrs.numel()} entries but strides has {strides.numel()}"
        )
    if tgt_loc.numel() != src_loc.numel():
        raise ValueError(f"tgt_loc has {tgt_loc.numel()} entries, src_loc {src_loc.numel()}")
    if tgt_loc.numel() == 0:
        return
    tgt = tgt_loc.to(torch.int64)
    src = src_loc.to(torch.int64)
    if int(torch.minimum(tgt.min(), src.min())) < 0:
        raise ValueError("slot indices must be non-negative")
    rows_needed = int(torch.maximum(tgt.max(), src.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        rows = _byte_rows(int(ptr), int(stride), rows_needed)
        rows[tgt] = rows[src].clone()


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's newly allocated slots into its row of the req->token table.

    For request i (in batch order): `req_to_token[req_pool_indices[i], start[i]:end[i]] =
    out_cache_loc[o_i : o_i + end[i] - start[i]]`, with o_i the sum of the earlier requests'
    lengths. Shapes: req_pool_indices/start_offset/end_offset [B], req_to_token
    [pool_size, pool_len], out_cache_loc [sum(end - start)]. Mutates `req_to_token`.
    """
    if req_to_token.shape[1] != pool_len:
        raise ValueError(f"pool_len {pool_len} != req_to_token.shape[1] {req_to_token.shape[1]}")
    offset = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        n = end - start
        if n < 0 or end > pool_len:
            raise ValueError(f"bad span [{start}, {end}) for a row of length {pool_len}")
        req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def _byte_rows(ptr: int, stride: int, rows: int) -> torch.Tensor:
    """A [rows, stride] uint8 view of the memory at `ptr` (no copy)."""
    buf = (ctypes.c_uint8 * (rows * stride)).from_address(ptr)
    return torch.frombuffer(buf, dtype=torch.uint8).view(rows, stride)


# SGLang imports these at module level on CPU but calls them only for speculative decoding,
# which the stand-in does not support: calling one raises NotImplementedError.
_SPECULATIVE_OPS = (
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu",
    "verify_tree_greedy_cpu",
)


def _unsupported(name: str) -> object:
    def op(*args: object, **kwargs: object) -> None:
        raise NotImplementedError(
            f"sgl_kernel.{name} (speculative decoding) is not implemented by the CPU stand-in"
        )

    op.__name__ = name
    return op


def __getattr__(name: str) -> object:
    if name in _SPECULATIVE_OPS:
        return _unsupported(name)
    raise AttributeError(
        f"sgl_kernel.{name} is not provided by the CPU stand-in (sgl-kernel-cpu-standin); "
        "this code path needs the real sgl-kernel on a GPU machine"
    )

"""Biased decode attention for CUDA graphs: fixed-shape device buffers, no host sync.

Legend: bs requests in a batch (max_bs the capacity), n query rows of a run (n = the graph's
batch size, bs <= n <= max_bs), H_q / H_kv heads, D head dim, S pool slots, R x W the
`req_to_token` table, C = max_context (the longest KV row a request may have).

A request on a compacted prefix node (logical length T_b, t_max = p_b physical slots) has
the row `req_to_token[row, :n_b]` = the p_b physical slots, T_b - p_b copies of
`ALIAS_SLOT` (beta -inf), then its own tail. The eager path (`attention_triton`) reads the
whole row and lets beta mask the aliases; this path reads [0, p_b) then [T_b, n_b), so the
aliases cost nothing, and the result is the same.

How it stays CUDA-graph safe (the approach of SGLang's Triton decode backend):
    - `GraphDecodePlan(...)` allocates every buffer once, sized by (max_bs, C): kv_indptr
      [max_bs+1], kv_indices [max_bs*C], the split partials [splits*max_bs*H_q*D]; the
      split size is fixed from C, never from the batch.
    - `check(bs, seq_lens_cpu, ...)` is the host-side validation (bs <= max_bs, n_b <= C,
      0 <= p_b <= T_b <= n_b), on host copies the scheduler already has. The backend calls it
      before capture and before each replay, outside the captured region; ValueError there.
    - `fill(...)` writes the buffers on the device (torch cumsum + a Triton kernel, one
      program per request): no `.item()`, `.cpu()` or `bool(tensor)`, no op whose output
      shape depends on tensor data. It does not validate values (that would sync).
    - `run(q, ...)` launches `_biased_attn_fwd` with grid (n, H_kv, splits) and merges the
      splits by LSE; it allocates only `out`, shaped like q. Rows b >= bs (graph padding)
      have an empty table and get out = 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kernels.biased_attention._common import (
    check_pool,
    check_queries,
    check_triton_device,
    default_sm_scale,
)
from kernels.biased_attention.graph import fill_slot_table, launch_decode

__all__ = ["GraphDecodePlan"]

HostInts = torch.Tensor | Sequence[int]


@dataclass
class GraphDecodePlan:
    """Persistent decode buffers for one attention shape (see the module legend).

    Args:
        max_bs: most requests per batch; max_context: C, the longest KV row (tokens).
        num_qo_heads, num_kv_heads, head_dim: H_q, H_kv, D (H_q a multiple of H_kv).
        device: where the buffers live (CUDA, or CPU under TRITON_INTERPRET=1).
        sm_scale: logit scale (None: 1/sqrt(D)).
        num_splits: KV splits per request (None: up to 8 on CUDA, chunks of >= 512 entries;
            up to 4 on CPU); block_n: keys per kernel step (None: 64 on CUDA, 16 on CPU).
    Raises:
        ValueError: a non-positive size, or H_q not a multiple of H_kv.
    """

    max_bs: int
    max_context: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    device: torch.device | str
    sm_scale: float | None = None
    num_splits: int | None = None
    block_n: int | None = None
    chunk_size: int = field(init=False)  # entries per split (a multiple of block_n)
    _launch: tuple[float, int, int] = field(init=False, repr=False)  # scale, block_n, splits
    kv_indptr: torch.Tensor = field(init=False, repr=False)  # [max_bs+1] int32
    kv_indices: torch.Tensor = field(init=False, repr=False)  # [max_bs*C] int32
    lens: torch.Tensor = field(init=False, repr=False)  # [max_bs] int32 table lengths
    _qo_indptr: torch.Tensor = field(init=False, repr=False)  # [max_bs+1] int32 arange
    _tile_start: torch.Tensor = field(init=False, repr=False)  # [max_bs] int32 zeros
    _zeros: torch.Tensor = field(init=False, repr=False)  # [max_bs] int64, p = T = 0
    _o_part: torch.Tensor = field(init=False, repr=False)  # [splits*max_bs*H_q*D] fp32
    _lse_part: torch.Tensor = field(init=False, repr=False)  # [splits*max_bs*H_q] fp32
    _lse: torch.Tensor = field(init=False, repr=False)  # [max_bs*H_q] fp32

    def __post_init__(self) -> None:
        sizes = dict(max_bs=self.max_bs, max_context=self.max_context,
                     num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads,
                     head_dim=self.head_dim)  # fmt: skip
        for name, val in sizes.items():
            if val < 1:
                raise ValueError(f"{name} must be >= 1, got {val}")
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(
                f"H_q={self.num_qo_heads} must be a multiple of H_kv={self.num_kv_heads}"
            )
        self.device = torch.device(self.device)
        self.sm_scale = default_sm_scale(self.head_dim, self.sm_scale)
        on_gpu = self.device.type == "cuda"
        block_n = self.block_n if self.block_n is not None else (64 if on_gpu else 16)
        if block_n < 16 or block_n & (block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
        splits = self.num_splits
        if splits is None:
            splits = min(8, math.ceil(self.max_context / 512)) if on_gpu else 4
        if splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {splits}")
        self.chunk_size = math.ceil(self.max_context / splits / block_n) * block_n
        self.block_n, self.num_splits = block_n, math.ceil(self.max_context / self.chunk_size)
        self._launch = (self.sm_scale, block_n, self.num_splits)
        dev, i32 = self.device, torch.int32
        rows_q = self.max_bs * self.num_qo_heads
        self.kv_indptr = torch.zeros(self.max_bs + 1, dtype=i32, device=dev)
        self.kv_indices = torch.zeros(self.max_bs * self.max_context, dtype=i32, device=dev)
        self.lens = torch.zeros(self.max_bs, dtype=i32, device=dev)
        self._qo_indptr = torch.arange(self.max_bs + 1, dtype=i32, device=dev)
        self._tile_start = torch.zeros(self.max_bs, dtype=i32, device=dev)
        self._zeros = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        f32 = torch.float32
        self._o_part = torch.empty(self.num_splits * rows_q * self.head_dim, dtype=f32, device=dev)
        self._lse_part = torch.empty(self.num_splits * rows_q, dtype=f32, device=dev)
        self._lse = torch.empty(rows_q, dtype=f32, device=dev)

    def check(
        self,
        bs: int,
        seq_lens: HostInts,
        prefix_physical: HostInts | None = None,
        prefix_logical: HostInts | None = None,
    ) -> None:
        """Host-side validation of a batch, called by the backend outside the captured region
        (before capture and before each replay) on host copies (`seq_lens_cpu`).

        Args:
            bs: requests; seq_lens, prefix_physical, prefix_logical: [>= bs] host ints
                (CPU tensors or lists; None: all 0). A CUDA tensor is refused: reading it
                here would be the sync this class avoids.
        Raises:
            ValueError: bs > max_bs, n_b > max_context, or not 0 <= p_b <= T_b <= n_b;
                the message names the request and its values.
        """
        if not 0 <= bs <= self.max_bs:
            raise ValueError(f"bs={bs} must lie in [0, max_bs={self.max_bs}]")
        lens = _host(seq_lens, "seq_lens", bs)
        phys = _host(prefix_physical, "prefix_physical", bs)
        logical = _host(prefix_logical, "prefix_logical", bs)
        for b, (n, p, t) in enumerate(zip(lens, phys, logical)):
            if n > self.max_context or not 0 <= p <= t <= n or n < 1:
                raise ValueError(
                    f"request {b}: need 1 <= seq_len <= max_context={self.max_context} and "
                    f"0 <= prefix_physical <= prefix_logical <= seq_len, got seq_len={n} "
                    f"prefix_physical={p} prefix_logical={t}"
                )

    def fill(
        self,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        prefix_physical: torch.Tensor | None,
        prefix_logical: torch.Tensor | None,
        bs: int,
    ) -> None:
        """Write the batch's alias-free slot table into the persistent buffers (on device).

        Args:
            req_to_token: [R, W] int32/int64; req_pool_indices, seq_lens: [>= bs] device
                ints; prefix_physical / prefix_logical: [>= bs] device ints, p_b = t_max of
                request b's compacted node and T_b its logical length (0 for plain
                requests; None: a batch without compacted requests).
            bs: requests (host int).
        Mutates `lens`, `kv_indptr`, `kv_indices`. Checks only shapes, dtypes and devices
        (no sync); the values must have passed `check()`.
        Raises:
            ValueError: bs > max_bs, or a tensor of the wrong rank, dtype, device or length.
        """
        if not 0 <= bs <= self.max_bs:
            raise ValueError(f"bs={bs} must lie in [0, max_bs={self.max_bs}]")
        if req_to_token.dim() != 2 or req_to_token.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"req_to_token must be [R, W] int32/int64, got {req_to_token.dtype} "
                f"{tuple(req_to_token.shape)}"
            )
        phys = self._zeros if prefix_physical is None else prefix_physical
        logical = self._zeros if prefix_logical is None else prefix_logical
        named = dict(req_pool_indices=req_pool_indices, seq_lens=seq_lens,
                     prefix_physical=phys, prefix_logical=logical)  # fmt: skip
        for name, t in named.items():
            if t.dim() != 1 or t.numel() < bs or t.is_floating_point():
                raise ValueError(f"{name} must be 1-D ints with >= bs={bs} entries, "
                                 f"got {t.dtype} {tuple(t.shape)}")  # fmt: skip
        check_triton_device(req_to_token, *named.values(), self.kv_indptr)
        if req_to_token.stride(1) != 1:
            req_to_token = req_to_token.contiguous()
        fill_slot_table(
            req_to_token, req_pool_indices, seq_lens, phys, logical, bs,
            self.lens, self.kv_indptr, self.kv_indices,
        )  # fmt: skip

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        beta_layer: torch.Tensor,
    ) -> torch.Tensor:
        """Decode attention of the filled batch: request b's token q[b] over its table.

        Args:
            q: [n, H_q, D], one new token per request, n <= max_bs (rows b >= bs get 0).
            k_cache, v_cache: [S, H_kv, D] one layer of the pool; beta_layer: [S, H_kv]
                fp32 (`BetaStore.beta[layer]`).
        Returns:
            out [n, H_q, D] in q's dtype (a new tensor; the plan's split buffers are
            overwritten). No host sync.
        Raises:
            ValueError: shapes, dtypes or devices that do not match the plan.
        """
        check_queries(q, self.num_kv_heads, self.head_dim)
        n = q.shape[0]
        if n > self.max_bs or q.shape[1] != self.num_qo_heads:
            raise ValueError(
                f"q must be [n <= max_bs={self.max_bs}, H_q={self.num_qo_heads}, "
                f"D={self.head_dim}], got {tuple(q.shape)}"
            )
        check_pool(k_cache, v_cache, beta_layer, self.num_kv_heads, self.head_dim)
        if k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
            raise ValueError("k_cache and v_cache need a contiguous last dim")
        check_triton_device(q, k_cache, v_cache, beta_layer, self.kv_indptr)
        if q.stride(2) != 1:
            q = q.contiguous()
        out = torch.empty((n, self.num_qo_heads, self.head_dim), dtype=q.dtype, device=q.device)
        scale, block_n, splits = self._launch
        rows_q = n * self.num_qo_heads
        o_part = self._o_part[: splits * rows_q * self.head_dim]
        # one tile per request: tile_req = qo_indptr[:-1] = arange, tile_start = 0
        tables = (self.kv_indptr, self.kv_indices, self._qo_indptr, self._qo_indptr,
                  self._tile_start)  # fmt: skip
        launch_decode(
            q, k_cache, v_cache, beta_layer, tables,
            o_part.view(splits, n, self.num_qo_heads, self.head_dim),
            self._lse_part[: splits * rows_q].view(splits, n, self.num_qo_heads),
            out, self._lse[:rows_q].view(n, self.num_qo_heads),
            sm_scale=scale, chunk_size=self.chunk_size, block_n=block_n,
        )  # fmt: skip
        return out


def _host(x: HostInts | None, name: str, bs: int) -> list[int]:
    """The first bs entries of a host int sequence (None: zeros); refuses device tensors."""
    if x is None:
        return [0] * bs
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise ValueError(f"{name} must be a host copy for check(), got one on {x.device}")
        if x.dim() != 1 or x.is_floating_point():
            raise ValueError(f"{name} must be 1-D ints, got {x.dtype} {tuple(x.shape)}")
        x = x.tolist()
    vals = [int(v) for v in x]
    if len(vals) < bs:
        raise ValueError(f"{name} has {len(vals)} entries, bs={bs}")
    return vals[:bs]

"""FlashInfer (GPU) biased attention over SGLang's paged pool: a JIT attention variant.

FlashInfer lets a custom ``AttentionVariant`` (C++ struct, JIT-compiled from
``jit_args``) rewrite each logit. Ours adds the per-slot, per-KV-head bias read from an
extra tensor argument ``beta_cache [S, H_kv]``. Two facts about FlashInfer's kernels shape
the transform:

* ``LogitsTransform`` sees the *unscaled* ``q.k``; the kernel multiplies its result by the
  variant's ``sm_scale_log2`` (= sm_scale * log2 e) afterwards. So the bias enters as
  ``beta / sm_scale``, and the kernel ends up with ``(q.k * sm_scale + beta) * log2 e``.
* ``kv_idx`` is the position inside the request's KV list, not the slot: the slot is
  ``paged_kv.indices[paged_kv.indptr[batch_idx] + kv_idx]`` (page size 1), and the hook
  also runs for padding positions past ``kv_len``, which must not be dereferenced.

beta = -inf is clamped to ``MASKED_BETA`` (-1e4) inside the kernel so that no chunk of
the split-KV decode sees an all -inf row (NaN in some FlashInfer versions); its weight is
exp(-1e4) = 0 in fp32. Rows whose LSE comes back below ``MASKED_BETA / 2`` saw only masked
entries and are rewritten to out = 0, lse = -inf, matching the reference. FlashInfer's
LSE is base 2; run() returns natural log.

Shape legend: :mod:`kernels.biased_attention._common` (B requests, n query tokens,
H_q = G * H_kv, D; ``k_cache/v_cache [S, H_kv, D]``, ``beta_cache [S, H_kv]`` fp32
contiguous, ``kv_indptr [B+1]``, ``kv_indices [nnz]`` int32, every request >= 1 slot).
For a ragged compacted prefix use :func:`kernels.biased_attention.ragged_to_paged`.

flashinfer is imported lazily (constructing a wrapper), never at module import.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch

from kernels.biased_attention._common import (
    AttentionOutput,
    check_indptr,
    check_pool,
    check_queries,
    check_slot_table,
    default_sm_scale,
)

__all__ = [
    "MASKED_BETA",
    "VARIANT_DECL",
    "VARIANT_NAME",
    "FlashInferBiasedPagedDecode",
    "FlashInferBiasedPagedExtend",
    "jit_args",
]

MASKED_BETA = -1.0e4
VARIANT_NAME = "CompactedBiasAttention"
VARIANT_DECL = r"""
template <typename P, typename = void>
struct CompactedBiasHasPagedKV : std::false_type {};
template <typename P>
struct CompactedBiasHasPagedKV<P, std::void_t<decltype(&P::paged_kv)>> : std::true_type {};

struct CompactedBiasAttention : AttentionVariantBase {
  static constexpr bool use_softmax = true;

  uint32_t window_left, qo_len, kv_len, kv_begin, num_kv_heads;
  float sm_scale_log2, inv_sm_scale;

  template <typename Params>
  __device__ __host__ CompactedBiasAttention(const Params& params, uint32_t batch_idx,
                                             uint8_t* smem_ptr) {
    qo_len = params.get_qo_len(batch_idx);
    kv_len = params.get_kv_len(batch_idx);
    window_left = kv_len;
    if constexpr (CompactedBiasHasPagedKV<Params>::value) {
      kv_begin = params.paged_kv.indptr[batch_idx];
      num_kv_heads = params.paged_kv.num_heads;
    } else {  // ragged prefill: built beside the paged kernel, never run by this module
      kv_begin = 0;
      num_kv_heads = params.num_kv_heads;
    }
    sm_scale_log2 = float(params.sm_scale) * math::log2e;
    inv_sm_scale = 1.f / float(params.sm_scale);
  }

  // logits = raw q.k; the kernel multiplies the result by sm_scale_log2.
  REGISTER_LOGITS_TRANSFORM(params, logits, batch_idx, qo_idx, kv_idx, qo_head_idx, kv_head_idx, {
    if constexpr (CompactedBiasHasPagedKV<Params>::value) {
      if (kv_idx < kv_len) {
        const int64_t slot = params.paged_kv.indices[kv_begin + kv_idx];
        const float beta = fmaxf(params.beta_cache[slot * num_kv_heads + kv_head_idx], -1.0e4f);
        return logits + beta * inv_sm_scale;
      }
    }
    return logits;
  })
};
"""


def jit_args(
    uri: str, q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int
) -> tuple[Any, ...]:
    """The ``jit_args`` tuple FlashInfer's wrappers take for our variant.

    Newer FlashInfer (``gen_customize_batch_decode_module`` with ``head_dim_vo``) wants
    separate qk/vo head dims and "double" scalars; older versions one head dim and "float".
    """
    from flashinfer.jit import gen_customize_batch_decode_module

    params = inspect.signature(gen_customize_batch_decode_module).parameters
    new_style = "head_dim_vo" in params
    dims: tuple[int, ...] = (head_dim, head_dim) if new_style else (head_dim,)
    return (
        uri,
        q_dtype,
        kv_dtype,
        q_dtype,
        torch.int32,
        *dims,
        ["beta_cache"],
        ["float"],  # additional tensors
        ["sm_scale"],
        ["double" if new_style else "float"],  # additional scalars
        VARIANT_NAME,
        VARIANT_DECL,
    )


def _dtype_tag(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _Base:
    """Workspace, plan checks, run() and output post-processing shared by decode and extend."""

    def __init__(self, workspace_bytes: int = 128 << 20, device: str | torch.device = "cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError("FlashInfer kernels need a CUDA device")
        self.device = torch.device(device)
        self._workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._inner: dict[tuple[Any, ...], Any] = {}
        self._active: Any = None
        self._shape: tuple[int, int, int, int] | None = None  # (n, H_q, H_kv, D)
        self._sm_scale = 1.0

    def _check_plan(
        self,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sm_scale: float | None,
    ) -> torch.Tensor:
        check_slot_table(kv_indptr, kv_indices)
        if num_kv_heads <= 0 or num_qo_heads % num_kv_heads:
            raise ValueError(f"H_q={num_qo_heads} must be a multiple of H_kv={num_kv_heads}")
        lens = kv_indptr.cpu().diff()
        if bool((lens == 0).any()):
            bad = int(torch.nonzero(lens == 0)[0, 0])
            raise ValueError(
                f"request {bad} has no KV slots; FlashInfer needs >= 1 per request "
                "(alias a padding slot with beta = -inf)"
            )
        self._sm_scale = default_sm_scale(head_dim, sm_scale)
        return torch.ones(lens.numel(), dtype=torch.int32, device=self.device)

    def _activate(
        self,
        uri: str,
        q_dtype: torch.dtype,
        kv_dtype: torch.dtype,
        head_dim: int,
        make: Callable[[tuple[Any, ...]], Any],
    ) -> None:
        """Make (first use: JIT-compile) the FlashInfer wrapper ``make(jit_args)`` for this
        (dtype, head_dim) pair, cache it, and make it the one plan()/run() use."""
        key = (q_dtype, kv_dtype, head_dim)
        if key not in self._inner:
            self._inner[key] = make(jit_args(uri, q_dtype, kv_dtype, head_dim))
        self._active = self._inner[key]

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        beta_cache: torch.Tensor,
    ) -> AttentionOutput:
        """``q [n, H_q, D]`` (decode: n = B) as planned over ``k_cache/v_cache [S, H_kv, D]``,
        ``beta_cache [S, H_kv]`` fp32. Returns ``out [n, H_q, D]`` (q dtype) and
        ``lse [n, H_q]`` fp32 natural log."""
        if self._active is None or self._shape is None:
            raise RuntimeError("call plan() before run()")
        n, num_qo, num_kv, dim = self._shape
        if tuple(q.shape) != (n, num_qo, dim):
            raise ValueError(f"q must be [{n}, {num_qo}, {dim}] as planned, got {tuple(q.shape)}")
        check_queries(q, num_kv, dim)
        check_pool(k_cache, v_cache, beta_cache, num_kv, dim)
        beta_cache = beta_cache.contiguous()
        paged = (k_cache.unsqueeze(1), v_cache.unsqueeze(1))  # NHD, page size 1
        out, lse2 = self._active.run(q, paged, beta_cache, self._sm_scale, return_lse=True)
        lse = lse2.float() * math.log(2.0)
        masked = ~(lse > 0.5 * MASKED_BETA)  # also catches NaN
        out = torch.where(masked[..., None], torch.zeros_like(out), out)
        lse = torch.where(masked, torch.full_like(lse, -math.inf), lse)
        return AttentionOutput(out, lse)


class FlashInferBiasedPagedDecode(_Base):
    """plan()/run() decode, ``q [B, H_q, D]``, over the paged pool with ``beta_cache``."""

    def __init__(
        self,
        workspace_bytes: int = 128 << 20,
        device: str | torch.device = "cuda",
        use_tensor_cores: bool = False,
    ):
        super().__init__(workspace_bytes, device)
        self.use_tensor_cores = use_tensor_cores

    def plan(
        self,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        sm_scale: float | None = None,
        q_dtype: torch.dtype = torch.bfloat16,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """Plan (host-side scheduling, one sync). JIT-compiles the variant on first use of
        a (dtype, head_dim) pair, which takes minutes. Mutates this wrapper only."""
        import flashinfer

        last_page_len = self._check_plan(
            kv_indptr, kv_indices, num_qo_heads, num_kv_heads, head_dim, sm_scale
        )
        kv_dtype = kv_dtype or q_dtype
        uri = (
            f"compacted_bias_decode_{_dtype_tag(q_dtype)}_{_dtype_tag(kv_dtype)}_"
            f"d{head_dim}_tc{int(self.use_tensor_cores)}"
        )
        self._activate(
            uri, q_dtype, kv_dtype, head_dim,
            lambda args: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace,
                "NHD",
                use_tensor_cores=self.use_tensor_cores,
                # a custom variant needs a named backend (FlashInfer refuses "auto" with
                # jit_args); the tensor-core decode runs FA2's prefill kernel
                backend="fa2",
                jit_args=args,
            ),
        )  # fmt: skip
        self._active.plan(
            kv_indptr.to(self.device),
            kv_indices.to(self.device),
            last_page_len,
            num_qo_heads,
            num_kv_heads,
            head_dim,
            1,
            q_data_type=q_dtype,
            kv_data_type=kv_dtype,
        )
        self._shape = (kv_indptr.numel() - 1, num_qo_heads, num_kv_heads, head_dim)


class FlashInferBiasedPagedExtend(_Base):
    """plan()/run() extend, ``q [n, H_q, D]`` + ``qo_indptr [B+1]``, non-causal over the
    paged prefix (FlashInfer's FA2 paged prefill with the same variant)."""

    def plan(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        sm_scale: float | None = None,
        q_dtype: torch.dtype = torch.bfloat16,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """Plan (host-side scheduling, one sync; first use JIT-compiles the variant)."""
        import flashinfer

        last_page_len = self._check_plan(
            kv_indptr, kv_indices, num_qo_heads, num_kv_heads, head_dim, sm_scale
        )
        check_indptr(qo_indptr, "qo_indptr", kv_indptr.numel(), None)
        kv_dtype = kv_dtype or q_dtype
        uri = f"compacted_bias_prefill_{_dtype_tag(q_dtype)}_{_dtype_tag(kv_dtype)}_d{head_dim}"
        self._activate(
            uri, q_dtype, kv_dtype, head_dim,
            lambda args: flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self._workspace, "NHD", backend="fa2", jit_args=args
            ),
        )  # fmt: skip
        self._active.plan(
            qo_indptr.to(self.device),
            kv_indptr.to(self.device),
            kv_indices.to(self.device),
            last_page_len,
            num_qo_heads,
            num_kv_heads,
            head_dim,
            1,
            causal=False,
            q_data_type=q_dtype,
            kv_data_type=kv_dtype,
        )
        self._shape = (int(qo_indptr[-1]), num_qo_heads, num_kv_heads, head_dim)

"""Attention with a per-key bias ``beta`` over ragged compacted KV (and SGLang's paged pool).

Backends, imported on demand (this package does not import triton):
    reference   torch, fp32, the truth (:mod:`.reference`)
    triton      Triton kernels, GPU or ``TRITON_INTERPRET=1`` on CPU (:mod:`.triton`)

Shape legend and layouts: :mod:`compaction_kernels.biased_attention._common`.
"""

from compaction_kernels.biased_attention._common import (
    AttentionOutput,
    PagedKV,
    RaggedKV,
    ragged_to_paged,
)

__all__ = ["AttentionOutput", "PagedKV", "RaggedKV", "ragged_to_paged"]

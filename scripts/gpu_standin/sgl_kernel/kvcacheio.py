"""`sgl_kernel.kvcacheio` of the check-only GPU stand-in: host-memory KV transfers (HiCache)
that SGLang imports at module level on CUDA; calling one raises NotImplementedError."""

from __future__ import annotations

from ._stubs import unsupported

_NAMES = (
    "transfer_embedding_ranges_direct",
    "transfer_kv_all_layer",
    "transfer_kv_all_layer_direct_lf_pf",
    "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_lf_ph",
    "transfer_kv_all_layer_mla",
    "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_direct",
    "transfer_kv_per_layer",
    "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_per_layer_mla",
    "transfer_kv_per_layer_mla_pf_lf",
    "transfer_kv_per_layer_pf_lf",
    "transfer_kv_per_layer_ph_lf",
)
globals().update({n: unsupported(f"kvcacheio.{n}") for n in _NAMES})
__all__ = list(_NAMES)

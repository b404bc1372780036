"""Attention kernels for compacted prefixes: one sub-package per op.

Every op has a torch ``reference`` (fp32, the truth) and a Triton implementation. Importing
this package does not import triton: pick a backend explicitly, e.g.
``from compaction_kernels.biased_attention import triton`` or through :func:`get_backend`.

Ops:
    biased_attention   attention with a per-key bias ``beta`` over ragged per-head KV
                       (compacted prefixes) or SGLang's paged slot layout; returns the LSE.
    merge_state        merge two partial attention results by their LSE (cascade).
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["BACKENDS", "OPS", "get_backend"]

OPS = ("biased_attention", "merge_state")
BACKENDS = {
    "biased_attention": ("reference", "triton"),
    "merge_state": ("reference", "triton"),
}


def get_backend(op: str, backend: str = "reference") -> ModuleType:
    """Import and return ``compaction_kernels.<op>.<backend>`` (lazily: triton loads here)."""
    if op not in BACKENDS:
        raise ValueError(f"unknown op {op!r}; known: {sorted(BACKENDS)}")
    if backend not in BACKENDS[op]:
        raise ValueError(f"op {op!r} has no backend {backend!r}; known: {BACKENDS[op]}")
    return importlib.import_module(f"compaction_kernels.{op}.{backend}")

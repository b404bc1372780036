"""`sgl_kernel.utils` of the check-only GPU stand-in: `is_arch_support_pdl`, the one name SGLang
imports from it (layers/attention/triton_backend.py, at module level on CUDA)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def is_arch_support_pdl() -> bool:
    """Whether the current CUDA device can take programmatic dependent launch (PDL): compute
    capability 9.0 or newer, on CUDA (not ROCm). The same answer as the real sgl_kernel.utils
    (and SGLang's own sglang.kernels.jit.utils) gives, so SGLang's Triton attention backend
    launches its decode kernels with PDL on an H100 exactly as with the real package; PDL only
    lets a kernel's prologue overlap the previous kernel's tail, never changes results.
    False where there is no CUDA device. Cached like the real one (first device asked)."""
    if torch.version.hip is not None or not torch.cuda.is_available():
        return False
    major, _ = torch.cuda.get_device_capability(torch.cuda.current_device())
    return major >= 9

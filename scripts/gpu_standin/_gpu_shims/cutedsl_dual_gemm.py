"""CHECK-ONLY shim for `sglang.kernels.ops.gemm.cutedsl_dual_gemm` (scripts/gpu_standin only).

The real module is SGLang's CuTe-DSL small-batch dual GEMM for SM100 (Blackwell); it imports
`cutlass` (nvidia-cutlass-dsl) at module level, which the GPU machine lacks. SGLang's
`DualGemm._select_mode` (srt/layers/dual_gemm.py) imports MAX_DUAL_GEMM_DECODE_TOKENS,
DualGemmQuantMode and can_use_dual_gemm from it while building every Llama MLP on CUDA, and
uses the fused kernel only when can_use_dual_gemm(...) is True. On an H100 (sm90) the real
can_use_dual_gemm is False too, because it requires is_sm100_supported(); so this shim answers
False for every shape and DualGemm's mode stays None, as with the real module. The kernels
themselves (dual_gemm_swiglu, dual_gemm_swiglu_fp8: registered for SM10x only) raise
NotImplementedError naming this shim.
"""

from __future__ import annotations

from enum import IntEnum

__shim__ = True

MAX_DUAL_GEMM_DECODE_TOKENS = 16  # as the real module


class DualGemmQuantMode(IntEnum):
    """The real module's quantization modes (same values and properties)."""

    STATIC_PER_TENSOR = 0
    STATIC_PER_TOKEN = 1
    DYNAMIC_PER_TENSOR = 2
    DYNAMIC_PER_TOKEN = 3
    UNQUANT = 4

    @property
    def is_quantized(self) -> bool:
        return self is not DualGemmQuantMode.UNQUANT

    @property
    def is_dynamic(self) -> bool:
        return self in (DualGemmQuantMode.DYNAMIC_PER_TENSOR, DualGemmQuantMode.DYNAMIC_PER_TOKEN)

    @property
    def is_per_token(self) -> bool:
        return self in (DualGemmQuantMode.STATIC_PER_TOKEN, DualGemmQuantMode.DYNAMIC_PER_TOKEN)


def can_use_dual_gemm(
    num_tokens: int, hidden_size: int, intermediate_size: int, quant_mode: DualGemmQuantMode
) -> bool:
    """Always False: the real predicate requires SM100 (is_sm100_supported()), so it is False
    on the sm90 H100 this shim serves; without cutlass the kernel could not run anyway."""
    return False


def _unsupported(name: str) -> object:
    def kernel(*args: object, **kwargs: object) -> object:
        raise NotImplementedError(
            f"sglang.kernels.ops.gemm.cutedsl_dual_gemm.{name} is not available: the module is "
            "the check-only shim of scripts/gpu_standin/_gpu_shims (no cutlass; SM100 only)"
        )

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


dual_gemm_swiglu = _unsupported("dual_gemm_swiglu")
dual_gemm_swiglu_fp8 = _unsupported("dual_gemm_swiglu_fp8")

"""`sgl_kernel.quantization` of the check-only GPU stand-in: GGUF ops SGLang imports at
module level on CUDA (layers/quantization/gguf.py); calling one raises NotImplementedError."""

from __future__ import annotations

from ._stubs import unsupported

ggml_dequantize = unsupported("quantization.ggml_dequantize")
ggml_moe_a8 = unsupported("quantization.ggml_moe_a8")
ggml_mul_mat_a8 = unsupported("quantization.ggml_mul_mat_a8")
ggml_mul_mat_vec_a8 = unsupported("quantization.ggml_mul_mat_vec_a8")

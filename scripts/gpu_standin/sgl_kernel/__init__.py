"""CHECK-ONLY stand-in for `sgl_kernel` on CUDA: used by scripts/gpu_serving.sh alone.

SGLang 0.5.23's compiled kernel package (`sglang-kernel`) is too large for the offline
wheelhouse and built for another torch, so `scripts/gpu_serving.sh` puts this directory first on
PYTHONPATH instead. It is never installed for users (no pyproject here): a real deployment
uses the real `sglang-kernel`. It provides, in plain torch, exactly the ops that SGLang's
bf16 Llama path + FlashInfer/Triton backends + greedy/top-k/top-p sampling + CUDA graphs call:

    rmsnorm, fused_add_rmsnorm, gemma_rmsnorm, gemma_fused_add_rmsnorm   (layers/layernorm.py)
    silu_and_mul, gelu_and_mul, gelu_tanh_and_mul   (layers/activation.py: hidden sizes the
        JIT act-and-mul kernel cannot take)
    top_k_renorm_prob, top_p_renorm_prob   (layers/sampler.py)
    weak_ref_tensor   (model_executor/runner_backend_utils/weak_ref_tensor.py)
    utils.is_arch_support_pdl   (layers/attention/triton_backend.py: sm90+ as the real one)

plus `scalar_type` (ScalarType, scalar_types: pure-Python layouts SGLang reads while importing
its quantization modules). Rotary embeddings, the KV-cache store and the act-and-mul fast path
are SGLang's own JIT kernels (sglang.kernels, built with nvcc on the machine), not sgl_kernel ops.

Every other name SGLang imports from `sgl_kernel` (anywhere, on any platform branch: quantized
GEMMs, MoE, MLA, speculative decoding, HiCache transfers, CPU/XPU/ROCm ops) exists, listed in
the one table `_names.STUBS`, and raises NotImplementedError naming itself and this stand-in
when called; its submodules (`flash_attn`, `kvcacheio`, `quantization`, ...) are registered in
sys.modules so `from sgl_kernel.x import y` works. Any name SGLang does not import raises
AttributeError naming this stand-in, so a code path that needs the real kernels fails loudly.
`benchmarks/gpu/preflight/kernels.py` checks that every import SGLang has resolves here. Shapes:
x [N, H] (rows, hidden), gated input [N, 2d] -> out [N, d], probs [B, V].
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from ._names import STUBS
from ._stubs import missing_attribute, stub_module, unsupported

__standin__ = True
__version__ = "0.0.0+gpu-check-standin"
_IMPLEMENTED = (
    "fused_add_rmsnorm",
    "gelu_and_mul",
    "gelu_tanh_and_mul",
    "gemma_fused_add_rmsnorm",
    "gemma_rmsnorm",
    "rmsnorm",
    "silu_and_mul",
    "top_k_renorm_prob",
    "top_p_renorm_prob",
    "weak_ref_tensor",
)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """float32 RMS norm of the rows of x times (weight + offset), in x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (y * (weight.float() + offset)).to(x.dtype)


def rmsnorm(
    input: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    enable_pdl: bool | None = None,
) -> torch.Tensor:
    """out = input / rms(input) * weight (rows of [N, H]); writes `out` when given."""
    y = _rms(input, weight, eps, 0.0)
    if out is None:
        return y
    out.copy_(y)
    return out


def fused_add_rmsnorm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    enable_pdl: bool | None = None,
) -> None:
    """In place: residual = input + residual; input = rmsnorm(residual) * weight."""
    s = input.float() + residual.float()
    residual.copy_(s.to(residual.dtype))
    input.copy_(_rms(s, weight, eps, 0.0).to(input.dtype))


def gemma_rmsnorm(
    input: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    enable_pdl: bool | None = None,
) -> torch.Tensor:
    """Gemma's RMS norm: input / rms(input) * (1 + weight)."""
    y = _rms(input, weight, eps, 1.0)
    if out is None:
        return y
    out.copy_(y)
    return out


def gemma_fused_add_rmsnorm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    enable_pdl: bool | None = None,
) -> None:
    """In place: residual = input + residual; input = residual / rms * (1 + weight)."""
    s = input.float() + residual.float()
    residual.copy_(s.to(residual.dtype))
    input.copy_(_rms(s, weight, eps, 1.0).to(input.dtype))


def _act_and_mul(act: str, input: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    d = input.shape[-1] // 2
    if input.shape[-1] != 2 * d:
        raise ValueError(f"act_and_mul: last dim {input.shape[-1]} is odd")
    gate, up = input[..., :d].float(), input[..., d:].float()
    if act == "silu":
        g = F.silu(gate)
    else:
        g = F.gelu(gate, approximate="tanh" if act == "gelu_tanh" else "none")
    y = (g * up).to(input.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def silu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[..., 2d] -> [..., d]: silu(x[..., :d]) * x[..., d:]."""
    return _act_and_mul("silu", input, out)


def gelu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[..., 2d] -> [..., d]: gelu(x[..., :d]) * x[..., d:] (erf gelu)."""
    return _act_and_mul("gelu", input, out)


def gelu_tanh_and_mul(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[..., 2d] -> [..., d]: gelu_tanh(x[..., :d]) * x[..., d:]."""
    return _act_and_mul("gelu_tanh", input, out)


def _per_row(value: torch.Tensor | float | int, rows: int, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(value, device=device)
    return t.reshape(-1).expand(rows) if t.numel() == 1 else t.reshape(rows)


def top_k_renorm_prob(probs: torch.Tensor, top_k: torch.Tensor | int) -> torch.Tensor:
    """probs [B, V]: keep each row's top_k largest (ties at the k-th value kept; k <= 0 or
    k >= V keeps all), zero the rest, renormalise."""
    b, v = probs.shape
    k = _per_row(top_k, b, probs.device).long()
    k = torch.where((k <= 0) | (k > v), torch.full_like(k, v), k)
    sorted_p = probs.sort(dim=-1, descending=True).values
    kth = sorted_p.gather(1, (k - 1).unsqueeze(1))
    kept = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)


def top_p_renorm_prob(probs: torch.Tensor, top_p: torch.Tensor | float) -> torch.Tensor:
    """probs [B, V]: keep each row's smallest most-probable set whose mass reaches top_p (a
    token is kept when the mass strictly before it is < top_p), zero the rest, renormalise."""
    b, _ = probs.shape
    p = _per_row(top_p, b, probs.device).to(probs.dtype).unsqueeze(1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(dim=-1) - sorted_p
    keep_sorted = before < p
    keep_sorted[:, 0] = True
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)


def weak_ref_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The real op returns a non-owning alias of a CUDA-graph output; this one returns an
    owning alias (same storage, shape and strides): graph outputs stay allocated a little
    longer, which changes memory use, never results."""
    return tensor.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())


def _register_stubs() -> list[str]:
    """Bind `_names.STUBS`: top-level stub ops here, stub submodules in sys.modules (under this
    package's own name, which is not `sgl_kernel` when a test loads it under another)."""
    names: list[str] = []
    for sub, ops in STUBS.items():
        if sub:
            mod = stub_module(f"{__name__}.{sub}", sub, ops)
            sys.modules[mod.__name__] = mod
            globals()[sub] = mod
            names.append(sub)
        else:
            clash = set(ops) & set(_IMPLEMENTED)
            if clash:
                raise RuntimeError(f"_names.STUBS lists implemented ops: {sorted(clash)}")
            globals().update({n: unsupported(n) for n in ops})
            names.extend(ops)
    return names


__all__ = sorted([*_IMPLEMENTED, *_register_stubs()])
__getattr__ = missing_attribute("sgl_kernel")

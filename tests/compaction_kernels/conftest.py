"""Fixtures for kernel tests: small odd ragged KV sets, one torch thread, GPU gating.

Triton reads TRITON_INTERPRET when it is first imported; the root tests/conftest.py sets it
on machines without CUDA, and this file does the same (setdefault) in case it runs first.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import pytest
import torch

from compaction_kernels import biased_attention

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


class RaggedKV(NamedTuple):
    """Batched ragged KV: keys/values [N, D], beta [N] fp32, indptr [B*H_kv+1] int32."""

    keys: torch.Tensor
    values: torch.Tensor
    beta: torch.Tensor
    indptr: torch.Tensor
    num_kv_heads: int

    @property
    def ragged(self) -> biased_attention.RaggedKV:
        """The set as the kernels take it (no head count)."""
        return biased_attention.RaggedKV(self.keys, self.values, self.beta, self.indptr)


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread() -> None:
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and "tests/compaction_kernels" in str(item.fspath).replace(
            os.sep, "/"
        ):
            item.add_marker(skip)


def build_ragged(
    counts: Sequence[int],
    num_kv_heads: int,
    head_dim: int,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    beta_scale: float = 1.0,
) -> RaggedKV:
    """Random ragged KV with ``counts[b*H_kv + h]`` rows for request b, KV head h."""
    if len(counts) % num_kv_heads:
        raise ValueError("len(counts) must be a multiple of num_kv_heads")
    gen = torch.Generator().manual_seed(seed)
    total = int(sum(counts))
    indptr = torch.zeros(len(counts) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(counts, dtype=torch.int64), 0).to(torch.int32)
    keys = torch.randn(total, head_dim, generator=gen)
    values = torch.randn(total, head_dim, generator=gen)
    beta = torch.randn(total, generator=gen) * beta_scale
    return RaggedKV(
        keys.to(device, dtype),
        values.to(device, dtype),
        beta.to(device),
        indptr.to(device),
        num_kv_heads,
    )


@pytest.fixture
def make_ragged() -> Callable[..., RaggedKV]:
    return build_ragged


@pytest.fixture
def sdpa() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """Plain dense attention of ``q [m, D]`` over ``k, v [t, D]`` with a float bias [t]:
    returns (out [m, D], lse [m]) in fp32, via torch SDPA and logsumexp."""

    def run(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bias: torch.Tensor,
        scale: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        q, k, v, bias = q.double(), k.double(), v.double(), bias.double()
        out = torch.nn.functional.scaled_dot_product_attention(
            q[None, None],
            k[None, None],
            v[None, None],
            attn_mask=bias[None, None, None, :],
            scale=scale,
        )[0, 0]
        lse = torch.logsumexp(q @ k.T * scale + bias[None, :], dim=-1)
        return out.float(), lse.float()

    return run


@pytest.fixture
def per_head_check(
    sdpa: Callable[..., tuple[torch.Tensor, torch.Tensor]],
) -> Callable[..., None]:
    """Assert a ragged decode result ``got`` (out [B, H_q, D], lse [B, H_q]) equals dense
    attention per (request, KV head) segment, and out = 0, lse = -inf on empty segments."""

    def check(got: Any, q: torch.Tensor, kv: RaggedKV, atol: float, rtol: float) -> None:
        host, num_kv = kv.indptr.tolist(), kv.num_kv_heads
        group = q.shape[1] // num_kv
        for b in range(q.shape[0]):
            for h in range(num_kv):
                s, e = host[b * num_kv + h], host[b * num_kv + h + 1]
                heads = slice(h * group, (h + 1) * group)
                if s == e:
                    assert torch.all(got.out[b, heads] == 0)
                    assert torch.all(got.lse[b, heads] == -math.inf)
                    continue
                out, lse = sdpa(q[b, heads], kv.keys[s:e], kv.values[s:e], kv.beta[s:e])
                torch.testing.assert_close(got.out[b, heads], out, atol=atol, rtol=rtol)
                torch.testing.assert_close(got.lse[b, heads], lse, atol=atol, rtol=rtol)

    return check

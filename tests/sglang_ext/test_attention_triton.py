"""The Triton path for compacted prefixes: `attention.paged` against `biased_sdpa` per
request (CPU under TRITON_INTERPRET=1, and on CUDA; no SGLang needed). The backend that runs
compacted batches on CUDA (`wrapped_backend`, through `cascade`) is tested in
test_sglang_ext_wrapped_backend.py and test_sglang_ext_cascade.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_ext.attention.paged import paged_biased_attention, plan_batch
from sglang_ext.attention.sdpa import biased_sdpa
from sglang_ext.kv_store import ALIAS_SLOT

S, H_KV, G, D = 96, 2, 3, 32
H_Q = H_KV * G
SCALE = 0.3
# Per request: compacted slots, aliases, own tokens. Request 1 touches no compacted slot.
LAYOUT = [(9, 4, 12), (0, 0, 17), (6, 7, 5)]
POOL_ROWS = [2, 0, 3]  # req_pool_indices


class Batch(SimpleNamespace):
    k: torch.Tensor  # [S, H_kv, D]
    v: torch.Tensor
    beta: torch.Tensor  # [S, H_kv]
    r2t: torch.Tensor  # [4, 48] int32
    rows: list[torch.Tensor]  # per request: its slots in row order
    compacted: torch.Tensor  # [S] bool


def make_batch(seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Batch:
    """Shuffled slots; compacted ones get random beta (-inf on one head's padding)."""
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(S, H_KV, D, generator=g), torch.randn(S, H_KV, D, generator=g)
    k[ALIAS_SLOT] = v[ALIAS_SLOT] = 0
    beta = torch.zeros(S, H_KV)
    beta[ALIAS_SLOT] = float("-inf")
    compacted = torch.zeros(S, dtype=torch.bool)
    compacted[ALIAS_SLOT] = True
    free = (torch.randperm(S - 1, generator=g) + 1).tolist()
    r2t = torch.randint(1, S, (4, 48), generator=g, dtype=torch.int32)  # junk past seq_len
    rows = []
    for (n_comp, n_alias, n_own), row in zip(LAYOUT, POOL_ROWS):
        comp = torch.tensor([free.pop() for _ in range(n_comp)], dtype=torch.long)
        beta[comp] = torch.randn(n_comp, H_KV, generator=g)
        beta[comp[n_comp * 2 // 3 :], 1] = float("-inf")  # head 1 kept fewer entries
        compacted[comp] = True
        own = torch.tensor([free.pop() for _ in range(n_own)], dtype=torch.long)
        slots = torch.cat([comp, torch.full((n_alias,), ALIAS_SLOT), own])
        r2t[row, : slots.numel()] = slots.int()
        rows.append(slots)
    return Batch(k=k.to(device, dtype), v=v.to(device, dtype), beta=beta.to(device),
                 r2t=r2t.to(device), rows=rows, compacted=compacted.to(device))  # fmt: skip


def sdpa_per_request(b: Batch, q: torch.Tensor, q_lens: list[int]) -> torch.Tensor:
    """`biased_sdpa` one request at a time, in fp32 on the CPU. q [n, H_q, D]."""
    outs, start = [], 0
    for slots, q_len in zip(b.rows, q_lens):
        n = slots.numel()
        qr = q[start : start + q_len].float().cpu().movedim(0, 1)  # [H_q, q, D]
        k = b.k.float().cpu()[slots].movedim(0, 1)  # [H_kv, n, D]
        v = b.v.float().cpu()[slots].movedim(0, 1)
        outs.append(biased_sdpa(qr, k, v, b.beta.cpu()[slots], n - q_len, SCALE).movedim(0, 1))
        start += q_len
    return torch.cat(outs)


def extend_q_lens(b: Batch) -> list[int]:
    return [11, b.rows[1].numel(), 1]  # a suffix, a fresh prompt (no prefix), one token


@pytest.mark.parametrize(("mode", "causal_block"), [("decode", 64), ("extend", 4), ("extend", 64)])
def test_matches_biased_sdpa_per_request(mode: str, causal_block: int) -> None:
    b = make_batch()
    q_lens = [1, 1, 1] if mode == "decode" else extend_q_lens(b)
    q = torch.randn(sum(q_lens), H_Q, D, generator=torch.Generator().manual_seed(1))
    seq_lens = [r.numel() for r in b.rows]
    got = paged_biased_attention(q, b.k, b.v, b.beta, b.r2t, torch.tensor(POOL_ROWS), seq_lens,
                                 q_lens, SCALE, causal_block=causal_block)  # fmt: skip
    want = sdpa_per_request(b, q, q_lens)
    assert got.shape == (sum(q_lens), H_Q, D) and got.dtype == q.dtype
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_plan_shapes_decode_single_call_extend_blocks() -> None:
    b = make_batch()
    heads = dict(num_qo_heads=H_Q, num_kv_heads=H_KV, head_dim=D)
    seq_lens = [r.numel() for r in b.rows]
    decode = plan_batch(b.r2t, POOL_ROWS, seq_lens, [1, 1, 1], **heads)
    assert decode.diagonal is None and decode.num_tokens == 3
    extend = plan_batch(b.r2t, POOL_ROWS, seq_lens, extend_q_lens(b), causal_block=4, **heads)
    assert extend.diagonal is not None and extend.num_tokens == 29
    assert extend.blocks.planned.qo_indptr.tolist() == [0, 4, 8, 11, 15, 19, 23, 27, 28, 29]
    assert extend.diagonal.planned.kv_indptr.numel() == 30  # one kernel request per token


def test_rejects_bad_inputs() -> None:
    b = make_batch()
    q = torch.zeros(3, H_Q, D)
    args = (q, b.k, b.v, b.beta, b.r2t, POOL_ROWS)
    with pytest.raises(ValueError, match=r"request 1: .* got q_len=30 seq_len=17"):
        paged_biased_attention(*args, [25, 17, 18], [1, 30, 1])
    with pytest.raises(ValueError, match=r"must all be \[B\], got 3, 2, 3"):
        paged_biased_attention(*args, [25, 17], [1, 1, 1])
    with pytest.raises(ValueError, match="q has 3 tokens, q_lens sum to 4"):
        paged_biased_attention(*args, [25, 17, 18], [2, 1, 1])
    with pytest.raises(ValueError, match="row=7"):
        paged_biased_attention(q, b.k, b.v, b.beta, b.r2t, [2, 7, 3], [25, 17, 18], [1, 1, 1])
    with pytest.raises(ValueError, match=r"q must be \[n, H_q, D\]"):
        paged_biased_attention(q[0], *args[1:], [25, 17, 18], [1, 1, 1])


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_matches_biased_sdpa_on_cuda(mode: str) -> None:
    b = make_batch(device="cuda", dtype=torch.bfloat16)
    q_lens = [1, 1, 1] if mode == "decode" else extend_q_lens(b)
    q = torch.randn(sum(q_lens), H_Q, D, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.tensor([r.numel() for r in b.rows], device="cuda")
    got = paged_biased_attention(q, b.k, b.v, b.beta, b.r2t, torch.tensor(POOL_ROWS, device="cuda"),
                                 seq_lens, torch.tensor(q_lens, device="cuda"), SCALE,
                                 causal_block=4)  # fmt: skip
    assert got.device.type == "cuda" and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float().cpu(), sdpa_per_request(b, q, q_lens),
                               atol=2e-2, rtol=2e-2)  # fmt: skip

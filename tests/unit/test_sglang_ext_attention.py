"""The plugin's biased torch_native attention against kernels/biased_attention/reference.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kernels.biased_attention.reference import biased_attention
from sglang_ext.attention import CompactionTorchNativeBackend, biased_sdpa
from sglang_ext.kv_store import ALIAS_SLOT, BetaStore


def _reference(q, k, v, beta, q_offset, scale):  # type: ignore[no-untyped-def]
    """Per query token and head: attend over entries <= its position. q [H_q, q, D]."""
    h_q, q_len, _ = q.shape
    group = h_q // k.shape[0]
    out = torch.empty(h_q, q_len, q.shape[2])
    for i in range(q_len):
        n = q_offset + i + 1
        for h in range(h_q):
            kh = h // group
            qi, bi = q[h, i : i + 1], beta[:n, kh]
            res = biased_attention(qi, k[kh, :n], v[kh, :n], bi, sm_scale=scale, with_lse=True)
            out[h, i] = res.out[0]
    return out


@pytest.mark.parametrize("q_len", [1, 5])
def test_biased_sdpa_matches_reference(q_len: int) -> None:
    g = torch.Generator().manual_seed(0)
    h_q, h_kv, n, d = 6, 2, 23, 16
    q = torch.randn(h_q, q_len, d, generator=g)
    k = torch.randn(h_kv, n, d, generator=g)
    v = torch.randn(h_kv, n, d, generator=g)
    beta = torch.randn(n, h_kv, generator=g)
    beta[3:9, 0] = float("-inf")  # aliases / padding
    got = biased_sdpa(q, k, v, beta, n - q_len, 0.25)
    want = _reference(q, k, v, beta, n - q_len, 0.25)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_biased_sdpa_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="bad shapes"):
        biased_sdpa(torch.zeros(4, 1, 8), torch.zeros(3, 5, 8), torch.zeros(3, 5, 8),
                    torch.zeros(5, 3), 4, None)  # fmt: skip


def _backend(num_slots: int = 64, layers: int = 2, h_kv: int = 2, d: int = 16):  # type: ignore[no-untyped-def]
    k_bufs = [torch.randn(num_slots, h_kv, d) for _ in range(layers)]
    v_bufs = [torch.randn(num_slots, h_kv, d) for _ in range(layers)]
    pool = SimpleNamespace(
        layer_num=layers, start_layer=0,
        get_key_buffer=lambda i: k_bufs[i], get_value_buffer=lambda i: v_bufs[i],
    )  # fmt: skip
    r2t = SimpleNamespace(req_to_token=torch.zeros(4, 128, dtype=torch.int32))
    runner = SimpleNamespace(device="cpu", req_to_token_pool=r2t, token_to_kv_pool=pool)
    return CompactionTorchNativeBackend(runner), k_bufs, v_bufs


def test_decode_mixed_batch_stock_and_compacted() -> None:
    torch.manual_seed(1)
    be, k_bufs, v_bufs = _backend()
    store: BetaStore = be.beta_store
    r2t = be.req_to_token_pool.req_to_token
    plain = torch.arange(10, 20)  # an ordinary request
    comp = torch.tensor([30, 31, 32, ALIAS_SLOT, ALIAS_SLOT, 40, 41])  # compacted + aliases + own
    r2t[1, :10], r2t[2, :7] = plain.int(), comp.int()
    store.enable_alias()
    store.compacted[torch.tensor([30, 31, 32])] = True
    store.beta[1, torch.tensor([30, 31, 32])] = torch.tensor([[0.5, -1.0], [0.0, 2.0], [-0.3, 0.1]])
    batch = SimpleNamespace(req_pool_indices=torch.tensor([1, 2]), seq_lens=torch.tensor([10, 7]),
                            out_cache_loc=None)  # fmt: skip
    be.init_forward_metadata(batch)
    assert be._biased == [False, True]
    q = torch.randn(2, 4, 16)  # [tokens, H_q, D]
    out = torch.empty_like(q)
    be._layer = 1
    be._run_sdpa_forward_decode(q, out, k_bufs[1], v_bufs[1], r2t, batch.req_pool_indices,
                                batch.seq_lens, None, scaling=0.25, enable_gqa=True,
                                causal=False, is_cross_attn=False, sliding_window_size=None)  # fmt: skip
    stock = torch.empty_like(q)
    be2, *_ = _backend()
    be2._biased = []
    be2._run_sdpa_forward_decode(q[:1], stock[:1], k_bufs[1], v_bufs[1], r2t,
                                 batch.req_pool_indices[:1], batch.seq_lens[:1], None,
                                 scaling=0.25, enable_gqa=True, causal=False,
                                 is_cross_attn=False, sliding_window_size=None)  # fmt: skip
    assert torch.equal(out[0], stock[0])  # the ordinary request took the stock path
    beta = store.beta[1, comp]
    want = _reference(q[1:2].movedim(0, 1), k_bufs[1][comp].movedim(0, 1),
                      v_bufs[1][comp].movedim(0, 1), beta, 6, 0.25)  # fmt: skip
    assert torch.allclose(out[1], want.movedim(0, 1)[0], atol=1e-5)

"""The plugin's biased torch_native attention against kernels/biased_attention/reference.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kernels.biased_attention.reference import biased_attention
from sglang_ext.attention import CompactionTorchNativeBackend, biased_sdpa, physical_entries
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
    assert be.reads[0] is None and be.reads[1].tolist() == [30, 31, 32, 40, 41]
    q = torch.randn(2, 4, 16)  # [tokens, H_q, D]
    out = torch.empty_like(q)
    be._layer = 1
    be._run_sdpa_forward_decode(q, out, k_bufs[1], v_bufs[1], r2t, batch.req_pool_indices,
                                batch.seq_lens, None, scaling=0.25, enable_gqa=True,
                                causal=False, is_cross_attn=False, sliding_window_size=None)  # fmt: skip
    stock = torch.empty_like(q)
    be2, *_ = _backend()
    be2.reads = []
    be2._run_sdpa_forward_decode(q[:1], stock[:1], k_bufs[1], v_bufs[1], r2t,
                                 batch.req_pool_indices[:1], batch.seq_lens[:1], None,
                                 scaling=0.25, enable_gqa=True, causal=False,
                                 is_cross_attn=False, sliding_window_size=None)  # fmt: skip
    assert torch.equal(out[0], stock[0])  # the ordinary request took the stock path
    beta = store.beta[1, comp]
    want = _reference(q[1:2].movedim(0, 1), k_bufs[1][comp].movedim(0, 1),
                      v_bufs[1][comp].movedim(0, 1), beta, 6, 0.25)  # fmt: skip
    assert torch.allclose(out[1], want.movedim(0, 1)[0], atol=1e-5)


def test_physical_entries_drops_the_aliases_only() -> None:
    row = torch.tensor([7, 8, 9, ALIAS_SLOT, ALIAS_SLOT, ALIAS_SLOT, 20, 21], dtype=torch.int32)
    got = physical_entries(row)
    assert got.dtype == torch.int64 and got.tolist() == [7, 8, 9, 20, 21]
    assert physical_entries(torch.tensor([3, 4])).tolist() == [3, 4]  # T == t_max: no alias


# A compacted prefix of T = 13 logical tokens in t_max = 4 physical slots (head 1 keeps 3:
# its 4th slot has beta = -inf), 9 aliases; an ordinary child node below it, then the tails.
PHYS, T, CHILD = [50, 51, 52, 53], 13, [60, 61]


def _mixed_batch(decode: bool):  # type: ignore[no-untyped-def]
    """Rows: plain, compacted + tail, compacted + child + tail; q new tokens per request."""
    be, k_bufs, v_bufs = _backend(num_slots=96, layers=2, h_kv=2, d=16)
    store: BetaStore = be.beta_store
    store.enable_alias()
    phys = torch.tensor(PHYS)
    store.compacted[phys] = True
    store.beta[:, phys] = torch.randn(2, 4, 2)
    store.beta[:, phys[3], 1] = float("-inf")
    prefix = PHYS + [ALIAS_SLOT] * (T - len(PHYS))
    q_lens = [1, 1, 1] if decode else [3, 1, 4]
    rows = [list(range(10, 16)), [*prefix, 70, 71, 72], prefix + CHILD + [80, 81, 82, 83]]
    r2t = be.req_to_token_pool.req_to_token
    for i, row in enumerate(rows):
        r2t[i + 1, : len(row)] = torch.tensor(row, dtype=torch.int32)
    seq_lens = torch.tensor([len(r) for r in rows])
    batch = SimpleNamespace(req_pool_indices=torch.tensor([1, 2, 3]), seq_lens=seq_lens,
                            out_cache_loc=None)  # fmt: skip
    return be, k_bufs, v_bufs, batch, rows, q_lens


@pytest.mark.parametrize("decode", [True, False])
def test_compacted_requests_read_physical_slots_and_tail_only(decode: bool) -> None:
    torch.manual_seed(3)
    be, k_bufs, v_bufs, batch, rows, q_lens = _mixed_batch(decode)
    be.init_forward_metadata(batch)
    assert be.reads[0] is None  # plain: the stock path
    assert be.reads[1].tolist() == [*PHYS, 70, 71, 72]
    assert be.reads[2].tolist() == PHYS + CHILD + [80, 81, 82, 83]
    assert all(ALIAS_SLOT not in r.tolist() for r in be.reads[1:])

    q = torch.randn(sum(q_lens), 4, 16)  # [tokens, H_q, D], H_q = 2 * H_kv
    kw = dict(scaling=0.25, enable_gqa=True, causal=not decode, is_cross_attn=False,
              sliding_window_size=None)  # fmt: skip
    r2t, idx, seq_lens = be.req_to_token_pool.req_to_token, batch.req_pool_indices, batch.seq_lens
    prefix_lens = seq_lens - torch.tensor(q_lens)
    extra = () if decode else (prefix_lens, torch.tensor(q_lens))
    for layer in range(2):
        be._layer = layer
        run = be._run_sdpa_forward_decode if decode else be._run_sdpa_forward_extend
        out = run(q, torch.empty_like(q), k_bufs[layer], v_bufs[layer], r2t, idx, seq_lens,
                  *extra, None, **kw)  # fmt: skip
        stock = torch.empty_like(q[: q_lens[0]])
        plain = CompactionTorchNativeBackend._run_sdpa_forward_decode if decode else (
            CompactionTorchNativeBackend._run_sdpa_forward_extend)  # fmt: skip
        be.reads = []  # the stock code of SGLang, on the plain request alone
        plain(be, q[: q_lens[0]], stock, k_bufs[layer], v_bufs[layer], r2t, idx[:1],
              seq_lens[:1], *(x[:1] for x in extra), None, **kw)  # fmt: skip
        be.init_forward_metadata(batch)
        assert torch.equal(out[: q_lens[0]], stock)
        start = q_lens[0]
        for row, q_len in zip(rows[1:], q_lens[1:]):
            # the all-entries path: every slot of the row, aliases masked by beta = -inf
            slots = torch.tensor(row)
            qs = q[start : start + q_len].movedim(0, 1)
            want = biased_sdpa(qs, k_bufs[layer][slots].movedim(0, 1),
                               v_bufs[layer][slots].movedim(0, 1),
                               be.beta_store.beta[layer, slots], len(row) - q_len, 0.25)  # fmt: skip
            got = out[start : start + q_len].movedim(0, 1)
            assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
            start += q_len

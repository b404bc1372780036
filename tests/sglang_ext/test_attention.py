"""The plugin's CPU biased attention (`sglang_ext.attention.rows`) against the reference, on SGLang's
real CPU pools (`real_runner`, `mixed_rows`: reused by the wrapped-backend tests)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from compaction_kernels.biased_attention.reference import biased_attention_lse
from sglang_ext.adapter.compacted_node import beta_store_of
from sglang_ext.attention.rows import PrefixPart, attend_rows, biased_sdpa
from sglang_ext.kv_store import ALIAS_SLOT
from sglang_ext.packing import PackedLayout
from tests.sglang_ext._attention import (
    COUNTS,
    H_KV,
    LAYERS,
    NUM_SLOTS,
    PHYS,
    D,
    T,
    full_row_reference,
    mixed_rows,
    real_runner,
)


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
            res = biased_attention_lse(qi, k[kh, :n], v[kh, :n], bi, sm_scale=scale)
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


def prefix_parts(runner: Any, layer: int) -> list[PrefixPart | None]:
    """The three `mixed_rows` requests' prefixes of `layer`, read from the pool's cells."""
    pool = runner.token_to_kv_pool
    store = beta_store_of(pool)
    layout = store.prefix_of(PHYS[0])
    assert layout is not None
    part = PrefixPart(*layout.read(layer, pool.get_key_buffer, pool.get_value_buffer,
                                   store.beta, torch.float32), T)  # fmt: skip
    return [None, part, part]


@pytest.mark.parametrize("decode", [True, False])
def test_attend_rows_reads_the_packed_prefix_and_the_tails(decode: bool) -> None:
    torch.manual_seed(3)
    runner = real_runner()
    rows, q_lens = mixed_rows(runner, decode)
    q = torch.randn(sum(q_lens), 2 * H_KV, D)  # [tokens, H_q, D]
    pool, r2t = runner.token_to_kv_pool, runner.req_to_token_pool.req_to_token
    store = beta_store_of(pool)
    for layer in range(LAYERS):
        want = full_row_reference(runner, layer, q, rows, q_lens, 0.25)
        k_alias = pool.get_key_buffer(layer)[ALIAS_SLOT].clone()
        pool.get_key_buffer(layer)[ALIAS_SLOT] = float("nan")  # read, it would poison the output
        got = attend_rows(q, pool.get_key_buffer(layer), pool.get_value_buffer(layer),
                          store.beta[layer], r2t, [1, 2, 3], [len(r) for r in rows], q_lens,
                          prefix_parts(runner, layer), 0.25)  # fmt: skip
        pool.get_key_buffer(layer)[ALIAS_SLOT] = k_alias
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_attend_rows_rejects_bad_lengths() -> None:
    runner = real_runner()
    pool, r2t = runner.token_to_kv_pool, runner.req_to_token_pool.req_to_token
    args = (pool.get_key_buffer(0), pool.get_value_buffer(0), torch.zeros(NUM_SLOTS, H_KV), r2t)
    with pytest.raises(ValueError, match="differ in length"):
        attend_rows(torch.zeros(1, 4, D), *args, [1], [4], [1, 1], [None], None)
    with pytest.raises(ValueError, match="q has 2 tokens"):
        attend_rows(torch.zeros(2, 4, D), *args, [1], [4], [1], [None], None)


def test_store_records_prefixes_by_first_slot() -> None:
    store = beta_store_of(real_runner().token_to_kv_pool)
    layout = PackedLayout(COUNTS, torch.tensor(PHYS), T)
    store.mark_prefix(layout)
    assert store.prefix_of(PHYS[0]) is layout and store.prefix_of(PHYS[1]) is None
    with pytest.raises(ValueError, match="N=3 <= T=2"):
        store.mark_prefix(PackedLayout(torch.ones(LAYERS, H_KV), torch.tensor(PHYS), 2))
    store.clear(torch.tensor(PHYS))
    assert store.prefix_of(PHYS[0]) is None and not store.prefixes

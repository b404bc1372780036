"""Real CPU pools with a compacted prefix installed packed, the rows of a mixed batch (plain,
compacted + tail, compacted + child + tail) and the full-row reference a request on it must
match: shared by the attention-path tests."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from sglang_ext.adapter.compacted_node import beta_store_of
from sglang_ext.attention.rows import biased_sdpa
from sglang_ext.kv_store import ALIAS_SLOT
from sglang_ext.packing import PackedLayout

NUM_SLOTS, LAYERS, H_KV, D = 96, 2, 2, 16


def real_runner(num_slots: int = NUM_SLOTS, layers: int = LAYERS, h_kv: int = H_KV, d: int = D):  # type: ignore[no-untyped-def]
    """A model-runner stand-in holding SGLang's real CPU pools (fp32 MHA KV pool with random
    K/V, a req_to_token table): what SGLang's attention backends read from a runner."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    pool = MHATokenToKVPool(num_slots, 1, torch.float32, h_kv, d, layers, "cpu", False)
    for i in range(layers):
        pool.get_key_buffer(i).copy_(torch.randn(num_slots + 1, h_kv, d))
        pool.get_value_buffer(i).copy_(torch.randn(num_slots + 1, h_kv, d))
    r2t = ReqToTokenPool(8, 128, "cpu", False)
    model_config = SimpleNamespace(is_encoder_decoder=False)
    return SimpleNamespace(device="cpu", req_to_token_pool=r2t, token_to_kv_pool=pool,
                           use_mla_backend=False, model_config=model_config,
                           server_args=SimpleNamespace())  # fmt: skip


# A compacted prefix of T = 13 logical tokens whose heads keep COUNTS [L, H_kv] entries
# (the longest head W = 6), packed into N = ceil(12 / 4) = 3 physical slots, 10 aliases; an
# ordinary child node below it, then the tails.
COUNTS = torch.tensor([[6, 1], [2, 3]])


PHYS, T, CHILD = [50, 51, 52], 13, [60, 61]


PLAIN_ROW = list(range(10, 16))


def mixed_rows(runner: Any, decode: bool) -> tuple[list[list[int]], list[int]]:
    """Write three rows into the runner's pools: plain, compacted + tail, compacted + child +
    tail; install the compacted prefix packed (mutates the pools). Returns rows, q_lens."""
    pool = runner.token_to_kv_pool
    store = beta_store_of(pool)
    store.enable_alias()
    layout = PackedLayout(COUNTS, torch.tensor(PHYS), T)
    for i in range(LAYERS):
        layout.write(i, *prefix_entries(i), pool.get_key_buffer, pool.get_value_buffer,
                     store.beta)  # fmt: skip
    store.compacted[layout.slots] = True
    store.mark_prefix(layout)
    prefix = PHYS + [ALIAS_SLOT] * (T - len(PHYS))
    q_lens = [1, 1, 1] if decode else [3, 1, 4]
    rows = [PLAIN_ROW, [*prefix, 70, 71, 72], prefix + CHILD + [80, 81, 82, 83]]
    r2t = runner.req_to_token_pool.req_to_token
    for i, row in enumerate(rows):
        r2t[i + 1, : len(row)] = torch.tensor(row, dtype=torch.int32)
    return rows, q_lens


def full_row_reference(runner: Any, layer: int, q: torch.Tensor, rows: list[list[int]],
                       q_lens: list[int], scale: float) -> torch.Tensor:  # fmt: skip
    """What a request on the compacted prefix must see, built from the prefix's own entries
    (not from the pool's cells): each head's t_{l,h} entries (beta -inf past them), then the
    row's tail [T, n); a plain row attends all its slots. q [tokens, H_q, D]."""
    pool, store = runner.token_to_kv_pool, beta_store_of(runner.token_to_kv_pool)
    k_all, v_all, b_all = prefix_entries(layer)
    W = int(COUNTS.max())
    pk, pv = torch.zeros(H_KV, W, D), torch.zeros(H_KV, W, D)
    pb = torch.full((H_KV, W), float("-inf"))
    lo = 0
    for h, t in enumerate(COUNTS[layer].tolist()):
        pk[h, :t], pv[h, :t], pb[h, :t] = k_all[lo : lo + t], v_all[lo : lo + t], b_all[lo : lo + t]
        lo += t
    out, start = torch.empty_like(q), 0
    for row, q_len in zip(rows, q_lens):
        compacted = row[0] == PHYS[0]
        slots = torch.tensor(row[T:] if compacted else row)
        k = pool.get_key_buffer(layer)[slots].movedim(0, 1)
        v = pool.get_value_buffer(layer)[slots].movedim(0, 1)
        beta = store.beta[layer, slots]
        if compacted:
            k, v, beta = torch.cat([pk, k], 1), torch.cat([pv, v], 1), torch.cat([pb.t(), beta])
        qs = q[start : start + q_len].movedim(0, 1)
        want = biased_sdpa(qs, k, v, beta, k.shape[1] - q_len, scale)
        out[start : start + q_len] = want.movedim(0, 1)
        start += q_len
    return out


def prefix_entries(layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The compacted prefix's ragged entries of `layer`: keys, values [E, D], beta [E]."""
    g = torch.Generator().manual_seed(100 + layer)
    e = int(COUNTS[layer].sum())
    return (
        torch.randn(e, D, generator=g),
        torch.randn(e, D, generator=g),
        torch.randn(e, generator=g),
    )

"""Real CPU pools and a real `CompactionRadixCache` for the radix-cache tests: the cache, a
fake runner, requests that hold and release paths, the accounting check, compacted prefixes
of a real model (`compact_rooms`; the `compacted` fixture is in conftest.py) and their original KV (`ORIGINAL_KV`)."""

from __future__ import annotations

from array import array
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import (
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey

from compactor.types import CompactedPrefix
from sglang_ext.adapter.radix_cache import CompactionRadixCache
from sglang_ext.config import CompactionConfig

POOL = 512


T = 96


def compact_rooms(model_dir: Path, n: int) -> tuple[list[int], CompactedPrefix]:
    """The first `n` tokens of a fixed text and their real compaction (am-highest, 0.25,
    context-prefill); registers their real KV in ORIGINAL_KV for `insert_fresh`."""
    from compactor.hf import load_model
    from compactor.pipeline import Hooks, compact_prefix
    from compactor.spec import CompactionSpec, QueryConfig

    model, tok = load_model(model_dir)
    text = " ".join(f"Room {i} has {i * 3} chairs." for i in range(40))
    ids = tok(text)["input_ids"][:n]
    spec = CompactionSpec(
        method="am-highest", ratio=0.25, queries=QueryConfig(sources=("context-prefill",))
    )
    prefix, _ = compact_prefix(model, tok, ids, spec, hooks=Hooks(progress=False))
    with torch.no_grad():
        cache = model(torch.tensor([ids]), use_cache=True).past_key_values
    ORIGINAL_KV[tuple(ids)] = [
        (layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)) for layer in cache.layers
    ]  # per layer [T, H_kv, D], post-RoPE, as SGLang's pool holds them
    return ids, prefix


# The real KV of the fixture's prefix, by token ids: `insert_fresh` writes it into the slots
# it allocates, as a prefill would (installs check magnitudes against the original's KV).
ORIGINAL_KV: dict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = {}


class FakeRunner:
    """The CompactionRunner surface the cache uses; results are queued by the test."""

    def __init__(self) -> None:
        self.submitted: list[tuple[list[int], list[list[int]]]] = []
        self.rounds: list[int] = []  # the fit round of each submission
        self.results: list[Any] = []
        self.epoch = 0
        self.pending = 0
        self.check: Any = None

    def new_epoch(self) -> int:
        self.epoch += 1
        return self.epoch

    def submit(self, token_ids: list[int], follow_ups: list[list[int]], fit_round: int = 0) -> None:
        self.submitted.append((list(token_ids), follow_ups))
        self.rounds.append(fit_round)

    def drain(self) -> list[Any]:
        out, self.results = self.results, []
        return out


def make_cache(
    fp: str, runner: Any = None, dtype: torch.dtype = torch.float32, **cfg: Any
) -> CompactionRadixCache:
    kv = MHATokenToKVPool(POOL, 1, dtype, 3, 64, 30, "cpu", False)
    alloc = TokenToKVPoolAllocator(POOL, dtype, "cpu", kv, False)
    r2t = ReqToTokenPool(8, 1024, "cpu", False)
    params = CacheInitParams(
        disable=False, req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc, page_size=1
    )
    cfg.setdefault("boundary_margin", 0)  # paths end exactly at the branch (trigger tests cover it)
    cfg.setdefault("align_tokens", 1)
    # one poll writes a whole result, however busy the machine (the time budget's own tests
    # set install_step_ms)
    cfg.setdefault("install_step_ms", 1e9)
    cfg.setdefault("min_continuations", 2)  # two questions suffice (see ..._trigger_chat)
    config = CompactionConfig(endpoint="inproc://", min_prefix_tokens=16, **cfg)
    return CompactionRadixCache(params, config, fp, runner=runner)


def key(ids: list[int]) -> RadixKey:
    return RadixKey(array("q", ids), None)


def insert_fresh(cache: CompactionRadixCache, ids: list[int]) -> torch.Tensor:
    """Insert `ids` with freshly allocated slots holding the fixture prefix's real KV where
    `ids` starts with it (as a finished request would)."""
    slots = cache.token_to_kv_pool_allocator.alloc(len(ids)).to(torch.int64)
    for prefix_ids, layers in ORIGINAL_KV.items():
        if tuple(ids[: len(prefix_ids)]) == prefix_ids:
            for i, (k, v) in enumerate(layers):
                k_buf, v_buf = cache.kvcache.get_key_buffer(i), cache.kvcache.get_value_buffer(i)
                k_buf[slots[: len(prefix_ids)]] = k.to(k_buf.dtype)
                v_buf[slots[: len(prefix_ids)]] = v.to(v_buf.dtype)
    res = cache.insert(InsertParams(key=key(ids), value=slots))
    cache.token_to_kv_pool_allocator.free(slots[: res.prefix_len])  # duplicates
    return slots


def check_accounting(cache: CompactionRadixCache) -> None:
    alloc = cache.token_to_kv_pool_allocator
    assert alloc.available_size() + cache.evictable_size() + cache.protected_size() == POOL


def make_req(cache: CompactionRadixCache, rid: str, ids: list[int], prefix_len: int) -> Any:
    """A minimal running request whose row holds the matched prefix then fresh slots."""
    m = cache.match_prefix(MatchPrefixParams(key=key(ids[:prefix_len])))
    assert m.device_prefix_len == prefix_len
    row = cache.req_to_token_pool.free_slots.pop(0)
    prefix_slots = cache.path_device_indices(m.last_device_node)[:prefix_len]
    fresh = cache.token_to_kv_pool_allocator.alloc(len(ids) - prefix_len)
    r2t = cache.req_to_token_pool.req_to_token
    r2t[row, :prefix_len] = prefix_slots.to(torch.int32)
    r2t[row, prefix_len : len(ids)] = fresh.to(torch.int32)
    kv = SimpleNamespace(req_pool_idx=row, cache_protected_len=prefix_len, cache_inserted_len=0,
                         swa_evict_floor=0)  # fmt: skip
    req = SimpleNamespace(
        rid=rid, kv=kv, extra_key=None, cache_salt=None, priority=0,
        origin_input_ids=list(ids), full_untruncated_fill_ids=array("q", ids),
        lock=cache.lock(m.last_device_node), last_node=m.last_device_node,
    )  # fmt: skip
    return req


def release_req(cache: CompactionRadixCache, req: Any, n: int) -> None:
    """What SGLang's release_kv_cache does after the final checkpoint."""
    row = cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
    cache.token_to_kv_pool_allocator.free(row[req.kv.cache_protected_len : n].to(torch.int64))
    cache.unlock(req.lock)
    cache.req_to_token_pool.free_slots.append(req.kv.req_pool_idx)

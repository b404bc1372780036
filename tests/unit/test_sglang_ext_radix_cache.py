"""CompactionRadixCache on SGLang's real CPU pools with a real compacted SmolLM2 prefix."""

from __future__ import annotations

from array import array
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey

from compactor.types import CompactedPrefix
from sglang_ext.adapter.radix_cache import CompactionRadixCache
from sglang_ext.config import CompactionConfig
from sglang_ext.kv_store import ALIAS_SLOT, head_counts
from sglang_ext.packing import slots_needed
from sglang_ext.runner import JobResult

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


@pytest.fixture(scope="module")
def compacted(prepared_model: Path) -> tuple[list[int], CompactedPrefix, str]:
    from compactor.models import fingerprint

    ids, prefix = compact_rooms(prepared_model, T)
    return ids, prefix, fingerprint(prepared_model)


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


def test_install_matches_whole_prefix_and_frees_original(compacted: Any) -> None:
    ids, prefix, fp = compacted
    cache = make_cache(fp)
    insert_fresh(cache, [*ids, 11, 12, 13])
    assert cache.evictable_size() == T + 3
    node = cache.install(ids, prefix)
    n_slots = slots_needed(head_counts(prefix))
    assert n_slots <= T // 2
    # original path (and the suffix under it) were unlocked: freed at install
    assert cache.evictable_size() == n_slots
    check_accounting(cache)
    m = cache.match_prefix(MatchPrefixParams(key=key([*ids, 7, 8])))
    assert m.device_prefix_len == T and m.last_device_node is node
    path = cache.path_device_indices(node)
    assert len(path) == T
    assert torch.equal(path[:n_slots], node.compaction.slots)
    assert (path[n_slots:] == ALIAS_SLOT).all()
    store = cache.beta_store
    assert store.compacted[node.compaction.slots].all()
    assert torch.isinf(store.beta[:, ALIAS_SLOT]).all()
    # layer 0, head 0 reads back exactly its kept keys; a head's unused rows are masked
    layer0 = prefix.layers[0]
    n0 = layer0.head_lengths()[0]
    kv = cache.kvcache
    k, _, beta = node.compaction.layout.read(
        0, kv.get_key_buffer, kv.get_value_buffer, store.beta, torch.float32
    )
    assert torch.allclose(k[0, :n0], layer0.keys[:n0])
    assert torch.equal(beta[0, :n0], layer0.beta[:n0].float())
    assert torch.isneginf(beta[0, n0:]).all()
    assert cache.stats.installed == 1 and cache.stats.logical_tokens == T
    assert cache.stats.physical_tokens == n_slots


def test_divergence_inside_compacted_node_misses_it(compacted: Any) -> None:
    ids, prefix, fp = compacted
    cache = make_cache(fp)
    insert_fresh(cache, ids)
    cache.install(ids, prefix)
    diverged = [*ids[: T - 5], 999, 998, 997, 996, 995, 994]
    assert cache.match_prefix(MatchPrefixParams(key=key(diverged))).device_prefix_len == 0
    assert cache.match_prefix(MatchPrefixParams(key=key(ids[:-1]))).device_prefix_len == 0
    # served normally: its own path goes into the ordinary tree beside the compacted node
    insert_fresh(cache, diverged)
    m = cache.match_prefix(MatchPrefixParams(key=key(diverged)))
    assert (
        m.device_prefix_len == len(diverged)
        and getattr(m.last_device_node, "compaction", None) is None
    )
    # requests covering the whole prefix still go through the compacted node
    m2 = cache.match_prefix(MatchPrefixParams(key=key([*ids, 1])))
    assert m2.device_prefix_len == T
    check_accounting(cache)


def test_locked_original_is_freed_only_after_unlock(compacted: Any) -> None:
    ids, prefix, fp = compacted
    cache = make_cache(fp)
    insert_fresh(cache, ids)
    held = cache.match_prefix(MatchPrefixParams(key=key(ids))).last_device_node
    cache.inc_lock_ref(held)  # a running request holds the original slots
    before = cache.token_to_kv_pool_allocator.available_size()
    cache.install(ids, prefix)
    n_slots = slots_needed(head_counts(prefix))
    assert cache.token_to_kv_pool_allocator.available_size() == before - n_slots
    check_accounting(cache)
    cache.dec_lock_ref(held)
    cache.poll_compactions()  # the scheduler's safe point reaps the retired path
    assert cache.token_to_kv_pool_allocator.available_size() == before - n_slots + T
    check_accounting(cache)


def test_locked_compacted_node_survives_eviction_then_evicts(compacted: Any) -> None:
    ids, prefix, fp = compacted
    cache = make_cache(fp)
    insert_fresh(cache, ids)
    node = cache.install(ids, prefix)
    slots = node.compaction.slots.clone()
    cache.inc_lock_ref(node)
    assert cache.evict(EvictParams(num_tokens=POOL)).num_tokens_evicted == 0
    assert cache.protected_size() == len(slots)
    cache.dec_lock_ref(node)
    assert cache.evict(EvictParams(num_tokens=POOL)).num_tokens_evicted == len(slots)
    assert cache.token_to_kv_pool_allocator.available_size() == POOL
    assert not cache.beta_store.compacted[slots].any()
    assert (cache.beta_store.beta[:, slots] == 0).all()
    assert cache.match_prefix(MatchPrefixParams(key=key([*ids, 5]))).device_prefix_len == 0
    assert cache.stats.evicted == 1 and cache.stats.physical_tokens == 0


def test_double_install_keeps_one_copy(compacted: Any) -> None:
    ids, prefix, fp = compacted
    cache = make_cache(fp)
    insert_fresh(cache, ids)
    first = cache.install(ids, prefix)
    avail = cache.token_to_kv_pool_allocator.available_size()
    assert cache.install(ids, prefix) is first
    assert cache.token_to_kv_pool_allocator.available_size() == avail
    assert cache.stats.double_installs == 1 and len(cache.compacted_nodes()) == 1


@pytest.mark.parametrize("what", ["fingerprint", "tokens", "length"])
def test_invalid_result_falls_back_without_leak(compacted: Any, what: str) -> None:
    ids, prefix, fp = compacted
    runner = FakeRunner()
    cache = make_cache(fp if what != "fingerprint" else "0" * 32, runner=runner)
    tokens = list(ids)
    if what == "tokens":
        tokens[3] += 1
    elif what == "length":
        tokens = tokens[:-1]
    runner.results.append(JobResult(tuple(tokens), prefix, None, 0.1))
    assert cache.poll_compactions() == 0
    assert cache.stats.invalid == 1 and cache.stats.fallbacks == 1
    assert cache.token_to_kv_pool_allocator.available_size() == POOL
    assert not cache.compacted_nodes()


def test_failed_compaction_counts_a_fallback(compacted: Any) -> None:
    _, _, fp = compacted
    runner = FakeRunner()
    cache = make_cache(fp, runner=runner)
    runner.results.append(JobResult((1, 2), None, TimeoutError(), 1.0))
    cache.poll_compactions()
    assert cache.stats.failures == 1 and cache.stats.fallbacks == 1


def _req(cache: CompactionRadixCache, rid: str, ids: list[int], prefix_len: int) -> Any:
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


def _release(cache: CompactionRadixCache, req: Any, n: int) -> None:
    """What SGLang's release_kv_cache does after the final checkpoint."""
    row = cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
    cache.token_to_kv_pool_allocator.free(row[req.kv.cache_protected_len : n].to(torch.int64))
    cache.unlock(req.lock)
    cache.req_to_token_pool.free_slots.append(req.kv.req_pool_idx)


def test_hits_trigger_one_compaction_with_follow_ups(compacted: Any) -> None:
    ids, _prefix, fp = compacted
    runner = FakeRunner()
    cache = make_cache(fp, runner=runner, min_hits=2)
    q1, q2 = [*ids, 501, 502, 503], [*ids, 601, 602]
    r1 = _req(cache, "a", q1, 0)
    cache.checkpoint(r1, up_to=len(q1))
    _release(cache, r1, len(q1))
    assert runner.submitted == []
    r2 = _req(cache, "b", q2, T)
    cache.checkpoint(r2, up_to=len(q2))
    _release(cache, r2, len(q2))
    assert len(runner.submitted) == 1
    tokens, follow_ups = runner.submitted[0]
    assert tokens == ids
    assert sorted(follow_ups) == [[501, 502, 503], [601, 602]]
    check_accounting(cache)
    # a third sharer of the same (or a nested) path does not ask again
    r3 = _req(cache, "c", [*ids, 601, 700], T + 1)
    cache.checkpoint(r3, up_to=T + 2)
    _release(cache, r3, T + 2)
    assert len(runner.submitted) == 1


@pytest.mark.parametrize("opt_out", [{"cache_salt": "tenant-a"}, {"extra_key": "lora-7"}])
def test_opted_out_requests_never_feed_the_fit(compacted: Any, opt_out: dict[str, str]) -> None:
    """A salted (or LoRA) request asking about the same document is neither a hit of the
    shared path nor one of its follow-ups: only the two unsalted questions are sent."""
    ids, _prefix, fp = compacted
    runner = FakeRunner()
    cache = make_cache(fp, runner=runner, min_hits=2)
    crafted = _req(cache, "x", [*ids, 901, 902, 903], 0)
    for name, value in opt_out.items():
        setattr(crafted, name, value)
    cache.checkpoint(crafted, up_to=T + 3)
    _release(cache, crafted, T + 3)
    for rid, tail, prefix in (("a", [501, 502], 0), ("b", [601, 602], T)):
        r = _req(cache, rid, [*ids, *tail], prefix)
        cache.checkpoint(r, up_to=T + 2)
        _release(cache, r, T + 2)
    assert len(runner.submitted) == 1
    tokens, follow_ups = runner.submitted[0]
    assert tokens == ids and sorted(follow_ups) == [[501, 502], [601, 602]]
    check_accounting(cache)


def test_request_started_before_install_stays_off_the_compacted_node(compacted: Any) -> None:
    ids, prefix, fp = compacted
    cache = make_cache(fp)
    insert_fresh(cache, ids)
    q_old = [*ids, 42, 43]
    old = _req(cache, "old", q_old, T)  # holds the original slots
    node = cache.install(ids, prefix)
    cache.checkpoint(old, up_to=len(q_old))
    assert cache.stats.skipped_checkpoints == 1
    assert not node.children  # nothing computed against the full prefix went under it
    _release(cache, old, len(q_old))
    cache.poll_compactions()
    check_accounting(cache)
    # a request that starts now runs on the compacted prefix and caches its suffix under it
    new = _req(cache, "new", [*ids, 42, 44], T)
    cache.checkpoint(new, up_to=T + 2)
    assert len(node.children) == 1
    _release(cache, new, T + 2)
    check_accounting(cache)
    assert (
        cache.match_prefix(MatchPrefixParams(key=key([*ids, 42, 44, 1]))).device_prefix_len == T + 2
    )


def test_only_branch_points_are_compacted(compacted: Any) -> None:
    """A prompt sent twice verbatim has 2 hits but no branch: nothing is sent until a request
    goes on differently after the shared document."""
    ids, _prefix, fp = compacted
    runner = FakeRunner()
    cache = make_cache(fp, runner=runner, min_hits=2)
    same = [*ids, 501, 502]
    for rid, prefix_len in (("a", 0), ("b", len(same))):
        r = _req(cache, rid, same, prefix_len)
        cache.checkpoint(r, up_to=len(same))
        _release(cache, r, len(same))
    assert runner.submitted == []
    r = _req(cache, "c", [*ids, 601], T)
    cache.checkpoint(r, up_to=T + 1)
    _release(cache, r, T + 1)
    assert [tokens for tokens, _ in runner.submitted] == [ids]
    check_accounting(cache)

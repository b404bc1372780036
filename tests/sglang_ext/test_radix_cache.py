"""CompactionRadixCache on SGLang's real CPU pools with a real compacted SmolLM2 prefix."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    MatchPrefixParams,
)

from sglang_ext.kv_store import ALIAS_SLOT, head_counts
from sglang_ext.packing import slots_needed
from sglang_ext.runner import JobResult
from tests.sglang_ext._radix import (
    POOL,
    FakeRunner,
    T,
    check_accounting,
    insert_fresh,
    key,
    make_cache,
    make_req,
    release_req,
)


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


def test_hits_trigger_one_compaction_with_follow_ups(compacted: Any) -> None:
    ids, _prefix, fp = compacted
    runner = FakeRunner()
    cache = make_cache(fp, runner=runner, min_hits=2)
    q1, q2 = [*ids, 501, 502, 503], [*ids, 601, 602]
    r1 = make_req(cache, "a", q1, 0)
    cache.checkpoint(r1, up_to=len(q1))
    release_req(cache, r1, len(q1))
    assert runner.submitted == []
    r2 = make_req(cache, "b", q2, T)
    cache.checkpoint(r2, up_to=len(q2))
    release_req(cache, r2, len(q2))
    assert len(runner.submitted) == 1
    tokens, follow_ups = runner.submitted[0]
    assert tokens == ids
    assert sorted(follow_ups) == [[501, 502, 503], [601, 602]]
    check_accounting(cache)
    # a third sharer of the same (or a nested) path does not ask again
    r3 = make_req(cache, "c", [*ids, 601, 700], T + 1)
    cache.checkpoint(r3, up_to=T + 2)
    release_req(cache, r3, T + 2)
    assert len(runner.submitted) == 1


@pytest.mark.parametrize("opt_out", [{"cache_salt": "tenant-a"}, {"extra_key": "lora-7"}])
def test_opted_out_requests_never_feed_the_fit(compacted: Any, opt_out: dict[str, str]) -> None:
    """A salted (or LoRA) request asking about the same document is neither a hit of the
    shared path nor one of its follow-ups: only the two unsalted questions are sent."""
    ids, _prefix, fp = compacted
    runner = FakeRunner()
    cache = make_cache(fp, runner=runner, min_hits=2)
    crafted = make_req(cache, "x", [*ids, 901, 902, 903], 0)
    for name, value in opt_out.items():
        setattr(crafted, name, value)
    cache.checkpoint(crafted, up_to=T + 3)
    release_req(cache, crafted, T + 3)
    for rid, tail, prefix in (("a", [501, 502], 0), ("b", [601, 602], T)):
        r = make_req(cache, rid, [*ids, *tail], prefix)
        cache.checkpoint(r, up_to=T + 2)
        release_req(cache, r, T + 2)
    assert len(runner.submitted) == 1
    tokens, follow_ups = runner.submitted[0]
    assert tokens == ids and sorted(follow_ups) == [[501, 502], [601, 602]]
    check_accounting(cache)


def test_request_started_before_install_stays_off_the_compacted_node(compacted: Any) -> None:
    ids, prefix, fp = compacted
    cache = make_cache(fp)
    insert_fresh(cache, ids)
    q_old = [*ids, 42, 43]
    old = make_req(cache, "old", q_old, T)  # holds the original slots
    node = cache.install(ids, prefix)
    cache.checkpoint(old, up_to=len(q_old))
    assert cache.stats.skipped_checkpoints == 1
    assert not node.children  # nothing computed against the full prefix went under it
    release_req(cache, old, len(q_old))
    cache.poll_compactions()
    check_accounting(cache)
    # a request that starts now runs on the compacted prefix and caches its suffix under it
    new = make_req(cache, "new", [*ids, 42, 44], T)
    cache.checkpoint(new, up_to=T + 2)
    assert len(node.children) == 1
    release_req(cache, new, T + 2)
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
        r = make_req(cache, rid, same, prefix_len)
        cache.checkpoint(r, up_to=len(same))
        release_req(cache, r, len(same))
    assert runner.submitted == []
    r = make_req(cache, "c", [*ids, 601], T)
    cache.checkpoint(r, up_to=T + 1)
    release_req(cache, r, T + 1)
    assert [tokens for tokens, _ in runner.submitted] == [ids]
    check_accounting(cache)

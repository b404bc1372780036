"""PD decode retraction with a `cpu_tensor` backup (`sglang_ext.adapter.retraction`), on a real
`CompactionRadixCache` over real CPU pools: a retracted request served from a compacted prefix
keeps it locked (eviction cannot take it), and on resume its row points at the compacted slots
again (the fresh slots SGLang gave them freed), the request bound to the node, so it is marked
compacted; finishing frees everything; a discarded backup unlocks it."""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams

from sglang_ext.adapter.compacted_node import compacted_ancestor
from sglang_ext.adapter.retraction import RETAINED_ATTR, release, repoint, retain
from tests.sglang_ext._radix import (
    POOL,
    check_accounting,
    insert_fresh,
    make_cache,
    make_req,
    release_req,
)

SUFFIX = [7, 8, 9, 10, 11]


def _served(compacted: Any) -> tuple[Any, Any, Any, int]:
    """A cache holding the compacted document, its node, and a request served from it (the
    document plus `SUFFIX`, `n` tokens in all)."""
    ids, prefix, fp = compacted
    cache = make_cache(fp)
    insert_fresh(cache, ids)
    node = cache.install(ids, prefix)
    req = make_req(cache, "r", [*ids, *SUFFIX], len(ids))
    return cache, node, req, len(ids) + len(SUFFIX)


def _retract(cache: Any, req: Any, n: int) -> None:
    """What SGLang's release_req does after the backup: free the request's own slots, unlock
    its node, give the row back, clear the request's tree state (`reset_for_retract`)."""
    release_req(cache, req, n)
    req.last_node, req.lock, req.prefix_len, req.kv.cache_protected_len = None, None, 0, 0


def _resume(cache: Any, req: Any, n: int) -> torch.Tensor:
    """What PD decode's `_pre_alloc` does for a resumed request: a row of fresh slots."""
    req.kv.req_pool_idx = cache.req_to_token_pool.free_slots.pop(0)
    fresh = cache.token_to_kv_pool_allocator.alloc(n)
    cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n] = fresh.to(torch.int32)
    return fresh


def test_a_retracted_request_resumes_on_its_compacted_prefix(compacted: Any) -> None:
    cache, node, req, n = _served(compacted)
    n_prefix = len(node.value)
    assert req.last_node is node
    assert retain(req, cache, "cpu_tensor")
    _retract(cache, req, n)
    # retracted: the compacted node stays, whatever is evicted
    cache.evict(EvictParams(num_tokens=POOL))
    assert node in cache.compacted_nodes() and cache.protected_size() == len(node.compaction.slots)
    _resume(cache, req, n)
    free_before = cache.token_to_kv_pool_allocator.available_size()
    assert (
        repoint(req, cache, cache.req_to_token_pool, cache.token_to_kv_pool_allocator) == n_prefix
    )
    row = cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
    assert torch.equal(row[:n_prefix].to(torch.int64), node.value.to(torch.int64))
    assert cache.token_to_kv_pool_allocator.available_size() == free_before + n_prefix
    assert req.last_node is node and compacted_ancestor(req.last_node) is node.compaction
    assert req.lock.node is node and getattr(req, RETAINED_ATTR) is None
    assert (req.prefix_len, req.kv.cache_protected_len) == (n_prefix, n_prefix)
    # finished: its own slots and its lock go back, and the node can be evicted again
    release_req(cache, req, n)
    check_accounting(cache)
    cache.evict(EvictParams(num_tokens=POOL))
    assert cache.token_to_kv_pool_allocator.available_size() == POOL


def test_a_discarded_backup_unlocks_the_prefix(compacted: Any) -> None:
    cache, node, req, n = _served(compacted)
    retain(req, cache, "cpu_tensor")
    _retract(cache, req, n)
    assert release(req, cache) and not release(req, cache)  # once
    check_accounting(cache)
    cache.evict(EvictParams(num_tokens=POOL))
    assert node not in cache.compacted_nodes()
    assert cache.token_to_kv_pool_allocator.available_size() == POOL


def test_only_cpu_tensor_backups_of_compacted_requests_are_retained(compacted: Any) -> None:
    ids, prefix, fp = compacted
    cache = make_cache(fp)
    insert_fresh(cache, ids)
    plain = make_req(cache, "plain", [*ids, *SUFFIX], len(ids) // 2)  # before the install
    cache.install(ids, prefix)
    served = make_req(cache, "served", [*ids, *SUFFIX], len(ids))
    assert not retain(served, cache, "none") and not retain(served, cache, "host_pool")
    assert not retain(plain, cache, "cpu_tensor")  # its path holds no compacted node
    assert repoint(plain, cache, cache.req_to_token_pool, cache.token_to_kv_pool_allocator) == 0


def test_an_aborted_retracted_request_lets_the_prefix_go(compacted: Any) -> None:
    """SGLang's scheduler discards the backup of a retracted request aborted by its client:
    the plugin's hook on `discard_kv_cache_backup` unlocks the node (that the hook reaches the
    scheduler's import: tests/sglang_ext/test_sglang_surface.py)."""
    from sglang_ext.adapter import hooks, surface

    assert (surface.RETRACT_DISCARD, hooks._release) in hooks.SERVING_HOOKS
    cache, node, req, n = _served(compacted)
    hooks._retain(True, req, cache, cache.req_to_token_pool, cache.token_to_kv_pool_allocator,
                  "cpu_tensor")  # fmt: skip
    _retract(cache, req, n)
    hooks._release(None, req, cache, "cpu_tensor")
    check_accounting(cache)
    cache.evict(EvictParams(num_tokens=POOL))
    assert node not in cache.compacted_nodes()

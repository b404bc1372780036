"""Compaction under memory pressure, on a real `CompactionRadixCache` over real CPU pools: a
result whose original prefix was evicted while it was computed is installed (its bounds were
read when it was sent, and are as strict), a result the pool has no slots for waits and is
installed once slots free up, or is dropped when its wait is over; every result not installed
is counted by reason."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams

from compactor.types import CompactedPrefix
from sglang_ext.runner import JobResult
from tests.sglang_ext._radix import (
    POOL,
    FakeRunner,
    check_accounting,
    insert_fresh,
    key,
    make_cache,
)


def sent_then_evicted(fp: str, ids: list[int], **cfg: Any) -> tuple[Any, FakeRunner]:
    """A cache that sent `ids` to compact while its original was cached, then evicted it."""
    runner = FakeRunner()
    cache = make_cache(fp, runner=runner, **cfg)
    insert_fresh(cache, ids)
    cache.lifecycle.send(ids, [])
    assert runner.submitted == [(ids, [])]
    cache.evict(EvictParams(num_tokens=POOL))
    assert cache.token_to_kv_pool_allocator.available_size() == POOL  # the original is gone
    return cache, runner


def scaled(prefix: CompactedPrefix, factor: float) -> CompactedPrefix:
    """`prefix` with every layer's values times `factor` (a magnitude the checks refuse)."""
    layers = [type(x)(x.keys, x.values * factor, x.beta, x.indptr) for x in prefix.layers]
    return CompactedPrefix(**{**vars(prefix), "layers": layers})


def test_a_result_whose_original_was_evicted_is_installed(compacted: Any, caplog: Any) -> None:
    ids, prefix, fp = compacted
    cache, runner = sent_then_evicted(fp, ids)
    runner.results.append(JobResult(tuple(ids), prefix, None, 0.1))
    with caplog.at_level(logging.INFO, logger="sglang_ext"):
        cache.poll_compactions()
    stats = cache.stats
    assert (stats.installed, stats.installed_evicted, stats.results_rejected) == (1, 1, {})
    assert "its original had been evicted meanwhile" in caplog.text
    m = cache.match_prefix(MatchPrefixParams(key=key(ids)))
    assert m.device_prefix_len == len(ids)  # later requests hit the compacted prefix
    check_accounting(cache)


def test_checks_stay_strict_after_eviction(compacted: Any) -> None:
    ids, prefix, fp = compacted
    cache, runner = sent_then_evicted(fp, ids)
    runner.results.append(JobResult(tuple(ids), scaled(prefix, 64.0), None, 0.1))
    cache.poll_compactions()
    assert cache.stats.installed == 0 and cache.stats.results_rejected == {"check": 1}
    assert cache.token_to_kv_pool_allocator.available_size() == POOL  # its slots went back
    check_accounting(cache)


def test_a_result_waits_for_slots_then_installs(compacted: Any) -> None:
    ids, prefix, fp = compacted
    cache, runner = sent_then_evicted(fp, ids)
    alloc = cache.token_to_kv_pool_allocator
    held = alloc.alloc(alloc.available_size())  # running requests hold the whole pool
    runner.results.append(JobResult(tuple(ids), prefix, None, 0.1))
    cache.poll_compactions()
    assert cache.stats.installed == 0 and cache.stats.results_rejected == {}
    assert len(cache.lifecycle.intake.waiting) == 1
    cache.poll_compactions()  # still no slots: it waits on
    assert len(cache.lifecycle.intake.waiting) == 1
    alloc.free(held)  # the requests finished
    cache.poll_compactions()
    assert cache.stats.installed == cache.stats.installed_evicted == 1
    assert cache.lifecycle.intake.waiting == [] and cache.stats.results_rejected == {}
    check_accounting(cache)


def test_a_wait_that_is_over_drops_the_result_with_its_reason(compacted: Any) -> None:
    ids, prefix, fp = compacted
    cache, runner = sent_then_evicted(fp, ids, timeout=0.05)
    alloc = cache.token_to_kv_pool_allocator
    held = alloc.alloc(alloc.available_size())
    runner.results.append(JobResult(tuple(ids), prefix, None, 0.1))
    cache.poll_compactions()
    assert len(cache.lifecycle.intake.waiting) == 1
    time.sleep(0.1)
    cache.poll_compactions()
    assert cache.lifecycle.intake.waiting == []
    assert cache.stats.results_rejected == {"no_slots": 1} and cache.stats.fallbacks == 1
    alloc.free(held)
    check_accounting(cache)


@pytest.mark.parametrize("reason", ["compactor", "stale"])
def test_other_rejections_are_counted_by_reason(compacted: Any, reason: str) -> None:
    ids, prefix, fp = compacted
    runner = FakeRunner()
    cache = make_cache(fp, runner=runner)
    insert_fresh(cache, ids)
    if reason == "stale":
        runner.results.append(JobResult(tuple(ids), prefix, None, 0.1, epoch=-1))
    else:
        runner.results.append(JobResult(tuple(ids), None, TimeoutError("slow"), 0.1))
    cache.poll_compactions()
    assert cache.stats.installed == 0 and cache.stats.results_rejected == {reason: 1}
    assert cache.lifecycle.intake.waiting == []

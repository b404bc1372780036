"""The plugin's pool gauges are SGLang's own counts: compacted, tree, free, pool; and the
exporter publishes them with the counters that moved them."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("sglang")

from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

from sglang_ext.kv_store import head_counts
from sglang_ext.metrics import CompactionStats, PrometheusExporter
from sglang_ext.packing import slots_needed
from tests.sglang_ext._radix import (
    POOL,
    T,
    insert_fresh,
    key,
    make_cache,
)


def _gauges(cache: Any) -> tuple[int, int, int, int]:
    s = cache.stats
    return s.physical_tokens, s.tree_slots, s.free_slots, s.pool_slots


def test_read_pool_splits_the_tree() -> None:
    stats = CompactionStats(physical_tokens=10)
    stats.read_pool(free=100, tree_total=40, pool=150)
    assert (stats.tree_slots, stats.free_slots, stats.pool_slots) == (30, 100, 150)


def test_pool_gauges_follow_the_tree_and_the_allocator(compacted: Any) -> None:
    ids, prefix, fp = compacted
    cache = make_cache(fp)
    cache.poll_compactions()
    assert _gauges(cache) == (0, 0, POOL, POOL)

    insert_fresh(cache, [*ids, 11, 12, 13])
    cache.poll_compactions()
    assert _gauges(cache) == (0, T + 3, POOL - T - 3, POOL)

    # a running request locks the path: protected, still the tree's
    node = cache.match_prefix(MatchPrefixParams(key=key(ids))).last_device_node
    cache.inc_lock_ref(node)
    cache.poll_compactions()
    assert _gauges(cache) == (0, T + 3, POOL - T - 3, POOL)
    cache.dec_lock_ref(node)

    # the install retires the original path: only the compacted slots stay held
    cache.install(ids, prefix)
    cache.poll_compactions()
    counts = head_counts(prefix)  # [L, H_kv]
    n_slots = slots_needed(counts)
    assert _gauges(cache) == (n_slots, 0, POOL - n_slots, POOL)
    # the fit's entries, and what the N slots hold for them: less than one slot more
    assert cache.stats.kept_entries == int(counts.sum()) > 0
    assert 0 <= n_slots * counts.numel() - cache.stats.kept_entries < counts.numel()
    alloc = cache.token_to_kv_pool_allocator
    assert cache.stats.free_slots == alloc.available_size()
    assert cache.stats.physical_tokens + cache.stats.tree_slots == (
        cache.evictable_size() + cache.protected_size()
    )


def test_a_scrape_that_sees_an_install_sees_its_gauges() -> None:
    """The exporter sets the gauges before it counts: at the moment `installed_total` moves,
    the installed prefix's tokens are already published (a scrape between the two writes
    must not read an install with no prefix)."""
    from prometheus_client import REGISTRY

    labels = {"tp_rank": "test-order"}
    exporter = PrometheusExporter(labels)
    seen: list[float | None] = []
    counter = exporter._counters["installed"].labels(**labels)
    count = counter.inc

    def inc(amount: float = 1) -> None:
        seen.append(REGISTRY.get_sample_value("sglang:compaction_logical_tokens", labels))
        count(amount)

    counter.inc = inc  # type: ignore[method-assign,assignment]
    try:
        exporter.update(CompactionStats(installed=1, logical_tokens=700, physical_tokens=70))
        assert seen == [700.0]
        assert REGISTRY.get_sample_value("sglang:compaction_installed_total", labels) == 1.0
    finally:
        for series in [*exporter._counters.values(), *exporter._gauges.values()]:
            REGISTRY.unregister(series)
        REGISTRY.unregister(exporter._latency)

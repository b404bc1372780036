"""Pool readings come from the servers' own series: parsed, never computed beyond pool - free."""

from __future__ import annotations

from harness.pool import PoolReading, parse_metrics

STOCK = """# HELP sglang:kv_available_tokens Number of free token slots in the KV cache pool.
# TYPE sglang:kv_available_tokens gauge
sglang:kv_available_tokens{engine_type="unified",model_name="m",tp_rank="0"} 2034.0
sglang:kv_evictable_tokens{engine_type="unified",model_name="m",tp_rank="0"} 1014.0
sglang:kv_used_tokens{engine_type="unified",model_name="m",tp_rank="0"} 24.0
sglang:num_running_reqs{engine_type="unified",model_name="m",tp_rank="0",priority="0"} 2.0
sglang:num_running_reqs{engine_type="unified",model_name="m",tp_rank="0",priority="1"} 1.0
sglang:num_queue_reqs{engine_type="unified",model_name="m",tp_rank="0"} 4.0
"""
PLUGIN = (
    STOCK
    + """sglang:compaction_physical_tokens 203.0
sglang:compaction_tree_slots 14.0
sglang:compaction_free_slots 7975.0
sglang:compaction_pool_slots 8192.0
"""
)


def test_parse_sums_labels_and_skips_comments() -> None:
    m = parse_metrics(STOCK)
    assert m["sglang:num_running_reqs"] == 3.0 and m["sglang:kv_available_tokens"] == 2034.0
    assert not any(k.startswith("#") for k in m)


def test_stock_reading_is_sglangs_own_free_count() -> None:
    r = PoolReading.parse(parse_metrics(STOCK), pool=3072)
    assert (r.free, r.held, r.compacted, r.tree) == (2034, 3072 - 2034, None, None)
    assert (r.sglang_cached, r.sglang_in_use, r.running, r.queued) == (1014, 24, 3, 4)


def test_plugin_reading_uses_its_fresh_free_slots() -> None:
    """The plugin's gauge is read every scheduler iteration; SGLang's may lag while idle."""
    r = PoolReading.parse(parse_metrics(PLUGIN), pool=8192)
    assert (r.free, r.sglang_free, r.held, r.compacted, r.tree) == (7975, 2034, 217, 203, 14)
    assert r.as_dict()["held"] == 217

"""An install that raises something other than a failed check (a CUDA out-of-memory while a
layer is copied) never reaches SGLang's scheduler loop: the install is aborted, its slots go
back to the pool, the original prefix keeps serving, the error is counted, and after
`BREAKER_AFTER` errors in a row compaction stops (installed prefixes still serve)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

from sglang_ext.guard import BREAKER_AFTER, HookGuard
from sglang_ext.installer import PendingInstall
from sglang_ext.metrics import CompactionStats
from sglang_ext.runner import JobResult
from tests.sglang_ext._radix import (
    POOL,
    FakeRunner,
    T,
    check_accounting,
    insert_fresh,
    key,
    make_cache,
)


def _oom(*args: Any, **kwargs: Any) -> int:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_an_oom_inside_an_install_is_contained(
    compacted: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids, prefix, fp = compacted
    runner = FakeRunner()
    cache = make_cache(fp, runner=runner)
    insert_fresh(cache, ids)
    monkeypatch.setattr(PendingInstall, "step", _oom)
    exported: list[CompactionStats] = []
    cache.lifecycle.exporter = SimpleNamespace(update=lambda s, _: exported.append(replace(s)))
    cache.poll_compactions()  # the pool gauges are current
    runner.results.append(JobResult(tuple(ids), prefix, None, 0.1))
    assert cache.poll_compactions() == 0  # raised nothing into the scheduler
    s = cache.stats
    assert (s.install_errors, s.failures, s.fallbacks, s.installed) == (1, 1, 1, 0)
    # the failure reaches /metrics in the poll that began and aborted the install (the
    # slots it took are back, so the pool gauges alone show no change)
    assert exported and exported[-1] == s
    assert not cache.compacted_nodes() and not cache.lifecycle.pending
    assert cache.token_to_kv_pool_allocator.available_size() == POOL - T  # slots returned
    assert cache.match_prefix(MatchPrefixParams(key=key(ids))).device_prefix_len == T
    assert not cache.guard.open
    check_accounting(cache)


def test_a_node_that_cannot_be_made_gives_its_written_slots_back(
    compacted: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every layer written, then making the tree node raises: the slots go back to the pool
    (none was reachable), the error is counted, the original prefix keeps serving."""
    ids, prefix, fp = compacted
    runner = FakeRunner()
    cache = make_cache(fp, runner=runner)
    insert_fresh(cache, ids)
    monkeypatch.setattr(cache.lifecycle.tree, "add_node", _oom)
    runner.results.append(JobResult(tuple(ids), prefix, None, 0.1))
    assert cache.poll_compactions(idle=True) == 0  # written whole, then the node failed
    s = cache.stats
    assert (s.install_errors, s.failures, s.fallbacks, s.installed) == (1, 1, 1, 0)
    assert not cache.compacted_nodes() and not cache.lifecycle.pending
    assert cache.token_to_kv_pool_allocator.available_size() == POOL - T  # slots returned
    assert cache.match_prefix(MatchPrefixParams(key=key(ids))).device_prefix_len == T
    check_accounting(cache)


def test_repeated_errors_open_the_breaker_and_compaction_stops(
    compacted: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids, prefix, fp = compacted
    runner = FakeRunner()
    cache = make_cache(fp, runner=runner)
    insert_fresh(cache, ids)
    monkeypatch.setattr(PendingInstall, "step", _oom)
    for i in range(BREAKER_AFTER):
        runner.results.append(JobResult(tuple(ids), prefix, None, 0.1))
        cache.poll_compactions()
        assert cache.guard.open is (i == BREAKER_AFTER - 1)
    assert cache.stats.breaker_open == 1 and cache.fingerprint is None
    monkeypatch.undo()  # installs would work again, but results in flight are dropped now
    runner.results.append(JobResult(tuple(ids), prefix, None, 0.1))
    cache.poll_compactions()
    assert not cache.compacted_nodes() and cache.stats.stale == 1  # dropped: a new epoch
    assert cache.token_to_kv_pool_allocator.available_size() == POOL - T
    check_accounting(cache)


def test_the_guard_answers_the_fallback_and_resets_on_success() -> None:
    tripped: list[str] = []
    guard = HookGuard(tripped.append)

    def boom() -> bool:
        raise RuntimeError("boom")

    assert guard.call("gate", False, boom) is False
    assert guard.call("gate", None, lambda: 7) == 7 and guard.in_a_row == 0
    for _ in range(BREAKER_AFTER):
        guard.call("poll", None, boom)
    assert guard.open and guard.errors == BREAKER_AFTER + 1
    assert len(tripped) == 1 and "3 failures in a row, the last in poll" in tripped[0]


def test_scheduler_hooks_never_raise_into_the_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    """The AFTER hooks SGLang's scheduler calls answer their safe fallback when their work
    raises: the install poll (counted, the breaker trips after BREAKER_AFTER), the graph gate
    (False: the batch runs eagerly, always correct), a weight update (compaction stops)."""
    from types import SimpleNamespace

    import sglang_ext.adapter.wrapped_backend as wb
    from sglang_ext.adapter import hooks

    tripped: list[str] = []

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise torch.OutOfMemoryError("CUDA out of memory")

    cache = SimpleNamespace(guard=HookGuard(tripped.append), poll_compactions=boom,
                            on_weights_updated=boom, fingerprint="fp",
                            trip=tripped.append)  # fmt: skip
    scheduler = SimpleNamespace(tree_cache=cache)
    for _ in range(BREAKER_AFTER):
        assert hooks._poll_scheduler(None, scheduler) is None
    assert cache.guard.errors == BREAKER_AFTER and len(tripped) == 1

    monkeypatch.setattr(wb, "graph_gate", boom)
    assert hooks._graph_gate(True, object(), object()) is False

    hooks._weights_updated(SimpleNamespace(success=True), SimpleNamespace(scheduler=scheduler))
    assert "a weight update raised" in tripped[-1]


def test_a_flush_drops_results_in_flight(compacted: Any) -> None:
    """/flush_cache resets the tree: a result asked of the flushed tree is dropped as stale."""
    ids, prefix, fp = compacted
    runner = FakeRunner()
    cache = make_cache(fp, runner=runner)
    insert_fresh(cache, ids)
    runner.results.append(JobResult(tuple(ids), prefix, None, 0.1))
    cache.reset()  # what SGLang's flush_cache does: the tree, then the pool
    cache.token_to_kv_pool_allocator.clear()
    insert_fresh(cache, ids)
    assert cache.poll_compactions() == 0
    assert cache.stats.stale == 1 and not cache.compacted_nodes()
    check_accounting(cache)

"""Refits: a compacted prefix fitted again as questions accumulate, swapped in atomically
(real CPU pools, a real compacted SmolLM2 prefix; the trigger's schedule alone at the end)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("sglang")

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams

from compactor.workers.job import CompactJob
from sglang_ext.adapter.compacted_node import child_key
from sglang_ext.config import CompactionConfig
from sglang_ext.kv_store import head_counts
from sglang_ext.runner import JobResult
from sglang_ext.trigger import CompactionTrigger
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


def _ask(cache: Any, rid: str, prompt: list[int], prefix_len: int) -> None:
    """One request that runs to the end: match, final checkpoint, release."""
    r = make_req(cache, rid, prompt, prefix_len)
    cache.checkpoint(r, up_to=len(prompt))
    release_req(cache, r, len(prompt))


def _installed(cache: Any, runner: FakeRunner, ids: list[int], prefix: Any, fit_round: int):
    runner.results.append(JobResult(tuple(ids), prefix, None, 0.1, fit_round=fit_round))
    assert cache.poll_compactions() == 1
    (node,) = cache.compacted_nodes()
    return node


def test_refit_replaces_the_fit_and_frees_the_old_one_when_its_requests_end(
    compacted: Any,
) -> None:
    ids, prefix, fp = compacted
    runner = FakeRunner()
    cache = make_cache(fp, runner=runner, min_hits=2, refit_at=(4,))
    insert_fresh(cache, [*ids, 500])
    _ask(cache, "a", [*ids, 501, 502], T)
    _ask(cache, "b", [*ids, 601], T)
    assert runner.rounds == [0] and len(runner.submitted[0][1]) == 2
    first = _installed(cache, runner, ids, prefix, 0)
    t_max = int(head_counts(prefix).max())

    # a request in flight on the first fit when the refit lands
    old = make_req(cache, "old", [*ids, 701, 702], T)
    assert cache.req_to_token_pool.req_to_token[old.kv.req_pool_idx, 0] == first.compaction.slots[0]
    _ask(cache, "c", [*ids, 801], T)
    assert runner.rounds == [0]  # 3 distinct questions: not yet
    _ask(cache, "c2", [*ids, 801], T)  # the same question again counts once
    assert runner.rounds == [0]
    _ask(cache, "d", [*ids, 901, 902], T)
    assert runner.rounds == [0, 1]  # 4 distinct questions: refit 1, with all four
    tokens, follow_ups = runner.submitted[1]
    assert tokens == ids
    assert sorted(follow_ups) == [[501, 502], [601], [801], [901, 902]]

    free_before = cache.token_to_kv_pool_allocator.available_size()
    second = _installed(cache, runner, ids, prefix, 1)
    assert second is not first and second.compaction.fit_round == 1
    assert cache.stats.installed == 2 and cache.stats.refits == 1
    # new requests match the refit; the first fit still holds its slots for `old`, the
    # question tails cached under it since its install (c's 1 + d's 2 slots, unlocked) are
    # freed at once
    m = cache.match_prefix(MatchPrefixParams(key=key([*ids, 5])))
    assert m.device_prefix_len == T and m.last_device_node is second
    assert cache.token_to_kv_pool_allocator.available_size() == free_before - t_max + 3
    assert cache.beta_store.compacted[first.compaction.slots].all()
    assert first.parent.children[child_key(first.compaction.prefix_hash, 0)] is first

    # `old` ends: it stays off the refit (its KV row is the first fit's), then the first
    # fit is freed at the next poll, beta and all, and is not counted as an eviction
    cache.checkpoint(old, up_to=T + 2)
    assert cache.stats.skipped_checkpoints == 1 and not second.children
    release_req(cache, old, T + 2)
    cache.poll_compactions()
    assert not cache.beta_store.compacted[first.compaction.slots].any()
    assert cache.stats.evicted == 0
    assert cache.compacted_nodes() == [second]
    check_accounting(cache)

    # each step is sent once; an old result of the same round is a double install
    _ask(cache, "e", [*ids, 1001], T)
    assert runner.rounds == [0, 1]
    runner.results.append(JobResult(tuple(ids), prefix, None, 0.1, fit_round=1))
    assert cache.poll_compactions() == 0 and cache.stats.double_installs == 1
    check_accounting(cache)
    cache.evict(EvictParams(num_tokens=POOL))  # nothing left behind
    assert cache.token_to_kv_pool_allocator.available_size() == POOL


def test_failed_refit_keeps_the_installed_fit_serving(compacted: Any) -> None:
    ids, prefix, fp = compacted
    runner = FakeRunner()
    cache = make_cache(fp, runner=runner, min_hits=2, refit_at=(3, 5))
    insert_fresh(cache, [*ids, 500])
    for rid, q in (("a", [501]), ("b", [601])):
        _ask(cache, rid, [*ids, *q], T)
    first = _installed(cache, runner, ids, prefix, 0)
    _ask(cache, "c", [*ids, 701], T)
    assert runner.rounds == [0, 1]
    runner.results.append(JobResult(tuple(ids), None, TimeoutError(), 1.0, fit_round=1))
    cache.poll_compactions()
    assert cache.stats.failures == 1 and cache.stats.fallbacks == 0
    assert cache.compacted_nodes() == [first]
    # not sent again as a new document; the next step refits it
    _ask(cache, "d", [*ids, 801], T)
    assert runner.rounds == [0, 1]
    _ask(cache, "e", [*ids, 901], T)
    assert runner.rounds == [0, 1, 2] and len(runner.submitted[-1][1]) == 5
    check_accounting(cache)


def test_refit_schedule_counts_distinct_questions_once_a_fit_is_installed() -> None:
    cfg = CompactionConfig(
        endpoint="inproc://", min_prefix_tokens=16, boundary_margin=0, align_tokens=1,
        min_continuations=2, refit_at=(4, 6), follow_up_tokens=2,
    )  # fmt: skip
    t = CompactionTrigger(cfg)
    doc = list(range(100, 140))
    branch = SimpleNamespace(hit_count=2, children={1: None, 2: None}, tokens=doc)
    t.remember("a", [*doc, 1])
    t.remember("b", [*doc, 2, 3, 4])
    t.on_hit(branch)
    first = t.pick(lambda n: list(n.tokens))
    assert first is not None and first.fit_round == 0
    for rid, q in (("c", [5]), ("c", [5]), ("d", [6, 7])):
        t.remember(rid, [*doc, *q])
    assert t.next_refit() is None  # 4 questions, but the first fit is not installed yet
    t.installed(doc)
    t.remember("e", [*doc, 6])  # an earlier turn of d's conversation: not a question
    refit = t.next_refit()
    assert refit is not None and refit.tokens == doc and refit.fit_round == 1
    assert refit.follow_ups == [[6, 7], [5], [2, 3], [1]]  # most recent first, cut to 2
    assert t.next_refit() is None  # in flight
    t.installed(doc)
    t.remember("f", [*doc, 8])
    assert t.next_refit() is None  # 5 < 6
    t.remember("g", [*doc, *range(200, 230)])  # a document of its own: not a question
    t.remember("h", [*doc, 9])
    assert (r2 := t.next_refit()) is not None and r2.fit_round == 2 and len(r2.follow_ups) == 6
    t.installed(doc)
    t.remember("i", [*doc, 10])
    assert t.next_refit() is None  # the schedule is spent


def test_a_refit_is_its_own_result_in_the_service_cache() -> None:
    from compactor.service.convert import job_from_request, request_from_job
    from compactor.spec import CompactionSpec

    spec = CompactionSpec(method="am-highest", ratio=0.1)
    first = CompactJob("fp", (1, 2, 3), spec, follow_ups=((4,),))
    refit = CompactJob("fp", (1, 2, 3), spec, follow_ups=((4,), (5,)), fit_round=1)
    assert first.key() == CompactJob("fp", (1, 2, 3), spec).key()  # follow-ups: not keyed
    assert refit.key() != first.key()
    assert refit.key() == CompactJob("fp", (1, 2, 3), spec, fit_round=1).key()
    back = job_from_request(request_from_job(refit), auto_ratio=0.1)
    assert back.fit_round == 1 and back.key() == refit.key()

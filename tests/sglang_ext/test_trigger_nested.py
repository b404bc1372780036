"""A document under an already compacted prefix is compacted whole, from the root.

Real CPU pools and real SmolLM2 compactions: the fixture's 96-token prefix S is installed
(node K0); a document D under it is then asked three questions over K0. The trigger sends
S + D (K0's key tokens, then the ordinary ones below it); the result's range check reads
what is left of the original KV (K0's slots and D's ordinary slots below K0: S's own
original is gone); the install retires D's nodes under K0 and K0 keeps serving S's other
requests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang")

from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

from compactor.types import CompactedPrefix
from sglang_ext.adapter.radix_cache import CompactionRadixCache
from sglang_ext.runner import JobResult
from tests.sglang_ext._radix import (
    ORIGINAL_KV,
    FakeRunner,
    T,
    check_accounting,
    compact_rooms,
    insert_fresh,
    key,
    make_cache,
    make_req,
    release_req,
)

DOC = 80  # tokens of the document under the compacted prefix


@pytest.fixture(scope="module")
def nested(prepared_model: Path, compacted: Any) -> tuple[list[int], CompactedPrefix]:
    """The tokens S + D [T + DOC] and their real compaction; registers their real KV."""
    ids, _, _ = compacted
    full, prefix = compact_rooms(prepared_model, T + DOC)
    assert full[:T] == ids
    return full, prefix


def write_original(cache: CompactionRadixCache, req: Any, full: list[int], start: int) -> None:
    """Give the request's fresh slots for positions [start, len(full)) their real KV (what
    its prefill over K0 would have written, near enough for the range check)."""
    slots = cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx, start : len(full)].long()
    for i, (k, v) in enumerate(ORIGINAL_KV[tuple(full)]):
        cache.kvcache.get_key_buffer(i)[slots] = k[start:]
        cache.kvcache.get_value_buffer(i)[slots] = v[start:]


def test_document_under_a_compacted_prefix_is_compacted_whole(compacted: Any, nested: Any) -> None:
    ids, prefix, fp = compacted
    full, full_prefix = nested
    runner = FakeRunner()
    cache = make_cache(fp, runner=runner, min_hits=2, min_continuations=3)
    insert_fresh(cache, [*ids, 7])
    k0 = cache.install(ids, prefix)  # S alone was compacted (the old rule's outcome)
    chat = make_req(cache, "chat", [*ids, 9, 9], T)  # a request on K0 outside the document
    cache.checkpoint(chat, up_to=T + 2)
    release_req(cache, chat, T + 2)
    for i, q in enumerate(([501, 502], [601], [701, 702, 703])):
        prompt = [*full, *q]
        start = T if i == 0 else T + DOC  # the first one prefills D over K0
        r = make_req(cache, f"q{i}", prompt, start)
        if i == 0:
            write_original(cache, r, full, T)
        cache.checkpoint(r, up_to=len(prompt))
        release_req(cache, r, len(prompt))
    # the whole path from the root: K0's key tokens, then the ordinary ones below it
    assert [tokens for tokens, _ in runner.submitted] == [full]
    assert sorted(runner.submitted[0][1]) == [[501, 502], [601], [701, 702, 703]]
    runner.results.append(JobResult(tuple(full), full_prefix, None, 0.1))
    while cache.lifecycle.pending or runner.results:
        cache.poll_compactions()
    assert cache.stats.installed == 2 and cache.stats.fallbacks == 0, cache.stats
    k1 = cache.lifecycle.installed[full_prefix.prefix_hash]
    # S + D + anything goes through the new node; S + anything else still through K0
    m = cache.match_prefix(MatchPrefixParams(key=key([*full, 501, 1])))
    assert m.last_device_node is not k0 and m.device_prefix_len >= len(full)
    assert cache.match_prefix(MatchPrefixParams(key=key([*full, 3]))).last_device_node is k1
    m0 = cache.match_prefix(MatchPrefixParams(key=key([*ids, 9, 9, 1])))
    assert m0.device_prefix_len == T + 2 and m0.last_device_node.parent is k0
    # D's ordinary nodes under K0 were retired and (unlocked) freed; K0 keeps its chat
    assert list(k0.children.values()) == [m0.last_device_node]
    check_accounting(cache)


def test_nothing_of_the_original_left_is_a_logged_fallback(compacted: Any, nested: Any) -> None:
    """A result for a path whose KV is all gone (evicted) is rejected with its reason."""
    _, _, fp = compacted
    full, full_prefix = nested
    runner = FakeRunner()
    cache = make_cache(fp, runner=runner)
    runner.results.append(JobResult(tuple(full), full_prefix, None, 0.1))
    cache.poll_compactions()
    assert cache.stats.invalid == 1 and cache.stats.installed == 0
    assert cache.stats.results_rejected == {"original_evicted": 1}  # never sent: no bounds kept
    check_accounting(cache)

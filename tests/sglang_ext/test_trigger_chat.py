"""The trigger on chat traffic, through a real `CompactionRadixCache` on a CPU pool.

The workload is the one a user met (issue #17): a 430-token system prompt, two chats that
share only it (two turns each), then two 840-token documents under it in the user turn,
four questions each. The stock rule (any branch point with 2 hits) sent the system prompt
alone; the default rule (3 distinct questions, each going on for fewer than
`min_prefix_tokens` tokens after the path) sends each document, whole from the root.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

from sglang_ext.adapter.radix_cache import CompactionRadixCache
from sglang_ext.config import CompactionConfig
from tests.sglang_ext._radix import FakeRunner, key, make_req, release_req

POOL = 8192
SYSTEM = [1, *range(10_000, 10_429)]  # 430 tokens (the template's system turn)
USER = [2, 3]  # the template's user header


def span(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def workload() -> list[tuple[str, list[int]]]:
    """(request id, prompt) in arrival order: chats first, then the documents."""
    out = []
    for c in range(2):  # two chats, two turns each: the second resends the first + a reply
        first = [*SYSTEM, *USER, *span(20_000 + 1000 * c, 30)]
        out.append((f"chat{c}-1", first))
        out.append((f"chat{c}-2", [*first, *span(30_000 + 1000 * c, 60), *USER, 7, 8, 9]))
    for d in range(2):
        doc = span(40_000 + 1000 * d, 840)
        for q in range(4):
            out.append((f"doc{d}-q{q}", [*SYSTEM, *USER, *doc, *span(50_000 + 100 * q, 15)]))
    return out


def make_cache(runner: FakeRunner, **cfg: Any) -> CompactionRadixCache:
    cfg.setdefault("align_tokens", 1)  # paths end at the margin (alignment: ..._trigger.py)
    kv = MHATokenToKVPool(POOL, 1, torch.float32, 1, 8, 1, "cpu", False)
    alloc = TokenToKVPoolAllocator(POOL, torch.float32, "cpu", kv, False)
    r2t = ReqToTokenPool(4, 2048, "cpu", False)
    params = CacheInitParams(
        disable=False, req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc, page_size=1
    )
    return CompactionRadixCache(params, CompactionConfig("inproc://", **cfg), "f" * 32, runner)


def cached(cache: CompactionRadixCache, prompt: list[int]) -> int:
    return int(cache.match_prefix(MatchPrefixParams(key=key(prompt))).device_prefix_len)


def run(cache: CompactionRadixCache, requests: list[tuple[str, list[int]]]) -> None:
    """Serve `requests` one at a time: match, prefill the rest, cache the prompt, finish."""
    for rid, prompt in requests:
        r = make_req(cache, rid, prompt, cached(cache, prompt))
        cache.checkpoint(r, up_to=len(prompt))
        release_req(cache, r, len(prompt))


def serve(**cfg: Any) -> tuple[list[list[int]], CompactionRadixCache]:
    """Run the workload; returns the paths sent for compaction and the cache."""
    runner = FakeRunner()
    cache = make_cache(runner, **cfg)
    run(cache, workload())
    return [tokens for tokens, _ in runner.submitted], cache


def test_documents_are_compacted_and_the_system_prompt_alone_is_not() -> None:
    sent, cache = serve()
    head = len(SYSTEM) + len(USER)
    docs = [[*SYSTEM, *USER, *span(40_000 + 1000 * d, 840)] for d in range(2)]
    # each document, whole from the root, cut by the boundary margin (32) before its branch
    assert sent == [doc[:-32] for doc in docs]
    assert all(len(tokens) > head for tokens in sent)  # never the system prompt alone
    # the figures behind the rule, at the end of the workload
    system = [*SYSTEM, *USER][:-32]
    asked, continuations = cache.trigger.questions(system)
    assert (len(asked), continuations) == (4, 2)  # two chats, two turns each
    doc_asked, doc_continuations = cache.trigger.questions(docs[1][:-32])
    assert (len(doc_asked), doc_continuations) == (4, 4)
    print(
        f"\nsystem prompt: T={len(system)}, questions {len(asked)}, continuations "
        f"{continuations}, reuse {len(system) * len(asked)}; document: "
        f"T={len(docs[1]) - 32}, questions {len(doc_asked)}, continuations "
        f"{doc_continuations}, reuse {(len(docs[1]) - 32) * len(doc_asked)}"
    )


def test_the_old_rule_sends_the_system_prompt_alone() -> None:
    """With one continuation enough (about the stock rule: any branch with 2 hits) the second
    chat's first turn sends the system prompt alone, T=400."""
    sent, _ = serve(min_continuations=1)
    assert len(sent[0]) == len(SYSTEM) + len(USER) - 32


@pytest.mark.parametrize("turns", [1, 3])
def test_three_chats_are_three_continuations_whatever_their_turns(turns: int) -> None:
    """The rule is about continuations, not about system prompts: three chats with short
    messages make their shared system prompt compactable, a chat's later turns count once."""
    runner = FakeRunner()
    cache = make_cache(runner)
    requests = []
    for c in range(3):
        prompt = [*SYSTEM, *USER, *span(20_000 + 1000 * c, 30)]
        for t in range(turns):
            requests.append((f"c{c}-{t}", prompt))
            prompt = [*prompt, *span(30_000 + 1000 * c + 100 * t, 20), *USER, 7]
    run(cache, requests[: turns * 2])
    assert runner.submitted == []  # two chats, however many turns
    run(cache, requests[turns * 2 :])
    assert [len(tokens) for tokens, _ in runner.submitted] == [len(SYSTEM) + len(USER) - 32]

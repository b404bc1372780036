"""`CompactionTrigger`: branch points only, once per document, retries with backoff (the chat-traffic rules: test_sglang_ext_trigger_chat.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from compactor.types import prefix_hash
from sglang_ext.config import CompactionConfig
from sglang_ext.trigger import (
    _MAX_FAILURES,
    _MAX_PATHS,
    _RECENT_PROMPTS,
    CompactionTrigger,
    PathIndex,
)

DOC = list(range(100, 400))  # 300 tokens


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def node(tokens: list[int], hits: int, children: int) -> Any:
    return SimpleNamespace(
        tokens=tokens, hit_count=hits, children={i: None for i in range(children)}
    )


def trigger(**kw: Any) -> tuple[CompactionTrigger, Clock]:
    """A trigger whose paths end at the branch and that needs one question (these tests are
    about branches, overlaps and retries; questions: test_sglang_ext_trigger_chat.py)."""
    clock = Clock()
    kw.setdefault("boundary_margin", 0)
    kw.setdefault("align_tokens", 1)
    kw.setdefault("min_continuations", 1)
    cfg = CompactionConfig(endpoint="inproc://", min_prefix_tokens=256, **kw)
    return CompactionTrigger(cfg, clock=clock), clock


def offer(t: CompactionTrigger, *nodes: Any) -> Any:
    for n in nodes:
        t.on_hit(n)
    return t.pick(lambda n: list(n.tokens))


def test_branch_point_with_enough_hits_is_sent_with_follow_ups() -> None:
    t, _ = trigger(min_hits=2, follow_up_tokens=2)
    t.remember("a", [*DOC, 1, 2, 3])
    t.remember("b", [*DOC, 4, 5])
    t.remember("other", [7, 8, 9])
    assert offer(t, node(DOC, hits=1, children=2)) is None  # too few hits: not a candidate
    assert offer(t, node([*DOC, 1, 2, 3], hits=2, children=0)) is None  # repeated prompt
    tokens, follow_ups, _ = offer(
        t, node(DOC, hits=2, children=2), node(DOC[:280], hits=3, children=2)
    )
    assert tokens == DOC  # the longest candidate
    assert follow_ups == [[4, 5], [1, 2]]  # most recent first, cut to follow_up_tokens
    assert list(t.candidates) == []


def test_short_or_overlapping_paths_are_not_sent_again() -> None:
    t, _ = trigger(min_hits=2)
    longer = [*DOC, *range(1000, 1300)]  # DOC, then a whole document more
    for i, prompt in enumerate(([*DOC, 1, 2, 3], [*DOC, 9], [*longer, 5], [*longer, 6])):
        t.remember(str(i), prompt)
    assert offer(t, node(DOC[:200], hits=5, children=2)) is None  # < min_prefix_tokens
    assert offer(t, node(DOC, hits=2, children=2)) is not None
    assert offer(t, node(DOC, hits=3, children=3)) is None  # in flight
    assert offer(t, node([*DOC, 1, 2], hits=2, children=2)) is None  # around it, same document
    assert offer(t, node(DOC[:260], hits=2, children=2)) is None  # inside it
    t.forget(prefix_hash(DOC))  # evicted after install: may be compacted again
    assert offer(t, node(DOC, hits=4, children=2)) is not None
    # a whole document under it is another compaction (the shorter one keeps its requests)
    assert offer(t, node(longer, hits=2, children=2)) is not None
    assert offer(t, node(DOC, hits=5, children=2)) is None  # now inside the longer one too


def test_failed_compaction_is_retried_with_backoff_then_cools_down() -> None:
    t, clock = trigger(min_hits=2, max_retries=2, retry_backoff_s=30.0, failure_cooldown_s=600.0)
    t.remember("a", [*DOC, 1])
    branch = node(DOC, hits=2, children=2)
    assert offer(t, branch) is not None
    assert t.failed(DOC) is True
    assert offer(t, branch) is None  # backing off
    clock.t = 30.0
    assert offer(t, branch) is not None  # first retry
    assert t.failed(DOC) is True
    clock.t = 89.0
    assert offer(t, branch) is None  # second backoff is 60 s
    clock.t = 90.0
    assert offer(t, branch) is not None
    assert t.failed(DOC) is False  # out of retries: cools down
    clock.t = 689.0
    assert offer(t, branch) is None
    clock.t = 690.0
    assert offer(t, branch) is not None  # cooled down: its record is dropped, a fresh start
    assert t.failed(DOC) is True  # the first failure of the fresh record: backoff again
    assert t._failures[prefix_hash(DOC)].count == 1


def test_path_stops_short_of_the_branch_by_the_margin() -> None:
    """Two requests whose questions both start with token 7 branch after it; a third that
    starts with 8 must still match the compacted prefix whole: the margin leaves the seam out."""
    t, _ = trigger(min_hits=2, boundary_margin=8, follow_up_tokens=64)
    t.remember("a", [*DOC, 7, 1])
    t.remember("b", [*DOC, 7, 2])
    tokens, follow_ups, _ = offer(t, node([*DOC, 7], hits=2, children=2))
    assert tokens == DOC[:-7]  # 301-token branch path minus 8
    assert follow_ups == [[*DOC[-7:], 7, 2], [*DOC[-7:], 7, 1]]
    t2, _ = trigger(min_hits=2, boundary_margin=64)
    assert offer(t2, node(DOC, hits=2, children=2)) is None  # 300 - 64 < min_prefix_tokens


def test_replicas_that_branch_a_token_apart_ask_for_the_same_prefix() -> None:
    """One replica's questions part right after the document, another's one token later
    (both start with token 7): after the margin both cut down to the same multiple of
    `align_tokens`, so a shared service sees one prefix, not two."""
    picked = []
    for branch in ([*DOC], [*DOC, 7]):
        t, _ = trigger(min_hits=2, boundary_margin=8, align_tokens=64)
        t.remember("a", [*branch, 1])
        t.remember("b", [*branch, 2])
        tokens, _, _ = offer(t, node(branch, hits=2, children=2))
        picked.append(tokens)
    assert picked[0] == picked[1] == DOC[:256]  # 292 and 293 both go down to 256
    t, _ = trigger(min_hits=2, boundary_margin=8, align_tokens=512)
    t.remember("a", [*DOC, 1])
    assert offer(t, node(DOC, hits=2, children=2)) is None  # aligned to 0 < min_prefix_tokens


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"max_retries": -1}, "retry limits"),
        ({"retry_backoff_s": -1.0}, "retry limits"),
        ({"boundary_margin": -1}, "boundary-margin must be >= 0, got -1"),
        ({"align_tokens": 0}, "align-tokens must be >= 1, got 0"),
        ({"min_continuations": 0}, "min-continuations must be >= 1, got 0"),
        ({"failure_cooldown_s": -1.0}, "failure-cooldown must be >= 0, got -1.0"),
    ],
)
def test_bad_limits_are_value_errors(bad: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CompactionConfig(endpoint="inproc://", **bad)


def test_path_index_finds_prefixes_and_enclosing_paths() -> None:
    idx = PathIndex()
    a, b, c = (1, 2, 3, 4, 5), (1, 2, 3, 9), (1, 2)
    for p in (a, b, c, a):
        idx.add(p)
    assert idx.query([1, 2, 3, 4, 5, 6]) == (5, False)  # a prefixes it
    assert idx.query([1, 2, 3]) == (2, True)  # c prefixes it; it is inside a and b
    assert idx.query([1, 2]) == (2, True)  # equal to c
    assert idx.query([1, 2, 3, 7]) == (2, False)  # leaves a and b inside their edge
    assert idx.query([5, 6]) == (0, False)
    idx.remove(a)
    assert idx.query([1, 2, 3, 4, 5, 6]) == (5, False)  # a was held twice
    idx.remove(a)
    idx.remove(c)
    assert idx.query([1, 2, 3, 4, 5, 6]) == (0, False)
    assert idx.query([1, 2, 3]) == (0, True)  # inside b still
    idx.remove(b)
    assert idx.query([1, 2]) == (0, False)


def test_memory_is_bounded() -> None:
    t, _ = trigger(min_hits=2, max_retries=0)
    for i in range(_MAX_FAILURES + 10):
        t.failed([-1 - i, *DOC])
    assert len(t._failures) == _MAX_FAILURES  # the oldest records dropped
    for i in range(_MAX_PATHS + 10):
        path = [i, *DOC]
        t.remember(str(i), [*path, 1])
        assert offer(t, node(path, hits=2, children=2)) is not None
    assert len(t._paths) == _MAX_PATHS and len(t._recent) == _RECENT_PROMPTS
    # the oldest held path was dropped from the overlap index as well: it may be sent again
    t.remember("again", [0, *DOC, 1])
    assert offer(t, node([0, *DOC], hits=2, children=2)) is not None
    assert offer(t, node([_MAX_PATHS + 9, *DOC], hits=2, children=2)) is None  # still held


def test_new_flags_reach_the_config() -> None:
    import argparse

    from sglang_ext.config import add_cli_args, config_from_namespace

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    ns = parser.parse_args(
        ["--compaction-endpoint", "inproc://", "--compaction-min-continuations", "4",
         "--compaction-failure-cooldown", "5"]
    )  # fmt: skip
    cfg = config_from_namespace(ns)
    assert cfg is not None and (cfg.min_continuations, cfg.failure_cooldown_s) == (4, 5.0)
    default = config_from_namespace(parser.parse_args(["--compaction-endpoint", "inproc://"]))
    assert default is not None and default.min_continuations == 3


def test_recent_prompts_are_bounded_by_tokens_not_only_by_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A few very long prompts (long chat histories) cannot hold unbounded memory: the
    oldest are dropped once the prompts kept hold more than `_RECENT_TOKENS` tokens."""
    import sglang_ext.trigger as trigger_module

    monkeypatch.setattr(trigger_module, "_RECENT_TOKENS", 1000)
    t = CompactionTrigger(CompactionConfig(endpoint="inproc://"))
    for i in range(5):
        t.remember(f"r{i}", list(range(i, i + 400)))
    assert list(t._recent) == ["r3", "r4"] and t._recent_tokens == 800
    t.remember("r4", list(range(10)))  # the same request again: counted once
    assert t._recent_tokens == 410
    t.remember("huge", list(range(5000)))  # one prompt over the budget alone is kept
    assert list(t._recent) == ["huge"] and t._recent_tokens == 5000


def test_a_pick_weighs_a_bounded_number_of_recent_branch_points() -> None:
    """Thousands of hits between two polls cost one pick of at most _MAX_CANDIDATES paths (the
    most recent), each scanning the recent prompts once."""
    from sglang_ext import trigger as trigger_mod

    t, _ = trigger(min_hits=2, follow_up_tokens=2)
    t.remember("a", [*DOC, 1, 2, 3])
    t.remember("b", [*DOC, 4, 5])
    scanned: list[int] = []
    real = t.questions
    t.questions = lambda path: (scanned.append(len(path)), real(path))[1]  # type: ignore[method-assign]
    for i in range(5000):
        t.on_hit(node(DOC[: 300 + i % 50], hits=2, children=2))
    t.on_hit(node(DOC, hits=2, children=2))
    assert len(t.candidates) == trigger_mod._MAX_CANDIDATES
    sub = t.pick(lambda n: list(n.tokens))
    assert sub is not None and len(scanned) <= trigger_mod._MAX_CANDIDATES

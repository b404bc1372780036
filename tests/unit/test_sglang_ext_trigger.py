"""`CompactionTrigger`: branch points only, once per document, retries with backoff."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from compactor.types import prefix_hash
from sglang_ext.config import CompactionConfig
from sglang_ext.trigger import CompactionTrigger

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
    clock = Clock()
    kw.setdefault("boundary_margin", 0)
    kw.setdefault("align_tokens", 1)
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
    tokens, follow_ups = offer(
        t, node(DOC, hits=2, children=2), node(DOC[:280], hits=3, children=2)
    )
    assert tokens == DOC  # the longest candidate
    assert follow_ups == [[4, 5], [1, 2]]  # most recent first, cut to follow_up_tokens
    assert t.candidates == []


def test_short_or_overlapping_paths_are_not_sent_again() -> None:
    t, _ = trigger(min_hits=2)
    assert offer(t, node(DOC[:200], hits=5, children=2)) is None  # < min_prefix_tokens
    assert offer(t, node(DOC, hits=2, children=2)) is not None
    assert offer(t, node(DOC, hits=3, children=3)) is None  # in flight
    assert offer(t, node([*DOC, 1, 2], hits=2, children=2)) is None  # around it
    assert offer(t, node(DOC[:260], hits=2, children=2)) is None  # inside it
    t.forget(prefix_hash(DOC))  # evicted after install: may be compacted again
    assert offer(t, node(DOC, hits=4, children=2)) is not None


def test_failed_compaction_is_retried_with_backoff_then_given_up() -> None:
    t, clock = trigger(min_hits=2, max_retries=2, retry_backoff_s=30.0)
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
    assert t.failed(DOC) is False  # out of retries
    clock.t = 1e6
    assert offer(t, branch) is None


def test_path_stops_short_of_the_branch_by_the_margin() -> None:
    """Two requests whose questions both start with token 7 branch after it; a third that
    starts with 8 must still match the compacted prefix whole: the margin leaves the seam out."""
    t, _ = trigger(min_hits=2, boundary_margin=8, follow_up_tokens=64)
    t.remember("a", [*DOC, 7, 1])
    t.remember("b", [*DOC, 7, 2])
    tokens, follow_ups = offer(t, node([*DOC, 7], hits=2, children=2))
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
        tokens, _ = offer(t, node(branch, hits=2, children=2))
        picked.append(tokens)
    assert picked[0] == picked[1] == DOC[:256]  # 292 and 293 both go down to 256
    t, _ = trigger(min_hits=2, boundary_margin=8, align_tokens=512)
    assert offer(t, node(DOC, hits=2, children=2)) is None  # aligned to 0 < min_prefix_tokens


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"max_retries": -1}, "retry limits"),
        ({"retry_backoff_s": -1.0}, "retry limits"),
        ({"boundary_margin": -1}, "boundary-margin must be >= 0, got -1"),
        ({"align_tokens": 0}, "align-tokens must be >= 1, got 0"),
    ],
)
def test_bad_limits_are_value_errors(bad: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CompactionConfig(endpoint="inproc://", **bad)

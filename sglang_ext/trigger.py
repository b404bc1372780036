"""`CompactionTrigger`: which radix-tree paths go to the compactor, when, with which queries.

The radix cache reports hits (`on_hit`) and requests it saw (`remember`); after each insert
it asks `pick(...)` for at most one path to send. Rules:

- a candidate is a branch point (2+ children: requests went on differently after it) with
  at least `min_hits` hits; with `min_hits` 1 any hit node is a candidate;
- the longest candidate path wins, cut `boundary_margin` tokens short: the two requests
  that made the branch may share the first tokens of their questions (or a token merged
  across the seam) that a third does not, and a compacted prefix is matched whole or not
  at all; then cut down to a multiple of `align_tokens` (replicas whose branch points
  differ by a token or two ask for the same prefix); paths shorter than
  `min_prefix_tokens` are not sent;
- one compaction per document: a path equal to, inside or around one in flight or
  installed is not sent again;
- a failed compaction may be sent again after `retry_backoff_s * 2**(failures - 1)`
  seconds, at most `max_retries` times; an evicted compacted prefix may be sent again;
- follow-ups are the first `follow_up_tokens` tokens after the path of the most recent
  requests that shared it (at most `max_follow_ups`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from compactor import prefix_hash
from sglang_ext.config import CompactionConfig

__all__ = ["CompactionTrigger", "Submission"]

_RECENT_PROMPTS = 64

Submission = tuple[list[int], list[list[int]]]  # (path tokens [T], follow-ups)


class CompactionTrigger:
    """Hit bookkeeping for one radix cache (see the module docstring)."""

    def __init__(self, config: CompactionConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self.candidates: list[Any] = []
        self._recent: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._paths: dict[str, tuple[int, ...]] = {}  # in flight or installed, by prefix hash
        self._failures: dict[str, int] = {}
        self._not_before: dict[str, float] = {}

    def reset(self) -> None:
        self.candidates.clear()
        self._recent.clear()
        self._paths.clear()
        self._failures.clear()
        self._not_before.clear()

    def remember(self, rid: str, prompt: Sequence[int]) -> None:
        """Keep a request's prompt (the last `_RECENT_PROMPTS`) to cut follow-ups from."""
        self._recent[rid] = tuple(int(t) for t in prompt)
        self._recent.move_to_end(rid)
        while len(self._recent) > _RECENT_PROMPTS:
            self._recent.popitem(last=False)

    def on_hit(self, node: Any) -> None:
        if node.hit_count >= self.config.min_hits:
            self.candidates.append(node)

    def pick(self, path_tokens: Callable[[Any], list[int] | None]) -> Submission | None:
        """The path to send now (marked in flight) and its follow-ups, or None.

        `path_tokens(node)` gives a node's tokens from the root, None when it must not be
        compacted. Clears the candidates.
        """
        best: list[int] | None = None
        for node in self.candidates:
            if len(node.children) < 2 and self.config.min_hits > 1:
                continue  # not a branch point: a repeated prompt or a prefill chunk's end
            tokens = path_tokens(node)
            if tokens is not None and (best is None or len(tokens) > len(best)):
                best = tokens
        self.candidates.clear()
        if best is None:
            return None
        # stop `boundary_margin` tokens short of the branch: later requests whose question
        # starts differently (or tokenizes differently at the seam) still match it whole;
        # then down to a multiple of `align_tokens`: another replica that branched a token
        # or two away asks for the same prefix (one compaction in a shared service)
        n = len(best) - self.config.boundary_margin
        best = best[: n - n % self.config.align_tokens]
        if len(best) < self.config.min_prefix_tokens:
            return None
        phash = prefix_hash(best)
        if self._overlaps(best) or self.clock() < self._not_before.get(phash, 0.0):
            return None
        self._paths[phash] = tuple(best)
        L, cut = len(best), self.config.follow_up_tokens
        follow_ups = [
            list(p[L : L + cut])
            for p in reversed(self._recent.values())
            if len(p) > L and list(p[:L]) == best
        ][: self.config.max_follow_ups]
        return best, follow_ups

    def failed(self, token_ids: Sequence[int]) -> bool:
        """Record a failed compaction; True when the path may be sent again later."""
        phash = prefix_hash([int(t) for t in token_ids])
        self._paths.pop(phash, None)
        n = self._failures[phash] = self._failures.get(phash, 0) + 1
        if n > self.config.max_retries:
            self._paths[phash] = tuple(int(t) for t in token_ids)  # never again
            return False
        self._not_before[phash] = self.clock() + self.config.retry_backoff_s * 2 ** (n - 1)
        return True

    def forget(self, phash: str) -> None:
        """An installed prefix was evicted: its path may be compacted again after new hits."""
        self._paths.pop(phash, None)
        self._failures.pop(phash, None)
        self._not_before.pop(phash, None)

    def _overlaps(self, tokens: list[int]) -> bool:
        t = tuple(tokens)
        return any(t[: len(p)] == p or p[: len(t)] == t for p in self._paths.values())

"""`CompactionTrigger`: which radix-tree paths go to the compactor, when, with which queries.

The radix cache reports hits (`on_hit`) and requests it saw (`remember`, the last
`_RECENT_PROMPTS`); after each insert it asks `pick(...)` for at most one path to send. Rules:

- a candidate is a branch point (2+ children: requests went on differently after it) with
  at least `min_hits` hits; with `min_hits` 1 any hit node is a candidate. Its path runs
  from the root, through a compacted node when the branch hangs below one (the new
  compaction covers the whole path: the compacted node's tokens, then the ordinary ones);
- the path is cut `boundary_margin` tokens short: the requests that made the branch may
  share the first tokens of their questions (or a token merged across the seam) that a
  third does not, and a compacted prefix is matched whole or not at all; then it is cut
  down to a multiple of `align_tokens` (replicas whose branch points differ by a token or
  two ask a shared service for the same prefix); paths shorter than `min_prefix_tokens`
  are not sent;
- its *questions* are the recent prompts that start with the path and go on for fewer than
  `min_prefix_tokens` tokens after it; a prompt with a longer tail carries a compactable
  document of its own, so it is evidence for a deeper path, not for this one. A question
  that is a prefix of another recent prompt is an earlier turn of that conversation, not a
  continuation of its own. A path is sent only when its questions are at least
  `min_continuations` continuations: a system prompt that two chats share (however many
  turns) or that documents are sent under is not compacted alone; a document is, once it
  has that many different questions;
- among the candidates of one insert the largest reuse wins: path length x questions (the
  KV tokens that requests read from the compacted prefix instead of the original), ties to
  the longer path;
- one compaction per document: a path equal to or inside one in flight or installed is not
  sent, nor one that extends such a path by fewer than `min_prefix_tokens` tokens (the same
  document found again at a later branch); a path that extends one by `min_prefix_tokens`
  or more (a document under a compacted system prompt) is sent, and the shorter node keeps
  serving its own requests. Lookups go
  through `PathIndex`, a token trie: O(path length), whatever the number of paths held;
- a failed compaction may be sent again after `retry_backoff_s * 2**(failures - 1)`
  seconds, at most `max_retries` times; then it cools down `failure_cooldown_s` and its
  record is dropped (a fresh start). An evicted compacted prefix may be sent again (unless
  it lies inside a longer one held);
- memory is bounded: at most `_RECENT_PROMPTS` recent prompts and `_RECENT_TOKENS` tokens
  in them (a long chat history counts by its length), at most `_MAX_PATHS` paths held
  (oldest dropped first: a dropped
  installed path is at worst sent again and counted as a double install) and
  `_MAX_FAILURES` failure records (oldest dropped);
- follow-ups are the first `follow_up_tokens` tokens after the path of the most recent
  questions (at most `max_follow_ups`);
- refits (`refit_at`, e.g. 8 then 32): the distinct questions asked on a held path are
  counted from its first fit's questions on (`remember`, a conversation's earlier turns
  once, at most `2 * refit_at[-1]` kept). Once its fit is installed (`installed`) and its
  questions reach the next step, `next_refit` sends the path again with the step's count
  of most recent questions and `fit_round` n (the n-th refit: the service computes it
  afresh). Each step is sent once; a failed refit leaves the installed fit serving
  (`refit_failed`) until the next step.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from compactor import prefix_hash
from sglang_ext.config import CompactionConfig

__all__ = ["CompactionTrigger", "PathIndex", "Submission"]

_RECENT_PROMPTS = 64
_RECENT_TOKENS = 1 << 20  # ~36 MB as Python ints, whatever the prompts' lengths
_MAX_PATHS = 256
# branch points one pick weighs (the most recent hits): a pick costs at most this many scans of
# the recent prompts, however many requests arrived since the last poll
_MAX_CANDIDATES = 32
_MAX_FAILURES = 1024


class Submission(NamedTuple):
    """A path to compact: its tokens [T], the follow-ups, and the fit round (0: first fit,
    n: its n-th refit)."""

    tokens: list[int]
    follow_ups: list[list[int]]
    fit_round: int = 0


class _TrieNode:
    __slots__ = ("children", "count", "edge", "ends")

    def __init__(self, edge: tuple[int, ...]) -> None:
        self.edge = edge  # tokens from the parent to this node
        self.children: dict[int, _TrieNode] = {}  # by the child's first edge token
        self.ends = 0  # paths that end here
        self.count = 0  # paths that end here or below


class PathIndex:
    """A multiset of token paths in a compressed trie: which of them prefix a query, and
    whether the query ends inside one; O(len(query)) whatever the number of paths."""

    def __init__(self) -> None:
        self._root = _TrieNode(())

    def add(self, tokens: tuple[int, ...]) -> None:
        node, i = self._root, 0
        node.count += 1
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                child = node.children[tokens[i]] = _TrieNode(tokens[i:])
                child.count, child.ends = 1, 1
                return
            e = child.edge
            if tokens[i : i + len(e)] != e:  # split the edge where the path leaves it
                m = next(j for j in range(len(e)) if i + j >= len(tokens) or tokens[i + j] != e[j])
                mid = _TrieNode(e[:m])
                mid.count, mid.children = child.count, {e[m]: child}
                child.edge = e[m:]
                node.children[tokens[i]] = child = mid
            child.count += 1
            node, i = child, i + len(child.edge)
        node.ends += 1

    def remove(self, tokens: tuple[int, ...]) -> None:
        """Remove one copy of `tokens` (which must have been added)."""
        node, i = self._root, 0
        node.count -= 1
        while i < len(tokens):
            child = node.children[tokens[i]]
            child.count -= 1
            if child.count == 0:
                del node.children[tokens[i]]
                return
            node, i = child, i + len(child.edge)
        node.ends -= 1

    def query(self, tokens: Sequence[int]) -> tuple[int, bool]:
        """(length of the longest held path that is a prefix of `tokens`, 0 if none; whether
        `tokens` equals or is a prefix of a held path)."""
        t = tuple(tokens)
        node, i, deepest = self._root, 0, 0
        while True:
            if node.ends and i:
                deepest = i
            if i == len(t):
                return deepest, node.count > 0
            child = node.children.get(t[i])
            if child is None:
                return deepest, False
            e = child.edge
            seg = t[i : i + len(e)]
            if seg != e:  # ends inside the edge (held paths go on) or leaves it
                return deepest, len(seg) < len(e) and e[: len(seg)] == seg
            node, i = child, i + len(e)


@dataclass
class _Failure:
    count: int
    not_before: float


@dataclass
class _Fit:
    """A held path's questions (distinct tails after it, most recent last) and refit state."""

    path: tuple[int, ...]
    tails: OrderedDict[tuple[int, ...], None] = field(default_factory=OrderedDict)
    rounds: int = 0  # refits sent so far
    installed: bool = False  # a fit is installed and no refit is in flight


def _continuations(
    tails: Iterable[tuple[int, ...]], among: Iterable[tuple[int, ...]] | None = None
) -> list[tuple[int, ...]]:
    """The `tails` (in their order) that are no prefix of a longer one of `among` (default:
    of `tails`): a conversation's earlier turns go."""
    held = list(tails)
    others = held if among is None else list(among)
    return [t for t in held if not any(len(u) > len(t) and u[: len(t)] == t for u in others)]


class CompactionTrigger:
    """Hit bookkeeping for one radix cache (see the module docstring)."""

    def __init__(self, config: CompactionConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self.candidates: deque[Any] = deque(maxlen=_MAX_CANDIDATES)
        self._recent: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._recent_tokens = 0
        self._paths: OrderedDict[str, tuple[int, ...]] = OrderedDict()  # in flight/installed
        self._index = PathIndex()  # the same paths, for overlap lookups
        self._failures: OrderedDict[str, _Failure] = OrderedDict()
        self._fits: dict[str, _Fit] = {}  # by prefix hash, for the held paths
        self._asked: set[str] = set()  # fits that got a new question since the last look

    def reset(self) -> None:
        self.candidates.clear()
        self._recent.clear()
        self._recent_tokens = 0
        self._paths.clear()
        self._index = PathIndex()
        self._failures.clear()
        self._fits.clear()
        self._asked.clear()

    def remember(self, rid: str, prompt: Sequence[int]) -> None:
        """Keep a request's prompt (the last `_RECENT_PROMPTS`): its questions and follow-ups;
        a question on a held path counts towards that path's refits."""
        old = self._recent.pop(rid, ())
        p = self._recent[rid] = tuple(int(t) for t in prompt)
        self._recent_tokens += len(p) - len(old)
        while len(self._recent) > 1 and (
            len(self._recent) > _RECENT_PROMPTS or self._recent_tokens > _RECENT_TOKENS
        ):
            self._recent_tokens -= len(self._recent.popitem(last=False)[1])
        if self._fits and self.config.refit_at:
            deepest, _ = self._index.query(p)
            phash = prefix_hash(list(p[:deepest])) if deepest else ""
            fit = self._fits.get(phash)
            if fit is not None and 0 < len(p) - deepest < self.config.min_prefix_tokens:
                self._ask(fit, phash, p[deepest:])

    @property
    def refit_asked(self) -> bool:
        """Whether a held path got new questions since `next_refit` last looked."""
        return bool(self._asked)

    def installed(self, token_ids: Sequence[int]) -> None:
        """A fit of this path was installed: its next refit may be sent when due."""
        fit = self._fits.get(prefix_hash([int(t) for t in token_ids]))
        if fit is not None:
            fit.installed = True

    def refit_failed(self, token_ids: Sequence[int]) -> None:
        """A refit failed: the installed fit keeps serving; the next step may refit it."""
        self.installed(token_ids)

    def next_refit(self) -> Submission | None:
        """A path whose questions reached its next `refit_at` step (marked in flight), with
        that many of its most recent questions as follow-ups; or None."""
        steps, cut = self.config.refit_at, self.config.follow_up_tokens
        while self._asked:
            phash = self._asked.pop()
            fit = self._fits.get(phash)
            if fit is None or not fit.installed or fit.rounds >= len(steps):
                continue
            need = steps[fit.rounds]
            questions = _continuations(reversed(fit.tails))  # most recent first
            if len(questions) < need:
                continue
            fit.rounds += 1
            fit.installed = False
            return Submission(list(fit.path), [list(q[:cut]) for q in questions[:need]], fit.rounds)
        return None

    def _ask(self, fit: _Fit, phash: str, tail: tuple[int, ...]) -> None:
        fit.tails[tail] = None
        fit.tails.move_to_end(tail)
        while len(fit.tails) > 2 * self.config.refit_at[-1]:
            fit.tails.popitem(last=False)
        self._asked.add(phash)

    def on_hit(self, node: Any) -> None:
        if node.hit_count >= self.config.min_hits:
            self.candidates.append(node)

    def questions(self, path: Sequence[int]) -> tuple[list[tuple[int, ...]], int]:
        """The recent prompts, most recent first, that start with `path` and go on for fewer
        than `min_prefix_tokens` tokens after it, and how many continuations they are: those
        that are no prefix of another recent prompt sharing `path` (module docstring)."""
        t, L = tuple(path), len(path)
        sharers = [p for p in reversed(self._recent.values()) if len(p) > L and p[:L] == t]
        limit = L + self.config.min_prefix_tokens
        asked = [p for p in sharers if len(p) < limit]
        tails = {p[L:] for p in sharers}
        return asked, len(_continuations({p[L:] for p in asked}, tails))

    def pick(self, path_tokens: Callable[[Any], list[int] | None]) -> Submission | None:
        """The path to send now (marked in flight) and its follow-ups, or None.

        `path_tokens(node)` gives a node's tokens from the root, None when it must not be
        compacted. Clears the candidates.
        """
        cfg = self.config
        scored: dict[tuple[int, ...], tuple[int, list[tuple[int, ...]]]] = {}
        for node in self.candidates:
            if len(node.children) < 2 and cfg.min_hits > 1:
                continue  # not a branch point: a repeated prompt or a prefill chunk's end
            tokens = path_tokens(node)
            if tokens is None:
                continue
            # stop `boundary_margin` tokens short of the branch: later requests whose question
            # starts differently (or tokenizes differently at the seam) still match it whole;
            # then down to a multiple of `align_tokens`: another replica that branched a token
            # or two away asks for the same prefix (one compaction in a shared service)
            n = max(0, len(tokens) - cfg.boundary_margin)
            path = tuple(tokens[: n - n % cfg.align_tokens])
            if len(path) < cfg.min_prefix_tokens or path in scored:
                continue
            asked, continuations = self.questions(path)
            if continuations >= cfg.min_continuations:
                scored[path] = (len(path) * len(asked), asked)
        self.candidates.clear()
        for path, (_, asked) in sorted(
            scored.items(), key=lambda kv: (kv[1][0], len(kv[0])), reverse=True
        ):
            if self._blocked(path):
                continue
            self._hold(path)
            L, cut = len(path), cfg.follow_up_tokens
            follow_ups = [list(p[L : L + cut]) for p in asked][: cfg.max_follow_ups]
            if cfg.refit_at:
                fit = self._fits[prefix_hash(list(path))] = _Fit(path)
                fit.tails.update((p[L:], None) for p in reversed(asked))
            return Submission(list(path), follow_ups)
        return None

    def failed(self, token_ids: Sequence[int]) -> bool:
        """Record a failed compaction. True: it may be sent again after its backoff; False:
        retries are spent, it cools down `failure_cooldown_s`, then starts afresh."""
        path = tuple(int(t) for t in token_ids)
        phash = prefix_hash(list(path))
        self._release(phash)
        old = self._failures.pop(phash, None)
        n = (old.count if old is not None else 0) + 1
        retry = n <= self.config.max_retries
        wait = (
            self.config.retry_backoff_s * 2 ** (n - 1) if retry else self.config.failure_cooldown_s
        )
        self._failures[phash] = _Failure(n, self.clock() + wait)
        while len(self._failures) > _MAX_FAILURES:
            self._failures.popitem(last=False)
        return retry

    def forget(self, phash: str) -> None:
        """An installed prefix was evicted: its path may be compacted again after new hits."""
        self._release(phash)
        self._failures.pop(phash, None)

    def _blocked(self, path: tuple[int, ...]) -> bool:
        """In flight, installed or the same document as one; or backing off after a failure."""
        deepest, inside = self._index.query(path)
        if inside or (deepest and len(path) - deepest < self.config.min_prefix_tokens):
            return True
        phash = prefix_hash(list(path))
        failure = self._failures.get(phash)
        if failure is None:
            return False
        if self.clock() < failure.not_before:
            return True
        if failure.count > self.config.max_retries:
            del self._failures[phash]  # cooled down: a fresh start
        return False

    def _hold(self, path: tuple[int, ...]) -> None:
        self._paths[prefix_hash(list(path))] = path
        self._index.add(path)
        while len(self._paths) > _MAX_PATHS:
            old_hash, old = self._paths.popitem(last=False)
            self._index.remove(old)
            self._fits.pop(old_hash, None)

    def _release(self, phash: str) -> None:
        path = self._paths.pop(phash, None)
        if path is not None:
            self._index.remove(path)
        self._fits.pop(phash, None)
        self._asked.discard(phash)

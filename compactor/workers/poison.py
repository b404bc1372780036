"""Poison prefixes: the prefixes on which workers died, so that retries cannot kill them all.

A worker that dies on a job (WorkerLost) is replaced and the job retried; a client that gets
UNAVAILABLE retries too. Without a memory across requests one prefix that crashes workers
(a poison prefix) restarts replica after replica. :class:`PoisonTable` counts the workers lost
per prefix identity (tenant, model fingerprint and prefix hash: whatever the spec or
follow-ups, the same tokens; per tenant, so that one tenant's crashes never refuse another's
requests); once a prefix has lost `threshold` workers the pool refuses it with
PoisonedJob (not retryable) without touching a worker. Bounded in time and size: a prefix is
forgotten `ttl_s` after its last loss, and at most `max_keys` prefixes are remembered (least
recently lost out first).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from compactor.types import prefix_hash
from compactor.workers.errors import PoisonedJob
from compactor.workers.job import CompactJob

__all__ = ["PoisonTable", "poison_key"]


def poison_key(job: CompactJob) -> str:
    """The prefix identity losses are counted by:
    ``"<tenant>|<model fingerprint>:<prefix sha256>"``."""
    return f"{job.tenant}|{job.model_fingerprint}:{prefix_hash(job.token_ids)}"


class PoisonTable:
    """Workers lost per prefix key (an LRU of at most `max_keys`, each entry kept `ttl_s`).

    Not thread-safe: used from the pool's event loop only. `clock` is for tests.
    """

    def __init__(
        self,
        threshold: int = 2,
        ttl_s: float = 600.0,
        max_keys: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if threshold < 1 or max_keys < 1:
            raise ValueError(f"threshold and max_keys must be >= 1, got {threshold}, {max_keys}")
        self.threshold = threshold
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._clock = clock
        self._lost: OrderedDict[str, tuple[int, float]] = OrderedDict()  # key -> (count, last)

    def __len__(self) -> int:
        return len(self._lost)

    def count(self, key: str) -> int:
        """Workers lost on `key` within the last `ttl_s` (0 once forgotten)."""
        entry = self._lost.get(key)
        if entry is None:
            return 0
        if self._clock() - entry[1] >= self.ttl_s:
            del self._lost[key]
            return 0
        return entry[0]

    def check(self, key: str) -> None:
        """Raise PoisonedJob if `key` has lost `threshold` workers (see :meth:`error`)."""
        n = self.count(key)
        if n >= self.threshold:
            raise self.error(key, n)

    def lost(self, key: str) -> int:
        """Count one more worker lost on `key`; returns the count now."""
        n = self.count(key) + 1
        self._lost[key] = (n, self._clock())
        self._lost.move_to_end(key)
        while len(self._lost) > self.max_keys:
            self._lost.popitem(last=False)
        return n

    def error(self, key: str, n: int) -> PoisonedJob:
        """The PoisonedJob for `key` (`n` workers lost), naming its prefix hash."""
        entry = self._lost.get(key)
        left = self.ttl_s - (self._clock() - entry[1]) if entry else self.ttl_s
        phash = key.rpartition(":")[2]
        return PoisonedJob(
            f"prefix {phash[:16]} lost {n} workers (limit {self.threshold}): refused without "
            f"running it for the next {max(0.0, left):.0f} s"
        )

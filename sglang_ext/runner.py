"""`CompactionRunner`: compactions on a background event loop, never waited on by the scheduler.

It owns a thread with an asyncio loop. The scheduler calls `submit()` (returns at once) and
`drain()` at a safe point. A result is checked (`check`, e.g. its shapes against the KV pool)
on the runner's thread, not the scheduler's; results of an older `epoch` (weights updated
since) are marked so. Each finished job is a `JobResult`.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from compactor import CompactedPrefix
from sglang_ext.compactors import Compactor

__all__ = ["CompactionRunner", "JobResult"]


@dataclass(frozen=True)
class JobResult:
    """One finished compaction: exactly one of `prefix` and `error` is set; `epoch` is the
    runner's epoch when it was submitted; `job_id` what `submit` returned; `fit_round` 0 for a
    prefix's first fit, n for its n-th refit; `done_at` when it finished (`time.perf_counter`)."""

    token_ids: tuple[int, ...]
    prefix: CompactedPrefix | None
    error: BaseException | None
    latency_s: float
    epoch: int = 0
    job_id: int = 0
    fit_round: int = 0
    done_at: float = field(default_factory=time.perf_counter)


class CompactionRunner:
    """Runs compactions on a background event loop; results wait in a queue for `drain()`.

    `check(prefix)`, when set, runs on the runner's thread for every result; a raised
    ValueError turns the result into a failed job carrying it (the scheduler counts it as
    invalid). `new_epoch()` marks every job submitted so far as stale. `on_submit(job_id,
    token_ids, follow_ups, fit_round)`, when set, is called by every `submit` (TP rank 0
    announces its submissions to the other ranks through it: `sglang_ext.tp`).
    """

    def __init__(
        self,
        compactor: Compactor,
        timeout: float,
        check: Callable[[CompactedPrefix], None] | None = None,
    ):
        self.compactor = compactor
        self.timeout = timeout
        self.check = check
        self.epoch = 0
        self.on_submit: Callable[[int, Sequence[int], Sequence[Sequence[int]], int], None] | None
        self.on_submit = None
        self._next_id = 0
        self._results: queue.SimpleQueue[JobResult] = queue.SimpleQueue()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="compaction-runner", daemon=True
        )
        self._thread.start()
        self._in_flight = 0
        self._lock = threading.Lock()

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    @property
    def pending(self) -> int:
        """Jobs in flight plus finished ones not drained yet."""
        return self.in_flight + self._results.qsize()

    def new_epoch(self) -> int:
        """Mark every job submitted so far as stale (their results carry the old epoch)."""
        self.epoch += 1
        return self.epoch

    def submit(
        self,
        token_ids: Sequence[int],
        follow_ups: Sequence[Sequence[int]],
        job_id: int | None = None,
        fit_round: int = 0,
    ) -> int:
        """Start one compaction (`fit_round` n > 0: the prefix's n-th refit); returns its job
        id at once (`job_id`, else the next of this runner's). Thread-safe."""
        tokens = tuple(int(t) for t in token_ids)
        fus = [list(f) for f in follow_ups]
        with self._lock:
            self._in_flight += 1
            if job_id is None:
                job_id = self._next_id
            self._next_id = max(self._next_id, job_id + 1)
        if self.on_submit is not None:
            self.on_submit(job_id, tokens, fus, fit_round)
        job = self._run(tokens, fus, self.epoch, job_id, fit_round)
        asyncio.run_coroutine_threadsafe(job, self._loop)
        return job_id

    async def _run(
        self,
        token_ids: tuple[int, ...],
        follow_ups: list[list[int]],
        epoch: int,
        job_id: int,
        fit_round: int,
    ) -> None:
        t0 = time.perf_counter()
        prefix: CompactedPrefix | None = None
        error: BaseException | None = None
        try:
            prefix = await asyncio.wait_for(
                self.compactor.compact_prefix(token_ids, follow_ups, fit_round), self.timeout
            )
            if self.check is not None:
                self.check(prefix)
        except BaseException as e:  # every failure becomes a fallback, never a crash
            prefix, error = None, e
        with self._lock:
            self._in_flight -= 1
        latency = time.perf_counter() - t0
        self._results.put(JobResult(token_ids, prefix, error, latency, epoch, job_id, fit_round))

    def drain(self) -> list[JobResult]:
        """Finished jobs since the last call (non-blocking)."""
        out: list[JobResult] = []
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                return out

    def wait_idle(self, timeout: float) -> bool:
        """Block until no job is in flight (tests only); True if idle in time."""
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        return not self.in_flight

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        close = getattr(self.compactor, "close", None)
        if callable(close):
            close()

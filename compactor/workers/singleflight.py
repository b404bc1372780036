"""Single-flight: concurrent calls with the same key share one execution.

The shared execution is cancelled when its last waiter goes away (cancelled or timed out),
so a compaction nobody waits for any more stops and frees its worker.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["SingleFlight"]

T = TypeVar("T")


@dataclass
class _Call(Generic[T]):
    task: asyncio.Task[T]
    waiters: int = 0


class SingleFlight(Generic[T]):
    """Deduplicates in-flight async calls by key (no hidden global state)."""

    def __init__(self) -> None:
        self._calls: dict[str, _Call[T]] = {}

    def __len__(self) -> int:
        return len(self._calls)

    async def do(self, key: str, fn: Callable[[], Awaitable[T]]) -> tuple[T, bool]:
        """Return (fn's result, shared): `shared` is True if another call was in flight."""
        call = self._calls.get(key)
        shared = call is not None
        if call is None:
            call = _Call(asyncio.ensure_future(fn()))
            self._calls[key] = call
            call.task.add_done_callback(functools.partial(self._done, key, call))
        call.waiters += 1
        try:
            return await asyncio.shield(call.task), shared
        finally:
            call.waiters -= 1
            if call.waiters == 0 and not call.task.done():
                call.task.cancel()

    def _done(self, key: str, call: _Call[T], task: asyncio.Future[Any]) -> None:
        if self._calls.get(key) is call:
            del self._calls[key]
        if not task.cancelled():
            task.exception()  # retrieved: waiters that left early must not cause a warning

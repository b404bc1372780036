"""Graceful drain of Compact calls: refuse new ones, let in-flight ones finish, cancel the rest.

    gate = DrainGate(limit=256)
    with gate.track():                               # per call; ServerDraining once closed,
                                                     # QueueFull past `limit` calls in flight
        out = await gate.run(service.compact_job(job))   # ServerDraining if the drain expires first
    ...
    finished = await gate.drain(30.0)                # on shutdown

The server keeps listening while it drains, so a new call gets UNAVAILABLE with a message
that says why (not "connection refused"), and health checks can still see NOT_SERVING.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from compactor.service.errors import ServerDraining
from compactor.workers.errors import QueueFull

__all__ = ["DrainGate"]

T = TypeVar("T")


class DrainGate:
    """Counts the Compact calls in flight (at most `limit`, None: no limit); closed by
    :meth:`drain`. One per server, one loop."""

    def __init__(self, limit: int | None = None) -> None:
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self.closed = False
        self.active = 0
        self.drain_seconds: float | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self._expired: asyncio.Future[None] | None = None

    @contextmanager
    def track(self) -> Iterator[None]:
        """Count one call for its whole life (work and streaming); ServerDraining if closed."""
        if self.closed:
            raise ServerDraining("server is shutting down (draining); retry on another server")
        if self.limit is not None and self.active >= self.limit:
            raise QueueFull(
                f"{self.active} Compact calls in flight, the most this server takes "
                "(--max-concurrent-rpcs); retry later"
            )
        self.active += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.active -= 1
            if self.active == 0:
                self._idle.set()

    async def run(self, work: Awaitable[T]) -> T:
        """`await work`, unless the drain expires first: then `work` is cancelled (and waited
        for, so its compaction is told to stop) and ServerDraining is raised. Cancelling the
        caller cancels `work` the same way."""
        task = asyncio.ensure_future(work)
        try:
            await asyncio.wait((task, self._expiry()), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait((task,))
        if task.cancelled() and self._expiry().done():
            raise ServerDraining(
                f"server shut down before the compaction finished "
                f"(drain time of {self.drain_seconds:.3g} s is up); retry on another server"
            )
        return task.result()

    async def drain(self, timeout: float) -> bool:
        """Refuse new calls; wait up to `timeout` s for those in flight. True if they all
        finished; else their work is cancelled (see :meth:`run`) and False is returned."""
        self.closed = True
        self.drain_seconds = timeout
        if await self.wait_idle(timeout):
            return True
        self._expiry().set_result(None)
        return False

    async def wait_idle(self, timeout: float) -> bool:
        """True once no call is in flight, False if that takes longer than `timeout` s."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    def _expiry(self) -> asyncio.Future[None]:
        if self._expired is None:
            self._expired = asyncio.get_running_loop().create_future()
        return self._expired

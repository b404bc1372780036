"""The pool's replicas: one model each, in this process (a thread) or a Ray actor.

A replica runs one job at a time (the pool sees to it). Cancelling `run` leaves the job
running: the pool then calls `cancel`, watches `job` until it has really ended, and may
`kill` a replica whose job does not stop (:mod:`compactor.workers.pool`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from typing import Any

from compactor.workers.errors import WorkerLost
from compactor.workers.job import CompactJob, JobResult
from compactor.workers.worker import Worker

__all__ = ["LocalReplica", "RayReplica", "Replica"]

log = logging.getLogger(__name__)


class Replica:
    """One model replica and its load counters; `run` raises WorkerLost if it dies.

    `job` is the future of the job it computes, set by `run` and cleared once that job has
    really ended (which, after a cancel, can be well after `run` was cancelled). `alive`
    turns False when the replica is found dead (also by a job nobody waits for any more).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.inflight = 0
        self.served = 0
        self.alive = True
        self.job: asyncio.Future[JobResult] | None = None

    async def run(self, job_id: str, job: CompactJob) -> JobResult:
        raise NotImplementedError

    def cancel(self, job_id: str) -> None:
        """Ask the job `job_id` to stop at its next cancellation point."""

    async def kill(self) -> bool:
        """Stop the replica whatever it computes; False if it cannot be (in process)."""
        return False

    async def close(self) -> None:
        self.alive = False

    async def _await(self, fut: asyncio.Future[JobResult]) -> JobResult:
        """Track `fut` as :attr:`job` and wait for it; cancelling the wait leaves it running."""
        self.job = fut

        def ended(f: asyncio.Future[JobResult]) -> None:
            if self.job is f:
                self.job = None
            # retrieved: nobody may wait for a cancelled job's outcome
            exc = None if f.cancelled() else f.exception()
            if exc is not None and self._is_death(exc):
                self.alive = False

        fut.add_done_callback(ended)
        return await asyncio.shield(fut)

    def _is_death(self, exc: BaseException) -> bool:
        """Whether a job that failed with `exc` means the replica itself is dead."""
        return False


class LocalReplica(Replica):
    """A :class:`Worker` in this process; jobs run in its own thread (it cannot be killed)."""

    def __init__(self, name: str, worker: Worker) -> None:
        super().__init__(name)
        self.worker = worker
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)

    async def run(self, job_id: str, job: CompactJob) -> JobResult:
        fut = asyncio.get_running_loop().run_in_executor(
            self._executor, self.worker.compact_job, job_id, job
        )
        return await self._await(fut)

    def cancel(self, job_id: str) -> None:
        self.worker.cancel(job_id)

    async def close(self) -> None:
        await super().close()
        self._executor.shutdown(wait=False, cancel_futures=True)


class RayReplica(Replica):
    """A Ray actor running :class:`Worker` (max_concurrency=2 so `cancel` gets through)."""

    def __init__(self, name: str, handle: Any) -> None:
        super().__init__(name)
        self.handle = handle

    async def run(self, job_id: str, job: CompactJob) -> JobResult:
        import ray

        fut = asyncio.wrap_future(self.handle.compact_job.remote(job_id, job).future())
        try:
            return await self._await(fut)
        except ray.exceptions.RayActorError as exc:
            self.alive = False
            raise WorkerLost(f"worker {self.name} died: {type(exc).__name__}") from None
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, BaseException):
                raise cause from None
            raise

    def cancel(self, job_id: str) -> None:
        try:
            self.handle.cancel.remote(job_id)
        except Exception as exc:  # the actor is gone: the pool's grace ends in a kill
            log.warning("could not send the cancel of job %s to %s: %s", job_id, self.name, exc)

    def _is_death(self, exc: BaseException) -> bool:
        import ray

        return isinstance(exc, ray.exceptions.RayActorError)

    async def kill(self) -> bool:
        await self.close()
        return True

    async def close(self) -> None:
        import ray

        await super().close()
        with contextlib.suppress(Exception):
            ray.kill(self.handle, no_restart=True)

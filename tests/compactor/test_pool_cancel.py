"""A cancelled job keeps its replica busy until it has really stopped.

(The pool used to count a cancelled replica free after `cancel_grace_s` while its job still
computed, so a Ray actor (max_concurrency=2) could run two jobs on one GPU.) An in-process
replica stays busy until its thread's job ends; a replica that can be killed (a Ray actor)
is killed and replaced after the grace.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any, ClassVar

import pytest

import compactor.workers.pool as pool_mod
from compactor.spec import CompactionSpec, QueryConfig
from compactor.workers.job import CompactJob
from compactor.workers.pool import PoolConfig, Replica, WorkerPool

HOLD_S = 1.5  # how long a fake job computes, ignoring its cancel
GRACE_S = 0.2


def _job(tag: int) -> CompactJob:
    return CompactJob("fp", (tag, tag + 1, tag + 2), CompactionSpec(method="am-highest", ratio=0.5))


async def _run_job_1_then_cancel(pool: WorkerPool, started: threading.Event) -> None:
    """Run job 1 on `pool`; once the worker has `started` it, cancel the wait for it."""
    first = asyncio.create_task(pool.run(_job(1)))
    await asyncio.to_thread(started.wait, 5)
    first.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await first


class _StubbornWorker:
    """A Worker stand-in whose jobs compute HOLD_S seconds whatever `cancel` says."""

    instances: ClassVar[list[_StubbornWorker]] = []

    def __init__(self, *_args: Any) -> None:
        self.events: list[tuple[str, int, float]] = []
        self.cancels: list[str] = []
        self.started = threading.Event()
        _StubbornWorker.instances.append(self)

    def compact_job(self, job_id: str, job: CompactJob) -> str:
        self.events.append(("start", job.token_ids[0], time.monotonic()))
        self.started.set()
        time.sleep(HOLD_S)
        self.events.append(("end", job.token_ids[0], time.monotonic()))
        return f"done {job.token_ids[0]}"

    def cancel(self, job_id: str) -> None:
        self.cancels.append(job_id)


def test_local_replica_stays_busy_until_the_cancelled_job_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pool_mod, "Worker", _StubbornWorker)
    _StubbornWorker.instances.clear()

    async def main() -> None:
        cfg = PoolConfig(model_dir="unused", workers=1, cancel_grace_s=GRACE_S)
        pool = await WorkerPool.start(cfg)
        worker = _StubbornWorker.instances[0]
        try:
            await _run_job_1_then_cancel(pool, worker.started)
            assert len(worker.cancels) == 1  # the worker was told
            second = asyncio.create_task(pool.run(_job(2)))
            await asyncio.sleep(GRACE_S + 0.4)  # past the grace; job 1 still computes
            assert pool.busy == 1 and pool.waiting == 1, (pool.busy, pool.waiting)
            assert [e[:2] for e in worker.events] == [("start", 1)]
            assert await asyncio.wait_for(second, 10) == "done 2"
        finally:
            await pool.close()
        kinds = [e[:2] for e in worker.events]
        assert kinds == [("start", 1), ("end", 1), ("start", 2), ("end", 2)]
        assert worker.events[2][2] >= worker.events[1][2]  # job 2 began after job 1 ended

    asyncio.run(main())


class _KillableReplica(Replica):
    """A replica (like a Ray actor) whose jobs never stop on a cancel, but which can be killed."""

    made: ClassVar[list[_KillableReplica]] = []

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.killed = False
        self.ran: list[int] = []
        _KillableReplica.made.append(self)

    async def run(self, job_id: str, job: CompactJob, *_old_grace: Any) -> Any:
        self.ran.append(job.token_ids[0])
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if job.token_ids[0] != 1:
            fut.set_result(f"done {job.token_ids[0]} on {self.name}")
        self.job = fut  # job 1 runs until the replica is killed
        fut.add_done_callback(lambda f: setattr(self, "job", None))
        return await asyncio.shield(fut)

    async def kill(self) -> bool:
        self.killed = True
        await self.close()
        return True


def test_a_job_that_does_not_stop_gets_its_replica_killed_and_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _KillableReplica.made.clear()
    names = iter(range(100))

    async def new_replica(self: WorkerPool) -> Replica:
        return _KillableReplica(f"r{next(names)}")

    monkeypatch.setattr(WorkerPool, "_new_replica", new_replica)
    restarts: list[int] = []

    async def main() -> None:
        cfg = PoolConfig(model_dir="unused", workers=1, cancel_grace_s=GRACE_S)
        pool = await WorkerPool.start(cfg, on_restart=lambda: restarts.append(1))
        try:
            first = asyncio.create_task(pool.run(_job(1)))
            await asyncio.sleep(0.05)
            first.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await first
            second = asyncio.create_task(pool.run(_job(2)))
            await asyncio.sleep(GRACE_S / 2)
            assert pool.busy == 1 and pool.waiting == 1  # within the grace: still busy
            out = await asyncio.wait_for(second, 5)
        finally:
            await pool.close()
        old, new = _KillableReplica.made
        assert old.killed and old.ran == [1]  # never given job 2
        assert out == f"done 2 on {new.name}" and new.ran == [2]
        assert restarts == [1]

    asyncio.run(main())


class _DeafOnceWorker:
    """A Worker stand-in that misses its first cancel (lost on its way) and obeys the next;
    job 1 computes HOLD_S * 4 seconds unless stopped, other jobs end at once."""

    instances: ClassVar[list[_DeafOnceWorker]] = []

    def __init__(self, *_args: Any) -> None:
        self.cancels: list[float] = []
        self.ends: list[str] = []
        self.stop = threading.Event()
        self.started = threading.Event()
        _DeafOnceWorker.instances.append(self)

    def compact_job(self, job_id: str, job: CompactJob) -> str:
        if job.token_ids[0] == 1:
            self.started.set()
            self.ends.append("stopped" if self.stop.wait(HOLD_S * 4) else "ran out")
        return f"done {job.token_ids[0]}"

    def cancel(self, job_id: str) -> None:
        self.cancels.append(time.monotonic())
        if len(self.cancels) > 1:
            self.stop.set()


def test_a_lost_cancel_is_sent_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pool_mod, "Worker", _DeafOnceWorker)
    monkeypatch.setattr(pool_mod, "CANCEL_RESEND_S", 0.1)
    _DeafOnceWorker.instances.clear()

    async def main() -> None:
        cfg = PoolConfig(model_dir="unused", workers=1, cancel_grace_s=HOLD_S * 8)
        pool = await WorkerPool.start(cfg)
        worker = _DeafOnceWorker.instances[0]
        try:
            await _run_job_1_then_cancel(pool, worker.started)
            t0 = time.monotonic()
            assert await asyncio.wait_for(pool.run(_job(2)), HOLD_S * 2) == "done 2"
        finally:
            await pool.close()
        # job 1 stopped on the second cancel, sent one resend period after the first
        assert worker.ends == ["stopped"]
        assert len(worker.cancels) == 2, worker.cancels
        assert worker.cancels[1] - worker.cancels[0] >= 0.1
        assert worker.cancels[1] - t0 < HOLD_S

    asyncio.run(main())


def test_worker_remembers_cancels_of_running_jobs_only(tmp_path: Any) -> None:
    """Cancels of jobs that are not running are kept only among the last EARLY_CANCELS (a
    cancel may overtake its job's compact call); a running job's until it ends."""
    from compactor.workers import worker as worker_mod
    from compactor.workers.errors import Cancelled
    from tests._tiny import tiny_llama

    tiny_llama(tmp_path)
    w = worker_mod.Worker(str(tmp_path))
    for i in range(1000):
        w.cancel(f"gone-{i}")
    kept = len(w._cancelled) + len(getattr(w, "_early", ()))
    assert kept <= worker_mod.EARLY_CANCELS
    w.cancel("early")  # before its compact call: that job stops at its first check
    spec = CompactionSpec("am-highest", ratio=0.5, queries=QueryConfig(sources=("repeat-prefill",)))
    job = CompactJob(w.fingerprint, tuple(range(2, 34)), spec)
    with pytest.raises(Cancelled):
        w.compact_job("early", job)
    assert "early" not in w._cancelled and "early" not in w._early
    assert w.compact_job("later", job).prefix.logical_length == 32

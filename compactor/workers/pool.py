"""A pool of model replicas: in-process threads or Ray actors, one job per replica at a time.

Dispatch goes to the least-loaded live replica (fewest jobs in flight, then fewest jobs
served). A job waits in a bounded queue when every replica is busy (QueueFull beyond
`max_queue`). A replica that dies mid-job (Ray actor killed, node lost) is replaced in the
background and the job retried on another replica, at most `max_retries` times (then
WorkerLost). Cancelling the awaiting coroutine tells the worker to stop at its next layer
and waits (up to `cancel_grace_s`) until it has, so a cancelled job really frees its replica.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from compactor.workers.errors import QueueFull, WorkerLost
from compactor.workers.job import CompactJob, JobResult
from compactor.workers.worker import Worker

__all__ = ["ACTOR_GPUS_PER_WORKER", "ACTOR_NUM_CPUS", "PoolConfig", "Replica", "WorkerPool"]

log = logging.getLogger(__name__)

# Ray resource requests of one worker actor. On a cluster with GPUs each actor takes one whole
# GPU, so Ray places exactly one actor per GPU; deploy/ (Ray cluster config, KubeRay manifests)
# sizes nodes from these numbers and tests/deploy checks that it does.
ACTOR_NUM_CPUS = 1
ACTOR_GPUS_PER_WORKER = 1


@dataclass(frozen=True)
class PoolConfig:
    """How to build the pool.

    Attributes:
        model_dir: local checkpoint directory every replica loads (once).
        workers: number of replicas.
        mode: "local" (threads in this process, no Ray) or "ray" (one actor per replica;
            uses the running Ray if initialised, else ``ray.init(address=ray_address)``).
        max_queue: jobs that may wait for a replica before QueueFull.
        max_retries: re-dispatches of a job whose replica died.
        cancel_grace_s: how long a cancelled job may take to stop before its replica is
            counted free anyway.
        layer_delay_s: test-only per-layer sleep passed to each Worker's constructor.
        device: torch device of "local" replicas ("cpu" or "cuda"); Ray actors take a GPU
            when the cluster has one.
    """

    model_dir: str
    workers: int = 1
    mode: Literal["local", "ray"] = "local"
    ray_address: str | None = None
    max_queue: int = 64
    max_retries: int = 2
    cancel_grace_s: float = 30.0
    layer_delay_s: float = 0.0
    device: str = "cpu"


class Replica:
    """One model replica and its load counters; `run` raises WorkerLost if it dies."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.inflight = 0
        self.served = 0
        self.alive = True

    async def run(self, job_id: str, job: CompactJob, grace_s: float) -> JobResult:
        raise NotImplementedError

    async def close(self) -> None:
        self.alive = False


class LocalReplica(Replica):
    """A :class:`Worker` in this process; jobs run in its own thread."""

    def __init__(self, name: str, worker: Worker) -> None:
        super().__init__(name)
        self.worker = worker
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)

    async def run(self, job_id: str, job: CompactJob, grace_s: float) -> JobResult:
        fut = asyncio.get_running_loop().run_in_executor(
            self._executor, self.worker.compact, job_id, job
        )
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            self.worker.cancel(job_id)
            await _settle(fut, grace_s)
            raise

    async def close(self) -> None:
        await super().close()
        self._executor.shutdown(wait=False, cancel_futures=True)


class RayReplica(Replica):
    """A Ray actor running :class:`Worker` (max_concurrency=2 so `cancel` gets through)."""

    def __init__(self, name: str, handle: Any) -> None:
        super().__init__(name)
        self.handle = handle

    async def run(self, job_id: str, job: CompactJob, grace_s: float) -> JobResult:
        import ray

        fut = asyncio.wrap_future(self.handle.compact.remote(job_id, job).future())
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                self.handle.cancel.remote(job_id)
            await _settle(fut, grace_s)
            raise
        except ray.exceptions.RayActorError as exc:
            self.alive = False
            raise WorkerLost(f"worker {self.name} died: {type(exc).__name__}") from None
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, BaseException):
                raise cause from None
            raise

    async def close(self) -> None:
        import ray

        await super().close()
        with contextlib.suppress(Exception):
            ray.kill(self.handle, no_restart=True)


class WorkerPool:
    """Async facade over the replicas; create with :meth:`start`, stop with :meth:`close`.

    `on_restart` is called once per replaced replica (for metrics).
    """

    def __init__(self, config: PoolConfig, on_restart: Callable[[], None] | None = None) -> None:
        self.config = config
        self.replicas: list[Replica] = []
        self.waiting = 0
        self._on_restart = on_restart or (lambda: None)
        self._cond = asyncio.Condition()
        self._names = itertools.count()
        self._owns_ray = False
        self._replacing: set[asyncio.Task[None]] = set()
        self._closed = False

    @classmethod
    async def start(
        cls, config: PoolConfig, on_restart: Callable[[], None] | None = None
    ) -> WorkerPool:
        if config.workers < 1:
            raise ValueError(f"workers must be >= 1, got {config.workers}")
        pool = cls(config, on_restart)
        if config.mode == "ray":
            import ray

            if not ray.is_initialized():
                ray.init(address=config.ray_address, include_dashboard=False, log_to_driver=True)
                pool._owns_ray = True
        pool.replicas = list(
            await asyncio.gather(*(pool._new_replica() for _ in range(config.workers)))
        )
        return pool

    @property
    def busy(self) -> int:
        return sum(r.inflight for r in self.replicas)

    async def run(self, job: CompactJob) -> JobResult:
        """Run `job` on the least-loaded replica (see module docstring for errors)."""
        if self.waiting >= self.config.max_queue:
            raise QueueFull(
                f"{self.waiting} requests already wait for a worker (limit {self.config.max_queue})"
            )
        job_id = job.request_id or uuid.uuid4().hex
        job_id = f"{job_id}-{uuid.uuid4().hex[:8]}"
        lost = 0
        while True:
            replica = await self._acquire()
            try:
                result = await replica.run(job_id, job, self.config.cancel_grace_s)
                replica.served += 1
                return result
            except WorkerLost as exc:
                lost += 1
                log.warning("job %s: %s (attempt %d)", job_id, exc, lost)
                self._replace(replica)
                if lost > self.config.max_retries:
                    raise WorkerLost(f"{exc}; gave up after {lost} attempts") from None
            finally:
                await self._release(replica)

    async def close(self) -> None:
        """Stop the replicas (running jobs are abandoned: drain before calling this)."""
        self._closed = True
        for task in list(self._replacing):
            task.cancel()
        for r in self.replicas:
            await r.close()
        if self._owns_ray:
            import ray

            ray.shutdown()

    # ---- private -----------------------------------------------------------------------
    async def _acquire(self) -> Replica:
        async with self._cond:
            self.waiting += 1
            try:
                while True:
                    free = [r for r in self.replicas if r.alive and r.inflight == 0]
                    if free:
                        best = min(free, key=lambda r: r.served)
                        best.inflight += 1
                        return best
                    await self._cond.wait()
            finally:
                self.waiting -= 1

    async def _release(self, replica: Replica) -> None:
        async with self._cond:
            replica.inflight -= 1
            self._cond.notify_all()

    def _replace(self, dead: Replica) -> None:
        dead.alive = False
        self._on_restart()

        async def replace() -> None:
            try:
                new = await self._new_replica()
            except Exception:
                log.exception("could not replace worker %s", dead.name)
                return
            async with self._cond:
                if self._closed:
                    await new.close()
                    return
                self.replicas[self.replicas.index(dead)] = new
                self._cond.notify_all()
            log.info("replaced worker %s with %s", dead.name, new.name)

        task = asyncio.create_task(replace())
        self._replacing.add(task)
        task.add_done_callback(self._replacing.discard)

    async def _new_replica(self) -> Replica:
        cfg = self.config
        name = f"worker-{next(self._names)}"
        if cfg.mode == "local":
            worker = await asyncio.to_thread(
                Worker, cfg.model_dir, cfg.device, 1, cfg.layer_delay_s
            )
            return LocalReplica(name, worker)
        import ray

        gpus = ACTOR_GPUS_PER_WORKER if ray.cluster_resources().get("GPU", 0) > 0 else 0
        actor: Any = ray.remote(Worker)
        actor = actor.options(
            num_cpus=ACTOR_NUM_CPUS, num_gpus=gpus, max_concurrency=2, max_restarts=0
        )
        handle = actor.remote(cfg.model_dir, "cuda" if gpus else "cpu", 1, cfg.layer_delay_s)
        await asyncio.wrap_future(handle.ready.remote().future())
        return RayReplica(name, handle)


async def _settle(fut: asyncio.Future[Any], timeout: float) -> None:
    """Wait (up to `timeout`) for a cancelled job's future; swallow its outcome."""
    await asyncio.wait([fut], timeout=timeout)
    if fut.done() and not fut.cancelled():
        fut.exception()

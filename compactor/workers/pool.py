"""A pool of model replicas: in-process threads or Ray actors, one job per replica at a time.

Dispatch goes to the least-loaded live replica (fewest jobs in flight, then fewest jobs
served). A job waits in a bounded queue when every replica is busy (QueueFull beyond
`max_queue`). A replica that dies mid-job (Ray actor killed, node lost) is replaced in the
background and the job retried on another replica, at most `max_retries` times (then
WorkerLost). Workers lost are also counted per prefix across requests
(:mod:`compactor.workers.poison`): once a prefix has lost `poison_after` workers, jobs for
it fail at once with PoisonedJob (not retryable) for `poison_ttl_s`, so one poison prefix
restarts at most `poison_after` replicas however often clients retry (jobs for it already
running on other replicas at that moment aside).

Cancelling the awaiting coroutine tells the worker to stop at its next cancellation point
(again every CANCEL_RESEND_S until it has) and returns at once; the replica stays busy until
the job has really stopped, so one replica never computes two jobs. A job still running
`cancel_grace_s` after its cancel gets its Ray actor killed and replaced; an in-process
replica (a thread: it cannot be killed) stays busy until the job ends.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Literal

from compactor.spec.limits import MAX_QUEUE
from compactor.workers.errors import QueueFull, WorkerLost
from compactor.workers.job import CompactJob, JobResult, safe_log_id
from compactor.workers.poison import PoisonTable, poison_key
from compactor.workers.replica import LocalReplica, RayReplica, Replica
from compactor.workers.worker import Worker

__all__ = [
    "ACTOR_GPUS_PER_WORKER",
    "ACTOR_NUM_CPUS",
    "LocalReplica",
    "PoolConfig",
    "RayReplica",
    "Replica",
    "WorkerPool",
]

log = logging.getLogger(__name__)

# Ray resource requests of one worker actor. On a cluster with GPUs each actor takes one whole
# GPU, so Ray places exactly one actor per GPU; deploy/ (Ray cluster config, KubeRay manifests)
# sizes nodes from these numbers and tests/deploy checks that it does.
ACTOR_NUM_CPUS = 1
ACTOR_GPUS_PER_WORKER = 1

# Loading a transformers checkpoint is not thread-safe (two loads at once in one process fail
# with "Cannot copy out of meta tensor"): in-process replicas are loaded one at a time.
_LOCAL_LOAD_LOCK = threading.Lock()

# A cancel is a message nobody answers: until its job stops, it is sent again this often, so
# one lost or overtaken on its way costs a resend, not the worker (cancels are idempotent).
CANCEL_RESEND_S = 1.0


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
        cancel_grace_s: how long a cancelled job may take to stop; then its Ray actor is
            killed and replaced (an in-process replica stays busy until the job ends).
        poison_after: workers lost on one prefix (across requests) after which jobs for it
            are refused with PoisonedJob; poison_ttl_s: for how long after its last loss;
            poison_keys: how many such prefixes are remembered (least recent out first).
        layer_delay_s: test-only per-layer sleep passed to each Worker's constructor.
        device: torch device of "local" replicas ("cpu" or "cuda"); Ray actors take a GPU
            when the cluster has one.
    """

    model_dir: str
    workers: int = 1
    mode: Literal["local", "ray"] = "local"
    ray_address: str | None = None
    max_queue: int = MAX_QUEUE
    max_retries: int = 2
    cancel_grace_s: float = 30.0
    poison_after: int = 2
    poison_ttl_s: float = 600.0
    poison_keys: int = 4096
    layer_delay_s: float = 0.0
    device: str = "cpu"


class WorkerPool:
    """Async facade over the replicas; create with :meth:`start`, stop with :meth:`close`.

    `on_restart` is called once per replaced replica (for metrics). Listeners added with
    :meth:`add_liveness_listener` are called with the number of live replicas whenever it
    may have changed (a replica died or was killed, a replacement came up).
    """

    def __init__(self, config: PoolConfig, on_restart: Callable[[], None] | None = None) -> None:
        self.config = config
        self.replicas: list[Replica] = []
        self.waiting = 0
        self.poison = PoisonTable(config.poison_after, config.poison_ttl_s, config.poison_keys)
        self._on_restart = on_restart or (lambda: None)
        self._listeners: list[Callable[[int], None]] = []
        self._cond = asyncio.Condition()
        self._names = itertools.count()
        self._owns_ray = False
        self._background: set[asyncio.Task[None]] = set()
        self._being_replaced: set[str] = set()  # names of dead replicas being replaced
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
        """Replicas running a job (a cancelled job counts until it has really stopped)."""
        return sum(r.inflight for r in self.replicas)

    @property
    def live(self) -> int:
        """Replicas alive (dead ones count again once their replacement is up)."""
        return sum(r.alive for r in self.replicas)

    def add_liveness_listener(self, fn: Callable[[int], None]) -> None:
        """Call `fn(live)` (in the pool's event loop) whenever :attr:`live` may change."""
        self._listeners.append(fn)

    async def run(self, job: CompactJob) -> JobResult:
        """Run `job` on the least-loaded replica (see module docstring for errors)."""
        key = poison_key(job)
        self.poison.check(key)  # PoisonedJob: refused without touching a worker
        if self.waiting >= self.config.max_queue:
            raise QueueFull(
                f"{self.waiting} requests already wait for a worker (limit {self.config.max_queue})"
            )
        job_id = f"{safe_log_id(job.request_id) or uuid.uuid4().hex}-{uuid.uuid4().hex[:8]}"
        lost = 0
        while True:
            replica = await self._acquire()
            stopping = False  # True: a background task releases the replica once it stopped
            try:
                self.poison.check(key)  # another job may have lost a worker on it meanwhile
                result = await replica.run(job_id, job)
                replica.served += 1
                return result
            except asyncio.CancelledError:
                stopping = self._stop(replica, job_id)
                raise
            except WorkerLost as exc:
                lost += 1
                total = self.poison.lost(key)
                log.warning(
                    "job %s: %s (attempt %d; %d lost on its prefix)", job_id, exc, lost, total
                )
                self._replace(replica)
                if total >= self.poison.threshold:
                    raise self.poison.error(key, total) from None
                if lost > self.config.max_retries:
                    raise WorkerLost(f"{exc}; gave up after {lost} attempts") from None
            finally:
                if not stopping:
                    await self._release(replica)

    async def close(self) -> None:
        """Stop the replicas (running jobs are abandoned: drain before calling this)."""
        self._closed = True
        for task in list(self._background):
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

    def _stop(self, replica: Replica, job_id: str) -> bool:
        """The job `job_id` of `replica` was cancelled: tell the worker, and unless the job
        has already ended, release the replica only once it has (background task; after
        `cancel_grace_s` a replica that can be killed is killed and replaced). True if that
        task now owns the release."""
        fut = replica.job
        if fut is None or fut.done():
            return False
        replica.cancel(job_id)
        self._spawn(self._release_when_stopped(replica, job_id, fut))
        return True

    async def _release_when_stopped(
        self, replica: Replica, job_id: str, fut: asyncio.Future[JobResult]
    ) -> None:
        grace = self.config.cancel_grace_s
        try:
            if await self._stopped_within(replica, job_id, fut, grace):
                if not replica.alive:  # it died meanwhile (a Ray actor lost)
                    self._replace(replica)
                return
            if await replica.kill():
                log.warning(
                    "job %s did not stop within %.3g s of its cancel: killed worker %s",
                    job_id,
                    grace,
                    replica.name,
                )
                self._replace(replica)
                return
            log.warning(
                "job %s did not stop within %.3g s of its cancel; worker %s stays busy until "
                "it ends",
                job_id,
                grace,
                replica.name,
            )
            await asyncio.wait([fut])
        finally:
            await self._release(replica)

    @staticmethod
    async def _stopped_within(
        replica: Replica, job_id: str, fut: asyncio.Future[JobResult], grace: float
    ) -> bool:
        """Whether `fut` ends within `grace` s; the cancel is sent again every
        CANCEL_RESEND_S meanwhile."""
        loop = asyncio.get_running_loop()
        end = loop.time() + grace
        while (left := end - loop.time()) > 0:
            done, _ = await asyncio.wait([fut], timeout=min(CANCEL_RESEND_S, left))
            if done:
                return True
            replica.cancel(job_id)
        return fut.done()

    def _replace(self, dead: Replica) -> None:
        """Count `dead` out and bring up a replacement in the background (retried with
        backoff until it comes up or the pool closes). Once per replica."""
        dead.alive = False
        if dead.name in self._being_replaced or dead not in self.replicas:
            return
        self._being_replaced.add(dead.name)
        self._on_restart()
        self._notify_liveness()

        async def replace() -> None:
            delay = 1.0
            while True:
                try:
                    new = await self._new_replica()
                    break
                except Exception:
                    log.exception(
                        "could not replace worker %s; retrying in %.3g s", dead.name, delay
                    )
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, 60.0)
            async with self._cond:
                if self._closed:
                    await new.close()
                    return
                self.replicas[self.replicas.index(dead)] = new
                self._being_replaced.discard(dead.name)
                self._cond.notify_all()
            log.info("replaced worker %s with %s", dead.name, new.name)
            self._notify_liveness()

        self._spawn(replace())

    def _notify_liveness(self) -> None:
        live = self.live
        for fn in self._listeners:
            try:
                fn(live)
            except Exception:
                log.exception("liveness listener failed")

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _new_replica(self) -> Replica:
        cfg = self.config
        name = f"worker-{next(self._names)}"
        if cfg.mode == "local":
            worker = await asyncio.to_thread(_load_local, cfg)
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


def _load_local(cfg: PoolConfig) -> Worker:
    """An in-process :class:`Worker` (one load at a time: see _LOCAL_LOAD_LOCK)."""
    with _LOCAL_LOAD_LOCK:
        return Worker(cfg.model_dir, cfg.device, 1, cfg.layer_delay_s)

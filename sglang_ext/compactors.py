"""Where compactions run: the `Compactor` protocol, its two implementations, and the runner.

- `InProcessCompactor` (`inproc://`): runs the service's own job path (`compactor.Worker`,
  `compactor.CompactJob`) in one spawned worker process on this machine (model loaded once,
  one torch thread). Not a thread
  of the scheduler process: SGLang's scheduler loop holds the GIL between steps, and the
  Python-heavy fit ran >15x slower beside it (a 1.9k-token prefix: 27 s alone, >400 s).
- `GrpcCompactor` (`host:port`, `grpc://`, `grpcs://`): asks the compaction service through
  `compactor.client` (imported lazily; a missing client counts as a failed compaction).
- `CompactionRunner`: owns a background thread with an asyncio loop. The scheduler calls
  `submit()` (returns at once) and `drain()` at a safe point; it never waits on a compaction.
  A result is checked (`check`, e.g. its shapes against the KV pool) on the runner's thread,
  not the scheduler's; results of an older `epoch` (weights updated since) are marked so.

Both compactors send `config.spec.for_follow_ups(follow_ups)`: the configured spec, less the
``follow-up`` source when a prefix arrives without follow-ups. Only the public surface of
`compactor` (its lazy top-level names) is used here.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from compactor import CompactedPrefix, CompactionSpec
from sglang_ext.config import CompactionConfig

__all__ = [
    "CompactionRunner",
    "Compactor",
    "GrpcCompactor",
    "InProcessCompactor",
    "JobResult",
    "PoolShape",
    "echo_check",
    "make_compactor",
]

logger = logging.getLogger(__name__)


class Compactor(Protocol):
    async def compact(
        self, token_ids: Sequence[int], follow_ups: Sequence[Sequence[int]], fit_round: int = 0
    ) -> CompactedPrefix: ...


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


class InProcessCompactor:
    """Compacts in a dedicated local worker process (spawned on first use)."""

    def __init__(self, model_path: str, config: CompactionConfig, fingerprint: str):
        self.model_path = model_path
        self.config = config
        self.fingerprint = fingerprint
        self._executor: ProcessPoolExecutor | None = None

    async def compact(
        self, token_ids: Sequence[int], follow_ups: Sequence[Sequence[int]], fit_round: int = 0
    ) -> CompactedPrefix:
        if self._executor is None:
            self._executor = ProcessPoolExecutor(
                max_workers=1,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_worker_init,
                initargs=(self.model_path,),
            )
        ids = [int(t) for t in token_ids]
        fus = [[int(t) for t in f] for f in follow_ups]
        loop = asyncio.get_running_loop()
        spec = self.config.spec.for_follow_ups(fus)
        return await loop.run_in_executor(
            self._executor, _worker_compact, spec, self.fingerprint, ids, fus
        )

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)


# The model replica of this worker process (compactor.Worker), set once by _worker_init
_WORKER: Any = None


def _worker_init(model_path: str) -> None:
    """Runs once in the worker process: one torch thread, the model loaded once."""
    global _WORKER
    from compactor import Worker

    _WORKER = Worker(model_path, torch_threads=1)


def _worker_compact(
    spec: CompactionSpec, fingerprint: str, token_ids: list[int], follow_ups: list[list[int]]
) -> CompactedPrefix:
    """One compaction in the worker process, through the service's own job path
    (`compactor.Worker` -> `compactor.run_compaction`); returns a picklable CompactedPrefix."""
    from compactor import CompactJob

    if _WORKER is None:
        raise RuntimeError("compaction worker used before its initializer ran")
    job = CompactJob(
        model_fingerprint=fingerprint,
        token_ids=tuple(token_ids),
        spec=spec,
        follow_ups=tuple(tuple(f) for f in follow_ups),
    )
    return _WORKER.compact(uuid.uuid4().hex, job).prefix


# The metadata JSON a result may carry: ~1 KB for the plugin's methods on SmolLM2; GVote's
# per-(layer, chunk) reports reach ~1 MiB on large models.
METADATA_BYTES = 4 << 20


@dataclass(frozen=True)
class PoolShape:
    """What a result must fit: L, the model's H_kv (a result has every head), D, the pool's
    dtype, and the heads [head_start, head_start + pool_heads) this rank's pool holds (all of
    them without tensor parallelism; see `sglang_ext.tp.head_range`)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: Any  # torch.dtype
    head_start: int = 0
    pool_heads: int | None = None  # None: num_kv_heads

    def __post_init__(self) -> None:
        heads = self.pool_heads if self.pool_heads is not None else self.num_kv_heads
        if not (self.head_start >= 0 and 0 < heads <= self.num_kv_heads - self.head_start):
            raise ValueError(
                f"pool heads [{self.head_start}, {self.head_start + heads}) not in the model's "
                f"{self.num_kv_heads} KV heads"
            )

    @classmethod
    def of(
        cls, kvcache: Any, model_kv_heads: int | None = None, tp_rank: int = 0, tp_size: int = 1
    ) -> PoolShape:
        """The shape of `kvcache`; with `model_kv_heads`, of TP rank `tp_rank` of `tp_size`.

        Raises:
            ValueError: the pool does not hold that rank's share of the model's heads.
        """
        from sglang_ext.tp import head_range

        k0 = kvcache.get_key_buffer(kvcache.start_layer)  # [S, H_kv / tp, D]
        layers, pool_heads, dim = int(kvcache.layer_num), int(k0.shape[1]), int(k0.shape[2])
        if model_kv_heads is None:
            return cls(layers, pool_heads, dim, k0.dtype)
        start, stop = head_range(int(model_kv_heads), tp_rank, tp_size)
        if stop - start != pool_heads:
            raise ValueError(
                f"KV pool holds {pool_heads} heads; rank {tp_rank} of tp_size {tp_size} should "
                f"hold {stop - start} of the model's {model_kv_heads}"
            )
        return cls(layers, int(model_kv_heads), dim, k0.dtype, start, pool_heads)

    @property
    def sliced(self) -> bool:
        """Whether this pool holds only some of a result's heads."""
        return self.pool_heads is not None and self.pool_heads != self.num_kv_heads

    def take(self, prefix: CompactedPrefix) -> CompactedPrefix:
        """This pool's heads of a full `prefix` [L layers x H_kv heads] (views; `prefix`
        itself when the pool holds every head)."""
        if self.pool_heads is None or not self.sliced:
            return prefix
        from sglang_ext.tp import slice_heads

        return slice_heads(prefix, self.head_start, self.head_start + self.pool_heads)

    def slots_for(self, prefix: CompactedPrefix) -> int:
        """The slots a full `prefix` takes packed in every rank's pool (`packing`): the most
        any rank's share of its heads needs, so every TP rank allocates alike."""
        from sglang_ext.kv_store import head_counts
        from sglang_ext.packing import slots_needed

        counts = head_counts(prefix)
        per = self.pool_heads or self.num_kv_heads
        return max(slots_needed(counts[:, h : h + per]) for h in range(0, counts.shape[1], per))

    def max_result_bytes(self, logical_length: int, budget_tokens: int | None = None) -> int:
        """The largest valid result for a prefix of T = `logical_length` tokens (keys and
        values in the pool's dtype): at most L * H_kv * min(T, 2t) entries with the spec's
        per-head budget t = `budget_tokens`, every head keeping T without one."""
        from compactor.service.convert import max_result_bytes

        return max_result_bytes(
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            logical_length,
            self.dtype,
            budget_tokens,
            metadata_allowance=METADATA_BYTES,
        )


def echo_check(prefix: CompactedPrefix, method: str, T: int, budget: int | None) -> None:
    """The result is what was asked for: `method`'s, and within the budget (at most
    L * H_kv * min(T, 2 * budget) entries; any count up to T a head without one). Raises
    ValueError naming what differs (the cache counts it invalid and keeps the prefix)."""
    if prefix.method != method:
        raise ValueError(f"result of method {prefix.method!r}, asked for {method!r}")
    per_head = T if budget is None else min(T, 2 * budget)
    cap = prefix.num_layers * prefix.num_kv_heads * per_head
    kept = prefix.kept_tokens()
    if kept > cap:
        raise ValueError(f"result keeps {kept} entries, over {cap} for budget {budget} of T={T}")


class GrpcCompactor:
    """Asks the gRPC compaction service through `compactor.client.AsyncCompactorClient`.

    With a `pool` shape, results come in the pool's dtype (the install casts to it anyway:
    the same bits, half the bytes of fp32 for a bf16 pool) and a stream larger than the
    largest valid result for the prefix is cut off while it arrives.

    The token comes from `config.token` or `config.token_file`; the file is checked before
    every request (`compactor.service.auth.TokenFile`: one stat, re-read only when it
    changed) and a new token replaces the client's call metadata."""

    def __init__(self, config: CompactionConfig, fingerprint: str, pool: PoolShape | None = None):
        self.config = config
        self.fingerprint = fingerprint
        self.pool = pool
        self.target = config.endpoint.split("://", 1)[-1]
        self._client: Any = None
        self._token_file: Any = None
        self._sent_token: str | None = None

    def _token(self) -> str | None:
        """The token to send now (the file's current content when there is one)."""
        if not self.config.token_file:
            return self.config.token
        if self._token_file is None:
            from compactor.service.auth import TokenFile

            self._token_file = TokenFile(self.config.token_file)
        token: str = self._token_file.read()
        return token

    def _make_client(self, token: str | None) -> Any:
        from pathlib import Path

        from compactor.client import AsyncCompactorClient, TlsFiles

        cfg = self.config
        tls = None
        if cfg.tls:
            if not cfg.tls_ca:
                raise ValueError("--compaction-tls needs --compaction-tls-ca")
            tls = TlsFiles(
                Path(cfg.tls_ca),
                Path(cfg.tls_cert) if cfg.tls_cert else None,
                Path(cfg.tls_key) if cfg.tls_key else None,
            )
        return AsyncCompactorClient(self.target, tls=tls, auth_token=token)

    def _client_for(self, token: str | None) -> Any:
        """The client, built on first use; its metadata follows a changed token."""
        if self._client is None:
            self._client = self._make_client(token)
        elif token != self._sent_token:
            from compactor.service.auth import TOKEN_HEADER

            self._client.metadata = ((TOKEN_HEADER, f"Bearer {token}"),) if token else ()
            logger.info("compaction token file changed: the new token is in use")
        self._sent_token = token
        return self._client

    async def compact(
        self, token_ids: Sequence[int], follow_ups: Sequence[Sequence[int]], fit_round: int = 0
    ) -> CompactedPrefix:
        client = self._client_for(self._token())
        fus = [[int(t) for t in f] for f in follow_ups]
        pool = self.pool
        spec = self.config.spec.for_follow_ups(fus)
        T = len(token_ids)
        budget = spec.result_budget(T)
        result = await client.compact(
            [int(t) for t in token_ids],
            self.fingerprint,
            spec,
            fus,
            timeout=self.config.timeout,
            fit_round=fit_round,
            kv_dtype=pool.dtype if pool else None,
            max_result_bytes=pool.max_result_bytes(T, budget) if pool else None,
        )
        prefix = getattr(result, "prefix", result)
        if not isinstance(prefix, CompactedPrefix):
            raise TypeError(f"compaction client returned {type(result).__name__}")
        echo_check(prefix, spec.method, T, budget)
        return prefix


def make_compactor(
    config: CompactionConfig, model_path: str, fingerprint: str, pool: PoolShape | None = None
) -> Compactor:
    """The compactor `config.endpoint` names (inproc:// or gRPC; `pool`: see GrpcCompactor)."""
    if config.in_process:
        return InProcessCompactor(model_path, config, fingerprint)
    return GrpcCompactor(config, fingerprint, pool)


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
                self.compactor.compact(token_ids, follow_ups, fit_round), self.timeout
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

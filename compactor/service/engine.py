"""The service's logic without gRPC: check -> cache -> single-flight -> worker pool -> encode."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from compactor.service.metrics import ServiceMetrics
from compactor.service.result_stream import EncodedPrefix, encode_prefix
from compactor.spec import AUTO_CHUNK_TOKENS, CompactionSpec
from compactor.spec.limits import MAX_REQUESTS_PER_TENANT, WorkLimits
from compactor.types import CompactedPrefix, dtype_from_name, prefix_hash
from compactor.workers.cache import ResultCache
from compactor.workers.errors import DeadlineExceeded, InvalidRequest, ModelMismatch, QueueFull
from compactor.workers.job import DEFAULT_AUTO_RATIO, CompactJob, safe_log_id
from compactor.workers.pool import PoolConfig, WorkerPool
from compactor.workers.singleflight import SingleFlight

__all__ = [
    "AUTO_CHUNK_TOKENS",
    "FALLBACK_MAX_PREFIX_TOKENS",
    "CompactOutcome",
    "CompactionService",
    "ModelSummary",
    "ServiceConfig",
    "auto_chunk_size",
]

log = logging.getLogger(__name__)


# The prefix limit for a model whose config.json gives no max_position_embeddings.
FALLBACK_MAX_PREFIX_TOKENS = 16384


def auto_chunk_size(spec: CompactionSpec, num_tokens: int, limit: int | None) -> int | None:
    """The chunk_size the service compacts a `num_tokens` prefix with (the documented rule).

    The spec's own chunk_size when it sets one; else `limit` when the prefix is longer than
    `limit` tokens and chunks are allowed (uniform head budgets and a method that does not
    plan per-layer budgets over the whole prefix, i.e. not a LayerBudgetPlanner such as
    KVCompose); else None (one chunk). `limit` None disables the rule.

    Why: a method's work per layer grows with the chunk, e.g. the mass features
    [H_kv, n, T_c] fp32 and OMP's [t, t] inverse Gram (t = ratio * T_c); chunks keep them
    at what a `limit`-token prefix needs, whatever T is. Chunks are compacted
    independently against the same reference queries, their budgets split in proportion
    to their lengths (``compactor.pipeline`` explains why that is exact in structure).
    """
    if spec.chunk_size is not None or limit is None or num_tokens <= limit:
        return spec.chunk_size
    if spec.head_budgets != "uniform":
        return None
    from compactor.methods import method_class
    from compactor.methods.context import LayerBudgetPlanner

    if issubclass(method_class(spec.method), LayerBudgetPlanner):
        return None
    return limit


@dataclass(frozen=True)
class ServiceConfig:
    """Limits and policy of one service instance (see PoolConfig for the workers).

    `max_prefix_tokens` None: the model's context length (config.json
    max_position_embeddings; FALLBACK_MAX_PREFIX_TOKENS when it has none).
    `auto_chunk_tokens`: prefixes longer than this whose spec leaves chunk_size unset are
    compacted in chunks of this many tokens (:func:`auto_chunk_size`; None: never).
    `limits`: the most work one request may ask (reference queries, generated tokens, ...).
    `max_deadline_s`: the longest a request may keep a compaction going (a request without a
    deadline, or a longer one, gets this one). `max_per_tenant`: distinct compactions one
    tenant (the caller's mTLS identity, "" for all others) may have in progress at once (a
    request for one already in progress joins it and costs nothing more).
    """

    pool: PoolConfig
    max_prefix_tokens: int | None = None
    cache_bytes: int = 1 << 30
    auto_ratio: float = DEFAULT_AUTO_RATIO
    chunk_bytes: int = 1 << 20
    auto_chunk_tokens: int | None = AUTO_CHUNK_TOKENS
    limits: WorkLimits = field(default_factory=WorkLimits)
    max_deadline_s: float = 3600.0
    max_per_tenant: int = MAX_REQUESTS_PER_TENANT

    def __post_init__(self) -> None:
        if not self.max_deadline_s > 0:
            raise ValueError(f"max_deadline_s must be > 0, got {self.max_deadline_s!r}")
        if self.max_per_tenant < 1:
            raise ValueError(f"max_per_tenant must be >= 1, got {self.max_per_tenant!r}")


@dataclass(frozen=True)
class ModelSummary:
    """What GetModelInfo reports; read from the checkpoint without loading it."""

    fingerprint: str
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    vocab_size: int | None
    context_length: int | None = None

    @classmethod
    def read(cls, model_dir: str | Path) -> ModelSummary:
        from compactor.models import fingerprint

        path = Path(model_dir)
        cfg = json.loads((path / "config.json").read_text())
        hq = int(cfg["num_attention_heads"])
        return cls(
            fingerprint=fingerprint(path),
            name=path.name,
            num_layers=int(cfg["num_hidden_layers"]),
            num_kv_heads=int(cfg.get("num_key_value_heads") or hq),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // hq),
            dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            vocab_size=int(cfg["vocab_size"]) if "vocab_size" in cfg else None,
            context_length=int(n) if (n := cfg.get("max_position_embeddings")) else None,
        )


@dataclass(frozen=True)
class CompactOutcome:
    """A result plus how this request got it."""

    encoded: EncodedPrefix
    cache_hit: bool
    shared: bool
    seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


class CompactionService:
    """Create with :meth:`start`; :meth:`compact` is what the servicer calls."""

    def __init__(
        self, config: ServiceConfig, model: ModelSummary, pool: WorkerPool, metrics: ServiceMetrics
    ) -> None:
        if config.max_prefix_tokens is None:
            limit = model.context_length or FALLBACK_MAX_PREFIX_TOKENS
            config = replace(config, max_prefix_tokens=limit)
        self.config = config
        self.model = model
        self.pool = pool
        self.metrics = metrics
        self.cache: ResultCache[EncodedPrefix] = ResultCache(
            config.cache_bytes, EncodedPrefix.nbytes
        )
        self.flights: SingleFlight[EncodedPrefix] = SingleFlight()
        # by tenant: the compactions (keys) its requests wait for, and how many wait for each
        self._per_tenant: dict[str, dict[str, int]] = {}

    @classmethod
    async def start(
        cls, config: ServiceConfig, metrics: ServiceMetrics | None = None
    ) -> CompactionService:
        metrics = metrics or ServiceMetrics()
        model = ModelSummary.read(config.pool.model_dir)
        pool = await WorkerPool.start(config.pool, on_restart=metrics.worker_restarts.inc)
        metrics.queue_depth.set_function(lambda: pool.waiting)
        metrics.busy_workers.set_function(lambda: pool.busy)
        return cls(config, model, pool, metrics)

    def check(self, job: CompactJob) -> None:
        """ModelMismatch / InvalidRequest before any work is queued."""
        if job.model_fingerprint != self.model.fingerprint:
            raise ModelMismatch(
                f"model fingerprint {job.model_fingerprint!r} is not this server's model "
                f"{self.model.fingerprint!r} ({self.model.name})"
            )
        job.validate(self.max_prefix_tokens, self.model.vocab_size, self.config.limits)

    def effective_job(self, job: CompactJob) -> CompactJob:
        """`job` as it is computed and keyed: chunk_size set by :func:`auto_chunk_size`.

        Call after :meth:`check` (the spec is valid then)."""
        size = auto_chunk_size(job.spec, len(job.token_ids), self.config.auto_chunk_tokens)
        if size == job.spec.chunk_size:
            return job
        return replace(job, spec=job.spec.replace(chunk_size=size))

    @property
    def max_prefix_tokens(self) -> int:
        """The longest prefix accepted: the configured limit, else the model's context."""
        return self.config.max_prefix_tokens or FALLBACK_MAX_PREFIX_TOKENS

    async def compact_job(self, job: CompactJob, timeout: float | None = None) -> CompactOutcome:
        """The encoded result for `job` (cache, else shared or new compaction).

        Raises ModelMismatch, InvalidRequest, QueueFull, DeadlineExceeded (after `timeout`
        seconds; the compaction is cancelled if no other request waits for it), WorkerLost,
        PoisonedJob (workers died on this prefix too often: ``compactor.workers.poison``).
        """
        t0 = time.perf_counter()
        self.check(job)
        job = self.effective_job(job)
        key = job.key()
        cap = self.config.max_deadline_s
        timeout = cap if timeout is None else min(timeout, cap)
        mine = self._per_tenant.setdefault(job.tenant, {})
        if key not in mine and len(mine) >= self.config.max_per_tenant:
            raise QueueFull(
                f"{len(mine)} compactions of this caller are in progress (limit "
                f"{self.config.max_per_tenant} per tenant)"
            )
        mine[key] = mine.get(key, 0) + 1
        try:
            return await self._compact(job, key, timeout, t0)
        finally:
            mine[key] -= 1
            if not mine[key]:
                del mine[key]
            if not mine:
                self._per_tenant.pop(job.tenant, None)

    async def _compact(
        self, job: CompactJob, key: str, timeout: float, t0: float
    ) -> CompactOutcome:
        hit = self.cache.get(key)
        if hit is not None:
            self.metrics.cache_hits.inc()
            return CompactOutcome(
                hit, cache_hit=True, shared=False, seconds=time.perf_counter() - t0
            )
        if timeout is not None and timeout <= 0:
            raise DeadlineExceeded("deadline passed before the compaction started")
        try:
            encoded, shared = await asyncio.wait_for(
                self.flights.do(key, lambda: self._compute(key, job)), timeout
            )
        except TimeoutError:
            raise DeadlineExceeded(f"compaction did not finish within {timeout:.3g} s") from None
        if shared:
            self.metrics.singleflight_joins.inc()
        return CompactOutcome(encoded, False, shared, seconds=time.perf_counter() - t0)

    async def wait_idle(self, timeout: float) -> bool:
        """True once no compaction runs (cancelled ones stopped), False after `timeout` s."""
        deadline = time.monotonic() + timeout
        while len(self.flights) or self.pool.busy:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def close(self) -> None:
        await self.pool.close()

    async def _compute(self, key: str, job: CompactJob) -> EncodedPrefix:
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        self.metrics.compactions.inc()
        result = await self.pool.run(job)
        _check_result(result.prefix, job, self.model)  # before it can be cached or sent
        kv_dtype = dtype_from_name(job.kv_dtype) if job.kv_dtype else None
        try:
            header, payload, digest = await asyncio.to_thread(
                encode_prefix, result.prefix, kv_dtype
            )
        except ValueError as exc:  # keys/values overflow the requested dtype
            raise InvalidRequest(f"kv_dtype {job.kv_dtype}: {exc}") from None
        encoded = EncodedPrefix(
            header, payload, digest, result.worker, result.compute_seconds, result.stage_seconds
        )
        self.cache.put(key, encoded)
        self.metrics.cache_bytes.set(self.cache.nbytes)
        log.info(
            "compacted %s: T=%d method=%s %d bytes (%s) in %.2f s on %s",
            safe_log_id(job.request_id) or key[:12],
            len(job.token_ids),
            job.spec.method,
            len(payload),
            job.kv_dtype or "float32",
            result.compute_seconds,
            result.worker,
        )
        return encoded


def _check_result(prefix: CompactedPrefix, job: CompactJob, model: ModelSummary) -> None:
    """A worker's result is the one asked for, for this model (structure, fingerprint, T,
    prefix hash, method); a RuntimeError (INTERNAL) otherwise, so it is never cached."""
    try:
        prefix.validate(
            expected_fingerprint=job.model_fingerprint,
            num_layers=model.num_layers,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
        )
    except ValueError as exc:
        raise RuntimeError(f"a worker returned an invalid result: {exc}") from None
    echo = (prefix.logical_length, prefix.prefix_hash, prefix.method)
    want = (len(job.token_ids), prefix_hash(job.token_ids), job.spec.method)
    if echo != want:
        raise RuntimeError(f"a worker returned the result for {echo}, not {want}")

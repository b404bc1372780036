"""Where compactions run: the `Compactor` protocol and its two implementations.

- `InProcessCompactor` (`inproc://`): runs the service's own job path (`compactor.Worker`,
  `compactor.CompactJob`) in one spawned worker process on this machine (model loaded once,
  one torch thread). Not a thread of the scheduler process: SGLang's scheduler loop holds the
  GIL between steps, and the Python-heavy fit ran >15x slower beside it (a 1.9k-token prefix:
  27 s alone, >400 s).
- `GrpcCompactor` (`host:port`, `grpc://`, `grpcs://`): asks the compaction service through
  `compactor.AsyncCompactorClient` (imported lazily; a missing client counts as a failed
  compaction).

Both send `config.spec.for_follow_ups(follow_ups)`: the configured spec, less the
``follow-up`` source when a prefix arrives without follow-ups. Only the public surface of
`compactor` (its lazy top-level names) is used here. `sglang_ext.runner` runs them.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import uuid
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Protocol

from compactor import CompactedPrefix, CompactionSpec
from sglang_ext.config import CompactionConfig
from sglang_ext.pool_shape import PoolShape, echo_check

__all__ = ["Compactor", "GrpcCompactor", "InProcessCompactor", "make_compactor"]

logger = logging.getLogger(__name__)


class Compactor(Protocol):
    async def compact_prefix(
        self, token_ids: Sequence[int], follow_ups: Sequence[Sequence[int]], fit_round: int = 0
    ) -> CompactedPrefix: ...


class InProcessCompactor:
    """Compacts in a dedicated local worker process (spawned on first use)."""

    def __init__(self, model_path: str, config: CompactionConfig, fingerprint: str):
        self.model_path = model_path
        self.config = config
        self.fingerprint = fingerprint
        self._executor: ProcessPoolExecutor | None = None

    async def compact_prefix(
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
    return _WORKER.compact_job(uuid.uuid4().hex, job).prefix


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
            from compactor import TokenFile

            self._token_file = TokenFile(self.config.token_file)
        token: str = self._token_file.read()
        return token

    def _make_client(self, token: str | None) -> Any:
        from pathlib import Path

        from compactor import AsyncCompactorClient, TlsFiles, TokenFile

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
        key = TokenFile(cfg.signing_key_file) if cfg.signing_key_file else None
        return AsyncCompactorClient(self.target, tls=tls, auth_token=token, signing_key=key)

    def _client_for(self, token: str | None) -> Any:
        """The client, built on first use; its metadata follows a changed token."""
        if self._client is None:
            self._client = self._make_client(token)
        elif token != self._sent_token:
            self._client.set_token(token)  # the signing key is another secret: untouched
            logger.info("compaction token file changed: the new token is in use")
        self._sent_token = token
        return self._client

    async def compact_prefix(
        self, token_ids: Sequence[int], follow_ups: Sequence[Sequence[int]], fit_round: int = 0
    ) -> CompactedPrefix:
        client = self._client_for(self._token())
        fus = [[int(t) for t in f] for f in follow_ups]
        pool = self.pool
        spec = self.config.spec.for_follow_ups(fus)
        T = len(token_ids)
        budget = spec.result_budget(T)
        result = await client.compact_prefix(
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

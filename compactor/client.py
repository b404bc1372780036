"""Clients of the compaction service: :class:`CompactorClient` (sync) and
:class:`AsyncCompactorClient`. Both reassemble and verify (sha256 + validate) the
CompactedPrefix, retry UNAVAILABLE with exponential backoff, and keep every attempt and
backoff inside the call's deadline (`timeout` seconds).

    with CompactorClient("127.0.0.1:50051") as c:
        result = c.compact_prefix(token_ids, fingerprint, CompactionSpec(method="am-omp-fast", ratio=0.1))
        result.prefix, result.cache_hit

A spec whose ratio and tokens are both None asks for the server's auto budget. The server
validates the spec (INVALID_ARGUMENT naming the field); the client sends it as is.

`kv_dtype` (torch.float16 / torch.bfloat16 / None = float32) asks for keys/values in the
serving model's KV dtype (beta stays float32): about half the bytes of float32 for the same
installed cache. `max_result_bytes` (see :func:`compactor.service.convert.max_result_bytes`)
bounds what one call may receive: a stream announcing or sending more is cancelled at once
and raises ResultTooLarge (a ChecksumError, never retried).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Awaitable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import grpc
import torch

from compactor.service.auth import TOKEN_HEADER, TokenFile, token_bytes
from compactor.service.convert import compact_request
from compactor.service.gen.compactor.v1 import compactor_pb2 as pb
from compactor.service.gen.compactor.v1 import compactor_pb2_grpc as pb_grpc
from compactor.service.result_stream import Assembler, ChecksumError
from compactor.spec import CompactionSpec
from compactor.types import CompactedPrefix, dtype_name

__all__ = [
    "AsyncCompactorClient",
    "CompactResult",
    "CompactorClient",
    "RetryPolicy",
    "TlsFiles",
    "describe_error",
]

_RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)
ERROR_TEXT_CHARS = 300  # of an error's text a log line carries


def describe_error(exc: BaseException | None) -> str:
    """An exception for one log line: its type, with a gRPC error's status code and the
    peer's details (the service's words: control characters escaped, a newline as ``\\n``),
    cut to ``ERROR_TEXT_CHARS`` ("..." marks a cut)."""
    if exc is None:
        return "-"
    if isinstance(exc, grpc.RpcError) and callable(getattr(exc, "code", None)):
        text = f"{exc.code().name}: {exc.details() or ''}"
    else:
        text = str(exc)
    safe = text.encode("unicode_escape").decode("ascii")
    cut = safe[:ERROR_TEXT_CHARS] + ("..." if len(safe) > ERROR_TEXT_CHARS else "")
    return f"{type(exc).__name__}({cut})"


R = TypeVar("R")  # what a compaction call returns: CompactResult or an awaitable of one


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter on UNAVAILABLE."""

    attempts: int = 5
    initial_s: float = 0.2
    max_s: float = 5.0
    multiplier: float = 2.0

    def delay(self, attempt: int) -> float:
        return random.uniform(0, min(self.max_s, self.initial_s * self.multiplier**attempt))


@dataclass(frozen=True)
class TlsFiles:
    """PEM files: the CA that signed the server cert; a client cert+key for mutual TLS."""

    ca: Path
    cert: Path | None = None
    key: Path | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.read_bytes(),
            private_key=self.key.read_bytes() if self.key else None,
            certificate_chain=self.cert.read_bytes() if self.cert else None,
        )


@dataclass(frozen=True)
class CompactResult:
    prefix: CompactedPrefix
    cache_hit: bool
    shared: bool
    seconds: float
    server_seconds: float
    compute_seconds: float
    worker: str
    attempts: int
    stage_seconds: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """A JSON-able summary (what `compactor request --json` prints)."""
        p = self.prefix
        return {
            "model_fingerprint": p.model_fingerprint,
            "prefix_hash": p.prefix_hash,
            "logical_length": p.logical_length,
            "method": p.method,
            "num_layers": p.num_layers,
            "kept_tokens": p.kept_tokens(),
            "kept_fraction": p.kept_fraction(),
            "nbytes": p.nbytes(),
            "cache_hit": self.cache_hit,
            "shared": self.shared,
            "seconds": self.seconds,
            "server_seconds": self.server_seconds,
            "compute_seconds": self.compute_seconds,
            "worker": self.worker,
            "attempts": self.attempts,
        }


class _Base(Generic[R]):
    """What both clients share; R is what a compaction call returns (a CompactResult, or
    an awaitable of one).
    """

    stub: pb_grpc.CompactorStub  # each client's own, on its blocking or asyncio channel

    def __init__(
        self,
        endpoint: str,
        tls: TlsFiles | None = None,
        auth_token: str | None = None,
        retry: RetryPolicy | None = None,
        max_message_bytes: int = 16 << 20,
        signing_key: str | TokenFile | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.tls = tls
        self.retry = retry or RetryPolicy()
        self.metadata: tuple[tuple[str, str], ...] = ()
        self.set_token(auth_token)
        # with a signing key (a file is read again when it changes), every result must carry
        # its HMAC under that key, bound to the request it answers
        self.signing_key = signing_key
        # the channel reconnects on the retry policy's schedule, not gRPC's (1 s growing to
        # 120 s): after a long outage a service that is back is reached within `max_s`,
        # where gRPC's backoff would fail every attempt fast for up to two minutes
        self.options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", round(self.retry.initial_s * 1000)),
            ("grpc.max_reconnect_backoff_ms", round(self.retry.max_s * 1000)),
        ]

    def set_token(self, token: str | None) -> None:
        """The bearer token sent from the next call on (None: none); a rotation touches
        nothing else (results are signed with the separate signing key)."""
        self.metadata = ((TOKEN_HEADER, f"Bearer {token}"),) if token else ()

    def compact_prefix(
        self,
        token_ids: Sequence[int],
        model_fingerprint: str,
        spec: CompactionSpec,
        follow_ups: Sequence[Sequence[int]] = (),
        *,
        timeout: float | None = None,
        request_id: str | None = None,
        kv_dtype: torch.dtype | str | None = None,
        max_result_bytes: int | None = None,
        fit_round: int = 0,
    ) -> R:
        """Compact `token_ids` as `spec` says, keys/values in `kv_dtype` (None = float32);
        `fit_round` n > 0 asks for the n-th refit (not the cached first fit). The async
        client returns an awaitable (the request is built, and checked, at the call).

        Raises grpc.RpcError, ResultTooLarge (over `max_result_bytes`, the call cancelled),
        ChecksumError (a corrupt stream) or ValueError (an invalid result, or `kv_dtype` not
        float32 / float16 / bfloat16).
        """
        req = compact_request(
            token_ids,
            model_fingerprint,
            spec,
            follow_ups,
            request_id or uuid.uuid4().hex,
            kv_dtype,
            fit_round,
        )
        return self.compact_request(req, timeout=timeout, max_result_bytes=max_result_bytes)

    def compact_request(
        self,
        req: pb.CompactRequest,
        timeout: float | None = None,
        max_result_bytes: int | None = None,
    ) -> R:
        """Send `req`; retries UNAVAILABLE within `timeout` (see :meth:`compact`)."""
        return self._send(req, timeout, max_result_bytes)

    def _send(self, req: pb.CompactRequest, timeout: float | None, cap: int | None) -> R:
        """:meth:`compact_request` (each client's own: blocking or asyncio)."""
        raise NotImplementedError

    @contextmanager
    def _attempt(
        self, req: pb.CompactRequest, tries: _Tries, cap: int | None
    ) -> Iterator[tuple[Assembler, Any]]:
        """One attempt of `tries`: a fresh Assembler (at most `cap` bytes) and the Compact
        stream, its deadline the time left; the stream is cancelled when the block raises
        ChecksumError (a corrupt or too large result: nothing more of it is wanted)."""
        asm = Assembler(cap)
        call = self.stub.Compact(req, timeout=tries.left(), metadata=self.metadata)
        try:
            yield asm, call
        except ChecksumError:
            call.cancel()
            raise

    def _result(self, asm: Assembler, req: pb.CompactRequest, tries: _Tries) -> CompactResult:
        key = token_bytes(self.signing_key)
        prefix = asm.result(expected_fingerprint=req.model_fingerprint, key=key, request=req)
        want = req.kv_dtype or "float32"
        if dtype_name(prefix.dtype) != want:
            raise ValueError(f"asked for {want} keys/values, got {dtype_name(prefix.dtype)}")
        tr = asm.trailer
        assert tr is not None  # result() checked it
        return CompactResult(
            prefix=prefix,
            cache_hit=tr.cache_hit,
            shared=tr.shared,
            seconds=time.perf_counter() - tries.t0,
            server_seconds=tr.server_seconds,
            compute_seconds=tr.compute_seconds,
            worker=tr.worker,
            attempts=tries.attempt + 1,
            stage_seconds=dict(tr.stage_seconds),
        )


class CompactorClient(_Base[CompactResult]):
    """Blocking client (a context manager; one channel)."""

    def __init__(self, endpoint: str, **kwargs: Any) -> None:
        super().__init__(endpoint, **kwargs)
        if self.tls:
            self.channel = grpc.secure_channel(endpoint, self.tls.credentials(), self.options)
        else:
            self.channel = grpc.insecure_channel(endpoint, self.options)
        self.stub = pb_grpc.CompactorStub(self.channel)

    def __enter__(self) -> CompactorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def model_info(self, timeout: float | None = 10.0) -> pb.ModelInfo:
        return self.stub.GetModelInfo(
            pb.GetModelInfoRequest(), timeout=timeout, metadata=self.metadata
        )

    def list_methods(self, timeout: float | None = 10.0) -> list[str]:
        resp = self.stub.ListMethods(
            pb.ListMethodsRequest(), timeout=timeout, metadata=self.metadata
        )
        return list(resp.methods)

    def _send(
        self, req: pb.CompactRequest, timeout: float | None, cap: int | None
    ) -> CompactResult:
        tries = _Tries(self.retry, timeout)
        while True:
            try:
                with self._attempt(req, tries, cap) as (asm, call):
                    for msg in call:
                        asm.add(msg)
                return self._result(asm, req, tries)
            except grpc.RpcError as err:
                time.sleep(tries.backoff(err))


class AsyncCompactorClient(_Base[Awaitable[CompactResult]]):
    """asyncio client (grpc.aio); use ``async with``."""

    def __init__(self, endpoint: str, **kwargs: Any) -> None:
        super().__init__(endpoint, **kwargs)
        if self.tls:
            self.channel = grpc.aio.secure_channel(endpoint, self.tls.credentials(), self.options)
        else:
            self.channel = grpc.aio.insecure_channel(endpoint, self.options)
        self.stub = pb_grpc.CompactorStub(self.channel)

    async def __aenter__(self) -> AsyncCompactorClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def _send(
        self, req: pb.CompactRequest, timeout: float | None, cap: int | None
    ) -> CompactResult:
        tries = _Tries(self.retry, timeout)
        while True:
            try:
                with self._attempt(req, tries, cap) as (asm, call):
                    async for msg in call:
                        asm.add(msg)
                return await asyncio.to_thread(self._result, asm, req, tries)
            except grpc.RpcError as err:
                await asyncio.sleep(tries.backoff(err))


class _Tries:
    """The attempts of one compaction call: its clock, its deadline (`timeout` seconds from
    now; None: none) and how many attempts failed so far."""

    def __init__(self, retry: RetryPolicy, timeout: float | None) -> None:
        self.retry = retry
        self.t0 = time.perf_counter()
        self.deadline = time.monotonic() + timeout if timeout is not None else None
        self.attempt = 0

    def left(self) -> float | None:
        """Seconds left for the next attempt (None: no deadline)."""
        return None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)

    def backoff(self, err: grpc.RpcError) -> float:
        """Seconds to wait before retrying after `err`; counts the failed attempt. Raises
        `err` when it is not retryable, no attempt is left or the wait would pass the
        deadline."""
        if err.code() not in _RETRYABLE or self.attempt + 1 >= self.retry.attempts:
            raise err
        delay = self.retry.delay(self.attempt)
        if self.deadline is not None and time.monotonic() + delay >= self.deadline:
            raise err
        self.attempt += 1
        return delay

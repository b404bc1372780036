"""The thin gRPC servicer: decode, call the engine, encode; errors via one status table."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

import grpc

from compactor.service.auth import TokenFile, tenant_of, token_bytes
from compactor.service.convert import job_from_request
from compactor.service.drain import DrainGate
from compactor.service.engine import CompactionService
from compactor.service.errors import status_for
from compactor.service.gen.compactor.v1 import compactor_pb2 as pb
from compactor.service.gen.compactor.v1 import compactor_pb2_grpc as pb_grpc
from compactor.service.result_stream import sign
from compactor.workers.job import safe_log_id

__all__ = ["CompactorServicer"]

log = logging.getLogger(__name__)


class CompactorServicer(pb_grpc.CompactorServicer):
    """`gate` refuses Compact calls (UNAVAILABLE) once the server drains; with a
    `signing_key` (shared with clients as a file, never sent) every result is signed with it,
    bound to its request (the trailer's HMAC)."""

    def __init__(
        self,
        service: CompactionService,
        gate: DrainGate | None = None,
        signing_key: str | TokenFile | None = None,
    ) -> None:
        self.service = service
        self.gate = gate or DrainGate()
        self.signing_key = signing_key

    async def Compact(
        self, request: pb.CompactRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.CompactChunk]:
        t0 = time.perf_counter()
        m = self.service.metrics
        status, counted = "OK", False

        def count() -> None:
            m.requests.labels(status=status).inc()
            m.latency.observe(time.perf_counter() - t0)

        try:
            with self.gate.track():
                job = job_from_request(request, self.service.config.auto_ratio)
                job = dataclasses.replace(job, tenant=tenant_of(context))
                out = await self.gate.run(
                    self.service.compact_job(job, timeout=context.time_remaining())
                )
                key = token_bytes(self.signing_key)
                trailer = pb.Trailer(
                    sha256=out.encoded.sha256,
                    hmac_sha256=sign(key, out.encoded.sha256, request) if key else "",
                    payload_bytes=len(out.encoded.payload),
                    cache_hit=out.cache_hit,
                    shared=out.shared,
                    compute_seconds=out.encoded.compute_seconds,
                    worker=out.encoded.worker,
                    stage_seconds=out.encoded.stage_seconds,
                )
                for msg in out.encoded.messages(self.service.config.chunk_bytes, trailer):
                    if msg.HasField("trailer"):
                        msg.trailer.server_seconds = time.perf_counter() - t0
                    yield msg
                m.bytes_streamed.inc(len(out.encoded.payload))
        except asyncio.CancelledError:
            status = "CANCELLED"
            log.info("request %s cancelled by the client", safe_log_id(request.request_id))
            raise
        except Exception as exc:
            code, details = status_for(exc, "Compact")
            status, counted = code.name, True
            count()  # before the abort: the client must not see the status before /metrics
            await context.abort(code, details)
        finally:
            if not counted:
                count()

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        s = self.service
        return pb.ModelInfo(
            model_fingerprint=s.model.fingerprint,
            name=s.model.name,
            num_layers=s.model.num_layers,
            num_kv_heads=s.model.num_kv_heads,
            head_dim=s.model.head_dim,
            dtype=s.model.dtype,
            max_prefix_tokens=s.config.max_prefix_tokens,
            auto_ratio=s.config.auto_ratio,
            workers=s.config.pool.workers,
            limits=s.config.limits.as_dict(),
        )

    async def ListMethods(
        self, request: pb.ListMethodsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListMethodsResponse:
        from compactor.methods import list_methods

        return pb.ListMethodsResponse(methods=list_methods())

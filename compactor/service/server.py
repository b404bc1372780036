"""Build, start and stop the grpc.aio compaction server (health + reflection included).

    server = await CompactorServer.start(ServerConfig(service=..., port=0))
    ... server.port ...
    await server.stop()          # drains: NOT_SERVING, refuse new calls, finish in-flight

Binds 127.0.0.1 unless told otherwise; port 0 picks a free port. Health reports SERVING
while at least one worker replica is alive and NOT_SERVING while none is (every replica
died and no replacement is up yet), and NOT_SERVING for good once the server drains.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from compactor.service.auth import TokenAuthInterceptor, TokenFile
from compactor.service.drain import DrainGate
from compactor.service.engine import CompactionService, ServiceConfig
from compactor.service.gen.compactor.v1 import compactor_pb2 as pb
from compactor.service.gen.compactor.v1 import compactor_pb2_grpc as pb_grpc
from compactor.service.metrics import ServiceMetrics
from compactor.service.servicer import CompactorServicer

__all__ = ["SERVICE_NAME", "CompactorServer", "PortInUseError", "ServerConfig", "TlsConfig"]

log = logging.getLogger(__name__)
# gRPC calls beyond --max-concurrent-rpcs Compact calls: health checks, GetModelInfo,
# ListMethods and a refused Compact's answer are served while Compact calls fill the limit
CONTROL_RPCS = 32

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Compactor"].full_name
# After the drain: how long cancelled compactions may take to stop, and then responses still
# being streamed (and other short calls) to finish. Exit comes <= drain + 2 * _SETTLE_S + close.
_SETTLE_S = 5.0


class PortInUseError(OSError):
    """The requested address could not be bound."""


@dataclass(frozen=True)
class TlsConfig:
    """PEM files; `client_ca` set = mutual TLS (clients must present a cert it signed)."""

    cert: Path
    key: Path
    client_ca: Path | None = None

    def credentials(self) -> grpc.ServerCredentials:
        ca = self.client_ca.read_bytes() if self.client_ca else None
        return grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())],
            root_certificates=ca,
            require_client_auth=ca is not None,
        )


@dataclass(frozen=True)
class ServerConfig:
    service: ServiceConfig
    host: str = "127.0.0.1"
    port: int = 0
    tls: TlsConfig | None = None
    auth_token: str | TokenFile | None = None  # a TokenFile is re-read when it changes
    signing_key: str | TokenFile | None = None  # signs every result (never sent)
    max_message_bytes: int = 16 << 20
    metrics_port: int | None = None  # None = no /metrics endpoint; 0 = any free port
    drain_seconds: float = 30.0
    max_concurrent_rpcs: int = 256  # Compact calls beyond it get RESOURCE_EXHAUSTED


class CompactorServer:
    """A running server; `port` is the bound port, `service` the engine behind it."""

    def __init__(
        self,
        server: grpc.aio.Server,
        service: CompactionService,
        port: int,
        config: ServerConfig,
        gate: DrainGate | None = None,
    ) -> None:
        self.server = server
        self.service = service
        self.port = port
        self.config = config
        self.gate = gate or DrainGate()
        self.health: health.aio.HealthServicer | None = None
        self.metrics_port: int | None = None
        self._health_tasks: set[asyncio.Task[None]] = set()
        self._health_lock = asyncio.Lock()

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    @classmethod
    async def start(cls, config: ServerConfig) -> CompactorServer:
        """Start workers, bind, serve. Raises PortInUseError if the address is taken."""
        metrics = ServiceMetrics()
        service = await CompactionService.start(config.service, metrics)
        try:
            return await cls._serve(config, service)
        except BaseException:
            await service.close()
            raise

    @classmethod
    async def _serve(cls, config: ServerConfig, service: CompactionService) -> CompactorServer:
        limit = config.max_message_bytes
        interceptors = [TokenAuthInterceptor(config.auth_token)] if config.auth_token else []
        server = grpc.aio.server(
            interceptors=interceptors,
            # health checks and model info are answered however many Compact calls wait
            maximum_concurrent_rpcs=config.max_concurrent_rpcs + CONTROL_RPCS,
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                ("grpc.so_reuseport", 0),
            ],
        )
        gate = DrainGate(config.max_concurrent_rpcs)
        servicer = CompactorServicer(service, gate, config.signing_key)
        pb_grpc.add_CompactorServicer_to_server(servicer, server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        target = f"{config.host}:{config.port}"
        try:
            if config.tls is not None:
                port = server.add_secure_port(target, config.tls.credentials())
            else:
                port = server.add_insecure_port(target)
        except RuntimeError as exc:
            raise PortInUseError(f"cannot bind {target}: {exc}") from None
        if port == 0:
            raise PortInUseError(f"cannot bind {target} (address in use or not available)")
        await server.start()
        self = cls(server, service, port, config, gate)
        self.health = health_servicer
        await self._sync_health()
        service.pool.add_liveness_listener(self._on_liveness)
        if config.metrics_port is not None:
            self.metrics_port = service.metrics.serve_http(config.metrics_port, config.host)
        log.info(
            "compactor serving %s on %s%s (%d %s worker(s), model %s)",
            SERVICE_NAME,
            self.address,
            " with TLS" if config.tls else "",
            config.service.pool.workers,
            config.service.pool.mode,
            service.model.fingerprint,
        )
        return self

    async def _sync_health(self) -> None:
        """Health of the server and the Compactor service: SERVING while a replica lives
        (ignored by the servicer once it shuts down gracefully)."""
        if self.health is None:
            return
        async with self._health_lock:  # one update at a time, each from the pool's state now
            await self._set_health(self.health, self.service.pool.live > 0)

    @staticmethod
    async def _set_health(servicer: health.aio.HealthServicer, live: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if live
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE_NAME):
            await servicer.set(name, status)

    def _on_liveness(self, live: int) -> None:
        """The pool's liveness listener: re-read its state and set health (a task: the pool
        calls this synchronously; the task reads the pool when it runs, so the last one wins)."""
        if live == 0:
            log.warning("no worker replica is alive: health NOT_SERVING until one is replaced")
        task = asyncio.ensure_future(self._sync_health())
        self._health_tasks.add(task)
        task.add_done_callback(self._health_tasks.discard)

    async def stop(self, grace: float | None = None) -> None:
        """Drain, then stop. Health reports NOT_SERVING at once and new Compact calls get
        UNAVAILABLE ("draining") while the port stays open; in-flight calls may finish for up
        to `grace` s (default drain_seconds). Those still running then end with UNAVAILABLE
        and their compactions are cancelled; once their workers have stopped (or after a few
        seconds), the workers are shut down with the server."""
        grace = self.config.drain_seconds if grace is None else grace
        if self.health is not None:
            await self.health.enter_graceful_shutdown()
        log.info(
            "draining: %d Compact call(s) in flight may finish within %.3g s; "
            "new calls get UNAVAILABLE",
            self.gate.active,
            grace,
        )
        if await self.gate.drain(grace):
            log.info("drained: no Compact call in flight")
        else:
            log.warning("drain time (%.3g s) is up: cancelled the compaction(s) in flight", grace)
            await self.gate.wait_idle(_SETTLE_S)
        if not await self.service.wait_idle(_SETTLE_S):
            log.warning("a cancelled compaction did not stop in %.3g s; stopping anyway", _SETTLE_S)
        await self.server.stop(_SETTLE_S)
        await self.service.close()
        self.service.metrics.close()
        log.info("stopped")

    async def wait(self) -> None:
        await self.server.wait_for_termination()

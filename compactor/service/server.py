"""Build, start and stop the grpc.aio compaction server (health + reflection included).

    server = await CompactorServer.start(ServerConfig(service=..., port=0))
    ... server.port ...
    await server.stop()          # drains: NOT_SERVING, refuse new calls, finish in-flight

Binds 127.0.0.1 unless told otherwise; port 0 picks a free port.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from compactor.service.auth import TokenAuthInterceptor, TokenFile
from compactor.service.engine import CompactionService, ServiceConfig
from compactor.service.gen.compactor.v1 import compactor_pb2 as pb
from compactor.service.gen.compactor.v1 import compactor_pb2_grpc as pb_grpc
from compactor.service.metrics import ServiceMetrics
from compactor.service.servicer import CompactorServicer

__all__ = ["SERVICE_NAME", "CompactorServer", "PortInUseError", "ServerConfig", "TlsConfig"]

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Compactor"].full_name


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
    max_message_bytes: int = 16 << 20
    metrics_port: int | None = None  # None = no /metrics endpoint; 0 = any free port
    drain_seconds: float = 30.0


class CompactorServer:
    """A running server; `port` is the bound port, `service` the engine behind it."""

    def __init__(
        self, server: grpc.aio.Server, service: CompactionService, port: int, config: ServerConfig
    ) -> None:
        self.server = server
        self.service = service
        self.port = port
        self.config = config
        self.health: health.aio.HealthServicer | None = None
        self.metrics_port: int | None = None

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
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                ("grpc.so_reuseport", 0),
            ],
        )
        pb_grpc.add_CompactorServicer_to_server(CompactorServicer(service), server)
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
        self = cls(server, service, port, config)
        self.health = health_servicer
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
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

    async def stop(self, grace: float | None = None) -> None:
        """Drain: report NOT_SERVING, refuse new calls, let in-flight ones finish (up to
        `grace` s, default drain_seconds), then stop the workers."""
        if self.health is not None:
            await self.health.enter_graceful_shutdown()
        await self.server.stop(self.config.drain_seconds if grace is None else grace)
        await self.service.close()
        self.service.metrics.close()

    async def wait(self) -> None:
        await self.server.wait_for_termination()

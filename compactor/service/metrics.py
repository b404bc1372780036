"""Prometheus metrics of one server instance (a private CollectorRegistry: no global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["ServiceMetrics"]


class ServiceMetrics:
    """Every metric the service exports; expose with :meth:`serve_http`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "compactor_requests", "Compact requests by final status", ["status"], registry=r
        )
        self.latency = Histogram(
            "compactor_request_seconds",
            "Compact request latency",
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600),
            registry=r,
        )
        self.queue_depth = Gauge("compactor_queue_depth", "Jobs waiting for a worker", registry=r)
        self.busy_workers = Gauge("compactor_busy_workers", "Workers running a job", registry=r)
        self.compactions = Counter("compactor_compactions", "Compactions started", registry=r)
        self.singleflight_joins = Counter(
            "compactor_singleflight_joins",
            "Requests that joined a compaction in flight",
            registry=r,
        )
        self.cache_hits = Counter(
            "compactor_cache_hits", "Requests served from the cache", registry=r
        )
        self.cache_bytes = Gauge(
            "compactor_cache_bytes", "Bytes held by the result cache", registry=r
        )
        self.bytes_streamed = Counter(
            "compactor_bytes_streamed", "Payload bytes streamed to clients", registry=r
        )
        self.worker_restarts = Counter(
            "compactor_worker_restarts", "Workers replaced after dying", registry=r
        )

    def serve_http(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve /metrics on `addr:port` (0 = any free port) in a thread; returns the port."""
        from prometheus_client import start_http_server

        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self._http = server
        return int(server.server_address[1])

    def close(self) -> None:
        http = getattr(self, "_http", None)
        if http is not None:
            http.shutdown()
            http.server_close()

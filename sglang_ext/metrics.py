"""Counters of the compaction plugin, kept in-process and exported to Prometheus.

`CompactionStats` is always kept (tests and the log read it). With `--enable-metrics` the
scheduler also publishes them as `sglang:compaction_*` series; SGLang runs prometheus_client
in multiprocess mode, so series created in the scheduler show up on the server's /metrics.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["CompactionStats", "PrometheusExporter"]


@dataclass
class CompactionStats:
    """Counters (monotonic) and gauges (current) of one radix cache."""

    requested: int = 0
    installed: int = 0
    failures: int = 0  # the compactor raised, timed out or was unreachable
    invalid: int = 0  # a result failed validation
    fallbacks: int = 0  # a prefix stayed uncompacted for any reason
    double_installs: int = 0
    skipped_checkpoints: int = 0  # requests that started before an install, kept off it
    evicted: int = 0
    retired_tokens_freed: int = 0
    logical_tokens: int = 0  # gauge: T summed over installed prefixes
    physical_tokens: int = 0  # gauge: slots those prefixes hold
    bytes_saved: int = 0  # gauge: KV bytes not held thanks to compaction
    last_latency_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class PrometheusExporter:
    """Mirror `CompactionStats` into prometheus_client series (create in the scheduler)."""

    _COUNTERS = ("requested", "installed", "failures", "invalid", "fallbacks", "evicted")
    _GAUGES = ("logical_tokens", "physical_tokens", "bytes_saved")

    def __init__(self, labels: dict[str, str] | None = None):
        from prometheus_client import Counter, Gauge, Histogram

        self.labels = dict(labels or {})
        names = list(self.labels)
        self._counters = {
            n: Counter(f"sglang:compaction_{n}_total", f"Compaction plugin: {n}.", names)
            for n in self._COUNTERS
        }
        self._gauges = {
            n: Gauge(
                f"sglang:compaction_{n}",
                f"Compaction plugin: {n}.",
                names,
                multiprocess_mode="mostrecent",
            )
            for n in self._GAUGES
        }
        self._latency = Histogram(
            "sglang:compaction_latency_seconds",
            "Compaction request latency (submit to result).",
            names,
            buckets=(0.5, 1, 2, 5, 10, 20, 40, 80, 160, 320),
        )
        self._seen = CompactionStats()

    def update(self, stats: CompactionStats, latency_s: float | None = None) -> None:
        for n, c in self._counters.items():
            delta = getattr(stats, n) - getattr(self._seen, n)
            if delta > 0:
                (c.labels(**self.labels) if self.labels else c).inc(delta)
        for n, g in self._gauges.items():
            (g.labels(**self.labels) if self.labels else g).set(getattr(stats, n))
        if latency_s is not None:
            (self._latency.labels(**self.labels) if self.labels else self._latency).observe(
                latency_s
            )
        self._seen = CompactionStats(**stats.as_dict())

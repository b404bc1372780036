"""Counters of the compaction plugin, kept in-process and exported to Prometheus.

`CompactionStats` is always kept (tests and the log read it). With `--enable-metrics` the
scheduler also publishes them as `sglang:compaction_*` series; SGLang runs prometheus_client
in multiprocess mode, so series created in the scheduler show up on the server's /metrics.

Pool gauges are read from SGLang's own counts at the scheduler's poll point (every loop
iteration, about once a second when idle), never estimated:

- `physical_tokens`: slots held by compacted nodes (their N slots, not the alias);
- `kept_entries`: the entries their fits keep, summed over layers and KV heads (sum of the
  per-(layer, head) budgets t_{l,h}). The entries are packed (`sglang_ext.packing`), so
  `physical_tokens` x layers x KV heads, what the pool holds for them, exceeds
  `kept_entries` by less than one slot per prefix, also for per-head or per-layer budgets
  (`--compaction-head-budgets auto`, gvote);
- `tree_slots`: slots held by ordinary tree nodes (the radix cache's evictable + protected
  sizes, less the compacted nodes' share, which the tree counts there too);
- `free_slots`: `token_to_kv_pool_allocator.available_size()`;
- `pool_slots`: the allocator's size (`--max-total-tokens`).

With `--tp-size` > 1 every rank exports its own series, labelled `tp_rank` (each rank's
pool holds its share of the KV heads; counters count the same events on every rank).

`pool_slots - free_slots - physical_tokens - tree_slots` is what running requests hold
outside the tree. Stock SGLang publishes the same allocator figure as
`sglang:kv_available_tokens` (refreshed on each logged batch and every 30 s when idle).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["CompactionStats", "PrometheusExporter"]


@dataclass
class CompactionStats:
    """Counters (monotonic) and gauges (current) of one radix cache."""

    requested: int = 0
    installed: int = 0
    refits: int = 0  # installs that replaced an installed fit of the same prefix
    failures: int = 0  # the compactor raised, timed out or was unreachable
    invalid: int = 0  # a result failed a check (checksum, shape, echo, magnitude)
    stale: int = 0  # a result computed for weights that were updated since
    deferred: int = 0  # a path not sent because max_in_flight compactions were pending
    fallbacks: int = 0  # a prefix stayed uncompacted for any reason
    double_installs: int = 0
    skipped_checkpoints: int = 0  # requests that started before an install, kept off it
    evicted: int = 0
    # forwards whose host decision disagreed with the rows' first slots (checked on CPU only;
    # the slot look-up served them): must stay 0
    host_mark_mismatches: int = 0
    install_errors: int = 0  # an install or hook raised something other than a failed check
    # forwards that attended a compacted prefix, and the request rows in them that sat on one
    # (the attention backend counts them as it serves them)
    compacted_forwards: int = 0
    compacted_rows: int = 0
    # compacted batches that ran eagerly, by why no CUDA graph served them
    eager_batches: dict[str, int] = field(default_factory=dict)
    # results not installed, by reason (sglang_ext.intake.REASONS)
    results_rejected: dict[str, int] = field(default_factory=dict)
    installed_evicted: int = 0  # installs whose original prefix had been evicted meanwhile
    breaker_open: int = 0  # gauge: 1 once repeated errors stopped compaction
    retired_tokens_freed: int = 0
    logical_tokens: int = 0  # gauge: T summed over installed prefixes
    physical_tokens: int = 0  # gauge: slots those prefixes hold
    kept_entries: int = 0  # gauge: their fits' entries, summed over layers and KV heads
    bytes_saved: int = 0  # gauge: KV bytes not held thanks to compaction
    beta_slots: int = 0  # gauge: pool slots the beta store marks compacted (alias excluded)
    tree_slots: int = 0  # gauge: slots held by ordinary (uncompacted) tree nodes
    free_slots: int = 0  # gauge: free slots in SGLang's KV pool
    pool_slots: int = 0  # gauge: the KV pool's size
    chosen_ratio: float = 0.0  # gauge: the kept fraction of the last install (its budget)
    estimated_error: float = 0.0  # gauge: its held-out error estimate (--compaction-target-error)
    last_latency_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def read_pool(self, free: int, tree_total: int, pool: int) -> None:
        """Set the pool gauges from SGLang's counts.

        Args:
            free: the allocator's `available_size()`.
            tree_total: the tree's evictable + protected sizes (compacted nodes included,
                at their physical size); `physical_tokens` must be current.
            pool: the allocator's size.
        Mutates `tree_slots`, `free_slots` and `pool_slots`.
        """
        self.tree_slots = int(tree_total) - self.physical_tokens
        self.free_slots, self.pool_slots = int(free), int(pool)

    def read_store(self, store: Any) -> None:
        """Copy the counters the attention backend keeps on the `BetaStore` (mark
        mismatches, forwards and rows served from a compacted prefix, eager batches by
        reason). Mutates those four."""
        self.host_mark_mismatches = store.mark_mismatches
        self.compacted_forwards = store.compacted_forwards
        self.compacted_rows = store.compacted_rows
        self.eager_batches = dict(store.eager_batches)

    def read_prefixes(self, infos: list[Any], kvcache: Any, store: Any) -> None:
        """Set the compacted-prefix gauges from the installed prefixes' `CompactionInfo`s
        (T, N slots, kept entries), the KV pool (bytes one slot holds over all layers) and
        the `BetaStore` (slots with a beta, the alias aside). Mutates `logical_tokens`,
        `physical_tokens`, `kept_entries`, `bytes_saved` and `beta_slots`."""
        k0 = kvcache.get_key_buffer(kvcache.start_layer)
        slot_bytes = 2 * kvcache.layer_num * k0.shape[1] * k0.shape[2] * k0.element_size()
        self.logical_tokens = sum(i.logical_length for i in infos)
        self.physical_tokens = sum(i.num_slots for i in infos)
        self.kept_entries = sum(i.kept_entries for i in infos)
        self.bytes_saved = (self.logical_tokens - self.physical_tokens) * slot_bytes
        self.beta_slots = int(store.compacted.sum()) - int(store.alias_ready)


class PrometheusExporter:
    """Mirror `CompactionStats` into prometheus_client series (create in the scheduler)."""

    _COUNTERS = (
        "requested",
        "installed",
        "refits",
        "failures",
        "invalid",
        "stale",
        "deferred",
        "fallbacks",
        "evicted",
        "host_mark_mismatches",
        "install_errors",
        "compacted_forwards",
        "compacted_rows",
        "installed_evicted",
    )
    # counters by reason: `sglang:compaction_<name>_total{reason=...}`
    _BY_REASON = ("eager_batches", "results_rejected")
    _GAUGES = (
        "logical_tokens",
        "physical_tokens",
        "kept_entries",
        "bytes_saved",
        "beta_slots",
        "tree_slots",
        "free_slots",
        "pool_slots",
        "chosen_ratio",
        "estimated_error",
        "breaker_open",
    )

    def __init__(self, labels: dict[str, str] | None = None):
        from prometheus_client import Counter, Gauge, Histogram

        self.labels = dict(labels or {})
        names = list(self.labels)
        self._counters = {
            n: Counter(f"sglang:compaction_{n}_total", f"Compaction plugin: {n}.", names)
            for n in self._COUNTERS
        }
        self._by_reason = {
            n: Counter(
                f"sglang:compaction_{n}_total",
                f"Compaction plugin: {n} by reason.",
                [*names, "reason"],
            )
            for n in self._BY_REASON
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
        """Publish `stats`: the gauges first, then the counters, so that a scrape which sees
        a counter move (an install) also sees the gauges it moved (the prefix's tokens)."""
        for n, g in self._gauges.items():
            (g.labels(**self.labels) if self.labels else g).set(getattr(stats, n))
        for n, c in self._counters.items():
            delta = getattr(stats, n) - getattr(self._seen, n)
            if delta > 0:
                (c.labels(**self.labels) if self.labels else c).inc(delta)
        for n, c in self._by_reason.items():
            seen = getattr(self._seen, n)
            for reason, count in getattr(stats, n).items():
                if count > seen.get(reason, 0):
                    c.labels(**self.labels, reason=reason).inc(count - seen.get(reason, 0))
        if latency_s is not None:
            (self._latency.labels(**self.labels) if self.labels else self._latency).observe(
                latency_s
            )
        self._seen = CompactionStats(**stats.as_dict())

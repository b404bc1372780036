"""KV pool usage read from a live SGLang server (stock or with the plugin), never computed.

Every figure comes from the server's own `/metrics` and `/server_info`:

- pool size: `max_total_num_tokens` (`/server_info`);
- free slots: SGLang's `sglang:kv_available_tokens` (its allocator's `available_size()`), or
  the plugin's `sglang:compaction_free_slots`, the same call read at every scheduler
  iteration, where the plugin is loaded;
- radix-cached and in-use slots: `sglang:kv_evictable_tokens` / `sglang:kv_used_tokens`;
- requests running / queued: `sglang:num_running_reqs` / `sglang:num_queue_reqs`;
- plugin only: slots held by compacted nodes (`sglang:compaction_physical_tokens`) and by
  ordinary tree nodes (`sglang:compaction_tree_slots`).

Slots held = pool - free, so a reading can never exceed the pool. Stock SGLang publishes its
pool gauges on each logged batch and, when idle, every 30 s: `read_pool(..., idle_since=t)`
waits until a gauge published after `t` is certain (the plugin's gauges need ~1 s). Servers
need `--enable-metrics` (and `--decode-log-interval 1` for fresh gauges while busy).
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "PoolReading",
    "PoolSampler",
    "fetch_metrics",
    "labelled",
    "parse_metrics",
    "pool_size",
    "read_pool",
]

IDLE_REPUBLISH_S = 32.0  # SGLang republishes its idle pool gauges every 30 s (+ a 1 s loop)
PLUGIN_REFRESH_S = 2.0  # the plugin reads the pool every scheduler iteration (>= 1/s idle)
_PLUGIN_FREE = "sglang:compaction_free_slots"


def fetch_metrics(url: str, timeout: float = 30.0) -> dict[str, float]:
    """Every series on `url`/metrics, summed over labels: name -> value."""
    return parse_metrics(urllib.request.urlopen(url + "/metrics", timeout=timeout).read().decode())


def labelled(url: str, name: str, label: str, timeout: float = 30.0) -> dict[str, float]:
    """Series `name` on `url`/metrics by the value of its label `label` (summed over the
    other labels): e.g. the plugin's rejected results by reason."""
    text = urllib.request.urlopen(url + "/metrics", timeout=timeout).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        labels, _, value = line.rpartition(" ")
        found = re.search(rf'[{{,]{label}="([^"]*)"', labels)
        if found is not None:
            out[found.group(1)] = out.get(found.group(1), 0.0) + float(value)
    return out


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {series name: value summed over its labels}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def pool_size(url: str, timeout: float = 30.0) -> int:
    """The server's KV pool size in slots (`max_total_num_tokens` of `/server_info`)."""
    import json

    info = json.loads(urllib.request.urlopen(url + "/server_info", timeout=timeout).read())
    if "max_total_num_tokens" in info:
        return int(info["max_total_num_tokens"])
    states = info.get("internal_states") or [{}]
    if "max_total_num_tokens" in states[0]:
        return int(states[0]["max_total_num_tokens"])
    raise KeyError(f"no max_total_num_tokens in {url}/server_info (keys {sorted(info)[:20]})")


@dataclass(frozen=True)
class PoolReading:
    """One reading of a server's KV pool, in slots (one slot per token and layer stack)."""

    pool: int
    free: int  # the plugin's fresh free-slot gauge where loaded, else SGLang's
    sglang_free: int  # sglang:kv_available_tokens as SGLang last published it
    sglang_cached: int  # sglang:kv_evictable_tokens
    sglang_in_use: int  # sglang:kv_used_tokens
    running: int
    queued: int
    compacted: int | None  # plugin: slots held by compacted nodes (None on stock)
    tree: int | None  # plugin: slots held by ordinary tree nodes (None on stock)

    @property
    def held(self) -> int:
        """Slots not free: the radix tree's plus what running requests hold."""
        return self.pool - self.free

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"held": self.held}

    @classmethod
    def parse(cls, m: dict[str, float], pool: int) -> PoolReading:
        plugin = _PLUGIN_FREE in m
        sglang_free = int(m.get("sglang:kv_available_tokens", 0))
        return cls(
            pool=pool,
            free=int(m[_PLUGIN_FREE]) if plugin else sglang_free,
            sglang_free=sglang_free,
            sglang_cached=int(m.get("sglang:kv_evictable_tokens", 0)),
            sglang_in_use=int(m.get("sglang:kv_used_tokens", 0)),
            running=int(m.get("sglang:num_running_reqs", 0)),
            queued=int(m.get("sglang:num_queue_reqs", 0)),
            compacted=int(m["sglang:compaction_physical_tokens"]) if plugin else None,
            tree=int(m["sglang:compaction_tree_slots"]) if plugin else None,
        )


def read_pool(url: str, pool: int | None = None, idle_since: float | None = None) -> PoolReading:
    """Read the pool of the server at `url`.

    Args:
        pool: the pool size if known (else read from `/server_info`).
        idle_since: `time.monotonic()` when the server's last request ended; the call sleeps
            until gauges published after that moment are certain (stock: ~32 s after it).
    """
    size = pool_size(url) if pool is None else pool
    m = fetch_metrics(url)
    if idle_since is not None:
        wait = PLUGIN_REFRESH_S if _PLUGIN_FREE in m else IDLE_REPUBLISH_S
        delay = idle_since + wait - time.monotonic()
        if delay > 0:
            time.sleep(delay)
            m = fetch_metrics(url)
    return PoolReading.parse(m, size)


class PoolSampler:
    """Sample a busy server's pool every `period` seconds on a thread (a context manager).

    After exit: `peak_held` (pool - least free seen), `max_running`, `max_queued`, `samples`.
    """

    def __init__(self, url: str, pool: int, period: float = 1.0):
        self.url, self.pool, self.period = url, pool, period
        self.peak_held = self.max_running = self.max_queued = self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        r = PoolReading.parse(fetch_metrics(self.url), self.pool)
        self.peak_held = max(self.peak_held, r.held)
        self.max_running = max(self.max_running, r.running)
        self.max_queued = max(self.max_queued, r.queued)
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self._sample()
            except OSError:  # a slow /metrics answer under load: skip this sample
                continue

    def __enter__(self) -> PoolSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def as_dict(self) -> dict[str, int]:
        return {
            "peak_held": self.peak_held,
            "max_running": self.max_running,
            "max_queued": self.max_queued,
            "samples": self.samples,
        }

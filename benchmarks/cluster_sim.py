"""Discrete-event model of a disaggregated deployment: SGLang replicas + a compaction pool.

What it predicts, as the compaction pool grows: request throughput, queueing delay (time from
arrival to admission), KV memory held by shared prefixes, and how long documents wait to be
compacted. Run `python benchmarks/cluster_sim.py --help`; it writes JSON and a PNG.

Assumptions (each is a flag; defaults are illustrative, not measured on a cluster):
- Requests arrive as a Poisson process; each reads one of `--docs` documents chosen by a Zipf law
  (exponent `--zipf`), then asks a question of `--question-tokens` and gets `--output-tokens`.
- Document lengths are log-normal around `--prefix-tokens` (sigma `--prefix-sigma`).
- Routing is prefix-affine: a document always goes to replica `doc % replicas`, whose radix cache
  keeps it while in use and evicts least-recently-used documents when memory is short.
- A replica holds at most `--kv-tokens` KV entries (all layers counted as one token entry, as
  SGLang counts them). A resident document costs its length, or `ratio` x its length once
  compacted; a running request costs its own question + output tokens.
- A request is admitted when its replica has room for it (and its document); otherwise it waits
  in FIFO order. Its service time is the prefill of the tokens not cached (`--prefill-tps`) plus
  `output_tokens` decode steps of `--decode-step-ms` plus `--decode-ms-per-ktoken` per 1000 KV
  entries the replica's running batch reads per step (fixed at admission). A compacted prefix is
  read at its compacted size: this assumes attention skips alias entries (cascade kernels); the
  CPU torch path still reads them, so it saves memory, not decode compute.
- After `--min-hits` requests have read a document on a replica, one compaction job is queued
  cluster-wide (single-flight: later replicas reuse the result). Jobs run FIFO on `pool` workers,
  each taking `--compact-base-s + --compact-s-per-ktoken * T/1000` seconds (take these from
  `benchmarks/compaction_speed.py`). A finished result is installed on every replica that holds
  the document.
The model ignores network transfer of compacted prefixes (tens of MB at most, well under the
compaction time) and prefill batching effects.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class SimConfig:
    rate: float = 6.0  # requests per second, cluster-wide
    duration: float = 600.0  # simulated seconds of arrivals
    docs: int = 200
    zipf: float = 1.1
    prefix_tokens: int = 32000
    prefix_sigma: float = 0.5
    question_tokens: int = 64
    output_tokens: int = 128
    replicas: int = 4
    kv_tokens: int = 200_000
    prefill_tps: float = 20_000.0
    decode_step_ms: float = 15.0
    decode_ms_per_ktoken: float = 0.02
    ratio: float = 0.1
    min_hits: int = 2
    pool: int = 0  # compaction workers; 0 = no compaction (stock)
    compact_base_s: float = 2.0
    compact_s_per_ktoken: float = 1.5
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("rate", "duration", "prefill_tps", "decode_step_ms"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("docs", "replicas", "kv_tokens", "prefix_tokens", "min_hits"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.ratio <= 1:
            raise ValueError(f"ratio must be in (0, 1], got {self.ratio}")
        if self.pool < 0:
            raise ValueError(f"pool must be >= 0, got {self.pool}")


@dataclass
class _Replica:
    docs: OrderedDict[int, int] = field(default_factory=OrderedDict)  # doc -> tokens held (LRU)
    users: dict[int, int] = field(default_factory=dict)  # doc -> running requests reading it
    hits: dict[int, int] = field(default_factory=dict)
    running_tokens: int = 0
    read_tokens: int = 0  # KV entries one decode step of the running batch reads
    running: int = 0
    queue: deque[tuple[float, int]] = field(default_factory=deque)  # (arrival, doc)

    def held(self) -> int:
        return sum(self.docs.values()) + self.running_tokens


@dataclass(frozen=True)
class SimResult:
    pool: int
    completed: int
    throughput_rps: float
    queue_delay_p50_s: float
    queue_delay_p95_s: float
    prefix_kv_tokens_mean: float
    compactions: int
    compaction_wait_mean_s: float
    served_from_compacted: float
    prefix_hit_rate: float


def simulate(cfg: SimConfig) -> SimResult:
    """Run one simulation; deterministic for a given config (seeded)."""
    rng = random.Random(cfg.seed)
    weights = [1.0 / (d + 1) ** cfg.zipf for d in range(cfg.docs)]
    lengths = [
        max(16, int(cfg.prefix_tokens * math.exp(rng.gauss(0.0, cfg.prefix_sigma))))
        for _ in range(cfg.docs)
    ]
    replicas = [_Replica() for _ in range(cfg.replicas)]
    compacted: set[int] = set()
    requested: dict[int, float] = {}  # doc -> time its compaction was queued
    pool_free = cfg.pool
    jobs: deque[int] = deque()
    events: list[tuple[float, int, str, Any]] = []
    seq = 0

    def push(t: float, kind: str, payload: Any) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, payload))
        seq += 1

    t = 0.0
    while True:
        t += rng.expovariate(cfg.rate)
        if t > cfg.duration:
            break
        push(t, "arrive", rng.choices(range(cfg.docs), weights)[0])

    delays: list[float] = []
    waits: list[float] = []
    completed = from_compacted = hits = 0
    prefix_samples: list[int] = []
    last_sample = -1.0
    last_finish = cfg.duration

    def doc_cost(doc: int) -> int:
        return max(1, int(lengths[doc] * cfg.ratio)) if doc in compacted else lengths[doc]

    def try_admit(r: _Replica, now: float) -> None:
        nonlocal from_compacted, hits
        while r.queue:
            arrival, doc = r.queue[0]
            own = cfg.question_tokens + cfg.output_tokens
            need = own + (0 if doc in r.docs else doc_cost(doc))
            if not _make_room(r, need, cfg.kv_tokens, keep=doc):
                return
            r.queue.popleft()
            cached = doc in r.docs
            hits += cached
            if not cached:
                r.docs[doc] = doc_cost(doc)
            r.docs.move_to_end(doc)
            r.users[doc] = r.users.get(doc, 0) + 1
            r.running += 1
            r.running_tokens += own
            from_compacted += doc in compacted
            prefill = cfg.question_tokens + (0 if cached else lengths[doc])
            read = r.docs[doc] + own
            r.read_tokens += read
            step = cfg.decode_step_ms + cfg.decode_ms_per_ktoken * r.read_tokens / 1000
            service = prefill / cfg.prefill_tps + cfg.output_tokens * step / 1000
            delays.append(now - arrival)
            push(now + service, "finish", (r, doc, own, read))
            r.hits[doc] = r.hits.get(doc, 0) + 1
            if cfg.pool and r.hits[doc] >= cfg.min_hits and doc not in requested:
                requested[doc] = now
                jobs.append(doc)
                start_jobs(now)

    def start_jobs(now: float) -> None:
        nonlocal pool_free
        while pool_free and jobs:
            doc = jobs.popleft()
            pool_free -= 1
            cost = cfg.compact_base_s + cfg.compact_s_per_ktoken * lengths[doc] / 1000
            push(now + cost, "compacted", doc)

    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            r = replicas[payload % cfg.replicas]
            r.queue.append((now, payload))
            try_admit(r, now)
        elif kind == "finish":
            r, doc, own, read = payload
            r.running -= 1
            r.running_tokens -= own
            r.read_tokens -= read
            last_finish = now
            r.users[doc] -= 1
            completed += 1
            try_admit(r, now)
        elif kind == "compacted":
            doc = payload
            compacted.add(doc)
            waits.append(now - requested[doc])
            pool_free += 1
            for r in replicas:
                if doc in r.docs:
                    r.docs[doc] = doc_cost(doc)
                    try_admit(r, now)
            start_jobs(now)
        if now - last_sample >= 1.0:
            last_sample = now
            prefix_samples.append(sum(sum(r.docs.values()) for r in replicas))

    end = max(cfg.duration, last_finish)
    return SimResult(
        pool=cfg.pool,
        completed=completed,
        throughput_rps=completed / end,
        queue_delay_p50_s=_quantile(delays, 0.5),
        queue_delay_p95_s=_quantile(delays, 0.95),
        prefix_kv_tokens_mean=sum(prefix_samples) / max(len(prefix_samples), 1),
        compactions=len(compacted),
        compaction_wait_mean_s=sum(waits) / len(waits) if waits else 0.0,
        served_from_compacted=from_compacted / max(len(delays), 1),
        prefix_hit_rate=hits / max(len(delays), 1),
    )


def _make_room(r: _Replica, need: int, capacity: int, keep: int) -> bool:
    """Evict idle documents (LRU first) until `need` more tokens fit; False if impossible."""
    for doc in list(r.docs):
        if r.held() + need <= capacity:
            break
        if doc != keep and r.users.get(doc, 0) == 0:
            del r.docs[doc]
    return r.held() + need <= capacity


def _quantile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f in SimConfig.__dataclass_fields__.values():
        if f.name == "pool":
            continue
        parser.add_argument(
            f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default
        )
    parser.add_argument("--pools", default="0,1,2,4,8,16", help="pool sizes to sweep (0 = stock)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cluster_sim.json"))
    parser.add_argument("--plot", type=Path, default=Path("benchmarks/results/cluster_sim.png"))
    args = parser.parse_args(argv)
    base = {k: v for k, v in vars(args).items() if k in SimConfig.__dataclass_fields__}
    pools = [int(p) for p in args.pools.split(",")]
    results = [simulate(SimConfig(**base, pool=p)) for p in pools]

    header = (
        f"{'pool':>5} {'req/s':>7} {'delay p50':>10} {'p95':>8} {'prefix KV':>10} "
        f"{'hit rate':>8} {'compacted':>9} {'wait s':>7}"
    )
    print(header)
    for r in results:
        print(
            f"{r.pool:>5} {r.throughput_rps:>7.2f} {r.queue_delay_p50_s:>10.2f} "
            f"{r.queue_delay_p95_s:>8.2f} {r.prefix_kv_tokens_mean:>10.0f} "
            f"{r.prefix_hit_rate:>8.2f} {r.compactions:>9} "
            f"{r.compaction_wait_mean_s:>7.1f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"config": base, "results": [asdict(r) for r in results]}, indent=2) + "\n"
    )
    _plot(results, args.plot)
    print(f"wrote {args.out} and {args.plot}")
    return 0


def _plot(results: list[SimResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pools = [r.pool for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    axes[0].plot(pools, [r.throughput_rps for r in results], "o-")
    axes[0].set(xlabel="compaction workers (0 = stock)", ylabel="requests / s", title="throughput")
    axes[1].plot(pools, [r.queue_delay_p95_s for r in results], "o-", label="p95")
    axes[1].plot(pools, [r.queue_delay_p50_s for r in results], "s--", label="p50")
    axes[1].set(xlabel="compaction workers", ylabel="seconds", title="queueing delay")
    axes[1].legend()
    axes[2].plot(pools, [r.prefix_kv_tokens_mean / 1000 for r in results], "o-")
    axes[2].set(xlabel="compaction workers", ylabel="k tokens", title="KV held by prefixes")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())

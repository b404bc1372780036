"""Discrete-event model of a disaggregated deployment: SGLang replicas + a compaction pool.

What it predicts, per configuration (stock, and each compaction pool size): its **capacity**,
the highest arrival rate it sustains within an SLO on queueing delay (p95 of the time from
arrival to admission <= `--slo-p95-s`), found by a search over arrival rates; the pool size
past which more compaction workers stop raising capacity; and, at one fixed rate, queueing
delay, KV memory held by shared prefixes and how long documents wait to be compacted
(`--help`; JSON with the command, commit, machine and date, and a PNG).

Every run drains (all arrived requests complete), so completed / last finish would rank
configurations by drain time; capacity is the figure to compare. Counted within the arrival
window only: `served_rps`, `compactions` (finished; their mean wait), `compactions_pending`.

Assumptions (each is a flag; defaults are illustrative, not measured on a cluster):
- Poisson arrivals; each request reads one of `--docs` documents (Zipf, `--zipf`), asks
  `--question-tokens` and gets `--output-tokens`. Document lengths are log-normal around
  `--prefix-tokens` (sigma `--prefix-sigma`).
- Prefix-affine routing: document d always goes to replica `d % replicas`, whose radix cache
  keeps it while in use and evicts idle documents LRU first when memory is short.
- A replica holds at most `--kv-tokens` KV entries (one per token, all layers, as SGLang counts
  them). A resident document costs its length, or `ratio` x it once compacted; a running
  request costs its own question + output tokens.
- A request is admitted (FIFO) when its replica has room for it and its document. Service
  time: prefill of the uncached tokens (`--prefill-tps`) + `output_tokens` decode steps of
  `--decode-step-ms` + `--decode-ms-per-ktoken` per 1000 KV entries the running batch reads
  (fixed at admission). A compacted prefix is read at its compacted size (its entries only).
- After `--min-hits` reads of a document on a replica, one compaction job is queued
  cluster-wide (single-flight). Jobs run FIFO on `pool` workers, each taking
  `--compact-base-s + --compact-s-per-ktoken * T/1000` s (from
  `benchmarks/offline/compaction_speed.py`); the result is installed on every replica holding it.
The model ignores network transfer of compacted prefixes (tens of MB at most, well under the
compaction time) and prefill batching effects. Arrival times at rate r are one fixed stream of
unit-rate gaps divided by r (same documents in the same order), so runs at different rates
differ only by the rate, which keeps the capacity search from chasing noise.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks import RESULTS, add_options
from harness.provenance import provenance


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
    """One run at one arrival rate. Delays and rates in seconds; KV in token entries."""

    pool: int
    rate: float
    arrived: int
    completed: int  # all of them (the run drains) unless some never fit in memory
    served_rps: float  # requests completed within the arrival window / its length
    queue_delay_p50_s: float
    queue_delay_p95_s: float  # inf when more than 5% were never admitted
    prefix_kv_tokens_mean: float  # sampled each second of the arrival window
    compactions: int  # finished within the arrival window
    compactions_pending: int  # requested but not finished by its end
    compaction_wait_mean_s: float  # request to install, over `compactions`
    served_from_compacted: float
    prefix_hit_rate: float


@dataclass(frozen=True)
class Capacity:
    """The highest arrival rate one configuration sustains within the SLO."""

    pool: int
    slo_p95_s: float
    capacity_rps: float  # 0 when even the lowest rate tried misses the SLO
    at_capacity: SimResult | None
    probes: tuple[tuple[float, float], ...]  # (rate, p95 queueing delay) of each run tried


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

    arrived = len(events)
    delays: list[float] = []
    waits: list[float] = []
    completed = in_window = from_compacted = hits = 0
    prefix_samples: list[int] = []
    last_sample = -1.0

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
            r.users[doc] -= 1
            completed += 1
            in_window += now <= cfg.duration
            try_admit(r, now)
        elif kind == "compacted":
            doc = payload
            compacted.add(doc)
            if now <= cfg.duration:
                waits.append(now - requested[doc])
            pool_free += 1
            for r in replicas:
                if doc in r.docs:
                    r.docs[doc] = doc_cost(doc)
                    try_admit(r, now)
            start_jobs(now)
        if now - last_sample >= 1.0 and now <= cfg.duration:
            last_sample = now
            prefix_samples.append(sum(sum(r.docs.values()) for r in replicas))

    delays += [math.inf] * sum(len(r.queue) for r in replicas)  # never admitted
    requested_in_window = sum(t <= cfg.duration for t in requested.values())
    return SimResult(
        pool=cfg.pool,
        rate=cfg.rate,
        arrived=arrived,
        completed=completed,
        served_rps=in_window / cfg.duration,
        queue_delay_p50_s=_quantile(delays, 0.5),
        queue_delay_p95_s=_quantile(delays, 0.95),
        prefix_kv_tokens_mean=sum(prefix_samples) / max(len(prefix_samples), 1),
        compactions=len(waits),
        compactions_pending=requested_in_window - len(waits),
        compaction_wait_mean_s=sum(waits) / len(waits) if waits else 0.0,
        served_from_compacted=from_compacted / max(len(delays), 1),
        prefix_hit_rate=hits / max(len(delays), 1),
    )


def capacity(
    cfg: SimConfig,
    slo_p95_s: float,
    start_rps: float = 1.0,
    rel_tol: float = 0.01,
    max_rps: float = 1e4,
) -> Capacity:
    """The highest arrival rate at which `cfg` (its `rate` ignored) keeps the p95 queueing
    delay <= `slo_p95_s`: double (or halve) from `start_rps` to bracket it, then bisect
    until the bracket is within `rel_tol`. Assumes the delay grows with the rate (checked
    only at the probes, which the result lists)."""
    if slo_p95_s <= 0:
        raise ValueError(f"slo_p95_s must be > 0, got {slo_p95_s}")
    if not 0 < rel_tol < 1:
        raise ValueError(f"rel_tol must be in (0, 1), got {rel_tol}")
    probes: list[tuple[float, float]] = []

    def run(rate: float) -> tuple[bool, SimResult]:
        res = simulate(replace(cfg, rate=rate))
        probes.append((rate, res.queue_delay_p95_s))
        return res.arrived > 0 and res.queue_delay_p95_s <= slo_p95_s, res

    lo: tuple[float, SimResult] | None = None
    hi: float | None = None
    rate = start_rps
    while lo is None or hi is None:  # bracket: double while met, halve while missed
        if rate < start_rps / 1024:
            return Capacity(cfg.pool, slo_p95_s, 0.0, None, tuple(sorted(probes)))
        if rate > max_rps:
            break
        ok, res = run(rate)
        lo, hi = ((rate, res), hi) if ok else (lo, rate)
        rate = rate * 2 if ok else rate / 2
    if lo is None:  # cannot happen: rates only grow past max_rps after a met SLO
        raise RuntimeError(f"capacity search found no rate meeting the SLO: {probes}")
    while hi is not None and hi - lo[0] > rel_tol * lo[0]:
        mid = (lo[0] + hi) / 2
        ok, res = run(mid)
        lo, hi = ((mid, res), hi) if ok else (lo, mid)
    return Capacity(cfg.pool, slo_p95_s, lo[0], lo[1], tuple(sorted(probes)))


def saturation_pool(caps: list[Capacity], gain: float = 0.05) -> int | None:
    """The smallest compaction pool (> 0) past which no larger pool in `caps` raises
    capacity by more than `gain` (relative); None without compaction pools."""
    pooled = sorted((c for c in caps if c.pool > 0), key=lambda c: c.pool)
    for i, c in enumerate(pooled):
        if all(d.capacity_rps <= c.capacity_rps * (1 + gain) for d in pooled[i + 1 :]):
            return c.pool
    return None


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
        if f.name != "pool":
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default),
                                default=f.default)  # fmt: skip
    parser.add_argument("--pools", default="0,1,2,4,8,16,32", help="pool sizes (0 = stock)")
    parser.add_argument("--slo-p95-s", type=float, default=10.0, help="p95 queueing delay SLO")
    parser.add_argument("--gain", type=float, default=0.05, help="'stops helping' threshold")
    add_options(parser, out=RESULTS / "cluster_sim.json", plot=RESULTS / "cluster_sim.png")
    args = parser.parse_args(argv)
    base = {k: v for k, v in vars(args).items() if k in SimConfig.__dataclass_fields__}
    pools = [int(p) for p in args.pools.split(",")]
    caps = [capacity(SimConfig(**base, pool=p), args.slo_p95_s) for p in pools]
    at_rate = [simulate(SimConfig(**base, pool=p)) for p in pools]
    sat = saturation_pool(caps, args.gain)

    stock = next((c.capacity_rps for c in caps if c.pool == 0), 0.0)
    print(f"capacity: highest arrival rate with p95 queueing delay <= {args.slo_p95_s:g} s")
    print("pool  capacity req/s  x stock  | at --rate: p95 delay s  compacted  pending  wait s")
    for c, r in zip(caps, at_rate):
        x = f"{c.capacity_rps / stock:.2f}" if stock else "-"
        print(
            f"{c.pool:>4}  {c.capacity_rps:>14.2f}  {x:>7}  | {r.queue_delay_p95_s:>20.2f}  "
            f"{r.compactions:>9}  {r.compactions_pending:>7}  {r.compaction_wait_mean_s:>6.1f}"
        )
    print(f"more workers stop helping (< {args.gain:.0%} more capacity) past pool = {sat}")
    out = {
        "provenance": provenance(argv),
        "config": base,
        "slo_p95_s": args.slo_p95_s,
        "gain": args.gain,
        "saturation_pool": sat,
        "capacity": [asdict(c) for c in caps],
        "at_rate": [asdict(r) for r in at_rate],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    _plot(caps, at_rate, args.slo_p95_s, args.plot)
    print(f"wrote {args.out} and {args.plot}")
    return 0


def _plot(caps: list[Capacity], at_rate: list[SimResult], slo: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pools = [c.pool for c in caps]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    axes[0].plot(pools, [c.capacity_rps for c in caps], "o-")
    axes[0].set(xlabel="compaction workers (0 = stock)", ylabel="requests / s",
                title=f"capacity (p95 queueing <= {slo:g} s)")  # fmt: skip
    for c in caps:
        rates, p95 = zip(*c.probes)
        axes[1].plot(rates, [max(d, 1e-2) for d in p95], ".-", label=f"pool {c.pool}")
    axes[1].axhline(slo, color="k", lw=0.8, ls="--")
    axes[1].set(xlabel="arrival rate (req/s)", ylabel="p95 queueing (s)", yscale="log",
                title="search probes")  # fmt: skip
    axes[1].legend(fontsize=7)
    rate = at_rate[0].rate if at_rate else 0.0
    axes[2].plot(pools, [r.queue_delay_p95_s for r in at_rate], "o-", label="p95")
    axes[2].plot(pools, [r.queue_delay_p50_s for r in at_rate], "s--", label="p50")
    axes[2].set(xlabel="compaction workers", ylabel="seconds", title=f"queueing at {rate:g} req/s")
    axes[2].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())

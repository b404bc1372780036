"""Service overhead and throughput: a compaction through gRPC vs. the same call in-process.

    python -m benchmarks.offline.service --tokens 1024 --repeats 2 [--mode local|ray] [--workers N]

For each of `repeats` distinct prefixes of `tokens` tokens (no cache hits): time the worker
function in this process (one torch thread, model already loaded), then the same job through
a server on loopback (its own model replica). Reports per-request seconds, the overhead
(service / in-process - 1), compactions per minute (sequential, and with `workers`
concurrent requests), and how fast an abandoned compaction frees its worker: after the client
cancels halfway through, and after a deadline of half a compaction (client-observed
DEADLINE_EXCEEDED time too). Writes JSON to benchmarks/results/service.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from typing import Any

from benchmarks import ROOT, add_options


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_options(ap, model="smollm2-135m", tokens=1024, repeats=2, method="am-highest", ratio=0.1)
    ap.add_argument("--mode", choices=("local", "ray"), default="local")
    add_options(ap, workers=1, out=ROOT / "benchmarks" / "results" / "service.json")
    args = ap.parse_args()

    import torch

    from compactor import hf
    from compactor.client import AsyncCompactorClient, CompactorClient
    from compactor.models import fingerprint, resolve_model
    from compactor.service.engine import ServiceConfig
    from compactor.service.server import CompactorServer, ServerConfig
    from compactor.spec import CompactionSpec, QueryConfig
    from compactor.workers.job import CompactJob
    from compactor.workers.pool import PoolConfig
    from compactor.workers.worker import run_compaction

    model_dir = resolve_model(args.model)
    fp = fingerprint(model_dir)
    # the service's default query sources of before (repeat-prefill only)
    spec = CompactionSpec(
        method=args.method, ratio=args.ratio, queries=QueryConfig(sources=("repeat-prefill",))
    )
    prefixes = [
        [(i * 7919 + s * 104729) % 40000 + 100 for i in range(args.tokens)]
        for s in range(2 * args.repeats + args.workers)
    ]
    torch.set_num_threads(1)
    model, tok = hf.load_model(model_dir)
    inproc = []
    for ids in prefixes[: args.repeats]:
        job = CompactJob(fp, tuple(ids), spec)
        t0 = time.perf_counter()
        run_compaction(model, tok, fp, job)
        inproc.append(time.perf_counter() - t0)
        print(f"in-process: {inproc[-1]:.2f} s", flush=True)
    del model

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def run(coro):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    pool = PoolConfig(model_dir=str(model_dir), workers=args.workers, mode=args.mode)
    server = run(CompactorServer.start(ServerConfig(service=ServiceConfig(pool=pool))))
    ep = f"127.0.0.1:{server.port}"
    service, transfer = [], []
    with CompactorClient(ep) as c:
        for ids in prefixes[args.repeats : 2 * args.repeats]:
            res = c.compact_prefix(ids, fp, spec, timeout=1800)
            service.append(res.seconds)
            transfer.append(res.seconds - res.compute_seconds)
            print(
                f"service: {res.seconds:.2f} s (worker {res.compute_seconds:.2f} s, "
                f"{res.prefix.nbytes() / 1e6:.1f} MB)",
                flush=True,
            )
        t0 = time.perf_counter()
        c.compact_prefix(prefixes[args.repeats], fp, spec, timeout=60)
        cache_hit_s = time.perf_counter() - t0

    async def concurrent() -> float:
        async with AsyncCompactorClient(ep) as ac:
            t0 = time.perf_counter()
            await asyncio.gather(
                *(
                    ac.compact_prefix(ids, fp, spec, timeout=1800)
                    for ids in prefixes[2 * args.repeats :]
                )
            )
            return time.perf_counter() - t0

    conc = asyncio.run(concurrent()) if args.workers > 1 else None
    aborts = asyncio.run(abort_latencies(server.service.pool, ep, fp, spec, args, inproc))
    run(server.stop(grace=5))
    mean_in, mean_svc = statistics.mean(inproc), statistics.mean(service)
    report = {
        "tokens": args.tokens,
        "method": args.method,
        "ratio": args.ratio,
        "mode": args.mode,
        "workers": args.workers,
        "in_process_s": inproc,
        "service_s": service,
        "service_minus_worker_s": transfer,
        # separate runs: noisy on a shared 2-core machine
        "overhead_fraction": mean_svc / mean_in - 1,
        # same run: time outside the worker's compaction (gRPC, encode, stream, verify)
        "overhead_fraction_vs_worker": statistics.mean(transfer)
        / statistics.mean(s - t for s, t in zip(service, transfer)),
        "compactions_per_minute_sequential": 60 / mean_svc,
        "compactions_per_minute_concurrent": (args.workers * 60 / conc) if conc else None,
        "cache_hit_s": cache_hit_s,
        **aborts,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


async def abort_latencies(
    pool: Any, ep: str, fp: str, spec: Any, args: Any, inproc_s: list[float]
) -> dict[str, Any]:
    """Seconds until the worker is free again after a cancel / a deadline (fresh prefixes).

    Both land halfway through a compaction (`abort_after_s`, half the mean in-process time):
    a worker that ran to the end would be free only ~`abort_after_s` later, one that stops at
    its next layer sooner. The worker checks for cancellation only between layers, so an
    abort during prefill + queries (most of a long prefix's time) waits for the layer loop.
    """
    import grpc

    from compactor.client import AsyncCompactorClient

    half = statistics.mean(inproc_s) / 2
    ids_cancel, ids_deadline = (
        [(i * 7919 + s * 104729) % 40000 + 100 for i in range(args.tokens)] for s in (9001, 9002)
    )

    async def until_free() -> float:
        t0 = time.perf_counter()
        while pool.busy:
            await asyncio.sleep(0.005)
        return time.perf_counter() - t0

    async with AsyncCompactorClient(ep) as ac:
        task = asyncio.ensure_future(ac.compact_prefix(ids_cancel, fp, spec, timeout=1800))
        while not pool.busy:
            await asyncio.sleep(0.005)
        await asyncio.sleep(half)
        task.cancel()
        cancel_to_free = await until_free()
        t0 = time.perf_counter()
        try:
            await ac.compact_prefix(ids_deadline, fp, spec, timeout=half)
            code = "OK"
        except grpc.aio.AioRpcError as exc:
            code = exc.code().name
        exceeded_after = time.perf_counter() - t0
        deadline_to_free = await until_free()
    print(
        f"cancel -> worker free {cancel_to_free:.2f} s; deadline {half:.2f} s -> {code} after "
        f"{exceeded_after:.2f} s, worker free {deadline_to_free:.2f} s later",
        flush=True,
    )
    return {
        "abort_after_s": half,
        "cancel_to_worker_free_s": cancel_to_free,
        "deadline_status": code,
        "deadline_exceeded_after_s": exceeded_after,
        "deadline_to_worker_free_s": deadline_to_free,
    }


if __name__ == "__main__":
    sys.exit(main())

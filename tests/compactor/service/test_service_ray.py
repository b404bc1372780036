"""The service with real Ray actors (2 workers, local Ray started once for the module)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import ray

from compactor.client import AsyncCompactorClient, CompactorClient
from compactor.service.convert import compact_request
from tests.compactor.service._fixtures import (
    FAST,
    PREFIX,
    assert_same_prefix,
    compact_in_background,
    make_prefix,
    running_server,
)


@pytest.fixture(scope="module")
def server(prepared_model: Path) -> Any:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        with running_server(prepared_model, mode="ray", workers=2, layer_delay_s=0.15) as (srv, _):
            yield srv
    finally:
        ray.shutdown()


def _metric(srv: Any, name: str, **labels: str) -> float:
    return float(srv.service.metrics.registry.get_sample_value(name, labels) or 0.0)


def _wait(pred: Any, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


def test_round_trip_is_bit_exact(server: Any, model_fp: str, reference_prefix: Any) -> None:
    with CompactorClient(f"127.0.0.1:{server.port}") as c:
        res = c.compact_prefix(PREFIX, model_fp, FAST, timeout=120)
    assert_same_prefix(res.prefix, reference_prefix)
    assert not res.cache_hit
    assert str(res.worker) != ""


def test_killing_the_busy_actor_still_answers(server: Any, model_fp: str, reference: Any) -> None:
    ids = make_prefix(20)
    pool = server.service.pool
    th, out = compact_in_background(f"127.0.0.1:{server.port}", ids, model_fp, 180)
    _wait(lambda: pool.busy == 1, 30)
    time.sleep(1.0)  # mid-request: the compaction takes ~5 s
    busy = [r for r in pool.replicas if r.inflight]
    assert len(busy) == 1
    ray.kill(busy[0].handle, no_restart=True)
    th.join(180)
    assert "err" not in out, out.get("err")
    assert_same_prefix(out["res"].prefix, reference(ids))
    assert _metric(server, "compactor_worker_restarts_total") == 1
    # The dead actor is replaced: a fresh Ray worker process imports torch and loads the model,
    # which on a loaded 2-core machine (a server test beside) took over 60 s.
    _wait(lambda: all(r.alive for r in pool.replicas), 180)


def test_32_identical_requests_one_compaction(server: Any, model_fp: str) -> None:
    ids = make_prefix(21)
    before = _metric(server, "compactor_compactions_total")

    async def main() -> list[Any]:
        async with AsyncCompactorClient(f"127.0.0.1:{server.port}") as c:
            return await asyncio.gather(
                *(c.compact_prefix(ids, model_fp, FAST, timeout=120) for _ in range(32))
            )

    results = asyncio.run(main())
    assert _metric(server, "compactor_compactions_total") - before == 1
    assert sum(not (r.shared or r.cache_hit) for r in results) == 1


def test_cancellation_frees_the_actor(server: Any, model_fp: str) -> None:
    from compactor.service.gen.compactor.v1 import compactor_pb2_grpc as pb_grpc

    pool = server.service.pool
    _wait(lambda: pool.busy == 0, 30)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.CompactorStub(ch)
        call = stub.Compact(compact_request(make_prefix(22), model_fp, FAST), timeout=60)
        _wait(lambda: pool.busy == 1, 10)
        time.sleep(2.5)  # past prefill + queries (~1.5 s), inside the ~4.5 s layer loop
        call.cancel()
        _wait(lambda: pool.busy == 0, 5)

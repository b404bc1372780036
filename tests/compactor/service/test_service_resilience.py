"""Failure handling of the service, over real gRPC on loopback (in-process workers).

- a cancel reaches the generation stage (long follow-up answers), not only the layer loop;
- a prefix that kills workers is refused (FAILED_PRECONDITION, not retried) after 2 lost
  workers, however often the client retries: at most 2 replicas restarted;
- health is NOT_SERVING while no replica is alive, SERVING again once one is;
- INTERNAL errors carry an incident id, not the exception's text; request ids are logged
  sanitized.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

import compactor.workers.pool as pool_mod
from compactor.client import CompactorClient
from compactor.service.convert import compact_request
from compactor.spec import CompactionSpec, QueryConfig
from compactor.types import prefix_hash
from compactor.workers.errors import WorkerLost
from compactor.workers.pool import LocalReplica
from tests._tiny import random_ids, tiny_llama
from tests.compactor.service._fixtures import FAST, make_prefix, running_server

POISON = 127  # the tiny model's last token id: a prefix starting with it kills its worker
TINY_SPEC = CompactionSpec(
    method="am-highest", ratio=0.25, queries=QueryConfig(sources=("repeat-prefill",))
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-service")
    tiny_llama(path)
    return path


@pytest.fixture(scope="module")
def tiny_fp(tiny_dir: Path) -> str:
    from compactor.models import fingerprint

    return fingerprint(tiny_dir)


def _metric(srv: Any, name: str, **labels: str) -> float:
    return float(srv.service.metrics.registry.get_sample_value(name, labels) or 0.0)


def _wait(pred: Any, timeout: float) -> float:
    """Seconds until `pred()` held (AssertionError after `timeout`)."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)
    return time.monotonic() - t0


def test_cancel_during_follow_up_generation_stops_before_the_layer_loop(
    prepared_model: Path, model_fp: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """256 answer tokens per follow-up take tens of seconds on one CPU thread: the cancel
    stops the job within a token or so (the worker used to finish generating, then collect
    queries, and stop only before layer 0; the replica counted free after the grace)."""
    import compactor.pipeline.compact as pipeline  # where compact_prefix finds its stages

    layers: list[int] = []
    real = pipeline.compact_layers

    def spy(*args: Any, **kwargs: Any) -> Any:
        layers.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "compact_layers", spy)
    spec = FAST.replace(queries={"sources": ("follow-up",), "follow_up_answer_tokens": 256})
    with running_server(prepared_model) as (srv, _lt):
        pool = srv.service.pool
        from compactor.service.gen.compactor.v1 import compactor_pb2_grpc as pb_grpc

        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            req = compact_request(make_prefix(40), model_fp, spec, [[101, 102, 103], [201, 202]])
            call = pb_grpc.CompactorStub(ch).Compact(req, timeout=120)
            _wait(lambda: pool.busy == 1, 30)
            time.sleep(1.0)  # generating the answers
            call.cancel()
            stopped = _wait(lambda: pool.busy == 0, 5)  # the grace is 10 s
        _wait(lambda: _metric(srv, "compactor_requests_total", status="CANCELLED") == 1, 5)
    assert layers == [], "the layer loop started"
    assert stopped < 5


@pytest.fixture
def dying_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    """Local replicas whose worker dies (WorkerLost) on any prefix starting with POISON."""

    class Dying(LocalReplica):
        async def run(self, job_id: str, job: Any, *rest: Any) -> Any:
            if job.token_ids[0] == POISON:
                self.alive = False
                raise WorkerLost(f"worker {self.name} died: poisoned")
            return await super().run(job_id, job, *rest)

    monkeypatch.setattr(pool_mod, "LocalReplica", Dying)


def test_a_poison_prefix_restarts_at_most_two_replicas(
    tiny_dir: Path, tiny_fp: str, dying_replicas: None
) -> None:
    poison = [POISON, *random_ids(31, seed=5)]
    with running_server(tiny_dir, workers=2, max_prefix_tokens=None) as (srv, _lt):
        ep = f"127.0.0.1:{srv.port}"
        with CompactorClient(ep) as c:  # retries UNAVAILABLE up to 5 attempts
            with pytest.raises(grpc.RpcError) as first:
                c.compact_prefix(poison, tiny_fp, TINY_SPEC, timeout=60)
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as again:
                c.compact_prefix(poison, tiny_fp, TINY_SPEC.replace(ratio=0.5), timeout=60)
            refused_in = time.monotonic() - t0
            healthy = c.compact_prefix(random_ids(32, seed=6), tiny_fp, TINY_SPEC, timeout=60)
        restarts = _metric(srv, "compactor_worker_restarts_total")
    for err in (first.value, again.value):
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, (err.code(), err.details())
        assert prefix_hash(poison)[:16] in (err.details() or "")
        assert "lost 2 workers" in (err.details() or "")
    assert restarts == 2
    assert refused_in < 2  # refused at once, no worker touched (not even for another spec)
    assert healthy.prefix.logical_length == 32


def test_health_is_not_serving_while_no_replica_lives(tiny_dir: Path) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with running_server(tiny_dir, workers=1, max_prefix_tokens=None) as (srv, lt):
        pool = srv.service.pool
        release = threading.Event()
        make = pool._new_replica

        async def slow_replacement() -> Any:
            while not release.is_set():
                await asyncio.sleep(0.02)
            return await make()

        pool._new_replica = slow_replacement  # type: ignore[method-assign]

        async def lose_the_replica() -> None:
            pool._replace(pool.replicas[0])

        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)

            def status(service: str = "compactor.v1.Compactor") -> int:
                req = health_pb2.HealthCheckRequest(service=service)
                return int(stub.Check(req, timeout=5).status)

            serving, not_serving = (
                health_pb2.HealthCheckResponse.SERVING,
                health_pb2.HealthCheckResponse.NOT_SERVING,
            )
            assert status() == serving and status("") == serving
            lt.run(lose_the_replica())
            _wait(lambda: status() == not_serving and status("") == not_serving, 5)
            release.set()
            _wait(lambda: status() == serving and status("") == serving, 10)
            assert pool.live == 1


def test_internal_errors_name_an_incident_not_the_exception(
    tiny_dir: Path, tiny_fp: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The exception's text stays in the server log, under the incident id."""
    import compactor.pipeline.compact as pipeline  # where compact_prefix finds its stages

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise TypeError("secret internal detail /srv/model/weights")

    monkeypatch.setattr(pipeline, "compact_layers", broken)  # a bug inside the worker
    with (
        caplog.at_level(logging.INFO, logger="compactor"),
        running_server(tiny_dir, max_prefix_tokens=None) as (srv, _lt),
        CompactorClient(f"127.0.0.1:{srv.port}") as c,
        pytest.raises(grpc.RpcError) as info,
    ):
        c.compact_prefix(random_ids(32, seed=7), tiny_fp, TINY_SPEC, timeout=60)
    assert info.value.code() == grpc.StatusCode.INTERNAL
    details = info.value.details() or ""
    m = re.fullmatch(r"internal error \(incident ([0-9a-f]{12})\)", details)
    assert m, details
    logged = [r for r in caplog.records if m.group(1) in r.getMessage()]
    assert logged and logged[0].exc_info is not None  # the traceback, under the incident


def test_request_ids_are_logged_printable_and_bounded(
    tiny_dir: Path, tiny_fp: str, caplog: pytest.LogCaptureFixture
) -> None:
    evil = "evil\nFAKE LOG LINE\x1b[2J" + "x" * 500
    with (
        caplog.at_level(logging.INFO, logger="compactor"),
        running_server(tiny_dir, max_prefix_tokens=None) as (srv, _lt),
        CompactorClient(f"127.0.0.1:{srv.port}") as c,
    ):
        c.compact_prefix(random_ids(32, seed=8), tiny_fp, TINY_SPEC, timeout=60, request_id=evil)
    done = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compacted ")]
    line = next(msg for msg in done if "evil" in msg)
    assert "\n" not in line and "\x1b" not in line and "x" * 100 not in line, line


def test_safe_log_id() -> None:
    from compactor.workers.job import LOG_ID_CHARS, safe_log_id

    assert safe_log_id("req-1_a.b:c/d") == "req-1_a.b:c/d"
    assert safe_log_id("a b\tc\n\x00\u00e9") == "a?b?c???"
    long = safe_log_id("y" * 1000)
    assert long == "y" * LOG_ID_CHARS + "..."


def test_compact_calls_past_the_limit_are_refused_and_health_still_answers(
    tiny_dir: Path, tiny_fp: str
) -> None:
    """--max-concurrent-rpcs bounds Compact calls; the health check (the probes) and model info
    are answered beside them, not queued behind them."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with running_server(tiny_dir, layer_delay_s=0.5, max_prefix_tokens=None,
                        max_concurrent_rpcs=1) as (srv, _lt):  # fmt: skip
        addr = f"127.0.0.1:{srv.port}"
        errors: list[BaseException] = []

        def first() -> None:
            try:
                with CompactorClient(addr) as c:
                    c.compact_prefix(random_ids(32, seed=1), tiny_fp, TINY_SPEC, timeout=120)
            except BaseException as exc:  # reported below
                errors.append(exc)

        t = threading.Thread(target=first)
        t.start()
        _wait(lambda: srv.gate.active == 1, 30)
        with CompactorClient(addr) as c:
            with pytest.raises(grpc.RpcError) as info:
                c.compact_prefix(random_ids(32, seed=2), tiny_fp, TINY_SPEC, timeout=30)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-concurrent-rpcs" in (info.value.details() or "")
            assert c.model_info().model_fingerprint == tiny_fp
        with grpc.insecure_channel(addr) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        t.join(120)
        assert errors == []

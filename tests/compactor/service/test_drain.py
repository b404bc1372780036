"""`compactor serve` as a real process: graceful drain on SIGTERM, and its /metrics endpoint.

On SIGTERM the service reports NOT_SERVING at once, refuses new Compact calls with
UNAVAILABLE while it keeps listening, lets the compaction in flight finish within
--drain-seconds (else cancels it: its client gets UNAVAILABLE and the worker stops), and
exits 0 leaving no process behind. `--test-layer-delay-s` makes a compaction slow on purpose.
"""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from compactor.client import CompactorClient, CompactResult, RetryPolicy
from compactor.service.server import SERVICE_NAME
from harness.launch import CompactorService
from tests.compactor.service._fixtures import FAST, PREFIX, make_prefix

NO_RETRY = RetryPolicy(attempts=1)


def _compact(endpoint: str, fp: str, ids: list[int], **spec: Any) -> CompactResult:
    with CompactorClient(endpoint, retry=NO_RETRY) as client:
        return client.compact_prefix(ids, fp, FAST.replace(**spec), timeout=180)


def _rpc_error(fn: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value


def _health(endpoint: str) -> int:
    with grpc.insecure_channel(endpoint) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return int(
            stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5).status
        )


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET /metrics, parsed: {(sample name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def _wait(pred: Callable[[], bool], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"not reached in {timeout} s: {what}")
        time.sleep(0.05)


def _running(procs: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


def _start(tmp_path: Path, model: Path, *args: str, in_process: bool = True) -> CompactorService:
    return CompactorService(
        model, tmp_path / "svc.log", workers=1, in_process=in_process, extra_args=list(args)
    ).start()


def _sigterm_and_wait(svc: CompactorService, timeout: float) -> tuple[int, float]:
    """SIGTERM the service (its main process only, as Kubernetes does); (exit code, seconds)."""
    assert svc.pid is not None
    proc = psutil.Process(svc.pid)
    t0 = time.monotonic()
    os.kill(svc.pid, signal.SIGTERM)
    code = proc.wait(timeout)
    return code, time.monotonic() - t0


def test_sigterm_finishes_the_compaction_in_flight_and_refuses_new_ones(
    prepared_model: Path, model_fp: str, tmp_path: Path
) -> None:
    svc = _start(
        tmp_path, prepared_model,
        "--metrics-port", "0", "--drain-seconds", "60", "--test-layer-delay-s", "0.15",
    )  # fmt: skip
    try:
        mport = svc.metrics_port()
        assert svc.pid is not None
        main = psutil.Process(svc.pid)
        with ThreadPoolExecutor(1) as pool:
            inflight = pool.submit(_compact, svc.endpoint, model_fp, PREFIX)
            _wait(lambda: _value(_scrape(mport), "compactor_busy_workers") == 1, 60, "busy")
            children = main.children(recursive=True)
            t0 = time.monotonic()
            os.kill(svc.pid, signal.SIGTERM)
            _wait(
                lambda: _health(svc.endpoint) == health_pb2.HealthCheckResponse.NOT_SERVING,
                5,
                "NOT_SERVING",
            )
            err = _rpc_error(lambda: _compact(svc.endpoint, model_fp, make_prefix(7)))
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            assert "draining" in (err.details() or ""), err.details()
            assert not inflight.done(), "the compaction was over before the drain was tested"
            result = inflight.result(timeout=120)
        done = time.monotonic()
        code = main.wait(60)
        exited = time.monotonic()
    finally:
        svc.stop()
    assert result.prefix.logical_length == len(PREFIX) and not result.cache_hit
    assert result.prefix.num_layers == 30 and result.prefix.method == "am-highest"
    assert code == 0
    assert exited - t0 < 60 and exited - done < 15, (exited - t0, exited - done)
    assert not _running(children)
    log = (tmp_path / "svc.log").read_text()
    assert "SIGTERM: shutting down gracefully" in log
    assert "draining: 1 Compact call(s) in flight" in log and "drained" in log


@pytest.mark.slow
def test_sigterm_with_a_short_drain_cancels_the_compaction_and_leaves_no_process(
    prepared_model: Path, model_fp: str, tmp_path: Path
) -> None:
    """Ray workers (the default): the cancelled compaction's actor and Ray's own processes
    must all be gone once the service has exited."""
    svc = _start(
        tmp_path, prepared_model,
        "--metrics-port", "0", "--drain-seconds", "1", "--test-layer-delay-s", "2",
        in_process=False,
    )  # fmt: skip
    try:
        mport = svc.metrics_port()
        assert svc.pid is not None
        main = psutil.Process(svc.pid)
        with ThreadPoolExecutor(1) as pool:
            inflight = pool.submit(_compact, svc.endpoint, model_fp, PREFIX)
            _wait(lambda: _value(_scrape(mport), "compactor_busy_workers") == 1, 60, "busy")
            children = main.children(recursive=True)
            code, seconds = _sigterm_and_wait(svc, 60)
            err = _rpc_error(lambda: inflight.result(timeout=10))
    finally:
        svc.stop()
    assert children, "a Ray service runs Ray's processes and a worker actor"
    assert code == 0
    assert seconds < 30, seconds  # the compaction alone would take 60 s
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert "drain time of 1 s is up" in (err.details() or ""), err.details()
    _gone, alive = psutil.wait_procs(_running(children), timeout=15)
    assert not _running(alive), alive
    assert "drain time (1 s) is up" in (tmp_path / "svc.log").read_text()


def test_metrics_endpoint_counts_a_compaction_a_cache_hit_and_an_error(
    prepared_model: Path, model_fp: str, tmp_path: Path
) -> None:
    from compactor.service.result_stream import encode_prefix

    svc = _start(tmp_path, prepared_model, "--metrics-port", "0")
    try:
        mport = svc.metrics_port()
        first = _compact(svc.endpoint, model_fp, PREFIX)
        second = _compact(svc.endpoint, model_fp, PREFIX)
        bad = _rpc_error(lambda: _compact(svc.endpoint, model_fp, PREFIX, ratio=1.5))
        m = _scrape(mport)
        code, _seconds = _sigterm_and_wait(svc, 60)
    finally:
        svc.stop()
    assert not first.cache_hit and second.cache_hit
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
    payload = len(encode_prefix(first.prefix)[1])
    assert _value(m, "compactor_requests_total", status="OK") == 2
    assert _value(m, "compactor_requests_total", status="INVALID_ARGUMENT") == 1
    assert _value(m, "compactor_compactions_total") == 1
    assert _value(m, "compactor_cache_hits_total") == 1
    assert _value(m, "compactor_singleflight_joins_total") == 0
    assert _value(m, "compactor_bytes_streamed_total") == 2 * payload > 0
    assert _value(m, "compactor_request_seconds_count") == 3
    assert _value(m, "compactor_busy_workers") == 0 and _value(m, "compactor_queue_depth") == 0
    assert _value(m, "compactor_cache_bytes") > 0
    assert code == 0

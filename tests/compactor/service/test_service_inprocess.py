"""The service with in-process workers (no Ray), over real gRPC on loopback."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from compactor.client import AsyncCompactorClient, CompactorClient
from compactor.service.gen.compactor.v1 import compactor_pb2 as pb
from tests.compactor.service._fixtures import FAST, PREFIX, assert_same_prefix, running_server

INVALID = grpc.StatusCode.INVALID_ARGUMENT
DELAY = 0.05  # test-only per-layer sleep: a 64-token compaction takes ~3 s


@pytest.fixture(scope="module")
def server(prepared_model: Path) -> Any:
    with running_server(prepared_model, layer_delay_s=DELAY, auth_token=None) as (srv, _lt):
        yield srv


def _prefix(seed: int, n: int = 64) -> list[int]:
    return [(i * 7919 + seed * 104729) % 40000 + 100 for i in range(n)]


def _metric(srv: Any, name: str, **labels: str) -> float:
    value = srv.service.metrics.registry.get_sample_value(name, labels)
    return float(value or 0.0)


def _code(fn: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code()


def test_round_trip_is_bit_exact_then_cached(
    server: Any, model_fp: str, reference_prefix: Any
) -> None:
    with CompactorClient(f"127.0.0.1:{server.port}") as c:
        info = c.model_info()
        assert info.model_fingerprint == model_fp and info.num_kv_heads == 3
        assert "am-omp-fast" in c.list_methods()
        first = c.compact_prefix(PREFIX, model_fp, FAST, timeout=120)
        second = c.compact_prefix(PREFIX, model_fp, FAST, timeout=120)
    assert_same_prefix(first.prefix, reference_prefix)
    assert_same_prefix(second.prefix, reference_prefix)
    assert not first.cache_hit and second.cache_hit
    assert _metric(server, "compactor_cache_hits_total") >= 1
    assert _metric(server, "compactor_bytes_streamed_total") > 0


def test_status_codes_from_real_bad_requests(server: Any, model_fp: str) -> None:
    ep = f"127.0.0.1:{server.port}"
    with CompactorClient(ep) as c:

        def call(fp: str = model_fp, ids: Any = None, timeout: float = 60, **kw: Any) -> Any:
            spec = FAST.replace(**kw)
            return c.compact_prefix(_prefix(1) if ids is None else ids, fp, spec, timeout=timeout)

        def raw(spec_json: str) -> Any:
            req = pb.CompactRequest(
                model_fingerprint=model_fp, token_ids=_prefix(1), spec_json=spec_json
            )
            return c.compact_request(req, timeout=60)

        assert _code(lambda: call(method="no-such-method")) == grpc.StatusCode.INVALID_ARGUMENT
        assert _code(lambda: call(method_params={"bogus": 1})) == grpc.StatusCode.INVALID_ARGUMENT
        assert _code(lambda: call(ratio=1.5)) == grpc.StatusCode.INVALID_ARGUMENT
        assert _code(lambda: raw('{"queries": {"sources": ["nope"]}}')) == INVALID
        assert _code(lambda: raw('{"method": "am-highest", "bogus": 1}')) == INVALID
        assert _code(lambda: call(head_budgets="/etc/passwd")) == INVALID
        assert _code(lambda: call(ids=_prefix(1, 5000))) == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as info:
            call(ratio=1.5)
        assert info.value.details() == "ratio must be in (0, 1], got 1.5"
        assert _code(lambda: call(fp="0" * 32)) == grpc.StatusCode.FAILED_PRECONDITION
        # a float where an integer belongs: refused before the worker (it once got INTERNAL)
        assert (
            _code(lambda: call(method="am-omp-fast", method_params={"nnls_iters": 2.5})) == INVALID
        )
        assert _code(lambda: call(ids=_prefix(2), timeout=0.5)) == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_idle(server)
    assert _metric(server, "compactor_requests_total", status="INVALID_ARGUMENT") >= 9


def test_queue_full_is_resource_exhausted(prepared_model: Path, model_fp: str) -> None:
    with running_server(prepared_model, layer_delay_s=0.2, max_queue=1) as (srv, _lt):
        ep = f"127.0.0.1:{srv.port}"

        async def main() -> list[Any]:
            async with AsyncCompactorClient(ep) as c:
                calls = [
                    c.compact_prefix(_prefix(10 + i), model_fp, FAST, timeout=1.5) for i in range(3)
                ]
                return await asyncio.gather(*calls, return_exceptions=True)

        results = asyncio.run(main())
        codes = sorted(r.code().name for r in results if isinstance(r, grpc.RpcError))
        assert "RESOURCE_EXHAUSTED" in codes, results
        assert _metric(srv, "compactor_requests_total", status="RESOURCE_EXHAUSTED") == 1


def test_32_identical_requests_share_one_compaction(server: Any, model_fp: str) -> None:
    ids = _prefix(3)
    before = _metric(server, "compactor_compactions_total")

    async def main() -> list[Any]:
        async with AsyncCompactorClient(f"127.0.0.1:{server.port}") as c:
            return await asyncio.gather(
                *(c.compact_prefix(ids, model_fp, FAST, timeout=120) for _ in range(32))
            )

    results = asyncio.run(main())
    assert _metric(server, "compactor_compactions_total") - before == 1
    assert sum(r.shared or r.cache_hit for r in results) == 31
    for r in results[1:]:
        assert_same_prefix(r.prefix, results[0].prefix)


def test_other_follow_ups_share_the_result(server: Any, model_fp: str) -> None:
    """Follow-ups are hints the first request brings, not part of the result's identity:
    two replicas asking for the same document with their own questions share one result."""
    spec = FAST.replace(queries={"sources": ("follow-up",), "follow_up_answer_tokens": 0})
    ep = f"127.0.0.1:{server.port}"
    before = _metric(server, "compactor_compactions_total")
    with CompactorClient(ep) as c:
        first = c.compact_prefix(_prefix(20), model_fp, spec, [[101, 102, 103]], timeout=120)
        second = c.compact_prefix(
            _prefix(20), model_fp, spec, [[201, 202], [203, 204]], timeout=120
        )
        other = c.compact_prefix(_prefix(20), model_fp, FAST, timeout=120)  # another query policy
    assert not first.cache_hit and second.cache_hit and not other.cache_hit
    assert_same_prefix(second.prefix, first.prefix)
    assert _metric(server, "compactor_compactions_total") - before == 2

    async def at_once() -> list[Any]:  # two replicas asking together: one compaction
        async with AsyncCompactorClient(ep) as ac:
            return await asyncio.gather(
                *(
                    ac.compact_prefix(_prefix(21), model_fp, spec, [[300 + i]], timeout=120)
                    for i in (1, 2)
                )
            )

    a, b = asyncio.run(at_once())
    assert _metric(server, "compactor_compactions_total") - before == 3
    assert a.shared or a.cache_hit or b.shared or b.cache_hit
    assert_same_prefix(a.prefix, b.prefix)


def test_prefix_limit_defaults_to_the_model_context(prepared_model: Path, model_fp: str) -> None:
    """No limit configured: the model's max_position_embeddings (8192 for SmolLM2); the
    module's server, configured with 4096, refuses 5000 tokens (the flag overrides it)."""
    with running_server(prepared_model, max_prefix_tokens=None) as (srv, _lt):
        c = CompactorClient(f"127.0.0.1:{srv.port}")
        with c, pytest.raises(grpc.RpcError) as info:
            assert c.model_info().max_prefix_tokens == 8192
            c.compact_prefix(_prefix(6, 8193), model_fp, FAST, timeout=60)
    assert info.value.code() == INVALID
    assert info.value.details() == "prefix has 8193 tokens; this server's limit is 8192"


def test_cancellation_frees_the_worker(server: Any, model_fp: str) -> None:
    pool = server.service.pool
    cancelled = _metric(server, "compactor_requests_total", status="CANCELLED")
    ch = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    from compactor.service.convert import compact_request
    from compactor.service.gen.compactor.v1 import compactor_pb2_grpc as pb_grpc

    stub = pb_grpc.CompactorStub(ch)
    call = stub.Compact(compact_request(_prefix(4), model_fp, FAST), timeout=60)
    _wait(lambda: pool.busy == 1, 10)
    time.sleep(0.3)
    call.cancel()
    _wait(lambda: pool.busy == 0, 5)
    ch.close()
    _wait(
        lambda: _metric(server, "compactor_requests_total", status="CANCELLED") == cancelled + 1, 5
    )


def test_request_cli_prints_json(
    server: Any, prepared_model: Path, tmp_path: Path, capsys: Any
) -> None:
    from compactor.cli import main

    inp = tmp_path / "ids.json"
    inp.write_text(json.dumps(PREFIX))
    rc = main(
        [
            "request",
            "--endpoint",
            f"127.0.0.1:{server.port}",
            "--model",
            str(prepared_model),
            "--input",
            str(inp),
            "--method",
            "am-highest",
            "--ratio",
            "0.25",
            "--query-sources",  # FAST's spec: the round trip above cached its result
            "repeat-prefill",
            "--json",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["logical_length"] == len(PREFIX) and out["cache_hit"] is True
    assert out["seconds"] > 0


def test_health_and_reflection(server: Any) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="compactor.v1.Compactor"), timeout=5
        )
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        req = reflection_pb2.ServerReflectionRequest(list_services="")
        out = next(
            iter(
                reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                    iter([req]), timeout=5
                )
            )
        )
        names = {s.name for s in out.list_services_response.service}
        assert "compactor.v1.Compactor" in names


def _wait(pred: Any, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


def _wait_idle(server: Any) -> None:
    _wait(lambda: server.service.pool.busy == 0, 10)


def test_work_caps_refuse_before_any_work_and_are_reported(server: Any, model_fp: str) -> None:
    """A spec asking 1e9 random queries (or any knob over `compactor serve`'s caps) is refused
    with INVALID_ARGUMENT naming the field and the cap; GetModelInfo lists the caps."""
    from dataclasses import replace

    from compactor.spec.limits import WorkLimits

    busy = _metric(server, "compactor_requests_total", status="OK")
    with CompactorClient(f"127.0.0.1:{server.port}") as c:
        assert dict(c.model_info().limits) == WorkLimits().as_dict()
        huge = FAST.replace(queries=replace(FAST.queries, sources=("random",), random_count=10**9))
        with pytest.raises(grpc.RpcError) as info:
            c.compact_prefix(_prefix(7), model_fp, huge, timeout=60)
    assert info.value.code() == INVALID
    assert "queries.random_count = 1000000000 is over this server's limit 8192" in (
        info.value.details() or ""
    )
    # a nested method's parameter, and megabytes of prompts, over the wire
    for spec, field in (
        (FAST.replace(method="keep-only", method_params={"inner_params": {"nnls_iters": 10**9}}),
         "method_params.inner_params.nnls_iters = 1000000000 is outside"),
        (FAST.replace(queries=replace(FAST.queries, sources=("self-study",),
                                      self_study_prompts=("x" * (1 << 20),) * 15)),
         "queries.self_study_prompts = 1048576 is over this server's limit 4096"),
    ):  # fmt: skip
        with CompactorClient(f"127.0.0.1:{server.port}") as c, pytest.raises(grpc.RpcError) as info:
            c.compact_prefix(_prefix(7), model_fp, spec, timeout=60)
        assert info.value.code() == INVALID and field in (info.value.details() or "")
    assert _metric(server, "compactor_requests_total", status="OK") == busy


def test_per_tenant_limit_and_deadline_cap(prepared_model: Path, model_fp: str) -> None:
    """One caller cannot hold more than `max_per_tenant` requests in progress
    (RESOURCE_EXHAUSTED), and a request without a deadline gets the service's cap."""
    import threading

    limits = {"max_per_tenant": 1, "max_deadline_s": 1.5}
    with running_server(prepared_model, layer_delay_s=0.2, service_kwargs=limits) as (srv, _):
        ep = f"127.0.0.1:{srv.port}"
        codes: list[grpc.StatusCode] = []

        def slow() -> None:
            with CompactorClient(ep) as c:
                codes.append(
                    _code(lambda: c.compact_prefix(_prefix(11), model_fp, FAST, timeout=None))
                )

        first = threading.Thread(target=slow)
        first.start()
        deadline = time.monotonic() + 30
        while srv.service.pool.busy == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        with CompactorClient(ep) as c:
            second = _code(lambda: c.compact_prefix(_prefix(12), model_fp, FAST, timeout=60))
        first.join(60)
    assert second == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert codes == [grpc.StatusCode.DEADLINE_EXCEEDED]  # ~6 s of work, capped at 1.5 s

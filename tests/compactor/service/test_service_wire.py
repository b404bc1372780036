"""Result size limits and the kv dtype over real gRPC: a hostile server whose stream never
ends (the clients cancel it at the limit, without retrying) and the real service with
bf16 payloads (bit-identical once installed, a separate cache entry)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from compactor.client import AsyncCompactorClient, CompactorClient, RetryPolicy
from compactor.service.convert import compact_request
from compactor.service.gen.compactor.v1 import compactor_pb2 as pb
from compactor.service.gen.compactor.v1 import compactor_pb2_grpc as pb_grpc
from compactor.service.result_stream import (
    ChecksumError,
    ResultTooLarge,
    encode_prefix,
    max_result_bytes,
)
from tests._results import make_prefix
from tests.compactor.service._fixtures import FAST, PREFIX, assert_same_prefix, running_server

CHUNK = b"\0" * (64 << 10)


class Hostile(pb_grpc.CompactorServicer):
    """Streams a header announcing `announce` payload bytes, then chunks until cancelled."""

    def __init__(self, announce: int) -> None:
        header, _, _ = encode_prefix(make_prefix([[1, 1]]))
        header.payload_bytes = announce
        self.header = header
        self.calls = 0
        self.sent = 0
        self.ended = threading.Event()

    def Compact(self, request: Any, context: grpc.ServicerContext) -> Iterator[pb.CompactChunk]:
        self.calls += 1
        context.add_callback(self.ended.set)
        yield pb.CompactChunk(header=self.header)
        off = 0
        while context.is_active() and self.sent < 100_000:
            yield pb.CompactChunk(chunk=pb.TensorChunk(offset=off, data=CHUNK))
            off += len(CHUNK)
            self.sent += 1


def _serve(
    servicer: pb_grpc.CompactorServicer, port: int = 0, workers: int = 1
) -> tuple[grpc.Server, int]:
    """A started gRPC server of `servicer` on loopback (`port` 0: a free one), and its port."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    pb_grpc.add_CompactorServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, port


@pytest.fixture
def hostile() -> Iterator[Any]:
    servers = []

    def start(announce: int) -> tuple[Hostile, str]:
        servicer = Hostile(announce)
        server, port = _serve(servicer, workers=2)
        servers.append(server)
        return servicer, f"127.0.0.1:{port}"

    yield start
    for s in servers:
        s.stop(grace=None)


def _assert_stopped(servicer: Hostile) -> None:
    """The call ended early (cancelled), once (no retry), and nothing more is sent.

    Called while the client's channel is still open (closing it would cancel the call too).
    """
    assert servicer.ended.wait(10)
    assert servicer.calls == 1
    sent = servicer.sent
    assert sent < 100_000
    threading.Event().wait(0.3)
    assert servicer.sent == sent


@pytest.mark.parametrize(
    ("announce", "error", "match"),
    [
        (1 << 40, ResultTooLarge, "exceeds the limit of 1048576"),  # header over the limit
        # payload bytes no tensor covers: refused at the header (chunk overruns: test_result_bounds)
        (100_000, ChecksumError, "tensors cover .* of payload_bytes 100000"),
    ],
)
def test_sync_client_cancels_an_over_limit_stream(hostile, announce, error, match) -> None:
    servicer, ep = hostile(announce)
    with CompactorClient(ep) as c:
        with pytest.raises(error, match=match) as info:  # keeps the call's frame alive
            c.compact_prefix(PREFIX, "fp", FAST, timeout=30, max_result_bytes=1 << 20)
        _assert_stopped(servicer)
        assert info.type is error


def test_async_client_cancels_an_over_limit_stream(hostile) -> None:
    servicer, ep = hostile(1 << 40)

    async def go() -> None:
        async with AsyncCompactorClient(ep) as c:
            with pytest.raises(ResultTooLarge, match="exceeds the limit") as info:
                await c.compact_prefix(PREFIX, "fp", FAST, timeout=30, max_result_bytes=1 << 20)
            await asyncio.to_thread(_assert_stopped, servicer)
            assert info.value.limit == 1 << 20

    asyncio.run(go())


class Info(pb_grpc.CompactorServicer):
    def GetModelInfo(self, request: Any, context: grpc.ServicerContext) -> pb.ModelInfo:
        return pb.ModelInfo()


@pytest.mark.parametrize(("max_s", "reached"), [(0.2, True), (10.0, False)])
def test_the_channel_reconnects_on_the_retry_policys_schedule(max_s, reached) -> None:
    """A service that went away and came back on its address is reached again within the
    policy's `max_s`, whatever gRPC's own reconnect backoff (1 s growing to 120 s) would be.
    With a 10 s policy the channel is still backing off 0.6 s later, and fails fast."""
    server, port = _serve(Info())
    policy = RetryPolicy(attempts=1, initial_s=max_s, max_s=max_s)
    with CompactorClient(f"127.0.0.1:{port}", retry=policy) as c:
        c.model_info(timeout=10)
        server.stop(grace=None).wait()
        for _ in range(5):  # a dropped connection reconnects at once; a refused one backs off
            with pytest.raises(grpc.RpcError) as info:
                c.model_info(timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            if "failed to connect" in (info.value.details() or ""):
                break
        else:
            raise AssertionError(f"no refused connect: {info.value.details()}")
        server, _ = _serve(Info(), port)
        try:
            time.sleep(0.6)
            if reached:
                c.model_info(timeout=10)
            else:
                with pytest.raises(grpc.RpcError) as info:
                    c.model_info(timeout=10)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            server.stop(grace=None)


@pytest.fixture(scope="module")
def server(prepared_model: Path) -> Any:
    with running_server(prepared_model, auth_token=None) as (srv, _lt):
        yield srv


def test_bf16_payload_round_trip_and_cache_key(
    server: Any, model_fp: str, reference_prefix: Any
) -> None:
    ep = f"127.0.0.1:{server.port}"
    ref = reference_prefix
    L, H, D, T = ref.num_layers, ref.num_kv_heads, ref.head_dim, len(PREFIX)
    t = FAST.budget_per_head(T, FAST.sink_tokens(T))
    limit32 = max_result_bytes(L, H, D, T, torch.float32, t)
    limit16 = max_result_bytes(L, H, D, T, torch.bfloat16, t)
    with CompactorClient(ep) as c:
        fp32 = c.compact_prefix(PREFIX, model_fp, FAST, timeout=120, max_result_bytes=limit32)
        bf16 = c.compact_prefix(
            PREFIX, model_fp, FAST, timeout=120, kv_dtype=torch.bfloat16, max_result_bytes=limit16
        )
        again = c.compact_prefix(PREFIX, model_fp, FAST, timeout=120, kv_dtype="bfloat16")
    assert_same_prefix(fp32.prefix, ref)
    assert not bf16.cache_hit and again.cache_hit  # a cache entry of its own
    assert_same_prefix(again.prefix, bf16.prefix)
    assert bf16.prefix.dtype == torch.bfloat16 and bf16.prefix.layers[0].beta.dtype == torch.float32
    for a, b in zip(bf16.prefix.layers, ref.layers):  # what the plugin installs: identical
        t_max = max(b.head_lengths())
        for x, y in zip(a.padded(t_max, torch.bfloat16), b.padded(t_max, torch.bfloat16)):
            assert torch.equal(x, y)
    assert bf16.prefix.nbytes() < 0.55 * fp32.prefix.nbytes()
    bad = compact_request(PREFIX, model_fp, FAST)
    bad.kv_dtype = "int8"
    with CompactorClient(ep) as c, pytest.raises(grpc.RpcError) as info:
        c.compact_request(bad, timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "kv_dtype" in (info.value.details() or "")

"""A hostile compaction service: a gRPC proxy on the service's own proto that tampers.

`HostileProxy` listens on a loopback port the OS picks and forwards every Compact call to a
real `compactor serve` (its `upstream`), then answers according to the mode queued with
:meth:`HostileProxy.expect` (one mode per new request id; a client's retries of the same
request keep its mode; with nothing queued it forwards honestly). Tampered results are
resealed, i.e. the trailer's sha256 and payload size are recomputed over the tampered
metadata JSON + payload, as a compromised service would do, so only validation can catch
them. Modes (`MODES`):

- ``honest``: the real stream, re-chunked (a control: it must install);
- ``garbage``: messages of random bytes that are no protobuf at all;
- ``truncated``: header and the first half of the payload, then a clean end (no trailer);
- ``random``: the payload replaced by random bytes, resealed;
- ``shape``: layer 0's keys and values [N, D] relabelled [2N, D/2] in the tensor table
  (same bytes), resealed;
- ``swap``: layer 0's keys and values swapped in the tensor table (same bytes, same shapes),
  resealed: a structurally valid result that only the HMAC (a service with a signing key)
  exposes; every resealed result is signed again with the bearer token the proxy forwards;
- ``nan``: NaN written into every 7th entry of layer 0's keys, resealed;
- ``huge``: every layer's keys and values times `HUGE_FACTOR` (finite in fp32), resealed;
- ``fingerprint`` / ``prefix_hash``: that metadata field replaced, resealed;
- ``oversize``: the header claims, and the stream carries, `OVERSIZE_FACTOR` times the
  largest payload a valid result for this prefix could have (every head keeping all T
  tokens), resealed;
- ``slow``: the real result, but the trailer only after `stall_s` seconds (or never, when
  the client gives up first);
- ``kill``: the header and the first payload chunk, then `kill_upstream()` (SIGKILL of the
  real service) and the call ends UNAVAILABLE, as with a dead peer; later calls of the
  same request are forwarded to the dead service.

Upstream errors are passed on with their status code.
"""

from __future__ import annotations

import json
import random
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from compactor.service.gen.compactor.v1 import compactor_pb2 as pb
from compactor.service.gen.compactor.v1 import compactor_pb2_grpc as pb_grpc
from compactor.service.result_stream import result_digest, sign

__all__ = ["HUGE_FACTOR", "MODES", "OVERSIZE_FACTOR", "Call", "HostileProxy", "Result"]

HUGE_FACTOR = 3e4
OVERSIZE_FACTOR = 2
CHUNK_BYTES = 1 << 20
_SERVICE = "compactor.v1.Compactor"
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
}
Message = pb.CompactChunk | bytes  # bytes go out as they are (not a protobuf)


@dataclass
class Result:
    """A real service's answer taken apart; tamper with it, :meth:`reseal`, re-stream it.

    Attributes:
        header: the Header (metadata JSON + tensor table).
        payload: the tensors' bytes in table order (mutable).
        trailer: the Trailer (sha256 over metadata JSON + payload).
    """

    header: pb.Header
    payload: bytearray
    trailer: pb.Trailer

    @property
    def metadata(self) -> dict[str, Any]:
        meta: dict[str, Any] = json.loads(self.header.metadata_json)
        return meta

    @metadata.setter
    def metadata(self, meta: dict[str, Any]) -> None:
        self.header.metadata_json = json.dumps(meta, sort_keys=True)

    def tensor(self, name: str) -> torch.Tensor:
        """A copy of tensor `name` (shape and dtype from the table)."""
        info = self._info(name)
        raw = bytearray(self.payload[info.offset : info.offset + info.nbytes])
        flat = torch.frombuffer(raw, dtype=torch.uint8).view(_DTYPES[info.dtype])
        return flat.reshape(list(info.shape)).clone()

    def put(self, name: str, t: torch.Tensor) -> None:
        """Write `t` over tensor `name`'s bytes (same byte size); mutates `payload`."""
        info = self._info(name)
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        if len(raw) != info.nbytes:
            raise ValueError(f"{name}: {len(raw)} bytes, the table says {info.nbytes}")
        self.payload[info.offset : info.offset + info.nbytes] = raw

    def names(self) -> list[str]:
        return [info.name for info in self.header.tensors]

    def reseal(self, request: pb.CompactRequest, bearer: str | None) -> None:
        """Size and digest recomputed over header, table and payload; a signed result is
        signed again for `request` with the bearer token the proxy forwarded (all an on-path
        attacker has: it reads the header). Mutates header and trailer."""
        self.header.payload_bytes = len(self.payload)
        self.trailer.payload_bytes = len(self.payload)
        self.trailer.sha256 = result_digest(self.header, bytes(self.payload))
        if self.trailer.hmac_sha256 and bearer:
            self.trailer.hmac_sha256 = sign(bearer.encode(), self.trailer.sha256, request)

    def chunks(self, chunk_bytes: int = CHUNK_BYTES) -> list[pb.CompactChunk]:
        """The payload as TensorChunk messages of <= `chunk_bytes` (at least one)."""
        view = memoryview(self.payload)
        return [
            pb.CompactChunk(chunk=pb.TensorChunk(offset=o, data=bytes(view[o : o + chunk_bytes])))
            for o in range(0, max(len(view), 1), chunk_bytes)
        ]

    def max_valid_payload(self) -> int:
        """Bytes of the largest valid result for this prefix: every head keeps all T tokens
        (keys, values, beta fp32, kept_indices int64) plus each layer's indptr."""
        m = self.metadata
        elem = torch.empty(0, dtype=_DTYPES[str(m["dtype"])]).element_size()
        L, H, D, T = (
            int(m[k]) for k in ("num_layers", "num_kv_heads", "head_dim", "logical_length")
        )
        return L * (H * T * (2 * D * elem + 4 + 8) + (H + 1) * 4)

    def _info(self, name: str) -> pb.TensorInfo:
        for info in self.header.tensors:
            if info.name == name:
                return info
        raise ValueError(f"no tensor {name!r} in the result (has {self.names()[:4]}...)")


# ---- tampers that keep a complete stream: mutate the Result, the proxy reseals it ------
def _random(r: Result, rng: random.Random) -> None:
    r.payload[:] = rng.randbytes(len(r.payload))


def _shape(r: Result, rng: random.Random) -> None:
    for info in r.header.tensors:
        if info.name in ("layers.0.keys", "layers.0.values"):
            n, d = info.shape
            info.shape[:] = [2 * n, d // 2] if d % 2 == 0 else [n * d, 1]


def _swap(r: Result, rng: random.Random) -> None:
    infos = {info.name: info for info in r.header.tensors}
    k, v = infos["layers.0.keys"], infos["layers.0.values"]
    k.name, v.name = v.name, k.name


def _nan(r: Result, rng: random.Random) -> None:
    keys = r.tensor("layers.0.keys")
    keys.view(-1)[::7] = float("nan")
    r.put("layers.0.keys", keys)


def _huge(r: Result, rng: random.Random) -> None:
    for name in r.names():
        if name.endswith((".keys", ".values")):
            r.put(name, r.tensor(name) * HUGE_FACTOR)


def _fingerprint(r: Result, rng: random.Random) -> None:
    r.metadata = r.metadata | {"model_fingerprint": "0" * 16 + "-another-model"}


def _prefix_hash(r: Result, rng: random.Random) -> None:
    r.metadata = r.metadata | {"prefix_hash": f"{rng.getrandbits(256):064x}"}


def _oversize(r: Result, rng: random.Random) -> None:
    r.payload += bytes(OVERSIZE_FACTOR * r.max_valid_payload() - len(r.payload))


TAMPERS: dict[str, Callable[[Result, random.Random], None]] = {
    "random": _random,
    "shape": _shape,
    "swap": _swap,
    "nan": _nan,
    "huge": _huge,
    "fingerprint": _fingerprint,
    "prefix_hash": _prefix_hash,
    "oversize": _oversize,
}
MODES = ("honest", "garbage", "truncated", "slow", "kill", *TAMPERS)


@dataclass(frozen=True)
class Call:
    """One Compact call the proxy answered: the request id and the mode it got."""

    request_id: str
    mode: str


@dataclass
class HostileProxy:
    """The hostile service (see the module docstring); a context manager.

    Attributes:
        upstream: host:port of a real `compactor serve`.
        kill_upstream: kills the real service (needed by mode ``kill``).
        stall_s: how long mode ``slow`` holds the trailer back.
        seed: of the random bytes.
    """

    upstream: str
    kill_upstream: Callable[[], None] | None = None
    stall_s: float = 60.0
    seed: int = 0
    host: str = "127.0.0.1"
    port: int = 0
    calls: list[Call] = field(default_factory=list, init=False)
    _queue: deque[str] = field(default_factory=deque, init=False, repr=False)
    _modes: dict[str, str] = field(default_factory=dict, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _server: Any = field(default=None, init=False, repr=False)
    _channel: Any = field(default=None, init=False, repr=False)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def expect(self, mode: str) -> None:
        """Answer the next new request with `mode`."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; modes are {MODES}")
        if mode == "kill" and self.kill_upstream is None:
            raise ValueError("mode 'kill' needs kill_upstream")
        with self._lock:
            self._queue.append(mode)

    def start(self) -> HostileProxy:
        self._channel = grpc.insecure_channel(
            self.upstream, [("grpc.max_receive_message_length", 256 << 20)]
        )
        stub = pb_grpc.CompactorStub(self._channel)
        self._stub = stub
        handlers = {
            "Compact": grpc.unary_stream_rpc_method_handler(
                self._compact,
                request_deserializer=pb.CompactRequest.FromString,
                response_serializer=_serialize,
            ),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                lambda req, ctx: self._unary(stub.GetModelInfo, req, ctx),
                request_deserializer=pb.GetModelInfoRequest.FromString,
                response_serializer=pb.ModelInfo.SerializeToString,
            ),
            "ListMethods": grpc.unary_unary_rpc_method_handler(
                lambda req, ctx: self._unary(stub.ListMethods, req, ctx),
                request_deserializer=pb.ListMethodsRequest.FromString,
                response_serializer=pb.ListMethodsResponse.SerializeToString,
            ),
        }
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(_SERVICE, handlers),)
        )
        self.port = self._server.add_insecure_port(f"{self.host}:{self.port}")
        self._server.start()
        return self

    def stop(self) -> None:
        """Stop serving (cancels stalled calls) and close the upstream channel; idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.stop(grace=1.0).wait()
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()

    def __enter__(self) -> HostileProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- the handlers (threads of the gRPC server) ----------------------------------
    def _mode_for(self, request_id: str) -> str:
        with self._lock:
            mode = self._modes.get(request_id)
            if mode is None:
                mode = self._queue.popleft() if self._queue else "honest"
                self._modes[request_id] = mode
            self.calls.append(Call(request_id, mode))
            return mode

    def _unary(self, method: Any, req: Any, ctx: grpc.ServicerContext) -> Any:
        try:
            return method(req, timeout=ctx.time_remaining())
        except grpc.RpcError as err:
            ctx.abort(err.code(), f"upstream: {err.details()}")

    def _compact(self, req: pb.CompactRequest, ctx: grpc.ServicerContext) -> Iterator[Message]:
        mode = self._mode_for(req.request_id)
        rng = random.Random(f"{self.seed}:{req.request_id}")
        try:
            if mode == "garbage":
                yield from (b"\x00" + rng.randbytes(64) for _ in range(3))
            elif mode == "kill":
                yield from self._kill(req, ctx)
            else:
                r = self._fetch(req, ctx)
                tamper = TAMPERS.get(mode)
                if tamper is not None:
                    tamper(r, rng)
                    bearer = dict(_auth(ctx)).get("authorization", "").removeprefix("Bearer ")
                    r.reseal(req, bearer or None)
                chunks = r.chunks()
                yield pb.CompactChunk(header=r.header)
                if mode == "truncated":
                    yield from chunks[: max(1, len(chunks) // 2)]
                    return
                yield from chunks
                if mode == "slow":
                    done = threading.Event()
                    ctx.add_callback(done.set)  # the call ended (client deadline, cancel)
                    if done.wait(self.stall_s):
                        return
                yield pb.CompactChunk(trailer=r.trailer)
        except grpc.RpcError as err:
            ctx.abort(err.code(), f"upstream: {err.details()}")

    def _fetch(self, req: pb.CompactRequest, ctx: grpc.ServicerContext) -> Result:
        header, trailer, payload = None, None, bytearray()
        for msg in self._stub.Compact(req, timeout=ctx.time_remaining(), metadata=_auth(ctx)):
            kind = msg.WhichOneof("kind")
            if kind == "header":
                header = msg.header
            elif kind == "chunk":
                payload += msg.chunk.data
            else:
                trailer = msg.trailer
        if header is None or trailer is None:
            raise RuntimeError(f"upstream stream of {req.request_id!r} had no header or trailer")
        return Result(header, payload, trailer)

    def _kill(self, req: pb.CompactRequest, ctx: grpc.ServicerContext) -> Iterator[Message]:
        """Stream the header and the first chunk, kill the real service, end UNAVAILABLE."""
        upstream = self._stub.Compact(req, timeout=ctx.time_remaining(), metadata=_auth(ctx))
        for msg in upstream:
            yield msg
            if msg.HasField("chunk"):
                break
        if self.kill_upstream is None:
            raise RuntimeError("mode 'kill' needs kill_upstream")
        self.kill_upstream()
        upstream.cancel()
        ctx.abort(grpc.StatusCode.UNAVAILABLE, "Connection reset by peer (compactor killed)")


def _serialize(msg: Message) -> bytes:
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


def _auth(ctx: grpc.ServicerContext) -> tuple[tuple[str, str], ...]:
    """The caller's bearer token, passed on upstream (the proxy itself holds none)."""
    return tuple((k, v) for k, v in ctx.invocation_metadata() if k == "authorization")

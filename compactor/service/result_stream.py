"""Results: a CompactedPrefix streamed out (:func:`encode_prefix`) and assembled back
(:class:`Assembler`), bounded and verified.

Wire format of a result: a Header (metadata JSON + tensor table), the payload (every tensor
of :meth:`CompactedPrefix.tensors`, raw bytes, concatenated in table order) in
TensorChunks, and a Trailer with the result's digest (:func:`result_digest`: sha256 over the
whole Header, tensor table included, then the payload) and, when the service has a bearer
signing key, `hmac_sha256`: HMAC-SHA256 of that digest bound to the request it answers, keyed
with a signing key the service and its clients share as a file and that never travels
(:func:`sign`). The digest finds corruption; the HMAC finds tampering and replay by anyone
without the key, the bearer token's readers included (a client that holds a signing key
refuses an unsigned or missigned result).

Shape legend: L layers, H_kv KV heads, D head dim, T prefix tokens (the logical length),
N kept rows of one layer (sum over its heads).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from compactor.service.gen.compactor.v1 import compactor_pb2 as pb
from compactor.types import CompactedPrefix, dtype_from_name, dtype_name

__all__ = [
    "METADATA_ALLOWANCE",
    "Assembler",
    "ChecksumError",
    "EncodedPrefix",
    "ResultTooLarge",
    "cast_prefix",
    "encode_prefix",
    "max_result_bytes",
    "prefix_digest",
    "result_digest",
    "sign",
]

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
}
_DTYPE_NAMES = {v: k for k, v in _TORCH_DTYPES.items()}
# Header allowance of max_result_bytes: the metadata JSON and tensor table travel in the one
# Header message, which the client's default gRPC message cap (16 MiB) already bounds.
METADATA_ALLOWANCE = 16 << 20


class ChecksumError(ValueError):
    """A streamed result is incomplete, out of order or fails its checksum."""


class ResultTooLarge(ChecksumError):
    """A streamed result announces more bytes than the caller's limit (`limit`), or more
    than can be allocated (`limit` None)."""

    def __init__(self, nbytes: int, limit: int | None, what: str = "result") -> None:
        why = f"exceeds the limit of {limit} bytes" if limit is not None else "cannot be allocated"
        super().__init__(f"{what} of {nbytes} bytes {why}")
        self.nbytes = nbytes
        self.limit = limit


def max_result_bytes(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    logical_length: int,
    kv_dtype: torch.dtype = torch.float32,
    budget_tokens: int | None = None,
    *,
    metadata_allowance: int = METADATA_ALLOWANCE,
) -> int:
    """The most bytes (metadata JSON + payload) a valid result for this model and prefix has.

    A valid result (:meth:`CompactedPrefix.validate`) keeps at most T entries per (layer,
    KV head); each entry costs keys + values [D] in `kv_dtype`, beta fp32 and kept_indices
    int64; each layer adds indptr [H_kv+1] int32. `metadata_allowance` covers the metadata
    JSON (method reports grow with L and the chunk count).

    `budget_tokens` (t, the spec's per-head budget, :meth:`CompactionSpec.budget_per_head`)
    bounds the total instead: at most L * H_kv * min(T, 2t) entries. Uniform and sensitivity
    budgets keep exactly L * H_kv * t in total (redistribution moves entries between heads,
    a head may reach T); per-layer planners (KVCompose with min_per_layer <= t, CompressKV)
    stay within rounding and floors of that, well inside 2t. Pass None for methods that pick
    their own budget (GVote ignores the spec's), or per-layer floors above t.

    Args:
        num_layers: L. num_kv_heads: H_kv. head_dim: D. logical_length: T (all >= 1).
        kv_dtype: keys/values dtype of the result (float32, float16, bfloat16).
        budget_tokens: t >= 1, or None (bound by T alone).
    Raises ValueError naming a nonsense input.
    """
    for name, v in (
        ("num_layers", num_layers),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("logical_length", logical_length),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if budget_tokens is not None and (
        isinstance(budget_tokens, bool) or not isinstance(budget_tokens, int) or budget_tokens < 1
    ):
        raise ValueError(f"budget_tokens must be an int >= 1 or None, got {budget_tokens!r}")
    if isinstance(metadata_allowance, bool) or metadata_allowance < 0:
        raise ValueError(f"metadata_allowance must be >= 0, got {metadata_allowance!r}")
    kv_size = torch.empty(0, dtype=dtype_from_name(dtype_name(kv_dtype))).element_size()
    per_head = logical_length if budget_tokens is None else min(logical_length, 2 * budget_tokens)
    entries = num_layers * num_kv_heads * per_head
    per_entry = 2 * head_dim * kv_size + 4 + 8  # keys + values, beta fp32, kept_indices int64
    indptrs = num_layers * (num_kv_heads + 1) * 4
    return entries * per_entry + indptrs + metadata_allowance


@dataclass(frozen=True)
class EncodedPrefix:
    """A result ready to stream (what the result cache holds)."""

    header: pb.Header
    payload: bytes
    sha256: str
    worker: str = ""
    compute_seconds: float = 0.0
    stage_seconds: dict[str, float] = field(default_factory=dict)

    def nbytes(self) -> int:
        return len(self.payload) + self.header.ByteSize()

    def messages(self, chunk_bytes: int, trailer: pb.Trailer) -> Iterator[pb.CompactChunk]:
        """Header, payload slices of <= `chunk_bytes`, then `trailer`."""
        yield pb.CompactChunk(header=self.header)
        view = memoryview(self.payload)
        for off in range(0, len(view), chunk_bytes):
            data = bytes(view[off : off + chunk_bytes])
            yield pb.CompactChunk(chunk=pb.TensorChunk(offset=off, data=data))
        yield pb.CompactChunk(trailer=trailer)


def cast_prefix(prefix: CompactedPrefix, kv_dtype: torch.dtype) -> CompactedPrefix:
    """`prefix` with keys/values [N, D] cast to `kv_dtype` (beta, indptr, kept_indices as
    they are); `prefix` itself when already in that dtype. Mutates nothing.

    Raises ValueError if a cast key/value overflows `kv_dtype` (float16 past 65504).
    """
    if prefix.dtype == kv_dtype:
        return prefix
    layers = []
    for i, layer in enumerate(prefix.layers):
        k, v = layer.keys.to(kv_dtype), layer.values.to(kv_dtype)
        if not (bool(torch.isfinite(k).all()) and bool(torch.isfinite(v).all())):
            raise ValueError(f"layer {i}: keys/values overflow {dtype_name(kv_dtype)}")
        layers.append(dataclasses.replace(layer, keys=k, values=v))
    return dataclasses.replace(prefix, layers=layers, dtype=kv_dtype)


def encode_prefix(
    prefix: CompactedPrefix, kv_dtype: torch.dtype | None = None
) -> tuple[pb.Header, bytes, str]:
    """(header, payload, sha256 hex) of a compacted prefix, keys/values cast to `kv_dtype`
    first when given (:func:`cast_prefix`; ValueError on overflow)."""
    if kv_dtype is not None:
        prefix = cast_prefix(prefix, kv_dtype)
    meta = json.dumps(prefix.metadata(), sort_keys=True)
    infos, parts, offset = [], [], 0
    for name, t in prefix.tensors().items():
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        infos.append(
            pb.TensorInfo(
                name=name,
                dtype=_DTYPE_NAMES[t.dtype],
                shape=list(t.shape),
                offset=offset,
                nbytes=len(raw),
            )
        )
        parts.append(raw)
        offset += len(raw)
    payload = b"".join(parts)
    header = pb.Header(
        metadata_json=meta,
        num_layers=prefix.num_layers,
        num_kv_heads=prefix.num_kv_heads,
        head_dim=prefix.head_dim,
        dtype=str(prefix.metadata()["dtype"]),
        tensors=infos,
        payload_bytes=len(payload),
    )
    return header, payload, result_digest(header, payload)


class Assembler:
    """Rebuilds a CompactedPrefix from a Compact stream; feed every message to :meth:`add`.

    Memory: the header's tensor table is checked and, with `max_bytes`, its size (metadata
    JSON + payload_bytes) before anything is allocated (ResultTooLarge); then one buffer of
    payload_bytes receives the chunks (a chunk past payload_bytes is refused) while the
    sha256 is updated chunk by chunk. :meth:`result` returns tensors that are views of that
    buffer, except tensors whose offset is not a multiple of their element size, which are
    copied (at most one extra copy of the payload in total).
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 or None, got {max_bytes}")
        self.max_bytes = max_bytes
        self.header: pb.Header | None = None
        self.trailer: pb.Trailer | None = None
        self._buf = torch.empty(0, dtype=torch.uint8)
        self._filled = 0
        self._sha = hashlib.sha256()

    def add(self, msg: pb.CompactChunk) -> None:
        """Take the next message; ResultTooLarge / ChecksumError if it cannot be accepted
        (grpc.aio yields None for a message it could not decode)."""
        if not isinstance(msg, pb.CompactChunk):
            raise ChecksumError(f"undecodable message in stream ({type(msg).__name__})")
        kind = msg.WhichOneof("kind")
        if kind == "header":
            if self.header is not None:
                raise ChecksumError("second header in stream")
            self._start(msg.header)
        elif self.header is None or self.trailer is not None:
            raise ChecksumError(f"unexpected {kind} message")
        elif kind == "chunk":
            self._chunk(msg.chunk, self.header.payload_bytes)
        elif kind == "trailer":
            self.trailer = msg.trailer

    def result(
        self,
        expected_fingerprint: str | None = None,
        key: bytes | None = None,
        request: pb.CompactRequest | None = None,
    ) -> CompactedPrefix:
        """The verified prefix; ChecksumError if incomplete or corrupt (or, with `key`, the
        signing key shared with the service, unsigned, or signed for another `request` or
        with another key), ValueError if invalid."""
        h, tr = self.header, self.trailer
        if h is None or tr is None:
            raise ChecksumError("stream ended before its trailer")
        if self._filled != h.payload_bytes or tr.payload_bytes != h.payload_bytes:
            raise ChecksumError(f"payload has {self._filled} bytes, expected {h.payload_bytes}")
        digest = self._sha.hexdigest()
        if digest != tr.sha256:
            raise ChecksumError("sha256 mismatch (header, tensor table or payload)")
        if key is not None:
            if not tr.hmac_sha256:
                raise ChecksumError("result is not signed, but this client has a signing key")
            if request is None or not hmac.compare_digest(
                sign(key, digest, request), tr.hmac_sha256
            ):
                raise ChecksumError(
                    "HMAC mismatch: the result was not signed with our key for this request"
                )
        tensors = {}
        for info in h.tensors:
            dtype = _TORCH_DTYPES[info.dtype]
            raw = self._buf[info.offset : info.offset + info.nbytes]
            if info.offset % dtype.itemsize:
                raw = raw.clone()  # an aligned copy: a view must start on an element boundary
            tensors[info.name] = raw.view(dtype).reshape(list(info.shape))
        prefix = CompactedPrefix.from_parts(json.loads(h.metadata_json), tensors)
        prefix.validate(expected_fingerprint=expected_fingerprint)
        return prefix

    # ---- private ---------------------------------------------------------------------
    def _start(self, h: pb.Header) -> None:
        size = h.payload_bytes + len(h.metadata_json.encode())
        if self.max_bytes is not None and size > self.max_bytes:
            raise ResultTooLarge(size, self.max_bytes, "announced result")
        end = 0  # tensors tile the payload in table order, as encode_prefix writes them
        for info in h.tensors:
            if info.offset != end:
                raise ChecksumError(f"tensor {info.name!r} at offset {info.offset}, expected {end}")
            end += info.nbytes
            dtype = _TORCH_DTYPES.get(info.dtype)
            if dtype is None:
                raise ChecksumError(f"tensor {info.name!r} has unknown dtype {info.dtype!r}")
            if any(d < 0 for d in info.shape):
                raise ChecksumError(f"tensor {info.name!r} has shape {list(info.shape)}")
            numel = math.prod(info.shape)
            if info.nbytes != numel * dtype.itemsize:
                raise ChecksumError(
                    f"tensor {info.name!r}: {info.nbytes} bytes for shape {list(info.shape)} "
                    f"{info.dtype}"
                )
            if info.offset + info.nbytes > h.payload_bytes:
                raise ChecksumError(
                    f"tensor {info.name!r} ends at {info.offset + info.nbytes} > payload_bytes "
                    f"{h.payload_bytes}"
                )
        if end != h.payload_bytes:
            raise ChecksumError(f"tensors cover {end} of payload_bytes {h.payload_bytes}")
        try:
            self._buf = torch.empty(h.payload_bytes, dtype=torch.uint8)
        except RuntimeError:  # only reachable without max_bytes
            raise ResultTooLarge(h.payload_bytes, None, "announced payload") from None
        self.header = h
        self._sha = _header_hash(h)

    def _chunk(self, chunk: pb.TensorChunk, payload_bytes: int) -> None:
        if chunk.offset != self._filled:
            raise ChecksumError(f"chunk at offset {chunk.offset}, expected {self._filled}")
        end = self._filled + len(chunk.data)
        if end > payload_bytes:
            raise ChecksumError(f"chunk ends at {end} > payload_bytes {payload_bytes}")
        if chunk.data:
            self._buf.numpy()[self._filled : end] = np.frombuffer(chunk.data, dtype=np.uint8)
            self._sha.update(chunk.data)
        self._filled = end


def prefix_digest(prefix: CompactedPrefix) -> str:
    """The sha256 that identifies a result's content: the one :func:`encode_prefix` sends
    for it (a received result gives back the digest its stream was verified against). It
    serializes the result once (what TP ranks compare, `sglang_ext.tp`)."""
    return encode_prefix(prefix)[2]


def result_digest(header: pb.Header, payload: bytes) -> str:
    """sha256 hex over the Header (deterministic protobuf bytes: metadata JSON, shape fields,
    tensor table, payload size), its length first, then the payload."""
    h = _header_hash(header)
    h.update(payload)
    return h.hexdigest()


def sign(key: bytes, digest: str, request: pb.CompactRequest) -> str:
    """HMAC-SHA256 hex, keyed with the signing key `key`, of a result digest
    (:func:`result_digest`) bound to the request it answers: its nonce (`request_id`), fit
    round and spec (the sha256 of `spec_json`). A signed result so answers one request only:
    replayed to another (another caller's, or as another refit) it fails the check."""
    spec = hashlib.sha256(request.spec_json.encode()).hexdigest()
    bound = f"{digest}\n{request.request_id}\n{request.fit_round}\n{spec}".encode()
    return hmac.new(key, bound, hashlib.sha256).hexdigest()


def _header_hash(header: pb.Header) -> Any:
    raw = header.SerializeToString(deterministic=True)
    h = hashlib.sha256(len(raw).to_bytes(8, "little"))
    h.update(raw)
    return h

"""The one place where protobuf messages and domain types meet.

Wire format of a request: the CompactionSpec as one JSON object (``spec_json``, see
:meth:`CompactionSpec.to_dict`) next to the model fingerprint, the prefix and its follow-ups.

Wire format of a result: a Header (metadata JSON + tensor table), the payload (every tensor
of :meth:`CompactedPrefix.tensors`, raw bytes, concatenated in table order) in
TensorChunks, and a Trailer whose sha256 covers metadata JSON + payload.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from compactor.service.gen.compactor.v1 import compactor_pb2 as pb
from compactor.spec import CompactionSpec
from compactor.types import CompactedPrefix
from compactor.workers.errors import InvalidRequest
from compactor.workers.job import CompactJob

__all__ = [
    "Assembler",
    "ChecksumError",
    "EncodedPrefix",
    "compact_request",
    "encode_prefix",
    "job_from_request",
    "request_from_job",
]

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
}
_DTYPE_NAMES = {v: k for k, v in _TORCH_DTYPES.items()}


class ChecksumError(ValueError):
    """A streamed result is incomplete, out of order or fails its checksum."""


# ---- requests --------------------------------------------------------------------------
def job_from_request(req: pb.CompactRequest, auto_ratio: float) -> CompactJob:
    """Decode a CompactRequest (budget 'auto' -> `auto_ratio`); InvalidRequest if malformed.

    The spec's values are checked by :meth:`CompactJob.validate` (the service's policy).
    """
    if not req.spec_json:
        raise InvalidRequest("spec_json is required (a CompactionSpec as a JSON object)")
    try:
        spec = CompactionSpec.from_dict(json.loads(req.spec_json))
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"spec_json is not valid JSON: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"spec_json: {exc}") from None
    return CompactJob(
        model_fingerprint=req.model_fingerprint,
        token_ids=tuple(req.token_ids),
        spec=spec.resolve_auto(auto_ratio),
        follow_ups=tuple(tuple(f.token_ids) for f in req.follow_ups),
        request_id=req.request_id,
    )


def compact_request(
    token_ids: Sequence[int],
    model_fingerprint: str,
    spec: CompactionSpec,
    follow_ups: Sequence[Sequence[int]] = (),
    request_id: str = "",
) -> pb.CompactRequest:
    """The CompactRequest for a spec (its ratio and tokens both None = budget 'auto')."""
    return pb.CompactRequest(
        model_fingerprint=model_fingerprint,
        token_ids=[int(t) for t in token_ids],
        spec_json=json.dumps(spec.to_dict(), sort_keys=True),
        follow_ups=[pb.TokenSequence(token_ids=[int(t) for t in f]) for f in follow_ups],
        request_id=request_id,
    )


def request_from_job(job: CompactJob) -> pb.CompactRequest:
    """Inverse of :func:`job_from_request`."""
    return compact_request(
        job.token_ids, job.model_fingerprint, job.spec, job.follow_ups, job.request_id
    )


# ---- results ---------------------------------------------------------------------------
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


def encode_prefix(prefix: CompactedPrefix) -> tuple[pb.Header, bytes, str]:
    """(header, payload, sha256 hex) of a compacted prefix."""
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
    return header, payload, _checksum(meta, payload)


class Assembler:
    """Rebuilds a CompactedPrefix from a Compact stream; feed every message to :meth:`add`."""

    def __init__(self) -> None:
        self.header: pb.Header | None = None
        self.trailer: pb.Trailer | None = None
        self._buf = bytearray()

    def add(self, msg: pb.CompactChunk) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "header":
            if self.header is not None:
                raise ChecksumError("second header in stream")
            self.header = msg.header
            self._buf = bytearray()
        elif self.header is None or self.trailer is not None:
            raise ChecksumError(f"unexpected {kind} message")
        elif kind == "chunk":
            if msg.chunk.offset != len(self._buf):
                raise ChecksumError(
                    f"chunk at offset {msg.chunk.offset}, expected {len(self._buf)}"
                )
            self._buf += msg.chunk.data
        elif kind == "trailer":
            self.trailer = msg.trailer

    def result(self, expected_fingerprint: str | None = None) -> CompactedPrefix:
        """The verified prefix; ChecksumError if incomplete or corrupt, ValueError if invalid."""
        h, tr = self.header, self.trailer
        if h is None or tr is None:
            raise ChecksumError("stream ended before its trailer")
        if len(self._buf) != h.payload_bytes or tr.payload_bytes != h.payload_bytes:
            raise ChecksumError(f"payload has {len(self._buf)} bytes, expected {h.payload_bytes}")
        if _checksum(h.metadata_json, bytes(self._buf)) != tr.sha256:
            raise ChecksumError("sha256 mismatch")
        tensors = {}
        for info in h.tensors:
            raw = self._buf[info.offset : info.offset + info.nbytes]
            dtype = _TORCH_DTYPES[info.dtype]
            flat = (
                torch.frombuffer(raw, dtype=torch.uint8).view(dtype)
                if raw
                else torch.empty(0, dtype=dtype)
            )
            tensors[info.name] = flat.reshape(list(info.shape)).clone()
        prefix = CompactedPrefix.from_parts(json.loads(h.metadata_json), tensors)
        prefix.validate(expected_fingerprint=expected_fingerprint)
        return prefix


def _checksum(meta_json: str, payload: bytes) -> str:
    h = hashlib.sha256(meta_json.encode())
    h.update(payload)
    return h.hexdigest()

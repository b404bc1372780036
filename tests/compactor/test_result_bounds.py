"""Result streams: the size bound, bounded assembly (one buffer, views, incremental sha256)
and keys/values in the model's dtype (cast on the service == cast at install)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from compactor.service.convert import (
    compact_request,
    job_from_request,
    kv_dtype_field,
    request_from_job,
)
from compactor.service.gen.compactor.v1 import compactor_pb2 as pb
from compactor.service.result_stream import (
    METADATA_ALLOWANCE,
    Assembler,
    ChecksumError,
    EncodedPrefix,
    ResultTooLarge,
    cast_prefix,
    encode_prefix,
    max_result_bytes,
)
from compactor.spec import CompactionSpec
from compactor.types import CompactedPrefix
from compactor.workers.errors import InvalidRequest
from compactor.workers.job import CompactJob
from tests._results import make_prefix

SPEC = CompactionSpec(method="am-highest", ratio=0.25)


def stream(prefix, chunk_bytes=7, kv_dtype=None):
    header, payload, digest = encode_prefix(prefix, kv_dtype)
    trailer = pb.Trailer(sha256=digest, payload_bytes=len(payload))
    return list(EncodedPrefix(header, payload, digest).messages(chunk_bytes, trailer))


def assemble(msgs, max_bytes=None) -> CompactedPrefix:
    asm = Assembler(max_bytes)
    for m in msgs:
        asm.add(m)
    return asm.result(expected_fingerprint="fp")


def assert_same(a: CompactedPrefix, b: CompactedPrefix) -> None:
    assert a.metadata() == b.metadata()
    ta, tb = a.tensors(), b.tensors()
    assert ta.keys() == tb.keys()
    for name in ta:
        assert ta[name].dtype == tb[name].dtype and torch.equal(ta[name], tb[name]), name


# ---- max_result_bytes -------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bound_is_exact_for_a_result_that_keeps_everything(dtype):
    """Every head keeping T entries (the most validate allows) hits the bound exactly."""
    T, H, D, L = 20, 3, 8, 2
    full = make_prefix([[T] * H] * L, T=T, D=D, dtype=dtype)
    full.validate()
    header, payload, _ = encode_prefix(full)
    bound = max_result_bytes(L, H, D, T, dtype)
    assert bound - METADATA_ALLOWANCE == len(payload)
    assert len(header.metadata_json) < METADATA_ALLOWANCE
    assert max_result_bytes(L, H, D, T, dtype, metadata_allowance=0) == len(payload)


def test_budget_bound_admits_redistributed_budgets():
    """Sensitivity budgets keep L*H_kv*t in total but one head may reach T: still inside."""
    T, H, D, L, t = 40, 4, 8, 3, 5
    skewed = [[20, 0, 0, 0], [5, 5, 5, 5], [2, 3, 7, 8]]
    assert all(sum(row) == H * t for row in skewed)
    p = make_prefix(skewed, T=T, D=D)
    p.validate()
    _, payload, _ = encode_prefix(p)
    tight = max_result_bytes(L, H, D, T, budget_tokens=t, metadata_allowance=0)
    assert len(payload) <= tight < max_result_bytes(L, H, D, T, metadata_allowance=0)
    # twice the budget per head on average still fits; more does not
    over = make_prefix([[2 * t] * H] * L, T=T, D=D)
    _, payload, _ = encode_prefix(over)
    assert len(payload) == tight
    # a budget above T/2 is capped by T
    assert max_result_bytes(L, H, D, T, budget_tokens=T) == max_result_bytes(L, H, D, T)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_layers": 0}, "num_layers"),
        ({"num_kv_heads": True}, "num_kv_heads"),
        ({"head_dim": 2.5}, "head_dim"),
        ({"logical_length": -1}, "logical_length"),
        ({"budget_tokens": 0}, "budget_tokens"),
        ({"kv_dtype": torch.int8}, "unsupported KV dtype"),
        ({"metadata_allowance": -1}, "metadata_allowance"),
    ],
)
def test_bound_rejects_nonsense(kwargs, match):
    args = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "logical_length": 10} | kwargs
    with pytest.raises(ValueError, match=match):
        max_result_bytes(**args)


# ---- Assembler ----------------------------------------------------------------------------
def test_valid_stream_under_the_limit_assembles_bit_exact():
    p = make_prefix([[2, 3, 1], [0, 4, 4]])
    limit = max_result_bytes(2, 3, 8, 20)
    for chunk in (7, 64, 1 << 20):
        assert_same(assemble(stream(p, chunk), limit), p)
    # the exact size is accepted, one byte less is refused
    header = stream(p)[0].header
    exact = header.payload_bytes + len(header.metadata_json)
    assert_same(assemble(stream(p), exact), p)
    with pytest.raises(ResultTooLarge, match=f"{exact} bytes exceeds the limit of {exact - 1}"):
        assemble(stream(p), exact - 1)


def test_over_limit_header_is_refused_before_allocation():
    """An exabyte announcement: allocating it would fail differently (limit None)."""
    header = stream(make_prefix([[1, 1]]))[0]
    header.header.payload_bytes = 1 << 60
    asm = Assembler(max_bytes=1 << 20)
    with pytest.raises(ResultTooLarge) as info:
        asm.add(header)
    assert info.value.limit == 1 << 20 and info.value.nbytes >= 1 << 60
    assert asm.header is None
    with pytest.raises(ChecksumError, match="unexpected chunk"):  # the stream is dead
        asm.add(pb.CompactChunk(chunk=pb.TensorChunk(offset=0, data=b"x")))


def test_chunk_beyond_payload_bytes_is_refused():
    msgs = stream(make_prefix([[1, 2]]), chunk_bytes=1 << 20)
    asm = Assembler()
    asm.add(msgs[0])
    n = msgs[0].header.payload_bytes
    with pytest.raises(ChecksumError, match=f"chunk ends at {n + 1} > payload_bytes {n}"):
        asm.add(pb.CompactChunk(chunk=pb.TensorChunk(offset=0, data=b"\0" * (n + 1))))
    asm.add(pb.CompactChunk(chunk=pb.TensorChunk(offset=0, data=b"\0" * n)))
    with pytest.raises(ChecksumError, match=f"chunk ends at {n + 1}"):
        asm.add(pb.CompactChunk(chunk=pb.TensorChunk(offset=n, data=b"\0")))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda i: setattr(i, "dtype", "complex64"), "unknown dtype"),
        (lambda i: setattr(i, "nbytes", i.nbytes + 4), "bytes for shape"),
        (lambda i: setattr(i, "offset", i.offset + 10**6), "at offset 1000000, expected 0"),
    ],
)
def test_bad_tensor_table_is_refused_at_the_header(change, match):
    msgs = stream(make_prefix([[1, 2]]))
    change(msgs[0].header.tensors[0])
    with pytest.raises(ChecksumError, match=match):
        Assembler().add(msgs[0])


def test_payload_bytes_no_tensor_covers_are_refused_at_the_header():
    """Trailing bytes (a valid result padded, resealed) would pass every later check."""
    msgs = stream(make_prefix([[1, 2]]))
    msgs[0].header.payload_bytes += 16
    with pytest.raises(ChecksumError, match="tensors cover"):
        Assembler().add(msgs[0])


def test_corrupt_or_truncated_streams_fail():
    msgs = stream(make_prefix([[1, 2]]))
    bad = [pb.CompactChunk() for _ in msgs]
    for a, b in zip(bad, msgs):
        a.CopyFrom(b)
    bad[1].chunk.data = bytes([bad[1].chunk.data[0] ^ 1]) + bad[1].chunk.data[1:]
    with pytest.raises(ChecksumError, match="sha256 mismatch"):
        assemble(bad)
    with pytest.raises(ChecksumError, match="payload has"):
        assemble(msgs[:2] + msgs[-1:])
    with pytest.raises(ChecksumError, match="before its trailer"):
        assemble(msgs[:-1])


def test_misaligned_offsets_and_views_of_one_buffer():
    """H_kv = 2 (indptr 12 bytes) puts kept_indices int64 at 4 mod 8 (copied); aligned
    tensors are views of the one payload buffer."""
    p = make_prefix([[2, 3], [1, 0]], D=3, dtype=torch.bfloat16)  # N = 5 then 1
    msgs = stream(p)
    infos = {i.name: i for i in msgs[0].header.tensors}
    assert infos["layers.0.kept_indices"].offset % 8 == 4
    back = assemble(msgs)
    assert_same(back, p)
    k0, v0 = back.layers[0].keys, back.layers[0].values
    assert k0.untyped_storage().data_ptr() == v0.untyped_storage().data_ptr()  # no copy
    ki = back.layers[0].kept_indices
    assert ki is not None and ki.data_ptr() % 8 == 0  # copied to an aligned place
    assert ki.untyped_storage().data_ptr() != k0.untyped_storage().data_ptr()


# ---- kv dtype -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cast_on_service_equals_cast_at_install(dtype):
    """The plugin installs with layer.padded(t_max, pool dtype): identical either way."""
    p = make_prefix([[2, 3, 1], [4, 0, 4]])
    served = assemble(stream(p, kv_dtype=dtype))
    assert served.dtype == dtype and served.layers[0].keys.dtype == dtype
    assert served.layers[0].beta.dtype == torch.float32
    for a, b in zip(served.layers, p.layers):
        t_max = max(b.head_lengths())
        for x, y in zip(a.padded(t_max, dtype), b.padded(t_max, dtype)):
            assert x.dtype == y.dtype and torch.equal(x, y)
        assert torch.equal(a.beta, b.beta) and torch.equal(a.indptr, b.indptr)
    _, pay32, _ = encode_prefix(p)
    h16, pay16, _ = encode_prefix(p, dtype)
    n, d = p.kept_tokens(), p.head_dim
    assert len(pay32) - len(pay16) == 2 * n * d * 2  # keys + values, 2 bytes saved each
    assert json.loads(h16.metadata_json)["dtype"] == h16.dtype == str(dtype).split(".")[1]
    assert cast_prefix(p, torch.float32) is p


def test_cast_that_overflows_float16_is_refused():
    p = make_prefix([[1, 1]])
    big = dataclasses.replace(p.layers[0], keys=torch.full_like(p.layers[0].keys, 1e6))
    with pytest.raises(ValueError, match="overflow float16"):
        encode_prefix(dataclasses.replace(p, layers=[big]), torch.float16)


def test_kv_dtype_on_the_wire_and_in_the_cache_key():
    ids = list(range(2, 40))
    keys = {}
    for asked in (None, torch.float32, "float32", torch.bfloat16, "bfloat16", torch.float16):
        req = compact_request(ids, "fp", SPEC, kv_dtype=asked)
        job = job_from_request(req, 0.1)
        assert request_from_job(job) == req
        keys.setdefault(job.kv_dtype, set()).add(job.key())
    assert {k: len(v) for k, v in keys.items()} == {"": 1, "bfloat16": 1, "float16": 1}
    assert len(set().union(*keys.values())) == 3
    # float32 keeps the key it had before the field existed
    assert CompactJob("fp", tuple(ids), SPEC).key() in keys[""]
    with pytest.raises(InvalidRequest, match="kv_dtype: unsupported KV dtype 'int8'"):
        job_from_request(pb.CompactRequest(spec_json=req.spec_json, kv_dtype="int8"), 0.1)
    with pytest.raises(InvalidRequest, match="kv_dtype must be one of"):
        CompactJob("fp", tuple(ids), SPEC, kv_dtype="float32").validate(100)
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        kv_dtype_field(torch.int64)

"""A result's integrity: its digest covers the header and tensor table as well as the payload,
and a service with a signing key signs the digest, bound to the request it answers, with it
(HMAC-SHA256); the key is shared as a file and never travels. A client that holds the key
refuses a result anyone without the key changed, even one resealed with a valid digest and
signed again with the bearer token read off the wire (layer 0's keys and values swapped in
the table: same bytes, same shapes), and a result replayed to another request."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from compactor.client import CompactorClient
from compactor.service.gen.compactor.v1 import compactor_pb2 as pb
from compactor.service.result_stream import (
    Assembler,
    ChecksumError,
    encode_prefix,
    prefix_digest,
    result_digest,
    sign,
)
from harness.hostile import HostileProxy
from tests._results import make_prefix
from tests.compactor.service._fixtures import FAST, PREFIX, running_server

KEY = b"signing-key"
TOKEN = "bearer-token"  # travels in every request's metadata
REQ = pb.CompactRequest(request_id="r1", fit_round=0, spec_json='{"method": "am-highest"}')


def _stream(header: pb.Header, payload: bytes, trailer: pb.Trailer) -> Assembler:
    asm = Assembler()
    for msg in (pb.CompactChunk(header=header),
                pb.CompactChunk(chunk=pb.TensorChunk(offset=0, data=payload)),
                pb.CompactChunk(trailer=trailer)):  # fmt: skip
        asm.add(msg)
    return asm


def _swap_layer0(header: pb.Header) -> None:
    infos = {i.name: i for i in header.tensors}
    infos["layers.0.keys"].name, infos["layers.0.values"].name = "layers.0.values", "layers.0.keys"


def test_the_digest_covers_the_tensor_table() -> None:
    header, payload, digest = encode_prefix(make_prefix([[2, 3], [1, 2]]))
    signed = sign(KEY, digest, REQ)
    trailer = pb.Trailer(sha256=digest, payload_bytes=len(payload), hmac_sha256=signed)
    got = _stream(header, payload, trailer).result(key=KEY, request=REQ)
    assert got.num_layers == 2
    assert prefix_digest(got) == digest  # what TP ranks compare (sglang_ext.tp)
    _swap_layer0(header)  # same payload, same metadata: only the table changed
    with pytest.raises(ChecksumError, match="sha256 mismatch"):
        _stream(header, payload, trailer).result()


def test_a_resealed_swap_needs_the_key() -> None:
    header, payload, _ = encode_prefix(make_prefix([[2, 3], [1, 2]]))
    honest = sign(KEY, result_digest(header, payload), REQ)
    _swap_layer0(header)
    resealed = result_digest(header, payload)  # what anyone can compute
    trailer = pb.Trailer(sha256=resealed, payload_bytes=len(payload), hmac_sha256=honest)
    assert _stream(header, payload, trailer).result().num_layers == 2  # no key: passes
    with pytest.raises(ChecksumError, match="HMAC mismatch"):
        _stream(header, payload, trailer).result(key=KEY, request=REQ)
    by_token = sign(TOKEN.encode(), resealed, REQ)  # the wire's reader signs with the token
    forged = pb.Trailer(sha256=resealed, payload_bytes=len(payload), hmac_sha256=by_token)
    with pytest.raises(ChecksumError, match="HMAC mismatch"):
        _stream(header, payload, forged).result(key=KEY, request=REQ)
    unsigned = pb.Trailer(sha256=resealed, payload_bytes=len(payload))
    with pytest.raises(ChecksumError, match="not signed"):
        _stream(header, payload, unsigned).result(key=KEY, request=REQ)


@pytest.mark.parametrize(
    "other",
    [
        pb.CompactRequest(request_id="r2", fit_round=0, spec_json=REQ.spec_json),  # a replay
        pb.CompactRequest(request_id="r1", fit_round=1, spec_json=REQ.spec_json),  # as a refit
        pb.CompactRequest(request_id="r1", fit_round=0, spec_json='{"method": "gvote"}'),
    ],
)
def test_a_signed_result_answers_its_own_request_only(other: pb.CompactRequest) -> None:
    header, payload, digest = encode_prefix(make_prefix([[2, 3], [1, 2]]))
    trailer = pb.Trailer(sha256=digest, payload_bytes=len(payload),
                         hmac_sha256=sign(KEY, digest, REQ))  # fmt: skip
    assert _stream(header, payload, trailer).result(key=KEY, request=REQ).num_layers == 2
    with pytest.raises(ChecksumError, match="HMAC mismatch"):
        _stream(header, payload, trailer).result(key=KEY, request=other)


@pytest.fixture(scope="module")
def signed_server(prepared_model: Path) -> Any:
    with running_server(prepared_model, auth_token=TOKEN, signing_key=KEY.decode()) as (srv, _):
        yield srv


def test_a_real_service_signs_and_a_swapping_proxy_is_refused(
    signed_server: Any, model_fp: str
) -> None:
    ep = f"127.0.0.1:{signed_server.port}"
    key = KEY.decode()
    with CompactorClient(ep, auth_token=TOKEN, signing_key=key) as c:
        res = c.compact_prefix(PREFIX, model_fp, FAST, timeout=120)
    assert res.prefix.num_layers == 30
    with HostileProxy(ep) as proxy, CompactorClient(proxy.address, auth_token=TOKEN,
                                                    signing_key=key) as c:  # fmt: skip
        proxy.expect("swap")
        with pytest.raises(ChecksumError, match="HMAC mismatch"):
            c.compact_prefix(PREFIX, model_fp, FAST, timeout=120)
        assert [call.mode for call in proxy.calls] == ["swap"]

"""TLS (certificates generated here with openssl, mutual TLS) and the bearer token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from compactor.client import CompactorClient, TlsFiles
from compactor.service.server import TlsConfig
from tests._certs import make_certs
from tests.compactor.service._fixtures import FAST, PREFIX, running_server

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def server(prepared_model: Path, certs: Path) -> Any:
    tls = TlsConfig(certs / "server.pem", certs / "server.key", client_ca=certs / "ca.pem")
    with running_server(prepared_model, tls=tls, auth_token=TOKEN) as (srv, _lt):
        yield srv


def test_mtls_with_token_works(server: Any, certs: Path, model_fp: str) -> None:
    tls = TlsFiles(certs / "ca.pem", certs / "client.pem", certs / "client.key")
    with CompactorClient(f"127.0.0.1:{server.port}", tls=tls, auth_token=TOKEN) as c:
        assert c.model_info().model_fingerprint == model_fp
        res = c.compact_prefix(PREFIX, model_fp, FAST, timeout=120)
    assert res.prefix.logical_length == len(PREFIX)


@pytest.mark.parametrize("token", [None, "wrong"])
def test_request_without_the_token_is_refused(
    server: Any, certs: Path, model_fp: str, token: Any
) -> None:
    tls = TlsFiles(certs / "ca.pem", certs / "client.pem", certs / "client.key")
    reg = server.service.metrics.registry
    before = reg.get_sample_value("compactor_compactions_total")
    with CompactorClient(f"127.0.0.1:{server.port}", tls=tls, auth_token=token) as c:
        with pytest.raises(grpc.RpcError) as info:
            c.compact_prefix(PREFIX, model_fp, FAST, timeout=30)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:
            c.model_info()
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # refused before any work was queued
    assert reg.get_sample_value("compactor_compactions_total") == before


def test_client_without_certificate_is_refused(server: Any, certs: Path) -> None:
    from compactor.client import RetryPolicy

    no_cert = TlsFiles(certs / "ca.pem")
    with (
        CompactorClient(
            f"127.0.0.1:{server.port}", tls=no_cert, auth_token=TOKEN, retry=RetryPolicy(attempts=1)
        ) as c,
        pytest.raises(grpc.RpcError) as info,
    ):
        c.model_info(timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_plaintext_client_is_refused(server: Any) -> None:
    with (
        CompactorClient(f"127.0.0.1:{server.port}", auth_token=TOKEN) as c,
        pytest.raises(grpc.RpcError) as info,
    ):
        c.model_info(timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_tenants_are_kept_apart(server: Any, certs: Path, model_fp: str) -> None:
    """Two mTLS identities asking for the same prefix and spec: tenant B never gets tenant A's
    result (no cache hit, no shared flight, a compaction of its own), so what A sends first
    (crafted follow-ups) does not decide what B gets, while A still shares its own results."""
    from dataclasses import replace

    def client(name: str) -> CompactorClient:
        tls = TlsFiles(certs / "ca.pem", certs / f"{name}.pem", certs / f"{name}.key")
        return CompactorClient(f"127.0.0.1:{server.port}", tls=tls, auth_token=TOKEN)

    ids = [(i * 31 + 7) % 40000 + 100 for i in range(64)]
    spec = replace(FAST, queries=replace(FAST.queries, sources=("follow-up",)))
    crafted = [[101, 102, 103] * 5]
    honest = [[ids[3], ids[9], 5000, 5001]]
    reg = server.service.metrics.registry
    before = reg.get_sample_value("compactor_compactions_total") or 0.0
    with client("client") as a, client("client-b") as b:
        first = a.compact_prefix(ids, model_fp, spec, follow_ups=crafted, timeout=120)
        again_a = a.compact_prefix(ids, model_fp, spec, follow_ups=honest, timeout=120)
        got_b = b.compact_prefix(ids, model_fp, spec, follow_ups=honest, timeout=120)
    assert not first.cache_hit and again_a.cache_hit  # one tenant shares its own results
    assert not got_b.cache_hit and not got_b.shared
    assert reg.get_sample_value("compactor_compactions_total") == before + 2
    assert any(
        not torch.equal(x.keys, y.keys) for x, y in zip(first.prefix.layers, got_b.prefix.layers)
    )


def test_the_health_probe_presents_a_client_certificate_under_mtls(
    server: Any, certs: Path
) -> None:
    """deploy/docker/healthcheck.py (what the k8s probes exec) gets SERVING from a server that
    requires client certificates only when it presents one."""
    import importlib.util

    from tests.deploy._deploy import DEPLOY

    spec = importlib.util.spec_from_file_location("hc", DEPLOY / "docker/healthcheck.py")
    hc = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(hc)  # type: ignore[union-attr]
    base = ["--address", f"127.0.0.1:{server.port}", "--tls-ca", str(certs / "ca.pem"),
            "--tls-server-name", "localhost", "--timeout", "5"]  # fmt: skip
    assert hc.check(hc.build_parser().parse_args(base)) == 1  # no certificate: refused
    mtls = [*base, "--tls-cert", str(certs / "client.pem"), "--tls-key", str(certs / "client.key")]
    assert hc.check(hc.build_parser().parse_args(mtls)) == 0
    assert hc.check(hc.build_parser().parse_args([*base, "--tls-cert", "x"])) == 2

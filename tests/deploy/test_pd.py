"""The PD overlay (deploy/k8s/overlays/pd): a stock prefill server, a decode server with exactly
the settings the plugin accepts, sglang-router in front of both with their Service URLs and
prefill's bootstrap port, and NetworkPolicies that let only the right pods reach each port.
Command lines parse with the real SGLang + plugin parser and sglang-router's own parser
(skipped, naming `make pd-deps`, where sglang-router is not installed)."""

from __future__ import annotations

from typing import Any

import pytest

from sglang_ext.adapter.pd import check_disaggregation
from tests.deploy._deploy import (
    DEPLOY,
    K8S,
    check_argv,
    classify,
    container_argvs,
    ingress_allowed,
    render_kustomization,
    router_parser,
    sglang_servers,
)

PD = K8S / "overlays" / "pd"
MONITORING = {"kubernetes.io/metadata.name": "monitoring"}
PROMETHEUS = {"app.kubernetes.io/name": "prometheus"}
CLIENT = {"sglang-client": "true"}
RUNTIME_PORTS = (12345, 49152, 65000)  # ZMQ rank / Mooncake RPC and transfer: chosen at run time


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return render_kustomization(PD)


def _deployment(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (dep,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == name]
    return dep


def _service_for(docs: list[dict[str, Any]], dep: dict[str, Any]) -> dict[str, Any]:
    labels = dep["spec"]["template"]["metadata"]["labels"]
    (svc,) = [
        d
        for d in docs
        if d["kind"] == "Service" and d["spec"]["selector"].items() <= labels.items()
    ]
    return svc


def _servers(docs: list[dict[str, Any]]) -> dict[str, tuple[dict[str, Any], Any]]:
    """disaggregation mode -> (Deployment, parsed SGLang + plugin arguments)."""
    out = {}
    for dep, c in sglang_servers(docs):
        (argv,) = [a for a in container_argvs(c) if (k := classify(a)) and k[0] == "sglang"]
        ns: Any = check_argv(*classify(argv))  # type: ignore[misc]
        out[ns.disaggregation_mode] = (dep, ns)
    return out


def _router(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    dep = _deployment(docs, "sglang-router")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    (argv,) = container_argvs(c)
    cl = classify(argv)
    assert cl is not None and cl[0] == "sglang-router", argv
    return dep, cl[1]


def _labels(dep: dict[str, Any]) -> dict[str, str]:
    return dict(dep["spec"]["template"]["metadata"]["labels"])


def test_only_the_pd_servers_serve(docs: list[dict[str, Any]]) -> None:
    """base/'s single server is gone; one prefill and one decode server, one pod each (a
    Service per server: the router addresses each, decode dials the bootstrap by its host)."""
    servers = _servers(docs)
    assert set(servers) == {"prefill", "decode"}
    names = {d["metadata"]["name"] for d in docs if d["kind"] in ("Deployment", "Service")}
    assert "sglang" not in names
    assert not [d for d in docs if d["metadata"]["name"] == "sglang-http"]
    for dep, _ in servers.values():
        assert dep["spec"]["replicas"] == 1, dep["metadata"]["name"]


def test_prefill_is_stock_and_decode_is_set_up_as_the_plugin_needs(
    docs: list[dict[str, Any]],
) -> None:
    servers = _servers(docs)
    (_, pre), (_, dec) = servers["prefill"], servers["decode"]
    assert pre.compaction_endpoint is None  # the plugin is installed, inactive: never compacts
    check_disaggregation(dec)  # the plugin's own check (ValueError naming the flag)
    assert dec.disaggregation_decode_enable_radix_cache
    assert dec.disaggregation_decode_retraction_backup == "cpu_tensor"
    assert not dec.enable_hierarchical_cache
    assert dec.disaggregation_transfer_backend == pre.disaggregation_transfer_backend
    assert pre.disaggregation_transfer_backend in ("mooncake", "mooncake_tcp")
    # the plugin's check refuses the same flags on prefill
    with pytest.raises(ValueError, match="--disaggregation-mode 'prefill'"):
        check_disaggregation(pre)


def test_services_and_ports_agree(docs: list[dict[str, Any]]) -> None:
    servers = _servers(docs)
    for mode, (dep, ns) in servers.items():
        (c,) = dep["spec"]["template"]["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        svc = {p["name"]: p for p in _service_for(docs, dep)["spec"]["ports"]}
        assert ports["http"] == svc["http"]["targetPort"] == ns.port
        if mode == "prefill":
            boot = ns.disaggregation_bootstrap_port
            assert ports["bootstrap"] == svc["bootstrap"]["targetPort"] == boot
        env = {e["name"]: e for e in c["env"]}
        assert env["SGLANG_HOST_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def test_router_command_names_both_servers(docs: list[dict[str, Any]]) -> None:
    """Parsed with sglang-router 0.3.2's own parser (RouterArgs.add_cli_args)."""
    if router_parser() is None:
        pytest.skip("sglang-router is not installed: run `make pd-deps`")
    from sglang_router.router_args import RouterArgs

    servers = _servers(docs)
    dep, args = _router(docs)
    r = RouterArgs.from_cli_args(check_argv("sglang-router", args), use_router_prefix=False)
    assert r.pd_disaggregation and not r.mini_lb and not r.service_discovery
    pdep, pns = servers["prefill"]
    ddep, dns = servers["decode"]
    psvc, dsvc = _service_for(docs, pdep), _service_for(docs, ddep)
    assert r.prefill_urls == [
        (f"http://{psvc['metadata']['name']}:{pns.port}", pns.disaggregation_bootstrap_port)
    ]
    assert r.decode_urls == [f"http://{dsvc['metadata']['name']}:{dns.port}"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": r.port, "metrics": r.prometheus_port}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[kind]["httpGet"]["port"] == r.port
    start = c["startupProbe"]  # outlasts the router's own wait for its servers
    assert start["periodSeconds"] * start["failureThreshold"] >= r.worker_startup_timeout_secs
    ann = dep["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/port"] == str(r.prometheus_port)
    svc = {p["name"]: p["targetPort"] for p in _service_for(docs, dep)["spec"]["ports"]}
    assert svc == {"http": r.port, "metrics": r.prometheus_port}


def test_network_policies_admit_exactly_the_pd_paths(docs: list[dict[str, Any]]) -> None:
    servers = _servers(docs)
    (pdep, pns), (ddep, dns) = servers["prefill"], servers["decode"]
    pre, dec = _labels(pdep), _labels(ddep)
    router = _labels(_deployment(docs, "sglang-router"))
    (head,) = [d for d in docs if d["kind"] == "RayCluster"]
    compactor = {"ray.io/cluster": head["metadata"]["name"], "ray.io/node-type": "head"}
    grpc = int(dns.compaction_endpoint.rsplit(":", 1)[1])
    boot = pns.disaggregation_bootstrap_port

    def ok(src: dict[str, str], dst: dict[str, str], port: int, ns: Any = None) -> bool:
        return ingress_allowed(docs, src, dst, port, ns)

    # clients -> router only
    assert ok(CLIENT, router, 30000)
    for dst, port in ((pre, pns.port), (dec, dns.port), (pre, boot), (compactor, grpc)):
        assert not ok(CLIENT, dst, port), (dst, port)
    # router -> prefill and decode HTTP and prefill's bootstrap, nothing else
    assert ok(router, pre, pns.port) and ok(router, dec, dns.port) and ok(router, pre, boot)
    assert not ok(router, compactor, grpc)
    for port in RUNTIME_PORTS:
        assert not ok(router, pre, port) and not ok(router, dec, port)
    # decode -> prefill: bootstrap and the run-time transfer ports; prefill -> decode: transfer
    assert ok(dec, pre, boot)
    for port in RUNTIME_PORTS:
        assert ok(dec, pre, port) and ok(pre, dec, port)
    # decode -> compactor gRPC; prefill never
    assert ok(dec, compactor, grpc) and not ok(pre, compactor, grpc)
    # nobody else reaches the bootstrap or transfer ports
    for src in (CLIENT, {"app.kubernetes.io/name": "other"}):
        assert not ok(src, pre, boot) and not ok(src, dec, RUNTIME_PORTS[0])
    assert not ok(PROMETHEUS, pre, boot, MONITORING)
    # Prometheus (its namespace) scrapes every /metrics port, from no other namespace
    r_metrics = int(_deployment(docs, "sglang-router")["spec"]["template"]["metadata"][
        "annotations"]["prometheus.io/port"])  # fmt: skip
    for dst, port in ((pre, pns.port), (dec, dns.port), (router, r_metrics)):
        assert ok(PROMETHEUS, dst, port, MONITORING)
        assert not ok(PROMETHEUS, dst, port, {"kubernetes.io/metadata.name": "default"})


def test_image_installs_mooncake_and_the_router_pinned() -> None:
    """The PD pods run the sglang-compaction image: it must carry the Mooncake transfer engine
    (CUDA wheel) and sglang-router, at fixed versions."""
    text = (DEPLOY / "docker" / "sglang.Dockerfile").read_text()
    assert '"mooncake-transfer-engine==0.3.13.post1"' in text
    assert '"sglang-router==0.3.2"' in text
    for lib in ("libibverbs1", "libnuma1"):
        assert lib in text

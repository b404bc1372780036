"""The deploy manifests keep the compaction pool closed: Ray token auth on every Ray process,
the Ray dashboard on loopback, no Ray port reachable from outside the pool (NetworkPolicy),
gRPC only from SGLang, each Secret key mounted only where it is read, and no plaintext
`compactor serve` on a non-loopback address without an explicit --insecure."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from compactor.endpoints import is_loopback
from tests.deploy._deploy import (
    DEPLOY,
    OVERLAYS,
    check_argv,
    classify,
    compaction_clients,
    container_argvs,
    dockerfile_argv,
    load_yaml_docs,
    pod_specs,
    render_kustomization,
    sglang_servers,
    split_shell,
)

RAY_CLUSTER = "compaction-pool"
# the labels KubeRay puts on the pool's pods
RAY_PODS = {
    "ray-head": {"ray.io/cluster": RAY_CLUSTER, "ray.io/node-type": "head"},
    "ray-gpu": {"ray.io/cluster": RAY_CLUSTER, "ray.io/node-type": "worker"},
    "ray-cpu": {"ray.io/cluster": RAY_CLUSTER, "ray.io/node-type": "worker"},
}
OPEN_PORTS = {50051: "sglang", 9090: "prometheus"}  # the head's only ports for other pods
SECRET_EXAMPLE = DEPLOY / "k8s" / "base" / "secret.example.yaml"


@pytest.fixture(scope="module", params=OVERLAYS, ids=lambda p: f"overlay-{p.name}")
def docs(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return render_kustomization(request.param)


def _ray(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (ray,) = [d for d in docs if d["kind"] == "RayCluster"]
    return ray


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def _mounted_secret_files(spec: dict[str, Any], c: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """path -> (Secret, key) for every Secret item container `c` of pod `spec` mounts."""
    vols = {v["name"]: v for v in spec.get("volumes", [])}
    out = {}
    for m in c.get("volumeMounts", []):
        sec = vols[m["name"]].get("secret")
        for item in (sec or {}).get("items", []):
            out[f"{m['mountPath']}/{item['path']}"] = (sec["secretName"], item["key"])
    return out


def test_every_ray_container_has_token_auth(docs: list[dict[str, Any]]) -> None:
    """Token auth on, the token read from a mounted Secret file: never an env var, which every
    process Ray starts would inherit."""
    documented = {d["metadata"]["name"]: d for d in load_yaml_docs(SECRET_EXAMPLE)}
    for name, spec in pod_specs(docs):
        if name not in RAY_PODS:
            continue
        for c in spec["containers"]:
            env = _env(c)
            assert env.get("RAY_AUTH_MODE") == "token", f"{name}: Ray auth is off"
            assert "RAY_AUTH_TOKEN" not in env, f"{name}: the Ray token is an env var"
            secret, key = _mounted_secret_files(spec, c)[env["RAY_AUTH_TOKEN_PATH"]]
            assert key in documented[secret]["stringData"], name


def test_the_dashboard_stays_on_loopback(docs: list[dict[str, Any]]) -> None:
    ray = _ray(docs)
    assert is_loopback(ray["spec"]["headGroupSpec"]["rayStartParams"]["dashboard-host"])
    for name, spec in pod_specs(docs):
        for c in spec["containers"]:
            ports = {p["containerPort"] for p in c.get("ports", [])}
            assert 8265 not in ports, f"{name}: the Ray dashboard port is exposed"


def _selects(policy: dict[str, Any], labels: dict[str, str]) -> bool:
    return policy["spec"]["podSelector"].get("matchLabels", {}).items() <= labels.items()


def test_no_ray_port_is_reachable_from_outside_the_pool(docs: list[dict[str, Any]]) -> None:
    """Every pod of the pool is selected by a policy (so it is isolated); a rule without a
    port list admits the pool's own pods only; other rules open only the gRPC port to SGLang
    and the metrics port to Prometheus."""
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    # the SGLang servers with --compaction-endpoint (PD: decode only, never prefill)
    clients = [d["spec"]["template"]["metadata"]["labels"] for d, _ in compaction_clients(docs)]
    assert clients
    for name, _spec in pod_specs(docs):
        if name not in RAY_PODS:
            continue
        mine = [p for p in policies if _selects(p, RAY_PODS[name])]
        assert mine, f"{name}: no NetworkPolicy selects it: every port is open"
        for rule in (r for p in mine for r in p["spec"].get("ingress", [])):
            sources = rule.get("from")
            assert sources, f"{name}: an ingress rule admits every source"
            if "ports" not in rule:
                for src in sources:
                    assert set(src) == {"podSelector"}, f"{name}: {src} reaches every Ray port"
                    assert src["podSelector"]["matchLabels"]["ray.io/cluster"] == RAY_CLUSTER
                continue
            for port in rule["ports"]:
                assert port["port"] in OPEN_PORTS, f"{name}: port {port['port']} opened"
                if OPEN_PORTS[port["port"]] == "sglang":
                    assert [s["podSelector"]["matchLabels"] for s in sources] == clients


def test_each_pod_mounts_only_the_secret_keys_it_reads(docs: list[dict[str, Any]]) -> None:
    for name, spec in pod_specs(docs):
        for vol in spec.get("volumes", []):
            if "secret" in vol:
                items = vol["secret"].get("items")
                assert items, f"{name}: the whole Secret {vol['secret']['secretName']} is mounted"
                if name != "ray-head":
                    assert "tls.key" not in {i["key"] for i in items}, name
        if name.startswith("ray-") and name != "ray-head":  # the Ray token, nothing else
            secrets = [v["secret"] for v in spec.get("volumes", []) if "secret" in v]
            assert [(s["secretName"], [i["key"] for i in s["items"]]) for s in secrets] == [
                ("ray-auth", ["auth_token"])
            ], name


def _serve_argvs() -> list[list[str]]:
    """Every `compactor serve` command line in deploy/ (Dockerfiles, compose, Ray, k8s)."""
    argvs = [dockerfile_argv(p) for p in (DEPLOY / "docker").glob("compactor*.Dockerfile")]
    compose = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())
    argvs.append(["compactor", "serve", *compose["services"]["compactor"]["command"]])
    ray = yaml.safe_load((DEPLOY / "ray" / "cluster.yaml").read_text())
    for script in ray["head_start_ray_commands"]:
        argvs += split_shell(script)
    for overlay in OVERLAYS:
        for _, spec in pod_specs(render_kustomization(overlay)):
            for c in spec["containers"]:
                argvs += container_argvs(c)
    return [a for a in argvs if (c := classify(a)) and c[0] == "compactor" and a[1:2] == ["serve"]]


def test_no_plaintext_service_on_an_open_address() -> None:
    argvs = _serve_argvs()
    assert len(argvs) >= 5, argvs
    for argv in argvs:
        ns = check_argv(*classify(argv))  # type: ignore[misc]
        if not is_loopback(ns.host):
            assert ns.tls_cert is not None or ns.insecure, json.dumps(argv)


def test_ray_launcher_config_is_closed() -> None:
    ray = yaml.safe_load((DEPLOY / "ray" / "cluster.yaml").read_text())
    scripts = [*ray["head_start_ray_commands"], *ray["worker_start_ray_commands"]]
    starts = [s for s in scripts if "ray start" in s]
    assert len(starts) == 2
    for script in starts:
        assert "RAY_AUTH_MODE=token" in script and "RAY_AUTH_TOKEN_PATH=" in script, script
        assert "--dashboard-host=0.0.0.0" not in script
    assert "--dashboard-host=127.0.0.1" in starts[0]


def test_pods_are_hardened(docs: list[dict[str, Any]]) -> None:
    """No pod runs as root, escalates privileges, writes its root filesystem, keeps a Linux
    capability, runs without the runtime's seccomp profile, or holds a service-account token."""
    for name, spec in pod_specs(docs):
        assert spec.get("automountServiceAccountToken") is False, name
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] != 0, name
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, name
            assert sc["readOnlyRootFilesystem"] is True, name
            assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"], name
            mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
            assert "/tmp" in mounts, f"{name}: a read-only root needs a writable /tmp"


def test_images_run_as_the_pods_user(docs: list[dict[str, Any]]) -> None:
    """Each image's final stage switches to a non-root USER before it starts anything, the
    uid the pods' securityContext runs as (so `docker run` and compose are not root either)."""
    uids = {spec["securityContext"]["runAsUser"] for _, spec in pod_specs(docs)}
    for path in sorted((DEPLOY / "docker").glob("*.Dockerfile")):
        final = path.read_text().rsplit("\nFROM ", 1)[1]
        users = [line.split()[1] for line in final.splitlines() if line.startswith("USER ")]
        assert users, f"{path.name}: the final stage runs as root"
        assert users[-1] not in ("0", "root") and {int(users[-1])} == uids, path.name
        assert final.index("USER ") < final.index("ENTRYPOINT"), path.name


def test_sglang_admin_endpoints_need_the_admin_key(docs: list[dict[str, Any]]) -> None:
    """--admin-api-key is set from the Secret: without it SGLang 0.5's admin-optional endpoints
    (/flush_cache, /update_weights_from_disk) answer any tenant."""
    documented = {d["metadata"]["name"]: d for d in load_yaml_docs(SECRET_EXAMPLE)}
    servers = sglang_servers(docs)
    assert servers
    for dep, c in servers:  # every SGLang server: single, PD prefill and decode
        (argv,) = [a for a in container_argvs(c) if (k := classify(a)) and k[0] == "sglang"]
        value = argv[argv.index("--admin-api-key") + 1]
        assert value.startswith("$(") and value.endswith(")"), dep["metadata"]["name"]
        ref = _env(c)[value[2:-1]]["secretKeyRef"]
        assert ref["key"] in documented[ref["name"]]["stringData"]


def _labels(dep: dict[str, Any]) -> dict[str, str]:
    return dict(dep["spec"]["template"]["metadata"]["labels"])


def test_sglang_and_metrics_ingress_are_closed(docs: list[dict[str, Any]]) -> None:
    """A policy selects each SGLang server's pods and opens only its HTTP port, to named
    clients (PD prefill: also its bootstrap port, to pods named by label only); only a PD
    server's peer (prefill <-> decode) reaches its other ports (Mooncake's, chosen at run
    time), with no port list; every Prometheus rule names its namespace (an empty
    namespaceSelector admits all of them)."""
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    servers = sglang_servers(docs)
    modes: dict[str, Any] = {}  # name -> parsed arguments
    for dep, c in servers:
        (argv,) = [a for a in container_argvs(c) if (k := classify(a)) and k[0] == "sglang"]
        modes[dep["metadata"]["name"]] = check_argv(*classify(argv))  # type: ignore[misc]
    peer_of = {"prefill": "decode", "decode": "prefill"}
    for dep, _c in servers:
        name, labels = dep["metadata"]["name"], _labels(dep)
        ns = modes[name]
        peers = [
            _labels(d)
            for d, _ in servers
            if modes[d["metadata"]["name"]].disaggregation_mode
            == peer_of.get(ns.disaggregation_mode)
        ]
        mine = [p for p in policies if _selects(p, labels)]
        assert mine, f"no NetworkPolicy selects {name}: every port is open to every pod"
        for rule in (r for p in mine for r in p["spec"]["ingress"]):
            assert rule["from"], f"{name}: a rule admits every source"
            if "ports" in rule:  # HTTP; on prefill its bootstrap port too, to the router only
                ports = [p["port"] for p in rule["ports"]]
                allowed = [[ns.port]]
                if ns.disaggregation_mode == "prefill":
                    allowed.append([ns.disaggregation_bootstrap_port])
                assert ports in allowed, f"{name}: ports {ports} opened"
                if ports != [ns.port]:
                    assert [set(src) for src in rule["from"]] == [{"podSelector"}], name
            else:  # every port: the PD peer's pods only
                assert peers, f"{name}: a rule without ports on a server with no PD peer"
                for src in rule["from"]:
                    assert set(src) == {"podSelector"}, f"{name}: {src} reaches every port"
                    assert src["podSelector"]["matchLabels"] in peers, name
    for rule in (r for p in policies for r in p["spec"]["ingress"]):
        for src in rule["from"]:
            if "namespaceSelector" in src:
                assert src["namespaceSelector"].get("matchLabels"), src


def test_ray_launcher_workers_mount_only_the_ray_token() -> None:
    docker = yaml.safe_load((DEPLOY / "ray" / "cluster.yaml").read_text())["docker"]
    assert not any("/etc/compactor" in o for o in docker["run_options"])
    assert docker["worker_run_options"] == [
        "-v /etc/compactor/ray-token:/etc/compactor/ray-token:ro"
    ]
    assert any("/etc/compactor:/etc/compactor:ro" in o for o in docker["head_run_options"])

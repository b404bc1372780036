"""deploy/ stays consistent with the code: every file parses, every command line parses with
the real CLI parser, ports/probes/Secrets agree across files, Ray resources match the pool's.
No docker engine or cluster needed (CI: 2 CPU cores)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from compactor.workers.pool import ACTOR_GPUS_PER_WORKER, ACTOR_NUM_CPUS
from tests.deploy._deploy import (
    DEPLOY,
    K8S,
    OVERLAYS,
    check_argv,
    classify,
    compaction_clients,
    container_argvs,
    dockerfile_argv,
    dockerfile_healthcheck,
    dockerfile_instructions,
    load_yaml_docs,
    pod_specs,
    probe_argvs,
    render_kustomization,
    router_parser,
    split_shell,
)

DOCKERFILES = sorted((DEPLOY / "docker").glob("*.Dockerfile"))
YAML_FILES = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])
COMPOSE = DEPLOY / "compose" / "compose.yaml"
RAY_CLUSTER = DEPLOY / "ray" / "cluster.yaml"
SECRET_EXAMPLE = K8S / "base" / "secret.example.yaml"
ROOT = DEPLOY.parent


def _ns(argvs: list[list[str]], program: str) -> list[Any]:
    out = []
    for argv in argvs:
        c = classify(argv)
        if c and c[0] == program:
            out.append(check_argv(*c))
    return out


def _one(argvs: list[list[str]], program: str) -> Any:
    found = _ns(argvs, program)
    assert len(found) == 1, f"expected one {program} command in {argvs}"
    return found[0]


def _secret(name: str) -> Any:
    """The Secret `name` as secret.example.yaml documents it."""
    (doc,) = [d for d in load_yaml_docs(SECRET_EXAMPLE) if d["metadata"]["name"] == name]
    return doc


def _image_dockerfile(image: str) -> Path:
    """compactor:cpu -> compactor-cpu.Dockerfile; registry/x/sglang-compaction:gpu -> sglang.Dockerfile."""
    name, _, tag = image.rpartition("/")[2].partition(":")
    stem = {"sglang-compaction": "sglang"}.get(name, name)
    return DEPLOY / "docker" / (f"{stem}-cpu.Dockerfile" if tag == "cpu" else f"{stem}.Dockerfile")


def test_deploy_tree_has_the_expected_parts() -> None:
    assert {p.name for p in DOCKERFILES} == {
        "compactor.Dockerfile",
        "compactor-cpu.Dockerfile",
        "sglang.Dockerfile",
        "sglang-cpu.Dockerfile",
    }
    assert {p.name for p in OVERLAYS} == {"cpu-dev", "gpu", "pd"}
    assert (DEPLOY / "README.md").is_file() and COMPOSE.is_file() and RAY_CLUSTER.is_file()


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_yaml_parses(path: Path) -> None:
    docs = load_yaml_docs(path)
    assert docs, f"{path} is empty"


# ---- Dockerfiles -----------------------------------------------------------------------------
@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_entrypoint_and_healthcheck_parse_with_real_cli(path: Path) -> None:
    argv = dockerfile_argv(path)
    c = classify(argv)
    assert c is not None, f"{path.name}: unexpected ENTRYPOINT {argv}"
    check_argv(*c)
    health = dockerfile_healthcheck(path)
    assert health is not None, f"{path.name}: no HEALTHCHECK"
    if c[0] == "compactor":
        check_argv(*classify(health))  # type: ignore[misc]
    else:
        assert health[-1].endswith("/health")


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_copies_existing_paths_and_has_ignore_file(path: Path) -> None:
    args = {}
    stages = set()
    for word, rest in dockerfile_instructions(path):
        if word == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            args[k] = v
        elif word == "FROM" and " AS " in rest:
            stages.add(rest.split(" AS ")[1].strip())
        elif word == "COPY":
            parts = rest.split()
            if parts[0].startswith("--from="):
                assert parts[0].split("=", 1)[1] in stages
                continue
            for src in parts[:-1]:
                src = src.replace("${MODEL_SRC}", args.get("MODEL_SRC", ""))
                assert (ROOT / src).exists(), f"{path.name}: COPY source {src} missing"
    assert Path(f"{path}.dockerignore").is_file()
    text = path.read_text()
    # The pure-torch sgl_kernel stand-in belongs on CPU images only.
    assert ("sgl-kernel-cpu" in text) == path.name.endswith("-cpu.Dockerfile")


# ---- compose + Prometheus ----------------------------------------------------------------------
def test_compose_commands_ports_secrets_and_prometheus_agree() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    entry = {}
    for name in ("compactor", "sglang"):
        svc = services[name]
        dockerfile = _image_dockerfile(svc["image"])
        ep = [
            a
            for w, r in dockerfile_instructions(dockerfile)
            if w == "ENTRYPOINT"
            for a in json.loads(r)
        ]
        entry[name] = c = classify(ep + svc["command"])
        assert c is not None
        check_argv(*c)
        for s in svc.get("secrets", []):
            assert s in compose["secrets"], f"{name}: undefined secret {s}"
        if name == "compactor":  # the healthcheck script parses too
            check_argv(*classify(svc["healthcheck"]["test"][1:]))  # type: ignore[misc]
    srv = check_argv(*entry["compactor"])
    sgl = check_argv(*entry["sglang"])
    assert srv.auth_token_file == Path("/run/secrets/compactor-token")
    assert sgl.compaction_token_file == "/run/secrets/compactor-token"
    # results signed with a key both sides read from one secret, never sent
    assert (
        str(srv.signing_key_file) == sgl.compaction_signing_key_file == "/run/secrets/signing-key"
    )
    assert sgl.compaction_endpoint == f"compactor:{srv.port}"
    assert services["sglang"]["healthcheck"]["test"][-1] == f"http://127.0.0.1:{sgl.port}/health"
    hc = check_argv(*classify(services["compactor"]["healthcheck"]["test"][1:]))
    assert hc.address.endswith(f":{srv.port}")
    prom_mount = services["prometheus"]["volumes"][0].split(":")[0]
    prom = yaml.safe_load((COMPOSE.parent / prom_mount).read_text())
    targets = {
        j["job_name"]: (j["static_configs"][0]["targets"], j["metrics_path"])
        for j in prom["scrape_configs"]
    }
    assert targets["compactor"] == ([f"compactor:{srv.metrics_port}"], "/metrics")
    assert targets["sglang"] == ([f"sglang:{sgl.port}"], "/metrics")
    assert sgl.enable_metrics


# ---- Ray cluster launcher ------------------------------------------------------------------------
def test_ray_cluster_config_matches_schema_and_worker_resources() -> None:
    import ray.autoscaler

    cfg = yaml.safe_load(RAY_CLUSTER.read_text())
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(cfg, schema)

    cmds = {
        k: [c for s in cfg[k] for c in split_shell(s)]
        for k in (
            "head_start_ray_commands",
            "worker_start_ray_commands",
            "setup_commands",
            "initialization_commands",
        )
    }
    every = [c for v in cmds.values() for c in v]
    for argv in every:
        if classify(argv):
            check_argv(*classify(argv))  # type: ignore[misc]
    serve = _one(cmds["head_start_ray_commands"], "compactor")
    wait = _one(cmds["head_start_ray_commands"], "ray/wait_for_gpus.py")
    assert serve.ray_address == "auto" and not serve.in_process
    head_start = next(a for a in cmds["head_start_ray_commands"] if a[:2] == ["ray", "start"])
    assert "--num-cpus=0" in head_start and "--num-gpus=0" in head_start  # no actor on the head

    nodes = cfg["available_node_types"]
    worker = nodes["gpu_worker"]
    gpus, cpus = worker["resources"]["GPU"], worker["resources"]["CPU"]
    start = next(a for a in cmds["worker_start_ray_commands"] if a[:2] == ["ray", "start"])
    assert f"--num-gpus={gpus}" in start and f"--num-cpus={cpus}" in start
    actors_per_node = gpus // ACTOR_GPUS_PER_WORKER
    assert actors_per_node >= 1 and cpus >= actors_per_node * ACTOR_NUM_CPUS
    assert serve.workers == worker["min_workers"] * actors_per_node
    assert wait.gpus == serve.workers * ACTOR_GPUS_PER_WORKER
    assert nodes[cfg["head_node_type"]]["resources"] == {"CPU": 0, "GPU": 0}


# ---- Kubernetes ----------------------------------------------------------------------------------
def test_kustomizations_reference_existing_files() -> None:
    for kfile in K8S.rglob("kustomization.yaml"):
        kust = yaml.safe_load(kfile.read_text())
        for ref in [*kust.get("resources", []), *(p["path"] for p in kust.get("patches", []))]:
            assert (kfile.parent / ref).exists(), f"{kfile}: {ref} missing"


@pytest.fixture(scope="module", params=OVERLAYS, ids=lambda p: f"overlay-{p.name}")
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param.name, render_kustomization(request.param)  # patch targets must exist


def _by_kind(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def test_k8s_commands_and_probes_parse_with_real_cli(rendered: Any) -> None:
    _, docs = rendered
    seen = set()
    for _, spec in pod_specs(docs):
        for c in spec["containers"]:
            assert c.get("resources", {}).get("requests"), f"{c['name']}: no resource requests"
            for argv in container_argvs(c) + probe_argvs(c):
                cl = classify(argv)
                if cl and cl[0] == "sglang-router" and router_parser() is None:
                    continue  # tests/deploy/test_pd.py skips, naming `make pd-deps`
                if cl:
                    check_argv(*cl)
                    seen.add(cl[0])
    assert {"compactor", "sglang", "docker/healthcheck.py"} <= seen


def test_k8s_ports_probes_endpoint_and_secrets_agree(rendered: Any) -> None:
    overlay, docs = rendered
    ray = _by_kind(docs, "RayCluster", "compaction-pool")
    head = ray["spec"]["headGroupSpec"]["template"]["spec"]
    (head_c,) = head["containers"]
    srv = _one(container_argvs(head_c), "compactor")
    ports = {p["name"]: p["containerPort"] for p in head_c["ports"]}
    assert ports["grpc"] == srv.port and ports["metrics"] == srv.metrics_port
    svc = _by_kind(docs, "Service", "compactor")
    assert svc["spec"]["selector"] == {
        "ray.io/cluster": ray["metadata"]["name"],
        "ray.io/node-type": "head",
    }
    svc_ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert svc_ports["grpc"]["targetPort"] == srv.port
    assert svc_ports["metrics"]["targetPort"] == srv.metrics_port
    ann = ray["spec"]["headGroupSpec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/port"] == str(srv.metrics_port)
    assert ray["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    for probe in probe_argvs(head_c):
        hc = check_argv(*classify(probe))  # type: ignore[misc]
        assert hc.address == f"127.0.0.1:{srv.port}"
        assert (hc.tls_ca is not None) == (srv.tls_cert is not None)

    # the SGLang server that dials the service: `sglang` (single server), `sglang-decode` (PD)
    ((dep, sgl_c),) = compaction_clients(docs)
    pod = dep["spec"]["template"]
    sgl = _one(container_argvs(sgl_c), "sglang")
    assert sgl.enable_metrics
    assert {p["containerPort"] for p in sgl_c["ports"]} == {sgl.port}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert sgl_c[kind]["httpGet"] == {"path": "/health", "port": sgl.port}
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(sgl.port)
    (ssvc,) = [
        d
        for d in docs
        if d["kind"] == "Service"
        and d["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    ]
    assert ssvc["spec"]["ports"][0]["targetPort"] == sgl.port
    assert sgl.compaction_endpoint == f"{svc['metadata']['name']}:{svc_ports['grpc']['port']}"
    # TLS and token on both sides or neither.
    assert sgl.compaction_tls == (srv.tls_cert is not None)
    assert (sgl.compaction_token_file is None) == (srv.auth_token_file is None)
    # Results signed with a key both sides mount from the Secret (it never goes on the wire).
    assert srv.signing_key_file is not None and sgl.compaction_signing_key_file is not None

    # Every file a flag names comes from a Secret that secret.example.yaml documents.
    documented = {name: set(_secret(name)["stringData"]) for name in ("compactor-auth", "ray-auth")}
    for spec, files in (
        (
            head,
            [
                srv.tls_cert,
                srv.tls_key,
                srv.auth_token_file,
                srv.signing_key_file,
                *(check_argv(*classify(p)).tls_ca for p in probe_argvs(head_c)),
            ],
        ),  # type: ignore[misc]
        (
            pod["spec"],
            [sgl.compaction_tls_ca, sgl.compaction_token_file, sgl.compaction_signing_key_file],
        ),
    ):
        vols = {v["name"]: v for v in spec["volumes"]}
        provided = set()
        for c in spec["containers"]:
            for m in c.get("volumeMounts", []):
                sec = vols[m["name"]].get("secret")
                if not sec:
                    continue
                keys = documented[sec["secretName"]]
                items = [i["path"] for i in sec.get("items", [])] or sorted(keys)
                assert {i["key"] for i in sec.get("items", [])} <= keys
                provided |= {f"{m['mountPath']}/{k}" for k in items}
        for f in files:
            if f is not None:
                assert str(f) in provided, f"{overlay}: {f} is not mounted from the Secret"


def test_k8s_ray_resources_match_worker_code(rendered: Any) -> None:
    overlay, docs = rendered
    ray = _by_kind(docs, "RayCluster", "compaction-pool")
    head = ray["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # no actor on the head
    srv = _one(container_argvs(head["template"]["spec"]["containers"][0]), "compactor")
    assert srv.ray_address == "auto" and not srv.in_process
    (group,) = ray["spec"]["workerGroupSpecs"]
    gpus = int(group["rayStartParams"].get("num-gpus", "0"))
    cpus = int(group["rayStartParams"]["num-cpus"])
    res = group["template"]["spec"]["containers"][0]["resources"]
    assert int(res["limits"].get("nvidia.com/gpu", 0)) == gpus
    assert float(res["requests"]["cpu"]) >= cpus
    if gpus:
        per_pod = gpus // ACTOR_GPUS_PER_WORKER
        assert cpus >= per_pod * ACTOR_NUM_CPUS
        assert srv.workers == group["minReplicas"] * per_pod  # one actor per GPU
        wait = _one(
            container_argvs(head["template"]["spec"]["containers"][0]), "ray/wait_for_gpus.py"
        )
        assert wait.gpus == srv.workers * ACTOR_GPUS_PER_WORKER
    else:
        assert srv.workers <= group["minReplicas"] * cpus // ACTOR_NUM_CPUS
    want_tag = "cpu" if overlay == "cpu-dev" else "gpu"
    for _, spec in pod_specs(docs):
        for c in spec["containers"]:
            assert c["image"].endswith(f":{want_tag}"), c["image"]
            if (
                any("/models/model" in a for a in container_argvs(c) for a in a)
                and want_tag == "gpu"
            ):
                assert any(m["mountPath"] == "/models" for m in c.get("volumeMounts", []))


# ---- the deploy scripts ----------------------------------------------------------------------------
def test_healthcheck_script_against_a_real_health_server() -> None:
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from tests.deploy._deploy import script_parser

    spec = __import__("importlib.util").util.spec_from_file_location(
        "hc", DEPLOY / "docker/healthcheck.py"
    )
    module = __import__("importlib.util").util.module_from_spec(spec)
    spec.loader.exec_module(module)

    async def main() -> list[int]:
        server = grpc.aio.server()
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        parser = script_parser("docker/healthcheck.py")
        args = parser.parse_args(["--address", f"127.0.0.1:{port}", "--timeout", "2"])
        try:
            await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
            up = await asyncio.to_thread(module.check, args)
            await servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            down = await asyncio.to_thread(module.check, args)
        finally:
            await server.stop(None)
        gone = await asyncio.to_thread(module.check, args)
        return [up, down, gone]

    assert asyncio.run(main()) == [0, 1, 1]


def test_runbook_cites_cluster_sim_command_and_failure_modes() -> None:
    text = (DEPLOY / "README.md").read_text()
    assert "python -m benchmarks.offline.cluster_sim" in text
    for needle in (
        "UNAUTHENTICATED",
        "UNAVAILABLE",
        "compactor_worker_restarts",
        "sglang:compaction_fallbacks_total",
    ):
        assert needle in text

"""`compactor serve` on a Ray cluster started as the manifests start it (`harness.ray_cluster`).

A head with token auth and no CPUs (no actor lands there, as deployed), a second node joined
with `ray start --address` that alone offers a CPU, and a real `compactor serve` attached with
`--ray-address`: the compaction runs in the second node's actor; that node is killed
mid-job, a third joins, and the request is still answered; a driver without the token, or with
another one, is refused by the cluster.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from compactor.client import CompactorClient
from harness.launch import CompactorService
from harness.ray_cluster import RayNode, token_env, write_token
from tests.compactor.service._fixtures import (
    FAST,
    assert_same_prefix,
    compact_in_background,
    make_prefix,
)

pytestmark = pytest.mark.slow

REFUSED = "Authentication token is missing or incorrect"  # Ray's GCS, to a driver


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[Path, RayNode, RayNode, contextlib.ExitStack]]:
    """(token file, head, second node, the stack that stops them: enter more on it)."""
    token = write_token(tmp_path / "ray-token")
    temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: Ray keeps sockets there
    try:
        with contextlib.ExitStack() as stack:
            head = stack.enter_context(RayNode.head(tmp_path / "head.log", token, temp))
            node = stack.enter_context(RayNode.worker(tmp_path / "node-a.log", token, head.address))
            yield token, head, node, stack
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def _driver(address: str, token: Path | None) -> subprocess.CompletedProcess[str]:
    """A separate Python process that joins the cluster as a driver and counts its nodes."""
    code = (
        "import ray\n"
        f"ray.init(address={address!r}, include_dashboard=False, log_to_driver=False)\n"
        "print('nodes', len(ray.nodes()))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env |= token_env(token)
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180
    )


def _worker_pid(result: Any) -> int:
    """The pid in a result's `worker` ("host:pid", the process that computed it)."""
    return int(str(result.worker).rsplit(":", 1)[1])


def test_a_driver_needs_the_clusters_token(
    cluster: tuple[Path, RayNode, RayNode, Any], tmp_path: Path
) -> None:
    token, head, _, _ = cluster
    ok = _driver(head.address, token)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "nodes 2" in ok.stdout
    for bad in (None, write_token(tmp_path / "another-token")):
        refused = _driver(head.address, bad)
        assert refused.returncode != 0, f"a driver with token {bad} joined"
        assert REFUSED in refused.stderr, refused.stderr[-2000:]


def test_serve_on_the_cluster_survives_losing_its_node(
    cluster: tuple[Path, RayNode, RayNode, contextlib.ExitStack],
    tmp_path: Path,
    prepared_model: Path,
    model_fp: str,
    reference: Any,
) -> None:
    token, head, node_a, stack = cluster
    serve = CompactorService(
        prepared_model,
        tmp_path / "serve.log",
        workers=1,
        extra_args=["--ray-address", head.address, "--test-layer-delay-s", "0.4"],
        env=token_env(token),
    )
    stack.enter_context(serve)  # stopped before the nodes

    ids = make_prefix(30)
    with CompactorClient(serve.endpoint) as client:
        first = client.compact_prefix(ids, model_fp, FAST, timeout=300)
    assert_same_prefix(first.prefix, reference(ids))
    assert node_a.owns(_worker_pid(first)), f"{first.worker} is not on the second node"

    later = make_prefix(31)
    th, out = compact_in_background(serve.endpoint, later, model_fp, 400)
    time.sleep(5.0)  # inside the ~12 s layer loop (30 layers x 0.4 s)
    assert th.is_alive(), "the job ended before its node could be killed"
    node_a.stop()  # the whole node: raylet, agents, the actor
    node_b = stack.enter_context(RayNode.worker(tmp_path / "node-b.log", token, head.address))
    th.join(400)
    assert not th.is_alive(), "the request was never answered"
    assert "err" not in out, out.get("err")
    assert_same_prefix(out["res"].prefix, reference(later))
    assert node_b.owns(_worker_pid(out["res"])), f"{out['res'].worker} is not on the new node"

"""The tests' kustomize renderer (tests/deploy/_deploy.py: resources, images, JSON6902 and
`$patch: delete` patches) agrees with kustomize itself, where `kubectl kustomize` is on PATH:
the same objects, equal apart from the labels kustomize adds (`labels:` in the
kustomizations, which the renderer leaves out)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy._deploy import OVERLAYS, pod_specs, render_kustomization

PART_OF = "app.kubernetes.io/part-of"


def _without_added_labels(doc: dict[str, Any]) -> dict[str, Any]:
    """A copy of `doc` without the part-of label kustomize adds (metadata, pod templates,
    Service selectors)."""
    doc = json.loads(json.dumps(doc))
    meta = doc["metadata"]
    meta.get("labels", {}).pop(PART_OF, None)
    if not meta.get("labels"):
        meta.pop("labels", None)
    templates = []
    if doc["kind"] == "Deployment":
        templates = [doc["spec"]["template"]]
    elif doc["kind"] == "RayCluster":
        templates = [doc["spec"]["headGroupSpec"]["template"]]
        templates += [g["template"] for g in doc["spec"]["workerGroupSpecs"]]
    for t in templates:
        labels = t.get("metadata", {}).get("labels", {})
        labels.pop(PART_OF, None)
        if not labels and "labels" in t.get("metadata", {}):
            del t["metadata"]["labels"]
            if not t["metadata"]:
                del t["metadata"]
    return doc


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: f"overlay-{p.name}")
def test_renderer_matches_kubectl_kustomize(overlay: Path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not on PATH")
    out = subprocess.run(
        [kubectl, "kustomize", str(overlay)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    real = {
        (d["kind"], d["metadata"]["name"]): _without_added_labels(d)
        for d in yaml.safe_load_all(out.stdout)
        if d
    }
    mine = render_kustomization(overlay)
    assert len(mine) == len(real)
    assert {(d["kind"], d["metadata"]["name"]): _without_added_labels(d) for d in mine} == real
    assert list(pod_specs(mine))  # something to compare

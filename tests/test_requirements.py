"""The Python dependencies are pinned, and nothing installs from two package indexes at once."""

from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENT = re.compile(r"^([A-Za-z0-9_.-]+)==([A-Za-z0-9_.+-]+)$")


def _requirements() -> list[str]:
    lines = []
    for path in sorted((ROOT / "requirements").glob("*.txt")):
        lines += [line.split("#")[0].strip() for line in path.read_text().splitlines()]
    return [line for line in lines if line]


def test_every_requirement_is_pinned() -> None:
    loose = [r for r in _requirements() if not REQUIREMENT.match(r)]
    assert loose == [], f"unpinned requirements: {loose}"


def test_protobuf_is_the_one_the_generated_code_was_made_for() -> None:
    """The generated gRPC code checks the protobuf runtime at import; the pin and the
    installed runtime must be the same major version as the code (make protos)."""
    pinned = dict(REQUIREMENT.match(r).groups() for r in _requirements())  # type: ignore[union-attr]
    gen = (ROOT / "compactor/service/gen/compactor/v1/compactor_pb2.py").read_text()
    major = int(re.search(r"Domain\.PUBLIC,\s*(\d+),", gen).group(1))  # type: ignore[union-attr]
    assert int(pinned["protobuf"].split(".")[0]) == major == int(version("protobuf").split(".")[0])


def test_no_install_mixes_package_indexes() -> None:
    files = [
        *ROOT.glob("deploy/docker/*.Dockerfile"),
        *ROOT.glob("scripts/*.sh"),
        ROOT / "Makefile",
    ]
    mixed = [str(f.relative_to(ROOT)) for f in files if "--extra-index-url" in f.read_text()]
    assert mixed == []

"""The Python dependencies are pinned, and nothing installs from two package indexes at once."""

from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENT = re.compile(r"^([A-Za-z0-9_.-]+)==([A-Za-z0-9_.+-]+)$")


LOCK = ROOT / "requirements" / "lock.txt"


def _requirements() -> list[str]:
    lines = []
    for path in sorted((ROOT / "requirements").glob("*.txt")):
        if path == LOCK:
            continue
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


def _locked() -> dict[str, list[str]]:
    """{name==version: its sha256 hashes} of the lock file."""
    out: dict[str, list[str]] = {}
    pin = ""
    for line in LOCK.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        if not line.startswith(" "):
            pin = line.rstrip(" \\")
            out[pin] = []
        else:
            m = re.fullmatch(r"\s+--hash=sha256:([0-9a-f]{64})( \\)?", line)
            assert m, f"not a hash line under {pin}: {line!r}"
            out[pin].append(m.group(1))
    return out


def test_the_lock_pins_every_requirement_with_hashes() -> None:
    from packaging.utils import canonicalize_name

    locked = _locked()
    unhashed = [pin for pin, hashes in locked.items() if not hashes]
    assert unhashed == []
    by_name = {canonicalize_name(p.split("==")[0]): p.split("==")[1] for p in locked}
    for req in _requirements():
        name, ver = REQUIREMENT.match(req).groups()  # type: ignore[union-attr]
        assert by_name.get(canonicalize_name(name)) == ver, f"{req} is not in the lock as pinned"


def test_the_lock_is_the_installed_closure() -> None:
    """What `make setup` installed (base.txt's pins, what they require, nodeps.txt) is exactly
    the lock: a dependency that moved, appeared or went is caught here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("lock", ROOT / "scripts/lock_requirements.py")
    lock = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(lock)  # type: ignore[union-attr]
    assert lock.main(["--check"]) == 0

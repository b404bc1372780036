"""Fetch one wheel for the GPU machines (CPython 3.12, manylinux x86_64) with pip, cached.

A GPU machine without network installs from a wheelhouse made on a machine with pip
(scripts/gpu_serving.sh's ``pack``); the checks download the same wheels here. ``fetch_wheel`` downloads a single wheel, without its
dependencies, into a cache folder unless a matching file is already there.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.tags import Tag
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

from benchmarks import ROOT as REPO

# Under .venv, so git ignores it; kept between runs so a wheel is downloaded once.
DEFAULT_CACHE = REPO / ".venv" / "gpu-check-wheels"
PYTHON_VERSION = "3.12"
# The same platform tags as scripts/gpu_serving.sh's pack.
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux_2_35_x86_64",
    "manylinux1_x86_64",
    "manylinux_2_5_x86_64",
)
_CP = "cp" + PYTHON_VERSION.replace(".", "")


def _runs_on_target(tag: Tag) -> bool:
    """Whether a wheel tag fits CPython 3.12 on one of PLATFORMS (pure-Python wheels do)."""
    interpreter_ok = tag.interpreter in {_CP, "py3", "py" + _CP[2:]} or (
        tag.interpreter.startswith("cp3") and tag.abi == "abi3"
    )
    abi_ok = tag.abi in {_CP, "abi3", "none"}
    return interpreter_ok and abi_ok and tag.platform in {"any", *PLATFORMS}


def _matching(requirement: Requirement, dest: Path) -> Path | None:
    """The newest wheel in ``dest`` that satisfies ``requirement`` and runs on the target."""
    best: tuple[Version, Path] | None = None
    for path in dest.glob("*.whl") if dest.is_dir() else ():
        try:
            name, version, _build, tags = parse_wheel_filename(path.name)
        except ValueError:
            continue
        if canonicalize_name(name) != canonicalize_name(requirement.name):
            continue
        if not requirement.specifier.contains(version, prereleases=True):
            continue
        if not any(_runs_on_target(t) for t in tags):
            continue
        if best is None or version > best[0]:
            best = (version, path)
    return None if best is None else best[1]


def fetch_wheel(requirement: str, dest: Path = DEFAULT_CACHE) -> Path:
    """Return the path of a wheel for ``requirement`` in ``dest``, downloading it if absent.

    ``requirement`` is a pip requirement (``"flashinfer_python==0.7.2"``). The wheel is for
    CPython 3.12 on manylinux x86_64 (a ``py3-none-any`` wheel qualifies too), fetched with
    ``pip download --no-deps --only-binary=:all:``. Raises RuntimeError with pip's output if
    pip fails or leaves no matching wheel.
    """
    req = Requirement(requirement)
    found = _matching(req, dest)
    if found is not None:
        return found
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", PYTHON_VERSION, "--implementation", "cp"]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    cmd += ["--disable-pip-version-check", "-d", str(dest), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    found = _matching(req, dest)
    if proc.returncode != 0 or found is None:
        raise RuntimeError(
            f"pip download {requirement!r} into {dest} "
            + (f"failed (exit {proc.returncode})" if proc.returncode else "left no matching wheel")
            + f":\n{proc.stdout}{proc.stderr}"
        )
    return found

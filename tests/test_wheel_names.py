"""The built wheel's top-level import names collide with nothing a user's SGLang install holds.

SGLang 0.5.23 requires PyPI's `kernels` (the Hugging Face kernel hub); a wheel of ours with a
top-level `kernels` would write into the same `site-packages/kernels/` and break one of the
two. So: build the wheel, read its top-level names, and check them against (1) the import names
of every distribution in the dependency closure of SGLang, transformers and FlashInfer (the
installed ones' real names, the others' distribution names), and (2) every top-level name
their sources import. Then a user-style install: PyPI's `kernels` first, our wheel second, in
a fresh venv; both import.
"""

from __future__ import annotations

import re
import subprocess
import sys
import venv
import zipfile
from importlib.metadata import PackageNotFoundError, distribution, packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
ROOTS = ("sglang", "transformers", "flashinfer-python")
HF_KERNELS = "kernels==0.14.1"  # the version range SGLang 0.5.23 requires
_IMPORT = re.compile(r"^\s*(?:from|import)\s+([A-Za-z_][A-Za-z0-9_]*)", re.M)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(ROOT)],
                   check=True, capture_output=True, timeout=600)  # fmt: skip
    return next(out.glob("*.whl"))


def wheel_names(path: Path) -> set[str]:
    """Top-level import names in a wheel (its dist-info aside)."""
    with zipfile.ZipFile(path) as z:
        tops = {n.split("/", 1)[0] for n in z.namelist() if "/" in n}
    return {t for t in tops if not t.endswith((".dist-info", ".data"))}


def closure(roots: tuple[str, ...]) -> set[str]:
    """Canonical distribution names required, transitively, by `roots` (extras aside)."""
    seen: set[str] = set()
    todo = [canonicalize_name(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = distribution(name).requires or []
        except PackageNotFoundError:
            continue
        for line in reqs:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(req.name))
    return seen


def provided_names(dists: set[str]) -> set[str]:
    """Import names the distributions provide: the installed ones' own top-level names, and
    each distribution's name as an import name (what an uninstalled one most likely uses)."""
    names = {d.replace("-", "_") for d in dists}
    for top, owners in packages_distributions().items():
        if any(canonicalize_name(o) in dists for o in owners):
            names.add(top)
    return names


def imported_names(package: str) -> set[str]:
    """Top-level names an installed package's sources import."""
    try:
        files = distribution(package).files or []
    except PackageNotFoundError:
        return set()
    found: set[str] = set()
    for f in files:
        if f.suffix == ".py":
            found |= set(_IMPORT.findall(Path(str(f.locate())).read_text(errors="replace")))
    return found


def test_no_top_level_name_is_taken_by_sglang_transformers_or_flashinfer(wheel: Path) -> None:
    ours = wheel_names(wheel)
    assert ours == {"compactor", "sglang_ext", "compaction_kernels"}  # harness is not shipped
    dists = closure(ROOTS)
    assert "kernels" in dists  # SGLang's requirement on Hugging Face's kernel hub is seen
    taken = provided_names(dists)
    for root in ("sglang", "transformers"):
        taken |= imported_names(root)
    assert "kernels" in taken
    assert not ours & taken, f"top-level names also used by SGLang's world: {ours & taken}"


@pytest.mark.slow
def test_hugging_face_kernels_and_ours_install_side_by_side(wheel: Path, tmp_path: Path) -> None:
    """A user's order: SGLang's `kernels` first, then our wheel; both still import."""
    env = tmp_path / "venv"
    venv.create(env, with_pip=True)
    py = env / "bin" / "python"
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, HF_KERNELS], check=True, capture_output=True, timeout=600)
    subprocess.run([*pip, "--no-deps", str(wheel)], check=True, capture_output=True, timeout=600)
    check = ("import kernels, compaction_kernels; "
             "assert callable(kernels.get_kernel); "
             "assert compaction_kernels.OPS; print('both')")  # fmt: skip
    out = subprocess.run([str(py), "-c", check], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "both" in out.stdout, out.stderr[-2000:]

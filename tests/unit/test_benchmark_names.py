"""No benchmark script may shadow a project package.

`python benchmarks/x.py` puts benchmarks/ first on sys.path, so a benchmarks/kernels.py would
be imported in place of the ``kernels`` package by every benchmark that imports compactor.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_benchmark_script_is_named_like_a_project_package() -> None:
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert {"compactor", "sglang_ext", "kernels", "harness"} <= packages
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    assert not scripts & packages, f"benchmarks/ shadows project packages: {scripts & packages}"

"""No benchmark script may shadow a project package.

`python benchmarks/x.py` puts benchmarks/ first on sys.path, so a benchmarks/compactor.py would
be imported in place of the ``compactor`` package by every benchmark that imports it.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_benchmark_script_is_named_like_a_project_package() -> None:
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert {"compactor", "sglang_ext", "compaction_kernels", "harness"} <= packages
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    assert not scripts & packages, f"benchmarks/ shadows project packages: {scripts & packages}"

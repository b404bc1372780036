"""`bash scripts/gpu_serving.sh preflight`: the CPU checks that would have named each failure of
the first GPU serving try before any GPU time was spent. Failures 2-4 (the CuteDSL dual GEMM's
`import cutlass`, a FlashInfer header left out of the bundle, `sgl_kernel.utils`) are put back
one at a time in tests/benchmarks/test_preflight_kernels.py and test_preflight_flashinfer.py; this
file holds failure 1 (an ambiguous flag), failure 5 (the compiled radix tree core on another
torch) and the whole preflight as CI runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.gpu.preflight import run as gpu_preflight
from benchmarks.gpu.preflight.run import Server, check_server_args, check_tree_core
from benchmarks.gpu.serving.run import tree_core_env

ROOT = Path(__file__).resolve().parents[2]


def test_every_server_of_the_run_parses() -> None:
    run = gpu_preflight.servers()
    assert set(run) == {"stock", "identity", "stock8b", "plugin8b"}
    assert [n for n, s in run.items() if s.plugin] == ["identity", "plugin8b"]
    assert check_server_args(run) == []


def test_failure_1_an_ambiguous_flag_is_named() -> None:
    """The first try passed `--cuda-graph-max-bs`, which SGLang 0.5.23 splits in two."""
    run = gpu_preflight.servers()
    old = [*run["stock8b"].flags, "--cuda-graph-max-bs", "64"]
    problems = check_server_args({"stock8b": Server(False, old)})
    assert len(problems) == 1 and "ambiguous option: --cuda-graph-max-bs" in problems[0]


def test_a_stock_server_knows_no_plugin_flag() -> None:
    flags = ["--model-path", "m", "--compaction-endpoint", "h:1"]
    assert (
        "unrecognized arguments: --compaction-endpoint"
        in check_server_args({"stock": Server(False, flags)})[0]
    )
    assert check_server_args({"plugin": Server(True, flags)}) == []


def test_failure_5_another_torch_selects_the_python_tree_core() -> None:
    """SGLang 0.5.23's bundled Rust tree core was built against torch 2.14.1; under torch 2.11
    it reads a tensor's dtype from the wrong field ("insert value must be an int64 tensor, got
    Float" on the first prefill). The run's servers use SGLang's pure-Python core there."""
    from importlib.metadata import requires

    pin = next(r for r in requires("sglang") or [] if r.startswith("torch==")).split("==")[1]
    assert tree_core_env("2.11.0+cu130") == {"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python"}
    assert tree_core_env(pin) == {} and tree_core_env(pin + "+cu130") == {}
    assert check_tree_core() == []


def test_failure_5_check_fails_without_the_python_core(monkeypatch: pytest.MonkeyPatch) -> None:
    import benchmarks.gpu.serving.run as gs

    monkeypatch.setattr(gs, "tree_core_env", lambda torch_version=None: {})
    problems = check_tree_core()
    assert len(problems) == 1 and "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python" in problems[0]


def test_sglang_reads_the_tree_core_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The variable the run sets is the one SGLang's tree-core selection reads."""
    from sglang.srt.mem_cache.unified_cache.tree_core_registry import select_tree_core_backend

    params = SimpleNamespace(tree_core_backend=None, token_to_kv_pool_allocator=None)
    for name, value in tree_core_env("2.11.0").items():
        monkeypatch.setenv(name, value)
    assert select_tree_core_backend(params) == "python"  # type: ignore[arg-type]


@pytest.mark.slow
def test_preflight_passes_as_ci_runs_it() -> None:
    """The whole preflight, wheelhouse packing included (downloads on first use)."""
    proc = subprocess.run(
        ["bash", "scripts/gpu_serving.sh", "preflight"], cwd=ROOT, capture_output=True,
        text=True, timeout=1500, env={**os.environ, "PY": sys.executable},
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "preflight: 5 ok, 0 failed" in out, out[-2000:]
    assert "wheelhouse: ['MANIFEST', 'site.tar.xz']" in out, out[-2000:]  # one part

"""Shared fixtures and markers.

- `gpu`: skipped unless a CUDA device is present.
- `sglang`: starts a real SGLang server (slow; deselect with `-m "not sglang"`). `make test`
  runs these one after another beside a second pytest process with the rest
  (scripts/run_tests.sh).
- `peer`: a cross-check against an independent implementation (kvpress); its outcome is
  printed by name at the end of the run, so a CI log shows that it ran and passed.
- `prepared_model`: the embedded SmolLM2-135M checkpoint, prepared once per machine;
  `plumbing_model`: a random 2-layer Llama with its tokenizer, for server tests of plumbing.
Servers bind 127.0.0.1 on ports the OS picks; no fixed ports.
"""

from __future__ import annotations

import os
import time

# One torch (OpenMP) thread per process: this process and every server, service and script it
# starts (they inherit the variable). `make test` runs two streams of tests side by side; a CPU
# SGLang server whose OpenMP threads (one per core by default) share the cores with a busy
# neighbour spends its time waiting on its own threads. Set before torch is imported: the
# OpenMP runtime reads it once, at load.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

# Triton kernels run under the interpreter on CPU-only machines. This must be set before
# triton is first imported anywhere in the test process.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path
from typing import Any

import pytest

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (marker gpu)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


_PEER_OUTCOMES: list[tuple[str, str]] = []
# A test that takes at least this long (setup + call + teardown) gets a line as it ends, with
# the time since the run began: a log cut off by a time limit still shows where the time went.
SLOW_LINE_S = 20.0
_RUN_T0 = time.monotonic()
_SPENT: dict[str, float] = {}
_CONFIG: list[pytest.Config] = []


def pytest_configure(config: pytest.Config) -> None:
    _CONFIG.append(config)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "peer" in report.keywords and (report.when == "call" or report.outcome != "passed"):
        _PEER_OUTCOMES.append((report.nodeid, report.outcome.upper()))
    spent = _SPENT.pop(report.nodeid, 0.0) + report.duration
    if report.when != "teardown":
        _SPENT[report.nodeid] = spent
    elif spent >= SLOW_LINE_S and _CONFIG:
        reporter = _CONFIG[-1].pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            elapsed = time.monotonic() - _RUN_T0
            reporter.write_line(f"[{elapsed:6.0f} s] {spent:5.0f} s {report.nodeid}")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for nodeid, outcome in _PEER_OUTCOMES:
        terminalreporter.write_line(f"peer check: {nodeid} {outcome}")


@pytest.fixture(autouse=True)
def _plugin_marker_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """A test that parses `--compaction-endpoint` in-process sets the plugin's marker in this
    process's environment (`sglang_ext.adapter.hooks.ACTIVE_ENV`); it is undone after each test."""
    from sglang_ext.adapter.hooks import ACTIVE_ENV

    monkeypatch.delenv(ACTIVE_ENV, raising=False)


@pytest.fixture(scope="session")
def prepared_model() -> Path:
    """Path of the prepared fp32 SmolLM2-135M checkpoint (converted on first use, ~40 s)."""
    from compactor.models import prepare_model

    return prepare_model("smollm2-135m")


@pytest.fixture(scope="session")
def plumbing_model(prepared_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight 2-layer Llama (the GPU run's CPU-smoke shape, `TINY`, at 8192
    positions; fp32) with the embedded model's tokenizer and chat template, written by the GPU
    run's own checkpoint writer (`benchmarks.gpu.serving.checkpoint.make_model`). SGLang and
    `compactor serve` load it like any checkpoint, at a small fraction of SmolLM2's compute
    per token: for the server tests that check how a compaction is carried (installs,
    fallbacks, transfers, counters), not what the answers say. Its answers are noise; a test
    that compares them compares them with the same model served stock."""
    from dataclasses import replace

    from benchmarks.gpu.serving.checkpoint import make_model
    from benchmarks.gpu.serving.run import TINY

    out = tmp_path_factory.mktemp("plumbing-model")
    make_model(out, prepared_model, replace(TINY, max_positions=8192), device="cpu",
               dtype="float32")  # fmt: skip
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny random Llama (`tests._tiny.tiny_llama`, seed 0) saved to a fresh tmp dir, built
    once per test module."""
    from tests._tiny import tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("tiny"))

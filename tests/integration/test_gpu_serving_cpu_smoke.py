"""scripts/gpu_serving.sh's run, all three phases, on CPU SGLang servers with toy random
models (`--cpu-smoke`): the plumbing a GPU run depends on (every service and server started
at once, the compacted-rows counter, resumable phases), checked without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_ext.adapter.hooks import ANNOUNCEMENT

pytestmark = [pytest.mark.sglang, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def test_all_three_phases_run_in_one_call_and_resume(tmp_path: Path) -> None:
    state, out = tmp_path / "state", tmp_path / "out"
    # --budget-s as long as the test waits: a busy machine must not skip the deferred second
    # half (the budget is a GPU session's; the plumbing is what this test checks)
    cmd = [sys.executable, "-m", "benchmarks.gpu.serving.run", "run", "--cpu-smoke",
           "--state", str(state), "--out", str(out), "--budget-s", "900"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # as scripts/gpu_serving.sh runs it
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    res = json.loads((out / "gpu_serving.json").read_text())
    assert list(res["details"]) == ["identity", "stock8b", "plugin8b"]
    assert not [p for p, d in res["details"].items() if "error" in d]

    ident = res["details"]["identity"]
    assert ident["compaction"]["installed_total"] == 1  # the identity fit was installed
    # ... and every scored request was served from it (the plugin's counter on /metrics)
    assert ident["compacted_rows_scored"] >= ident["scored_requests"] == 3
    assert res["identity_outputs_equal"] is True
    assert ident["logprob_max_abs_diff"] < 0.5 * ident["control_mean_abs_diff"]
    assert res["prefix_slots_ratio"] > 1 and res["idle_plugin_throughput_ratio"] > 0
    assert res["provenance"]["command"].startswith("python -m benchmarks.gpu.serving.run run")

    # what SGLang runs: the plugin's servers wrap torch_native, the stock ones are it
    assert res["backend"] == "torch_native" and res["cuda_graphs"] is False  # CPU: no graphs
    assert res["details"]["plugin8b"]["prefix"]["full_batch_lines"] > 0

    # a second call runs nothing again: every phase is recorded without error
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    assert again.stdout.count("recorded without error by an earlier run") == 3

    # the plugin is loaded only where a server has --compaction-endpoint
    logs = {p.stem: p.read_text(errors="replace") for p in (state / "logs").glob("sglang-*.log")}
    assert set(logs) == {f"sglang-{n}" for n in
                         ("identity-stock", "identity-identity", "stock8b", "plugin8b")}  # fmt: skip
    for name, text in logs.items():
        stock = name in ("sglang-identity-stock", "sglang-stock8b")
        assert (ANNOUNCEMENT in text) is not stock, name
        assert ("impl=CompactionRadixCache" in text) is not stock, name

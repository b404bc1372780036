"""`bash scripts/gpu_serving.sh plan`: the device calls of a GPU run, their recorded seconds,
and the check that they fit one session's device time (no GPU, nothing staged)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu.serving import plan as gpu_plan
from benchmarks.gpu.serving.plan import (
    COMMAND_LIMIT_S,
    PHASES,
    check,
    load_timings,
    need_s,
    plan_calls,
)

ROOT = Path(__file__).resolve().parents[2]


def test_the_plan_fits_as_ci_runs_it() -> None:
    proc = subprocess.run(["bash", "scripts/gpu_serving.sh", "plan"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PY": sys.executable})  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "plan: fits" in out
    for step in ("machine start", "install", "flashinfer_jit", *PHASES, "compaction_speed"):
        assert step in out, step
    assert "carry .whl/gpu_serving" in out  # the wheelhouse travels with the serving call


def test_every_step_has_a_recorded_source() -> None:
    steps = json.loads(gpu_plan.TIMINGS.read_text())["steps"]
    assert all(rec["s"] > 0 and rec["source"] for rec in steps.values())
    timings = load_timings()
    used = {s.name for c in plan_calls(timings) for s in c.steps}
    assert used <= set(timings) and set(PHASES) <= used


def test_a_plan_over_its_limits_does_not_fit(tmp_path: Path) -> None:
    timings = load_timings()
    slow = {**timings, "flashinfer_jit": COMMAND_LIMIT_S}  # one command over 9 minutes
    problems = check(plan_calls(slow), slow, [50.0, 4.0])
    assert any("call serve: its command needs" in p for p in problems)
    assert any("of device time" in p for p in problems)  # and the session with it
    assert any("over 64" in p for p in check(plan_calls(timings), timings, [70.0, 4.0]))
    assert check(plan_calls(timings), timings, [50.0, 4.0]) == []
    # the script exits non-zero on such timings
    data = json.loads(gpu_plan.TIMINGS.read_text())
    data["steps"]["identity"]["s"] = 900
    path = tmp_path / "timings.json"
    path.write_text(json.dumps(data))
    assert gpu_plan.main(["--timings", str(path)]) == 1


def test_phase_needs_come_from_the_recorded_timings() -> None:
    timings = load_timings()
    assert [need_s(p) for p in PHASES] == [timings[p] for p in PHASES]
    with pytest.raises(ValueError, match="unknown phase 'nope'"):
        need_s("nope")
    no_phases = plan_calls(timings, ())
    assert [s.name for s in no_phases[0].steps] == ["install", "models", "gpu_tests"]

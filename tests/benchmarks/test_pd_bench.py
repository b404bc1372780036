"""benchmarks/server/pd.py's summary of a measured pass (the servers themselves: the PD tests)."""

from __future__ import annotations

import pytest

from benchmarks.server.pd import timing_summary
from harness.workload import Timed


def test_timing_summary_reads_throughput_ttft_and_the_decode_step() -> None:
    results = [
        Timed("a", [1, 2, 3, 4, 5], 0, ttft_s=1.0, latency_s=2.0),  # 4 steps in 1 s
        Timed("b", [1, 2, 3], 0, ttft_s=3.0, latency_s=4.0),  # 2 steps in 1 s
        Timed("c", [1], 0, ttft_s=2.0, latency_s=2.0),  # one token: no step
    ]
    s = timing_summary(results, wall_s=6.0)
    assert s["requests"] == 3 and s["request_throughput"] == pytest.approx(0.5)
    assert s["ttft_p50_s"] == 2.0 and s["ttft_p95_s"] == 3.0
    assert s["decode_step_s"] == pytest.approx((0.25 + 0.5) / 2)

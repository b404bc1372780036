"""A short soak on the real CPU server: install / flush cycles leave nothing behind.

`benchmarks/soak.py --cycles 300` is the long run (benchmarks/results/soak.json); this
test runs the same cycles a few times and asserts the same invariants.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"
_spec = importlib.util.spec_from_file_location("soak", _PATH)
assert _spec is not None and _spec.loader is not None
soak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(soak)


def test_install_flush_cycles_return_to_baseline(prepared_model: Path, tmp_path: Path) -> None:
    result = soak.run_soak(prepared_model, tmp_path, cycles=8, warmup=2)
    s = result["summary"]
    assert s["cycles"] == 8
    assert s["installs_invalid"] == 0 and s["installs_failed"] == 0
    assert s["compacted_prefix_held_every_cycle"]  # each cycle really installed
    assert s["third_request_hit_the_prefix_every_cycle"]
    assert s["free_slots_always_back_to_pool"]
    assert s["beta_slots_max_after_flush"] == 0
    assert s["physical_tokens_max_after_flush"] == 0
    # a leak of the installed prefix (~0.4 MB of fp16 KV per cycle here) would show; allocator
    # noise of a few MB does not fail it
    assert s["scheduler_rss_growth_mib"] is not None and s["scheduler_rss_growth_mib"] < 24

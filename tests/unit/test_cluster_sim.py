"""The deployment simulator: deterministic, conserves requests, and compaction relieves memory."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "cluster_sim.py"
_spec = importlib.util.spec_from_file_location("cluster_sim", _PATH)
assert _spec is not None and _spec.loader is not None
cluster_sim = importlib.util.module_from_spec(_spec)
sys.modules["cluster_sim"] = cluster_sim
_spec.loader.exec_module(cluster_sim)

# A small, memory-bound cluster: long documents, little KV memory per replica.
BASE = dict(rate=6.0, duration=120.0, docs=60, prefix_tokens=32000, replicas=2, kv_tokens=150_000)


def test_deterministic_and_conserves_requests() -> None:
    a = cluster_sim.simulate(cluster_sim.SimConfig(**BASE, pool=0))
    b = cluster_sim.simulate(cluster_sim.SimConfig(**BASE, pool=0))
    assert a == b
    assert a.compactions == 0 and a.served_from_compacted == 0
    arrivals = a.completed  # every admitted request finishes by the end of the run
    assert arrivals > 0.8 * BASE["rate"] * BASE["duration"]


def test_compaction_relieves_a_memory_bound_cluster() -> None:
    stock = cluster_sim.simulate(cluster_sim.SimConfig(**BASE, pool=0))
    pooled = cluster_sim.simulate(cluster_sim.SimConfig(**BASE, pool=16, compact_base_s=1.0))
    assert pooled.compactions > 0 and pooled.served_from_compacted > 0.2
    assert pooled.prefix_hit_rate > stock.prefix_hit_rate
    assert pooled.queue_delay_p95_s < stock.queue_delay_p95_s


def test_bad_config_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="ratio must be in"):
        cluster_sim.SimConfig(ratio=0.0)
    with pytest.raises(ValueError, match="pool must be >= 0"):
        cluster_sim.SimConfig(pool=-1)

"""The deployment simulator: deterministic, conserves requests, compaction relieves memory, and
capacity (the highest rate within the SLO) is what it compares, not drain time."""

from __future__ import annotations

import pytest

from benchmarks.offline import cluster_sim

# A small, memory-bound cluster: long documents, little KV memory per replica.
BASE = dict(rate=6.0, duration=120.0, docs=60, prefix_tokens=32000, replicas=2, kv_tokens=150_000)


def test_deterministic_and_conserves_requests() -> None:
    a = cluster_sim.simulate(cluster_sim.SimConfig(**BASE, pool=0))
    b = cluster_sim.simulate(cluster_sim.SimConfig(**BASE, pool=0))
    assert a == b
    assert a.compactions == 0 and a.compactions_pending == 0 and a.served_from_compacted == 0
    assert a.completed == a.arrived  # the run drains: every arrival finishes
    assert a.arrived > 0.8 * BASE["rate"] * BASE["duration"]
    # served counts the arrival window only: never more than arrived there
    assert a.served_rps * BASE["duration"] <= a.arrived


def test_figures_are_counted_within_the_arrival_window() -> None:
    """Jobs still queued when arrivals stop are pending, not waits longer than the run."""
    slow = cluster_sim.simulate(
        cluster_sim.SimConfig(**BASE, pool=1, compact_base_s=30.0, compact_s_per_ktoken=3.0)
    )
    assert slow.compactions > 0 and slow.compactions_pending > 0
    assert slow.compaction_wait_mean_s <= BASE["duration"]
    # overloaded: served in the window falls well short of the offered rate
    over = cluster_sim.simulate(cluster_sim.SimConfig(**{**BASE, "rate": 30.0}, pool=0))
    assert over.completed == over.arrived
    assert over.served_rps < 0.5 * over.rate


def test_compaction_relieves_a_memory_bound_cluster() -> None:
    stock = cluster_sim.simulate(cluster_sim.SimConfig(**BASE, pool=0))
    pooled = cluster_sim.simulate(cluster_sim.SimConfig(**BASE, pool=16, compact_base_s=1.0))
    assert pooled.compactions > 0 and pooled.served_from_compacted > 0.2
    assert pooled.prefix_hit_rate > stock.prefix_hit_rate
    assert pooled.queue_delay_p95_s < stock.queue_delay_p95_s


def test_capacity_is_the_highest_rate_within_the_slo() -> None:
    slo = 5.0
    stock = cluster_sim.capacity(cluster_sim.SimConfig(**BASE, pool=0), slo, rel_tol=0.02)
    pooled = cluster_sim.capacity(
        cluster_sim.SimConfig(**BASE, pool=16, compact_base_s=1.0), slo, rel_tol=0.02
    )
    for cap in (stock, pooled):
        assert cap.capacity_rps > 0 and cap.at_capacity is not None
        assert cap.at_capacity.rate == cap.capacity_rps
        assert cap.at_capacity.queue_delay_p95_s <= slo
        # a probe just above capacity (within the tolerance) missed the SLO
        above = [d for r, d in cap.probes if cap.capacity_rps < r <= cap.capacity_rps * 1.02]
        assert above and all(d > slo for d in above)
    assert pooled.capacity_rps > stock.capacity_rps


def test_capacity_zero_when_nothing_meets_the_slo() -> None:
    """No document fits a replica: nothing is admitted, at any rate."""
    tiny = cluster_sim.SimConfig(**{**BASE, "kv_tokens": 1000}, pool=0)
    stuck = cluster_sim.simulate(tiny)
    assert stuck.completed == 0 < stuck.arrived and stuck.queue_delay_p95_s == float("inf")
    cap = cluster_sim.capacity(tiny, slo_p95_s=10.0)
    assert cap.capacity_rps == 0 and cap.at_capacity is None and cap.probes


def test_saturation_pool_is_where_more_workers_stop_helping() -> None:
    def cap(pool: int, rps: float) -> object:
        return cluster_sim.Capacity(pool, 10.0, rps, None, ())

    caps = [cap(0, 4.0), cap(1, 5.0), cap(2, 6.0), cap(4, 6.2), cap(8, 6.25), cap(16, 6.3)]
    assert cluster_sim.saturation_pool(caps, gain=0.05) == 2
    assert cluster_sim.saturation_pool(caps, gain=0.01) == 8
    assert cluster_sim.saturation_pool([cap(0, 4.0)]) is None


def test_bad_config_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="ratio must be in"):
        cluster_sim.SimConfig(ratio=0.0)
    with pytest.raises(ValueError, match="pool must be >= 0"):
        cluster_sim.SimConfig(pool=-1)
    with pytest.raises(ValueError, match="slo_p95_s must be > 0, got 0"):
        cluster_sim.capacity(cluster_sim.SimConfig(), 0.0)

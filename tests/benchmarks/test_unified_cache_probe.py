"""Why the plugin keeps its own `RadixCache` subclass: SGLang's default `UnifiedRadixCache`
cannot hold a compacted prefix (`benchmarks/offline/unified_cache_probe.py`).

Each assertion is one finding of the probe on the installed SGLang. A failure here means
SGLang changed what its default cache can do: rerun the probe
(`.venv/bin/python -m benchmarks.offline.unified_cache_probe`), and check whether compacted prefixes
can now move into `UnifiedRadixCache` (ARCHITECTURE.md, why the plugin does not use it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.offline import unified_cache_probe as probe

_ROOT = Path(__file__).resolve().parents[2]
_RESULT = _ROOT / "benchmarks" / "results" / "unified_cache_probe.json"

L, T, K = probe.L, probe.T, probe.K
RUST = "RustUnifiedTreeCore"


@pytest.fixture(scope="module")
def found() -> dict[str, Any]:
    return probe.run()


@pytest.fixture(scope="module")
def py(found: dict[str, Any]) -> dict[str, Any]:
    ops: dict[str, Any] = found["cores"]["python"]
    assert ops["tree_core"] == "UnifiedTreeCore", ops["construct"]
    return ops


@pytest.fixture(scope="module")
def rust(found: dict[str, Any]) -> dict[str, Any]:
    ops: dict[str, Any] = found["cores"]["rust"]
    if ops["tree_core"] != RUST:
        pytest.skip(f"the Rust tree core is not built here: {ops}")
    return ops


def test_a_value_shorter_than_its_key(py: dict[str, Any], rust: dict[str, Any]) -> None:
    """Rust refuses t slots for L tokens; Python takes them and matches t tokens."""
    assert rust["insert_short_value"]["status"] == "error"
    assert rust["insert_short_value"]["error"] == (
        f"ValueError: insert value length {T} is shorter than the aligned key length {L}"
    )
    short = py["insert_short_value"]
    assert short["status"] == "wrong"
    assert short["match_device_prefix_len"] == T and short["match_full_kv_hit_length"] == L


def test_the_padded_value_matches_whole(py: dict[str, Any], rust: dict[str, Any]) -> None:
    """The plugin's form (t slots then ALIAS_SLOT, L long) is stored and matched whole."""
    for ops in (py, rust):
        assert ops["insert_padded_and_match"]["status"] == "ok"


def test_partial_matches_split_the_compacted_node(py: dict[str, Any], rust: dict[str, Any]) -> None:
    """(c) no whole-or-nothing match: a K-token prefix is served K entries of the value."""
    for ops in (py, rust):
        split = ops["split_inside"]
        assert split["status"] == "wrong" and split["node_split"]
        assert split["match_device_prefix_len"] == K


def test_sizes_count_tokens_not_slots(py: dict[str, Any], rust: dict[str, Any]) -> None:
    """(d) evictable/protected count L; eviction frees the L - t ALIAS_SLOT entries too."""
    for ops in (py, rust):
        acc = ops["slot_accounting"]
        assert acc["unlocked"]["evictable"] == L and acc["locked"]["protected"] == L
        ev = ops["evict"]
        assert ev["status"] == "wrong" and ev["freed_alias_slot"] == L - T
        assert ev["num_tokens_evicted"] == L
    # adjusting the ledger by hand does not carry through a lock
    assert py["adjust_size_then_lock"]["locked"]["evictable"] == T - L
    assert rust["adjust_size_then_lock"]["error"] == (
        "RuntimeError: Rust TreeCore panicked: dec_evictable_size: Full evictable size underflow"
    )


def test_no_compacted_node_beside_the_original(py: dict[str, Any], rust: dict[str, Any]) -> None:
    """The same tokens cached in full: the insert frees the compacted slots as duplicates."""
    for ops in (py, rust):
        rec = ops["install_beside_original"]
        assert rec["status"] == "wrong" and rec["compacted_slots_freed"]
        assert rec["match_returns_original"]


def test_per_node_data(py: dict[str, Any], rust: dict[str, Any]) -> None:
    """(b) Python nodes take an attribute a split leaves on the tail; Rust has no nodes."""
    assert py["per_node_data"]["status"] == "wrong"
    assert not py["per_node_data"]["front_after_split_has_it"]
    assert rust["per_node_data"]["error"] == (
        "NotImplementedError: node_by_id: not yet ported to the Rust tree core"
    )


def test_component_hooks_are_python_only(py: dict[str, Any], rust: dict[str, Any]) -> None:
    """(e) a custom FULL component fixes the slot counts, on the Python core only: asking
    for Rust with one builds the Python core."""
    assert py["custom_full_component"]["status"] == "ok"
    custom = rust["custom_full_component"]
    assert custom["tree_core"] == "UnifiedTreeCore"
    assert "custom components require the Python TreeCore" in custom["note"]


def test_match_walks_from_the_root_only(found: dict[str, Any]) -> None:
    assert found["interface"]["match_prefix_args"] == ["self", "params"]
    assert found["interface"]["match_prefix_params_fields"] == ["key", "cow_mamba", "req"]


def test_the_committed_result_is_this_finding(found: dict[str, Any]) -> None:
    saved = json.loads(_RESULT.read_text())
    assert saved["sglang"] == found["sglang"]
    for core, ops in found["cores"].items():
        if saved["cores"][core]["tree_core"] != ops["tree_core"]:
            continue  # built another core here (no Rust extension)
        statuses = {k: v["status"] for k, v in ops.items() if isinstance(v, dict)}
        assert statuses == {
            k: v["status"] for k, v in saved["cores"][core].items() if isinstance(v, dict)
        }, core

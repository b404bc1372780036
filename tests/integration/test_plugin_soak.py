"""A short soak on the real CPU server: install / flush cycles leave nothing behind, and a
weight update drops the compacted prefix.

`benchmarks/server/soak.py --cycles 300` is the long run (benchmarks/results/soak.json); this
test runs the same cycles a few times and asserts the same invariants.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from benchmarks.server import soak
from harness.launch import SGLangServer
from harness.workload import metric, prompt

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def _weight_update(server: SGLangServer, doc: str) -> None:
    """Reloading the same checkpoint drops the compacted prefix, then compaction goes on."""
    installed = metric(server, "sglang:compaction_installed_total")
    for q in soak.QUESTIONS[:2]:
        server.generate(prompt(doc, q), max_new_tokens=1)
    _until(server, "sglang:compaction_installed_total", installed + 1)
    assert metric(server, "sglang:compaction_physical_tokens") > 0
    out = server.post("/update_weights_from_disk", {"model_path": str(server.model_path)})
    assert out["success"], out
    _until(server, "sglang:compaction_physical_tokens", 0)
    assert metric(server, "sglang:compaction_pool_slots") == metric(
        server, "sglang:compaction_free_slots"
    )
    # the same weights (same fingerprint): the document is compacted again after new hits
    for q in soak.QUESTIONS:
        assert server.generate(prompt(doc, q), max_new_tokens=1)["output_ids"]
    _until(server, "sglang:compaction_installed_total", installed + 2)
    # SGLang's own flush ran first (nothing running); the hook saw the same fingerprint
    log = server.log_tail(200_000)
    assert re.search(
        r"weights updated: \d+ compacted prefix\(es\) dropped, fingerprint (\w+) -> \1", log
    )


def _until(server: SGLangServer, name: str, target: float, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while metric(server, name) != target:
        assert time.monotonic() < deadline, f"{name} != {target}:\n{server.log_tail()}"
        time.sleep(0.3)


def test_install_flush_cycles_return_to_baseline(prepared_model: Path, tmp_path: Path) -> None:
    # gvote: budgets differ per layer and KV head, so every cycle installs and frees a packed
    # prefix whose layers share slots (sglang_ext.packing)
    result = soak.run_soak(
        prepared_model, tmp_path, cycles=8, warmup=2, after=_weight_update, method="gvote"
    )
    s = result["summary"]
    assert s["cycles"] == 8
    assert s["installs_invalid"] == 0 and s["installs_failed"] == 0
    assert s["compacted_prefix_held_every_cycle"]  # each cycle really installed
    assert s["third_request_hit_the_prefix_every_cycle"]
    assert s["free_slots_always_back_to_pool"]
    assert s["beta_slots_max_after_flush"] == 0
    assert s["physical_tokens_max_after_flush"] == 0
    # a leak of the installed prefix (~0.6 MiB of fp16 KV per cycle here) would show; allocator
    # noise of a few MB does not fail it
    assert s["scheduler_rss_growth_mib"] is not None and s["scheduler_rss_growth_mib"] < 24

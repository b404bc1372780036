"""`make demo`'s program end to end, small: one document, stock vs ratio 0.1, then no orphans.

Real `compactor serve` (Ray), two real SGLang servers, the demo's own table and files; every
KV figure asserted on is read from the servers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def _processes_with(mark: str) -> list[int]:
    """Pids of live processes whose environment holds `mark` (the demo's descendants inherit
    it; processes of tests running beside this one do not)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and mark.encode() in (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except OSError:  # gone, or not ours
            continue
    return found


def test_demo_prints_the_table_and_leaves_no_process(prepared_model: Path, tmp_path: Path) -> None:
    run_id = uuid.uuid4().hex  # in the environment of the demo and everything it starts
    proc = subprocess.run(
        [
            sys.executable, "-m", "harness.demo", "--docs", "1", "--sentences", "40",
            "--ratios", "0.1", "--max-new-tokens", "12", "--out", str(tmp_path),
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
        env={**os.environ, "COMPACTION_DEMO_TEST": run_id},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "KV held" in proc.stdout and "ratio 0.1" in proc.stdout
    data = json.loads((tmp_path / "demo.json").read_text())
    records = data["records"]
    assert [r["config"] for r in records] == ["stock", "ratio 0.1"]
    stock, compacted = records
    assert compacted["compactions_installed"] == 1 and compacted["compaction_fallbacks"] == 0
    # KV slots are read from each server (pool - free), never computed
    for r in records:
        pool = r["pool"]
        assert r["kv_slots_held"] == pool["installed"]["held"]
        # "warm" (right after warm-up) is None where the install had already landed
        assert pool["warm"] is not None or r is compacted
        for reading in (v for v in pool.values() if v is not None):
            assert 0 <= reading["held"] <= reading["pool"] == r["pool_slots"]
        assert 0 < r["run"]["peak_held"] <= r["pool_slots"] and r["run"]["samples"] > 0
    assert stock["pool"]["installed"]["compacted"] is None  # stock: SGLang's own gauges only
    assert stock["kv_slots_held"] <= stock["pool_slots"]
    # before its install the compaction server holds what stock holds (same requests) ...
    if compacted["pool"]["warm"] is not None:
        before = compacted["pool"]["warm"]["held"]
        assert abs(before - stock["kv_slots_held"]) <= 0.1 * stock["kv_slots_held"]
    # ... after it, the compacted node's slots and little else: 5x less than stock
    installed = compacted["pool"]["installed"]
    assert 0 < installed["compacted"] <= installed["held"]
    assert stock["kv_slots_held"] / compacted["kv_slots_held"] >= 5
    # the plugin's free slots are the allocator's, as SGLang itself reports them
    after = compacted["pool"]["after"]
    assert after["free"] == after["sglang_free"]
    assert after["compacted"] + after["tree"] <= after["held"]
    # twelve questions: the six the compaction fitted and six it never saw, graded apart
    assert all(r["requests"] == 12 and r["ttft_p50_s"] > 0 for r in records)
    assert sum(a["seen"] for a in compacted["answers"]) == 6
    assert stock["agreement_seen"] == stock["agreement_unseen"] == 1.0
    for key in ("agreement_unseen", "needle_accuracy_unseen", "needle_accuracy_seen"):
        assert 0.0 <= compacted[key] <= 1.0
    # teacher-forced, per token: stock scoring its own greedy answers agrees with itself (up to
    # prefill-vs-decode numerics) and finds them no less likely; every answer token is scored
    for r in records:
        for a, s in zip(r["answers"], stock["answers"], strict=True):
            assert len(a["forced_agree"]) == len(a["forced_logprobs"]) == len(s["output_ids"])
    assert stock["token_agreement_unseen"] >= 0.95
    assert abs(stock["logprob_gap_unseen"]) < 0.05
    assert 0.0 <= compacted["token_agreement_unseen"] <= 1.0
    right = [s["needle"] for s in stock["answers"] if not s["seen"] and s["needle"] is not None]
    assert (stock["needle_retention_unseen"] is None) == (not any(right))
    prov = data["provenance"]
    assert prov["command"].startswith("python -m harness.demo") and prov["commit"]
    assert (tmp_path / "demo.png").stat().st_size > 0
    assert not _processes_with(f"COMPACTION_DEMO_TEST={run_id}"), "the demo left processes behind"

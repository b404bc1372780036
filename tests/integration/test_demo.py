"""`make demo`'s program end to end, small: one document, stock vs ratio 0.1, then no orphans.

Real `compactor serve` (Ray), two real SGLang servers, the demo's own table and files.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def _our_processes() -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    marks = ("sglang.launch_server", "compactor serve", "raylet", "gcs_server", "ray::")
    return [line for line in out.splitlines() if any(m in line for m in marks)]


def test_demo_prints_the_table_and_leaves_no_process(prepared_model: Path, tmp_path: Path) -> None:
    before = set(_our_processes())
    proc = subprocess.run(
        [
            sys.executable, "-m", "harness.demo", "--docs", "1", "--sentences", "40",
            "--ratios", "0.1", "--max-new-tokens", "12", "--out", str(tmp_path),
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "KV slots held" in proc.stdout and "ratio 0.1" in proc.stdout
    records = json.loads((tmp_path / "demo.json").read_text())["records"]
    assert [r["config"] for r in records] == ["stock", "ratio 0.1"]
    stock, compacted = records
    assert compacted["compactions_installed"] == 1 and compacted["compaction_fallbacks"] == 0
    assert stock["kv_slots_held"] / compacted["kv_slots_held"] >= 5
    assert all(r["requests"] == 6 and r["ttft_p50_s"] > 0 for r in records)
    assert (tmp_path / "demo.png").stat().st_size > 0
    assert set(_our_processes()) <= before, "the demo left processes behind"

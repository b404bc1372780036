"""`python -m benchmarks.offline.ruler --quick`: the suite's structure and pairing (no score)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from harness.provenance import ROOT


def test_quick_suite_pairs_every_item_with_stock(tmp_path: Path, prepared_model: Path) -> None:
    out = tmp_path / "ruler.json"
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.offline.ruler", "--quick", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(out.read_text())
    assert {"command", "commit", "machine", "date"} <= set(data["provenance"])
    items = data["items"]
    tasks, settings = {"niah_single", "vt"}, {"agnostic", "multi-query"}
    assert {r["task"] for r in items} == tasks and {r["setting"] for r in items} == settings
    assert len(items) == len(tasks) * len(settings)  # 1 seed, 1 method, 1 ratio
    for task in tasks:  # one stock answer per item, the same in both settings
        assert len({r["stock_score"] for r in items if r["task"] == task}) == 1
    for r in items:
        assert 0 <= r["score"] <= 1 and 0 <= r["token_agreement"] <= 1
    summary = {(s["setting"], s["task"]): s for s in data["summary"]}
    assert set(summary) == {(s, t) for s in settings for t in (*tasks, "all")}
    for (_setting, task), s in summary.items():
        assert s["items"] == (2 if task == "all" else 1)
        m = s["mcnemar"]
        assert m["both"] + m["stock_only"] + m["ours_only"] + m["neither"] == s["items"]
        assert s["compression"] == 10.0 and s["token_agreement_ci"] is not None

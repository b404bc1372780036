"""`benchmarks/gpu/cascade_step.py` (GPU timings) runs its workload end to end on the CPU: the
rows it builds pass the cascade's layout checks, across every timed step the prefix calls are
planned once, and the static cascade gives the eager cascade's output."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.gpu.cascade_step import STAGES, main

TINY = ["--device", "cpu", "--dtype", "float32", "--layers", "2", "--batch", "3",
        "--prefix-tokens", "64", "--ratio", "0.25", "--tail", "4", "--heads", "4",
        "--kv-heads", "2", "--head-dim", "16", "--reps", "2"]  # fmt: skip


def test_cpu_plumbing_plans_the_prefix_once(tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    assert main([*TINY, "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    ms = res["ms_per_step"]
    assert set(ms) == {*STAGES, "step", "static_prep", "static_eager", "static_replay"}
    assert ms.pop("static_replay") is None  # a CUDA graph: not on the CPU
    assert all(v > 0 for v in ms.values())
    assert res["static_max_abs_diff"] < 1e-5  # the static cascade gives the eager one's output
    # 16 entries per head x 2 heads x 2 layers = 64 cells in 16 slots of 4 cells
    assert res["entries_per_head"] == 16 and res["n_slots"] == 16
    assert res["prefix_plans_made"] == 1  # every step after the first reused the prefix plan
    assert res["provenance"]["command"].startswith("python -m benchmarks.gpu.cascade_step")

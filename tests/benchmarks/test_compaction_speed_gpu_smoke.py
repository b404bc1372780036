"""benchmarks/gpu/compaction_speed_gpu.py --smoke: the GPU benchmark's code path, tiny, on the CPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from sglang_ext.config import PLUGIN_SPEC

ROOT = Path(__file__).resolve().parents[2]


def _load_benchmark():
    from benchmarks.gpu import compaction_speed_gpu

    return compaction_speed_gpu


def test_gpu_benchmark_smoke_runs_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _load_benchmark()
    argv = ["compaction_speed_gpu.py", "--smoke", "--skip", "layer", "--out", str(tmp_path)]
    argv += ["--chunk-tokens", "300"]  # the service's rule: the 512-token prefix in 2 chunks
    monkeypatch.setattr(sys, "argv", argv)
    assert bench.main() == 0
    out = json.loads((tmp_path / "compaction_speed_gpu_smoke.json").read_text())
    assert out["meta"]["device"] == "cpu" and out["provenance"]["commit"]
    assert [r["method"] for r in out["doc"]] == ["am-highest", "am-omp-fast"]
    assert [(r["method"], r["T"]) for r in out["big"]] == [("am-highest", 512)]
    assert [r["chunk_size"] for r in (*out["doc"], *out["big"])] == [None, None, 300]
    assert out["provenance"]["command"].endswith("--chunk-tokens 300")
    for rec in (*out["doc"], *out["big"]):
        assert "error" not in rec
        assert rec["spec"]["queries"]["sources"] == ["follow-up"]
        assert rec["spec"]["on_policy"] is PLUGIN_SPEC.on_policy
        stages = rec["wall_s"]
        assert {"prefill", "queries", "selection", "beta", "values", "compaction"} <= set(stages)
        fit = stages["selection"] + stages["beta"] + stages["values"]
        assert 0 < fit <= stages["compaction"] + 1e-6
        assert rec["total_s"] >= stages["prefill"] + stages["queries"]
        assert 0 < rec["kept_per_head_mean"] <= rec["budget_per_head"]
    assert out["meta"]["warmup_s"] > 0 and out["meta"]["warmup_T"] == 128  # untimed, first


def test_gpu_benchmark_starts_no_step_past_its_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = _load_benchmark()
    argv = ["compaction_speed_gpu.py", "--smoke", "--skip", "big", "--budget-s", "0"]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(tmp_path)])
    assert bench.main() == 1  # an incomplete run says so
    out = json.loads((tmp_path / "compaction_speed_gpu_smoke.json").read_text())
    assert [r["skipped"] for r in out["doc"]] == ["not started: over --budget-s 0"] * 2
    assert out["layer"]["skipped"] and out["big"] == []


def test_the_spelled_out_plugin_spec_is_the_plugin_s(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where sglang_ext is not importable the benchmark spells the plugin's spec out: the same."""
    bench = _load_benchmark()
    monkeypatch.setitem(sys.modules, "sglang_ext.config", None)  # import -> ImportError
    assert bench.plugin_spec("am-highest", 0.2) == PLUGIN_SPEC.replace(
        method="am-highest", ratio=0.2
    )

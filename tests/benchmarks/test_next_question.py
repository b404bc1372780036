"""benchmarks/server/next_question.py end to end on a short needle and a short prose document with
the plugin's spec, a target_error configuration and GVote: the result file's rows, their
ranges, provenance and plot; and its configuration registry. The run serves `plumbing_model`
(random weights, the embedded model's tokenizer): what is checked is the script, not a figure
(benchmarks/results/next_question.json holds SmolLM2's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.server import _next_question_report as report
from benchmarks.server import next_question as bench

ROOT = Path(__file__).resolve().parents[2]


def test_baseline_is_the_old_plugin_spec_and_configs_override_today_s() -> None:
    from sglang_ext.config import PLUGIN_SPEC

    assert bench.config_spec("default") == PLUGIN_SPEC
    old = bench.config_spec("baseline")  # the defaults when issue #21 was filed
    assert old.queries.sources == ("follow-up",) and old.queries.max_queries_per_head == 2048
    assert (old.method, old.on_policy, old.ratio) == ("am-highest", True, 0.1)
    assert old.queries.follow_up_answer_tokens == 32
    assert bench.config_spec("repeat-prefill").queries.sources == ("follow-up", "repeat-prefill")
    assert bench.config_spec("ratio-0.2").ratio == 0.2
    target = bench.config_spec("target-0.2")
    assert (target.target_error, target.ratio, target.method) == (0.2, 0.3, PLUGIN_SPEC.method)
    assert bench.config_spec("gvote").method == "gvote"
    with pytest.raises(ValueError, match="nope"):
        bench.config_spec("nope")


def test_short_documents_write_rows_in_range(plumbing_model: Path, tmp_path: Path) -> None:
    out, png = tmp_path / "nq.json", tmp_path / "nq.png"
    argv = ["--model", str(plumbing_model), "--docs", "1", "--prose-docs", "1"]
    argv += ["--sentences", "20", "--configs", "baseline,target-0.2,gvote"]
    argv += ["--refit-steps", "1,3", "--seen-questions", "4", "--answer-tokens", "4"]
    assert bench.main([*argv, "--json", str(out), "--plot", str(png)]) == 0
    data = json.loads(out.read_text())
    assert {"command", "commit", "machine", "date"} <= set(data["provenance"])
    assert "--refit-steps 1,3" in data["provenance"]["command"]
    rows, meta = data["rows"], data["meta"]
    # the target configuration holds one of >= 2 follow-ups out: k=1 is skipped, and said so
    keys = [("baseline", 1), ("baseline", 3), ("target-0.2", 3), ("gvote", 1), ("gvote", 3)]
    assert [(r["config"], r["k"], r["kind"], r["docs"]) for r in rows] == [
        (c, k, kind, 1) for kind in ("needle", "prose") for c, k in keys
    ]
    assert [(s["config"], s["k"]) for s in meta["skipped"]] == [("target-0.2", 1)]
    assert meta["seen_questions"] == 4 and meta["prose_docs"] == 1
    for r in rows:
        # a share of the k fitted questions
        assert r["seen_agree16"] * r["k"] == pytest.approx(round(r["seen_agree16"] * r["k"]))
        assert 0.0 <= r["seen_agree16"] <= 1.0
        assert 0.0 <= r["unseen_agree16"] <= 1.0
        assert 0.0 <= r["unseen_token_agreement"] <= 1.0
        # the full prefix's own greedy tokens are its most likely ones: the gap is small
        assert -1.0 < r["unseen_logppl_gap"] < 5.0
        assert 0.0 < r["kept_ratio"] <= 1.0
        # a fit that keeps every entry reproduces attention exactly (GVote on these random
        # weights keeps the whole prefix: their attention is flat); one that drops entries errs
        if r["kept_ratio"] == 1.0:
            assert r["unseen_attn_error"] == 0.0
        else:
            assert 0.0 < r["unseen_attn_error"] < 2.0
        assert r["seconds"] > 0
        assert (r["unseen_needles"] is None) == (r["kind"] == "prose")
        if r["config"] == "baseline":
            assert r["method"] == "am-highest" and r["ratio"] == 0.1
            assert r["target_met_share"] is None and r["mean_chosen_ratio"] is None
        elif r["config"] == "target-0.2":
            assert r["ratio"] == r["mean_chosen_ratio"] in (0.05, 0.1, 0.2, 0.3)
            assert r["target_met_share"] in (0.0, 1.0) and r["estimated_error"] > 0
        else:  # gvote: the ratio it realized
            assert r["ratio"] == r["kept_ratio"] and r["target_met_share"] is None
    per_doc = [r for r in data["per_document"] if r["config"] != "full"]
    for r in per_doc:
        if r["config"] == "target-0.2":
            assert r["target_met"] == (r["unseen_attn_error"] <= 0.2)
            assert r["ratio"] == r["chosen_ratio"]
        else:
            assert r["target_met"] is None and r["chosen_ratio"] is None
    # the meta compares the chosen / realized ratios with the plugin's fixed one
    memory = {(m["config"], m["kind"]): m for m in meta["memory_vs_baseline"]}
    assert set(memory) == {
        (c, kind) for c in ("target-0.2", "gvote") for kind in ("needle", "prose")
    }
    for m in memory.values():
        assert m["baseline_ratio"] == 0.1
        assert m["memory_vs_baseline"] == pytest.approx(m["mean_ratio"] / 0.1)
    full = [r for r in data["per_document"] if r["config"] == "full"]
    assert [r["kind"] for r in full] == ["needle", "prose"]
    assert all(len(r["unseen_answers"]) == 6 for r in full)
    assert full[0]["unseen_needles"] is not None and full[1]["unseen_needles"] is None
    assert png.stat().st_size > 0


def test_summary_averages_over_documents_and_shares_targets_met() -> None:
    base = {"method": "am-highest", "sources": ["follow-up"], "k": 2, "kind": "needle"}
    base |= {m: 0.5 for m in report.METRICS}
    per_doc = [
        base | {"config": "t", "ratio": 0.1, "chosen_ratio": 0.1, "target_error": 0.2,
                "target_met": True, "unseen_attn_error": 0.1},
        base | {"config": "t", "ratio": 0.3, "chosen_ratio": 0.3, "target_error": 0.2,
                "target_met": False, "unseen_attn_error": 0.3, "unseen_needles": None},
        {"config": "full", "doc": 0},
    ]  # fmt: skip
    (row,) = report.summarize(per_doc)
    assert row["docs"] == 2 and row["target_met_share"] == 0.5
    assert row["ratio"] == row["mean_chosen_ratio"] == pytest.approx(0.2)
    assert row["unseen_attn_error"] == pytest.approx(0.2)
    assert row["unseen_needles"] == 0.5  # None is left out of the mean
    (mem,) = report.memory_vs_baseline([row], 0.1)
    assert mem["memory_vs_baseline"] == pytest.approx(2.0)

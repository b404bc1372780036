"""`python -m benchmarks.offline.ruler --quick`: the suite's structure and pairing (no score)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.offline.ruler import KVPRESS_PY
from harness.provenance import ROOT


def test_quick_suite_pairs_every_item_with_stock(tmp_path: Path, prepared_model: Path) -> None:
    out = tmp_path / "ruler.json"
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.offline.ruler", "--quick", "--seed-start", "3",
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(out.read_text())
    assert {"command", "commit", "machine", "date"} <= set(data["provenance"])
    assert data["base_specs"]["agnostic"]["queries"]["sources"] == ["repeat-prefill"]
    assert "follow-up" in data["base_specs"]["multi-query"]["queries"]["sources"]
    assert {r["seed"] for r in data["items"]} == {1003}  # a later part of the held-out split
    ours = [r for r in data["items"] if r["method"] == "am-highest"]
    tasks, settings = {"niah_single", "vt"}, {"agnostic", "multi-query"}
    haystacks = {"filler", "essays"}
    assert {r["task"] for r in ours} == tasks and {r["setting"] for r in ours} == settings
    assert {(r["task"], r["haystack"]) for r in ours} == {(t, h) for t in tasks for h in haystacks}
    assert len(ours) == len(tasks) * len(haystacks) * len(settings)  # 1 seed, method, ratio
    for task in tasks:  # one stock answer per item, the same in both settings
        for h in haystacks:
            item = [r for r in data["items"] if (r["task"], r["haystack"]) == (task, h)]
            assert len({r["stock_score"] for r in item}) == 1
    for r in ours:
        assert 0 <= r["score"] <= 1 and 0 <= r["token_agreement"] <= 1
    press = [r for r in data["items"] if r["method"] == "kvpress:snapkv"]
    if KVPRESS_PY.exists():  # the same items through kvpress, query-agnostic
        assert sorted((r["task"], r["haystack"], r["setting"]) for r in press) == sorted(
            (t, h, "agnostic") for t in tasks for h in haystacks
        )
        assert all(isinstance(r["kvpress_stock_agrees"], bool) for r in press)
        # kvpress without a press answers the single needles as stock does (end token aside)
        assert all(r["kvpress_stock_agrees"] for r in press if r["task"] == "niah_single")
    else:
        assert press == []
    summary = {(s["method"], s["setting"], s["task"], s["haystack"]): s for s in data["summary"]}
    for setting in settings:
        groups = [("all", "all"), *((t, "all") for t in tasks), *(("all", h) for h in haystacks)]
        for task, haystack in groups:
            s = summary[("am-highest", setting, task, haystack)]
            assert s["items"] == (4 if (task, haystack) == ("all", "all") else 2)
            m = s["mcnemar"]
            assert m["both"] + m["stock_only"] + m["ours_only"] + m["neither"] == s["items"]
            assert s["compression"] == 10.0 and s["token_agreement_ci"] is not None


def test_a_negative_seed_start_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.offline.ruler import _parse

    with pytest.raises(SystemExit):
        _parse(["--seed-start", "-1"])
    assert "--seed-start must be >= 0, got -1" in capsys.readouterr().err


def test_setting_spec_follows_the_base_and_serving_fallback() -> None:
    from benchmarks.offline.ruler import setting_spec
    from compactor.spec import CompactionSpec
    from sglang_ext.config import PLUGIN_SPEC

    plugin_multi = setting_spec("plugin", "", "multi-query", None)
    assert plugin_multi == PLUGIN_SPEC  # the plugin's own follow-up policy, unchanged
    plugin_agnostic = setting_spec("plugin", "", "agnostic", None)
    assert plugin_agnostic.queries.sources == ("repeat-turn",)  # no follow-ups: fallback
    assert plugin_agnostic.on_policy == PLUGIN_SPEC.on_policy
    assert plugin_agnostic.method == PLUGIN_SPEC.method
    for flag in ("on", "off"):
        assert setting_spec("plugin", "", "agnostic", None, flag).on_policy == (flag == "on")
    spec_multi = setting_spec("spec", "", "multi-query", 8192)
    assert spec_multi.queries.sources == (*CompactionSpec().queries.sources, "follow-up")
    assert spec_multi.queries.max_queries_per_head == 8192
    assert setting_spec("spec", "repeat-prefill", "agnostic", None).queries.sources == (
        "repeat-prefill",
    )


def test_merge_joins_parts_and_refuses_what_disagrees(tmp_path: Path) -> None:
    from benchmarks.offline.ruler_results import merge

    def part(name: str, method: str, stock: float, haystack: str | None = None) -> str:
        item = {"task": "niah_single", "tokens": 1990, "seed": 1000, "stock_score": stock,
                "setting": "agnostic", "method": method, "ratio": 0.1, "score": 1.0,
                "token_agreement": None, "logprob_gap": None, "seconds": 1.0}  # fmt: skip
        if haystack:
            item["haystack"] = haystack
        path = tmp_path / name
        path.write_text(json.dumps({"provenance": {"command": name}, "config": {},
                                    "items": [item]}))  # fmt: skip
        return str(path)

    old, new = part("a.json", "kvzip", 1.0), part("b.json", "kvpress:kvzip", 1.0, "filler")
    records, parts = merge([old, new])
    assert [r["part"] for r in records] == [0, 1] and [p["file"] for p in parts] == [
        "a.json",
        "b.json",
    ]
    assert {r["haystack"] for r in records} == {"filler"}  # a file from before haystacks
    with pytest.raises(ValueError, match=r"stock score 0\.0"):
        merge([old, part("c.json", "snapkv", 0.0)])
    with pytest.raises(ValueError, match="in two files"):
        merge([old, part("d.json", "kvzip", 1.0)])
    essays = part("e.json", "kvzip", 0.0, "essays")  # another item: another haystack
    assert len(merge([old, essays])[0]) == 2

"""benchmarks/next_question.py end to end on a short document with the plugin's spec: the
result file's rows, their ranges, provenance and plot; and its configuration registry."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load() -> Any:
    spec = importlib.util.spec_from_file_location(
        "next_question", ROOT / "benchmarks" / "next_question.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


bench = _load()


def test_baseline_is_the_plugin_spec_and_configs_override_it() -> None:
    from sglang_ext.config import PLUGIN_SPEC

    assert bench.config_spec("baseline") == PLUGIN_SPEC
    alt = bench.config_spec("repeat-prefill")
    assert alt.queries.sources == ("follow-up", "repeat-prefill")
    assert alt.replace(queries={"sources": PLUGIN_SPEC.queries.sources}) == PLUGIN_SPEC
    assert bench.config_spec("ratio-0.2").ratio == 0.2
    with pytest.raises(ValueError, match="nope"):
        bench.config_spec("nope")


def test_short_document_writes_rows_in_range(prepared_model: Path, tmp_path: Path) -> None:
    out, png = tmp_path / "nq.json", tmp_path / "nq.png"
    argv = ["--model", str(prepared_model), "--docs", "1", "--sentences", "20"]
    argv += ["--configs", "baseline", "--refit-steps", "1,2", "--answer-tokens", "8"]
    assert bench.main([*argv, "--json", str(out), "--plot", str(png)]) == 0
    data = json.loads(out.read_text())
    assert {"command", "commit", "machine", "date"} <= set(data["provenance"])
    assert "--refit-steps 1,2" in data["provenance"]["command"]
    rows = data["rows"]
    assert [(r["config"], r["k"], r["docs"]) for r in rows] == [
        ("baseline", 1, 1),
        ("baseline", 2, 1),
    ]
    for r in rows:
        assert r["method"] == "am-highest" and r["ratio"] == 0.1
        # a share of the k fitted questions
        assert r["seen_agree16"] * r["k"] == pytest.approx(round(r["seen_agree16"] * r["k"]))
        assert 0.0 <= r["seen_agree16"] <= 1.0
        assert 0.0 <= r["unseen_agree16"] <= 1.0
        assert 0.0 <= r["unseen_token_agreement"] <= 1.0
        # the full prefix's own greedy tokens are its most likely ones: the gap is small
        assert -1.0 < r["unseen_logppl_gap"] < 5.0
        assert r["seconds"] > 0
    full = [r for r in data["per_document"] if r["config"] == "full"]
    assert len(full) == 1 and len(full[0]["unseen_answers"]) == 6
    assert png.stat().st_size > 0

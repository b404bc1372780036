"""benchmarks/report/ruler_plot.py: the curves it draws, and the plot of the committed files."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.report.ruler_plot import curves, plot


def _s(setting: str, method: str, compression: float, acc: float, task: str = "all") -> dict:
    return {"setting": setting, "method": method, "compression": compression, "task": task,
            "accuracy": acc, "accuracy_ci": [acc - 0.1, acc + 0.1], "stock_accuracy": 0.9,
            "items": 8}  # fmt: skip


def test_curves_group_by_setting_and_method_in_compression_order() -> None:
    got = curves([_s("agnostic", "kvzip", 20.0, 0.4), _s("agnostic", "kvzip", 10.0, 0.6),
                  _s("multi-query", "kvzip", 10.0, 0.7), _s("agnostic", "kvzip", 10.0, 0.0, "vt"),
                  {**_s("agnostic", "kvzip", 10.0, 0.0), "haystack": "essays"}])  # fmt: skip
    points = got["agnostic"]["kvzip"]
    assert [p[0] for p in points] == [10.0, 20.0]
    assert [p[1:] for p in points] == [
        pytest.approx((0.6, 0.5, 0.7)),
        pytest.approx((0.4, 0.3, 0.5)),
    ]
    assert list(got["multi-query"]) == ["kvzip"]  # per-task and per-haystack rows are left out


def test_a_method_run_on_part_of_the_items_is_left_out() -> None:
    got = curves([_s("agnostic", "kvzip", 10.0, 0.6), {**_s("agnostic", "gvote", 10.0, 0.1),
                  "items": 4}])  # fmt: skip
    assert list(got["agnostic"]) == ["kvzip"]


def test_plot_of_the_committed_files_and_a_refusal(tmp_path: Path) -> None:
    import json

    png = tmp_path / "r.png"
    from benchmarks.report.ruler_plot import FILES, RESULTS

    plot([RESULTS / f for f in FILES], png)
    assert png.stat().st_size > 10_000
    other = tmp_path / "other.json"
    n = max(s["items"] for s in json.loads((RESULTS / FILES[0]).read_text())["summary"])
    x = {**_s("agnostic", "x", 10.0, 0.5), "stock_accuracy": 0.5, "items": n}
    other.write_text(json.dumps({"summary": [x]}))
    with pytest.raises(ValueError, match="different items"):
        plot([RESULTS / FILES[0], other], tmp_path / "x.png")

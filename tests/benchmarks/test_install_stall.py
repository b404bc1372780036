"""benchmarks/server/install_stall.py's analysis: gaps from streamed chunks, window labels, ratios,
and the plugin's log lines (no server)."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest

from benchmarks.server import install_stall as bench

ROOT = Path(__file__).resolve().parents[2]


def test_gaps_divide_multi_token_chunks_and_skip_empty_ones() -> None:
    arrivals = [(0.0, 1), (0.1, 2), (0.1, 2), (0.4, 4)]
    gs = bench.gaps(arrivals)
    assert [(g.start, g.end, g.tokens) for g in gs] == [(0.0, 0.1, 1), (0.1, 0.4, 2)]
    assert gs[1].tpot_s == pytest.approx(0.15)
    assert bench.gaps([]) == []


def test_labels_follow_window_priority_and_ratios_use_steady_median() -> None:
    # 10 ms steady steps, a 200 ms prefill step near t=1.1, two 30 ms steps at t=2.0
    times = [i * 0.01 for i in range(100)] + [1.19, 1.2]
    times += [1.2 + i * 0.01 for i in range(1, 80)] + [2.02, 2.05]
    times += [2.05 + i * 0.01 for i in range(1, 50)]
    arrivals = [(t, i + 1) for i, t in enumerate(times)]
    windows = {
        "install": (2.0, 2.04),
        "result": (1.995, 1.995),
        "trigger": (0.995, 1.2),
        "compaction": (1.9, 2.0),
        "steady": (0.0, 0.0),
    }
    out = bench.summarize(bench.gaps(arrivals), windows)
    assert out["steady_tpot_ms"] == pytest.approx(10.0)
    assert out["install"]["gaps"] == 2  # the two 30 ms steps overlap [2.0, 2.04]
    assert out["install"]["max_ms"] == pytest.approx(30.0)
    assert out["install"]["max_over_steady"] == pytest.approx(3.0)
    assert out["install"]["steady_share_at_least_max"] == 0.0
    assert out["steady"]["steady_share_at_least_max"] > 0
    assert out["trigger"]["max_ms"] == pytest.approx(200.0)
    # the install window wins over compaction where both overlap one gap
    assert bench.label(bench.Gap(1.99, 2.01, 1), windows) == "install"
    assert bench.label(bench.Gap(1.95, 1.96, 1), windows) == "compaction"
    assert bench.label(bench.Gap(1.98, 1.999, 1), windows) == "result"


def test_install_window_starts_after_the_gap_the_result_arrived_in() -> None:
    gs = [bench.Gap(0.0, 1.0, 1), bench.Gap(1.0, 1.5, 1), bench.Gap(1.5, 1.6, 1)]
    # the result lands late in a long (prefill) gap; the install finishes in the next one
    lo, hi = bench.install_window(gs, result_at=0.99, installed=1.2)
    assert (lo, hi) == (1.0, 1.2)
    windows = {"install": (lo, hi), "result": (0.99, 0.99)}
    windows |= {"trigger": (0.0, 0.0), "compaction": (0.0, 0.0), "steady": (0.0, 0.0)}
    assert [bench.label(g, windows) for g in gs] == ["result", "install", "steady"]
    # result and install in one gap: the window starts at the result
    assert bench.install_window(gs, result_at=1.1, installed=1.3, margin=0.01) == (1.09, 1.31)


def test_summarize_needs_steady_gaps() -> None:
    windows = {n: (0.0, 10.0) for n in bench.LABELS}
    with pytest.raises(ValueError, match="no steady gap"):
        bench.summarize([bench.Gap(1.0, 2.0, 1)], windows)


def test_log_events_read_millisecond_stamps() -> None:
    text = (
        "[2026-01-02 03:04:05.250 TP0] sglang_ext: compaction requested T=1 hash=ab follow_ups=2\n"
        "[2026-01-02 03:04:05.300 TP0] Prefill batch, #new-seq: 1, #new-token: 11\n"
        "[2026-01-02 03:04:06.125 TP0] sglang_ext: installed compacted prefix hash=ab "
        "method=am-highest T=1871 slots=190 (9.8x)\n"
        "a line without a stamp\n"
    )
    ev = bench.log_events(text)
    base = datetime.datetime(2026, 1, 2, 3, 4, 5).timestamp()
    assert ev["requested"] == [pytest.approx(base + 0.25)]
    assert ev["prefills"] == [pytest.approx(base + 0.3)]
    assert ev["installed"] == [{"t": pytest.approx(base + 1.125), "T": 1871, "slots": 190}]
    assert ev["fallbacks"] == []

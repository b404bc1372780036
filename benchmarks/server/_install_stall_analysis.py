"""The analysis of benchmarks/server/install_stall.py (no server): a stream's inter-token gaps, the
windows that label them, the per-label summary against steady decoding, and the plugin's log
lines (`SGLANG_LOG_MS=1` stamps). The windows and what they hold: install_stall.py's docstring.
"""

from __future__ import annotations

import datetime
import re
import statistics
from dataclasses import dataclass
from typing import Any

LABELS = ("install", "result", "trigger", "compaction", "steady")
TARGET_RATIO = 1.10
_STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3})")
_INSTALLED = re.compile(r"installed compacted prefix hash=\S+ method=\S+ T=(\d+) slots=(\d+)")


@dataclass(frozen=True)
class Gap:
    """One streamed chunk after the first: `start`/`end` wall seconds, `tokens` in it."""

    start: float
    end: float
    tokens: int

    @property
    def tpot_s(self) -> float:
        return (self.end - self.start) / max(self.tokens, 1)


def gaps(arrivals: list[tuple[float, int]]) -> list[Gap]:
    """[(wall time, tokens so far)] of a stream's chunks -> the gaps between them (chunks
    that add no token are skipped)."""
    out, prev = [], arrivals[0] if arrivals else None
    for t, n in arrivals[1:]:
        assert prev is not None
        if n > prev[1]:
            out.append(Gap(prev[0], t, n - prev[1]))
            prev = (t, n)
    return out


def label(gap: Gap, windows: dict[str, tuple[float, float]]) -> str:
    """The first of `LABELS` whose window [start, end] overlaps the gap; else "steady"."""
    for name in LABELS[:-1]:
        lo, hi = windows[name]
        if gap.start < hi and gap.end > lo:
            return name
    return "steady"


def install_window(
    gs: list[Gap], result_at: float, installed: float, margin: float = 0.0
) -> tuple[float, float]:
    """The span whose gaps hold the install's writes: from the end of the gap the result
    arrived in (its token was due before the next poll point; that gap is labelled
    `result`) to the `installed` stamp; from `result_at` when both fall in one gap."""
    holder = next((g for g in gs if g.end >= result_at), None)
    lo = holder.end if holder is not None and holder.end < installed else result_at
    return lo - margin, installed + margin


LOCAL_GAPS = 40


def summarize(gs: list[Gap], windows: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """Median/max TPOT (ms) and count per label, and the ratios to steady's median.

    Raises:
        ValueError: no steady gap (nothing to compare with).
    """
    by: dict[str, list[float]] = {n: [] for n in LABELS}
    for g in gs:
        by[label(g, windows)].append(g.tpot_s * 1e3)
    if not by["steady"]:
        raise ValueError(f"no steady gap among {len(gs)}: windows {windows}")
    steady = statistics.median(by["steady"])
    out: dict[str, Any] = {"steady_tpot_ms": steady}
    for name, xs in by.items():
        out[name] = {
            "gaps": len(xs),
            "median_ms": statistics.median(xs) if xs else None,
            "max_ms": max(xs) if xs else None,
            "p90_ms": sorted(xs)[int(0.9 * (len(xs) - 1))] if xs else None,
            "max_over_steady": max(xs) / steady if xs else None,
            "median_over_steady": statistics.median(xs) / steady if xs else None,
            # noise reference: how many steady gaps are at least this window's worst one
            "steady_share_at_least_max": (
                sum(s >= max(xs) for s in by["steady"]) / len(by["steady"]) if xs else None
            ),
        }
    # the decode's own level right after the install (context and batch as during it): the
    # median of the next LOCAL_GAPS steady gaps
    end = windows["install"][1]
    after = [g.tpot_s * 1e3 for g in gs if g.start >= end and label(g, windows) == "steady"][
        :LOCAL_GAPS
    ]
    inst = by["install"]
    local = statistics.median(after) if after else None
    out["local_steady_after_install_ms"] = local
    out["install_max_over_local_steady"] = max(inst) / local if inst and local else None
    out["install_median_over_local_steady"] = (
        statistics.median(inst) / local if inst and local else None
    )
    return out


def log_events(text: str) -> dict[str, Any]:
    """Stamps (wall seconds) of the plugin's lines and the prefills in a server log slice."""
    ev: dict[str, Any] = {"requested": [], "installed": [], "prefills": [], "fallbacks": []}
    for line in text.splitlines():
        m = _STAMP.match(line)
        if m is None:
            continue
        t = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S.%f").timestamp()
        if "compaction requested" in line:
            ev["requested"].append(t)
        elif (mi := _INSTALLED.search(line)) is not None:
            ev["installed"].append({"t": t, "T": int(mi.group(1)), "slots": int(mi.group(2))})
        elif "prefix stays uncompacted" in line:
            ev["fallbacks"].append(t)
        elif "Prefill batch" in line:
            ev["prefills"].append(t)
    return ev

"""Renderers of the RULER-style suite's Attention Matching tables (registered in
`benchmarks.report._tables_lib.TABLES`, listed by benchmarks/report/readme_tables.py): where
the AM fit loses the needle, lever by lever from am-highest to kvzip (`ruler_am_decomposition`);
the AM family's candidates against kvzip, dev and held-out (`ruler_am_refit`); a method against
another on the same items (`paired_to`); the default's choice on the headline's held-out items
(`ruler_default`)."""

from __future__ import annotations

from typing import Any

from benchmarks.offline.ruler_results import item_key, overall
from benchmarks.report._tables_lib import rec, table
from benchmarks.report._tables_ruler import paired

RATIOS = (0.1, 0.05)

# Held-out, ~2k tokens, query-agnostic, repeat-prefill queries: (key score, budget split,
# what the refit fits, method). Each row changes one lever of the one above it or of the
# kvzip row.
_RMS = "RMS over queries (am-highest)"
_MAX = "max over queries, sinks in the softmax (kvzip)"
_RMS_KVZIP = "RMS over queries, sinks in the softmax"
_UNIFORM = "uniform per head"
_GLOBAL = "global top-k (kvzip)"
_FLAT = "kvzip:layerwise=true:non_uniform=false"
_DECOMPOSITION = (
    (_RMS, _UNIFORM, "beta + values", "am-highest"),
    (_RMS, _UNIFORM, "none", "keep-only:inner=am-highest"),
    (_MAX, _UNIFORM, "none", _FLAT),
    (_MAX, _UNIFORM, "beta + values", f"{_FLAT}:refit=am"),
    (_MAX, _GLOBAL, "none", "kvzip"),
    (_RMS_KVZIP, _GLOBAL, "none", "kvzip:reduce=rms"),
    (_MAX, _GLOBAL, "beta", "kvzip:refit=beta"),
    (_MAX, _GLOBAL, "values", "kvzip:refit=values"),
    (_MAX, _GLOBAL, "beta + values", "kvzip:refit=am"),
)


def _cell(s: dict[str, Any]) -> str:
    """Retention with its 95% interval, then accuracy: "0.75 [0.40, 1.00] / 0.43"."""
    if s["retention"] is None:
        return f"- / {s['accuracy']:.2f}"
    lo, hi = s["retention_ci"]
    return f"{s['retention']:.2f} [{lo:.2f}, {hi:.2f}] / {s['accuracy']:.2f}"


def _fit_cell(s: dict[str, Any], records: list[dict[str, Any]]) -> str:
    """Per-token agreement / log-prob gap / attention output error on the needle's readers."""
    err = [r["output_err"] for r in records]
    return f"{s['token_agreement']:.2f} / {s['logprob_gap']:.2f} / {sum(err) / len(err):.3f}"


def _records(data: dict[str, Any], method: str, ratio: float) -> list[dict[str, Any]]:
    return [r for r in data["items"]
            if r["method"] == method and r["ratio"] == ratio and r["setting"] == "agnostic"]  # fmt: skip


@table("ruler_am_decomposition", "ruler/ruler_am_decomp.json")
def _ruler_am_decomposition(data: list[dict[str, Any]]) -> list[list[str]]:
    """Per row of `_DECOMPOSITION`, at 10x and at 20x: retention / accuracy, then per-token
    agreement / log-prob gap / output error (mean over layers and heads, on the queries of
    the scored question and stock's answer)."""
    summary = [s for s in overall(data[0]["summary"]) if s["setting"] == "agnostic"]
    head = ["key score", "budget split", "refit"]
    for r in RATIOS:
        x = f"{1 / r:.0f}x"
        head += [f"{x}: retention / accuracy", f"{x}: agreement / log-prob gap / output error"]
    first = rec(summary, method="kvzip", ratio=RATIOS[0])
    rows = [head, ["stock", f"{first['items']} items", "-",
                   *([f"accuracy {first['stock_accuracy']:.2f}", "1.00 / 0 / 0"] * len(RATIOS))]]  # fmt: skip
    for score, split, fit, method in _DECOMPOSITION:
        row = [score, split, fit]
        for r in RATIOS:
            s = rec(summary, method=method, ratio=r)
            row += [_cell(s), _fit_cell(s, _records(data[0], method, r))]
        rows.append(row)
    return rows


def paired_to(data: dict[str, Any], method: str, ratio: float, other: str = "kvzip") -> str:
    """`method`'s retention minus `other`'s at `ratio` with the paired 95% interval, and the
    items each answers right where the other is wrong: "+0.05 [-0.02, +0.12] (3 / 1)".

    Raises:
        ValueError: the two ran on different items.
    """
    right = [{item_key(r): r["score"] == 1.0 for r in _records(data, m, ratio)}
             for m in (method, other)]  # fmt: skip
    if right[0].keys() != right[1].keys():
        raise ValueError(f"{method} and {other} at {1 / ratio:.0f}x ran on different items")
    diff, ci, a, b = paired(data, right[0], right[1])
    if diff is None or ci is None:
        return f"- ({a} / {b})"
    return f"{diff:+.2f} [{ci[0]:+.2f}, {ci[1]:+.2f}] ({a} / {b})"


# Candidates of the AM family against kvzip as it is: kvzip's keys refitted whole; the refit
# holding verbatim the keys some query reads with >= 0.2 of its attention; holding whole the
# heads where some query reads a kept key with >= 0.5 or >= 0.2; and kvzip's selection by
# AM's key score (RMS over the queries). Dev (to choose) and held-out (to report), at 10x and
# 20x; a method shows where it ran.
_REFIT_SPLITS = ("dev", "held-out")
_HEADS = "kvzip:refit=am:refit_verbatim={}:refit_hold=heads"
_REFIT_METHODS = ("kvzip", "kvzip:refit=am", "kvzip:refit=am:refit_verbatim=0.2",
                  _HEADS.format(0.5), _HEADS.format(0.2), "kvzip:reduce=rms")  # fmt: skip


@table("ruler_am_refit", "ruler/ruler_dev_am.json", "ruler/ruler_am_refit.json")
def _ruler_am_refit(data: list[dict[str, Any]]) -> list[list[str]]:
    """Per split and method of `_REFIT_METHODS` run there, at 10x and 20x: retention /
    accuracy, agreement / log-prob gap / output error, and the retention minus kvzip's with
    its paired interval (right alone: it / kvzip)."""
    head = ["split", "method", "items"]
    for r in RATIOS:
        x = f"{1 / r:.0f}x"
        head += [f"{x}: retention / accuracy", f"{x}: agreement / log-prob gap / output error",
                 f"{x}: retention - kvzip's [paired 95%] (right alone: it / kvzip)"]  # fmt: skip
    rows = [head]
    for split, d in zip(_REFIT_SPLITS, data, strict=True):
        summary = [s for s in overall(d["summary"]) if s["setting"] == "agnostic"]
        ran = {s["method"] for s in summary}
        for method in (m for m in _REFIT_METHODS if m in ran):
            row = [split, method, str(rec(summary, method=method, ratio=RATIOS[0])["items"])]
            for r in RATIOS:
                s = rec(summary, method=method, ratio=r)
                diff = "-" if method == "kvzip" else paired_to(d, method, r)
                row += [_cell(s), _fit_cell(s, _records(d, method, r)), diff]
            rows.append(row)
    return rows


# The default's choice reported on held-out: the candidate chosen on dev, kvzip (the default
# it would replace) and kvpress's KVzip, on the same held-out items at each compression (at
# 20x the headline's 88 items; at 10x 88 of its 256; at 50x the 16 of the first table).
_DEFAULT_ROWS = (("kvzip", "kvzip"), ("kvzip:reduce=rms", "kvzip:reduce=rms"),
                 ("kvpress's KVzip", "kvpress:kvzip"))  # fmt: skip


@table("ruler_default", "ruler/ruler_2k_default.json")
def _ruler_default(data: list[dict[str, Any]]) -> list[list[str]]:
    """Per compression, then per method of `_DEFAULT_ROWS`: items, retention / accuracy,
    agreement / log-prob gap (kvpress's rows have none), and the retention minus kvzip's and
    minus kvpress's KVzip's with the paired interval (right alone: it / the other)."""
    summary = [s for s in overall(data[0]["summary"]) if s["setting"] == "agnostic"]
    rows = [["compression", "method", "items", "retention / accuracy", "agreement / log-prob gap",
             "- kvzip's [paired 95%] (right alone: it / kvzip)",
             "- kvpress KVzip's [paired 95%] (right alone: it / KVzip)"]]  # fmt: skip
    ratios = {s["ratio"] for s in summary if s["method"] == _DEFAULT_ROWS[1][1]}
    for r in sorted(ratios, reverse=True):
        x = f"{1 / r:.0f}x"
        first = rec(summary, method="kvzip", ratio=r)
        rows.append([x, "stock", str(first["items"]), f"accuracy {first['stock_accuracy']:.2f}",
                     "1.00 / 0", "-", "-"])  # fmt: skip
        for label, method in _DEFAULT_ROWS:
            s = rec(summary, method=method, ratio=r)
            agree = s.get("token_agreement")  # kvpress's rows have none
            fit = "-" if agree is None else f"{agree:.2f} / {s['logprob_gap']:.2f}"
            diffs = ["-" if other == method else paired_to(data[0], method, r, other)
                     for other in ("kvzip", "kvpress:kvzip")]  # fmt: skip
            rows.append([x, label, str(s["items"]), _cell(s), fit, *diffs])
    return rows

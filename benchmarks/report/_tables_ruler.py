"""Renderers of the RULER-style suite's tables (registered in
`benchmarks.report._tables_lib.TABLES`, listed by benchmarks/report/readme_tables.py): the
held-out run, ruler/ruler.json (`ruler`, and per haystack `ruler_haystacks`; the same table of
the plugin's spec on the dev items with kvzip and the default's candidate,
`ruler_plugin_candidate`), our kvzip against kvpress's KVzip at 10x and at 20x on more of its
items (`ruler_10x`, `ruler_20x`), the same at ~4k tokens (`ruler_4k`) and our kvzip there with
its query cap lifted (`ruler_4k_queries`), our kvzip as the sinks and then the queries' own
tokens joined its softmax (`ruler_kvzip`), the defaults before and after they were chosen on it
(`ruler_defaults`), our kvzip's two framings of the repeat (`ruler_repeat`), and the tasks
beyond the 2k needles: multi-key needles at ~4k tokens and variable tracking
(`ruler_breadth`)."""

from __future__ import annotations

from typing import Any

from benchmarks.offline.ruler_results import item_key, on_every_item, overall
from benchmarks.report._tables_lib import rec, table
from compactor.eval.paired import mcnemar_p, retention_difference


def _ruler_cell(s: dict[str, Any]) -> str:
    """Retention with its 95% interval, then accuracy: "0.75 [0.40, 1.00] / 0.43"."""
    if s["retention"] is None:
        return f"- / {s['accuracy']:.2f}"
    lo, hi = s["retention_ci"]
    return f"{s['retention']:.2f} [{lo:.2f}, {hi:.2f}] / {s['accuracy']:.2f}"


def _ruler_10x_20x(summary: list[dict[str, Any]], **match: Any) -> list[str]:
    """The cells at 10x and 20x of the summary row matching `match`, then the per-token
    agreement at both ("0.98 / 0.97")."""
    picked = [rec(summary, **match, ratio=r) for r in (0.1, 0.05)]
    agree = " / ".join(f"{s['token_agreement']:.2f}" for s in picked)
    return [*(_ruler_cell(s) for s in picked), agree]


@table("ruler_plugin_candidate", "ruler/ruler_dev_plugin_candidate.json")
@table("ruler", "ruler/ruler.json")
def _ruler(data: list[dict[str, Any]]) -> list[list[str]]:
    """All tasks and haystacks together: per setting and method, one column per compression.
    A method run on part of the items (one haystack) is left to the per-haystack table."""
    summary = on_every_item(data[0]["summary"])
    ratios = sorted({s["ratio"] for s in summary}, reverse=True)
    first = summary[0]
    rows = [["setting", "method", *(f"{1 / r:.0f}x" for r in ratios), "per-token agreement"]]
    rows.append(["-", f"stock ({first['items']} items)",
                 *([f"accuracy {first['stock_accuracy']:.2f}"] * len(ratios)), "1.00"])  # fmt: skip
    for setting, method in dict.fromkeys((s["setting"], s["method"]) for s in summary):
        cells = [_ruler_cell(rec(summary, setting=setting, method=method, ratio=r)) for r in ratios]
        agree = [rec(summary, setting=setting, method=method, ratio=r).get("token_agreement")
                 for r in ratios]  # fmt: skip
        rows.append([setting, method, *cells,
                     " / ".join("-" if a is None else f"{a:.2f}" for a in agree)])  # fmt: skip
    return rows


@table("ruler_haystacks", "ruler/ruler.json")
def _ruler_haystacks(data: list[dict[str, Any]]) -> list[list[str]]:
    """Query-agnostic, per haystack: stock's accuracy, then each method's cells."""
    return _per_haystack(data[0]["summary"], with_all=False)


# Held-out, ~2k tokens, query-agnostic, at 10x: our kvzip and kvpress's KVzip (the best press
# at 2k) on the same items: (label, method).
_HEAD_TO_HEAD = (("our kvzip", "kvzip"), ("kvpress's KVzip", "kvpress:kvzip"))


def _head_to_head(data: list[dict[str, Any]], ratio: float) -> list[list[str]]:
    """Stock's accuracy, then per method at `ratio`: retention with its interval and accuracy,
    per-token agreement, and the items it answers right where the other answers wrong (the
    exact McNemar p of those two counts on its row); on ours, its retention minus KVzip's with
    the paired interval (:func:`paired`).

    Raises:
        ValueError: the two methods ran on different items (the message names the table).
    """
    summary = [s for s in overall(data[0]["summary"]) if s["setting"] == "agnostic"]
    picked = [rec(summary, method=m, ratio=ratio) for _, m in _HEAD_TO_HEAD]
    right = [_right(data[0], m).get(ratio, {}) for _, m in _HEAD_TO_HEAD]
    if right[0].keys() != right[1].keys():
        name = f"ruler_{1 / ratio:.0f}x"
        raise ValueError(f"{name}: {len(right[0])} and {len(right[1])} items differ")
    diff, ci, *only = paired(data[0], right[0], right[1])
    rows = [["method", "items", "retention [95% interval] / accuracy", "per-token agreement",
             "right where the other is wrong", "retention, ours - KVzip [paired 95%]"]]  # fmt: skip
    first = picked[0]
    rows.append(["stock", str(first["items"]), f"accuracy {first['stock_accuracy']:.2f}", "1.00",
                 "-", "-"])  # fmt: skip
    for (label, _), s, n in zip(_HEAD_TO_HEAD, picked, only, strict=True):
        agree = s.get("token_agreement")
        rows.append([label, str(s["items"]), _ruler_cell(s),
                     "-" if agree is None else f"{agree:.2f}", str(n), "-"])  # fmt: skip
    rows[2][4] += f" (McNemar p {mcnemar_p(*only):.2f})"
    if diff is not None and ci is not None:  # None: stock right on no item
        rows[2][5] = f"{diff:+.2f} [{ci[0]:+.2f}, {ci[1]:+.2f}]"
    return rows


@table("ruler_10x", "ruler/ruler_2k_10x.json")
def _ruler_10x(data: list[dict[str, Any]]) -> list[list[str]]:
    """Ours against kvpress's KVzip at 10x (:func:`_head_to_head`)."""
    return _head_to_head(data, 0.1)


@table("ruler_20x", "ruler/ruler_2k_20x.json")
def _ruler_20x(data: list[dict[str, Any]]) -> list[list[str]]:
    """Ours against kvpress's KVzip at 20x (:func:`_head_to_head`)."""
    return _head_to_head(data, 0.05)


@table("ruler_4k", "ruler/ruler_4k.json")
def _ruler_4k(data: list[dict[str, Any]]) -> list[list[str]]:
    """~4k-token contexts, query-agnostic: every method and press over all items, then per
    haystack."""
    return _per_haystack(data[0]["summary"], with_all=True)


def _per_haystack(summary: list[dict[str, Any]], with_all: bool) -> list[list[str]]:
    """Query-agnostic rows per haystack ("all" first when `with_all`): stock's accuracy (from
    our kvzip's rows), then every method's cells at 10x, 20x and 50x."""
    rows = [["haystack", "method", "10x", "20x", "50x"]]
    mine = [s for s in summary if s["task"] == "all" and s["setting"] == "agnostic"]
    for hay in dict.fromkeys(s["haystack"] for s in mine if with_all or s["haystack"] != "all"):
        here = [s for s in mine if s["haystack"] == hay]
        stock = rec(here, method="kvzip")
        rows.append([hay, f"stock ({stock['items']} items)",
                     *([f"accuracy {stock['stock_accuracy']:.2f}"] * 3)])  # fmt: skip
        for method in dict.fromkeys(s["method"] for s in here):
            rows.append([hay, method, *(_ruler_cell(rec(here, method=method, ratio=r))
                                        for r in (0.1, 0.05, 0.02))])  # fmt: skip
    return rows


# Our kvzip at ~4k tokens with the reference-query cap per KV head at the old default (8192)
# and the new one (16384: above what repeat-prefill yields there, ~12k): (split, cap, file);
# query-agnostic.
_CAP_STEPS = (
    ("dev", "8192 (the old default)", "ruler/ruler_dev_4k_cap8192.json"),
    ("dev", "16384 (none dropped)", "ruler/ruler_dev_4k_cap16384.json"),
    ("held-out", "8192 (the old default)", "ruler/ruler_4k_cap8192.json"),
    ("held-out", "16384 (the new default)", "ruler/ruler_4k_cap16384.json"),
)


@table("ruler_4k_queries", *(f for *_, f in _CAP_STEPS))
def _ruler_4k_queries(data: list[dict[str, Any]]) -> list[list[str]]:
    """Per split and cap: stock's items, our kvzip's cells at 10x, 20x and 50x ("-": not
    run; "(n items)" where a ratio ran on fewer items), then its per-token agreement at 10x."""
    rows = [["split", "queries per KV head", "items", "10x", "20x", "50x",
             "per-token agreement, 10x"]]  # fmt: skip
    for (split, cap, _), d in zip(_CAP_STEPS, data, strict=True):
        mine = [s for s in overall(d["summary"]) if s["method"] == "kvzip"]
        cells = {s["ratio"]: s for s in mine if s["setting"] == "agnostic"}
        items = cells[0.1]["items"]
        rows.append([split, cap, str(items), *(_cap_cell(cells, r, items) for r in (0.1, 0.05, 0.02)),
                     f"{cells[0.1]['token_agreement']:.2f}"])  # fmt: skip
    return rows


def _cap_cell(cells: dict[float, dict[str, Any]], ratio: float, items: int) -> str:
    """The cell at `ratio` ("-": not run), "(n items)" added where it ran on other than `items`."""
    if ratio not in cells:
        return "-"
    n = cells[ratio]["items"]
    return _ruler_cell(cells[ratio]) + ("" if n == items else f" ({n} items)")


# Our kvzip's softmax, step by step: (split, haystack, what it holds, file); query-agnostic.
_KVZIP_STEPS = (
    ("dev", "filler", "the prefix", "ruler/ruler_dev_kvzip_before.json"),
    ("dev", "filler", "+ the sinks", "ruler/ruler_dev_kvzip_after.json"),
    ("dev", "filler", "+ the sinks + its own tokens", "ruler/ruler_dev_kvzip_suffix.json"),
    ("dev", "essays", "+ the sinks", "ruler/ruler_dev_kvzip_essays.json"),
    ("dev", "essays", "+ the sinks + its own tokens", "ruler/ruler_dev_kvzip_suffix_essays.json"),
    ("held-out", "filler", "the prefix", "ruler/ruler_before_sinks.json"),
    ("held-out", "filler", "+ the sinks", "ruler/ruler_agnostic.json"),
    ("held-out", "filler", "+ the sinks + its own tokens", "ruler/ruler_suffix_filler_agnostic.json"),
    ("held-out", "essays", "+ the sinks", "ruler/ruler_essays.json"),
    ("held-out", "essays", "+ the sinks + its own tokens", "ruler/ruler_suffix_essays.json"),
)  # fmt: skip


@table("ruler_kvzip", *(f for *_, f in _KVZIP_STEPS))
def _ruler_kvzip(data: list[dict[str, Any]]) -> list[list[str]]:
    """What each reference query's softmax holds beside the scored keys, per split and
    haystack: retention at 10x and 20x, then the per-token agreement at both."""
    rows = [["split", "haystack", "kvzip's softmax", "10x", "20x", "per-token agreement"]]
    for (split, hay, what, _), d in zip(_KVZIP_STEPS, data, strict=True):
        cells = _ruler_10x_20x(overall(d["summary"]), method="kvzip", setting="agnostic")
        rows.append([split, hay, what, *cells])
    return rows


# The defaults before and after they were chosen on the RULER-style dev seeds, then reported on
# the held-out ones: (split, defaults, file, method). "old" / "new": as shipped before / after.
_DEFAULTS = (
    ("dev", "CLI/service, old: am-omp-fast, repeat-prefill + self-study, 2048 per head",
     "ruler/ruler_dev_spec.json", "am-omp-fast"),
    ("dev", "CLI/service: kvzip, repeat-prefill + self-study, 2048", "ruler/ruler_dev_spec.json", "kvzip"),
    ("dev", "CLI/service, new: kvzip, repeat-prefill, 8192", "ruler/ruler_dev_kvzip_after.json", "kvzip"),
    ("dev", "plugin, old: am-highest, on-policy", "ruler/ruler_dev_plugin.json", "am-highest"),
    ("dev", "plugin: kvzip, on-policy", "ruler/ruler_dev_plugin.json", "kvzip"),
    ("dev", "plugin: kvzip, on-policy, 8192", "ruler/ruler_dev_plugin_8192.json", "kvzip"),
    ("dev", "plugin: am-highest, off-policy, 8192", "ruler/ruler_dev_plugin_offpolicy.json",
     "am-highest"),
    ("dev", "plugin: kvzip:refit=am, off-policy, 8192", "ruler/ruler_dev_plugin_offpolicy.json",
     "kvzip:refit=am"),
    ("dev", "plugin, new: kvzip, off-policy, 8192", "ruler/ruler_dev_plugin_offpolicy.json", "kvzip"),
    ("held-out", "CLI/service, old", "ruler/ruler_default_method.json", "am-omp-fast"),
    ("held-out", "CLI/service, new", "ruler/ruler_agnostic.json", "kvzip"),
    ("held-out", "CLI/service, new", "ruler/ruler_multiquery.json", "kvzip"),
    ("held-out", "plugin, old", "ruler/ruler_plugin_old.json", "am-highest"),
    ("held-out", "plugin, new", "ruler/ruler_plugin_new.json", "kvzip"),
)  # fmt: skip


@table("ruler_defaults", *dict.fromkeys(f for _, _, f, _ in _DEFAULTS))
def _ruler_defaults(data: list[dict[str, Any]]) -> list[list[str]]:
    """Old and new defaults per split and setting: retention at 10x and 20x, then the
    per-token agreement at both."""
    files = dict(zip(dict.fromkeys(f for _, _, f, _ in _DEFAULTS), data, strict=True))
    rows = [["split", "defaults", "setting", "10x", "20x", "per-token agreement"]]
    for split, label, name, method in _DEFAULTS:
        summary = overall(files[name]["summary"])
        for setting in dict.fromkeys(s["setting"] for s in summary if s["method"] == method):
            cells = _ruler_10x_20x(summary, setting=setting, method=method)
            rows.append([split, label, setting, *cells])
    return rows


# Our kvzip's reference queries: the repeat as plain text after the prefix (repeat-prefill, the
# default before) or asked as the assistant's turn (repeat-turn, the default since); query-
# agnostic, on the same items per split: (split, source, file).
_REPEAT = (
    ("dev", "repeat-prefill", "ruler/ruler_dev_kvzip_kernel.json"),
    ("dev", "repeat-turn", "ruler/ruler_dev_repeat_turn.json"),
    ("held-out", "repeat-prefill", "ruler/ruler_2k_repeat_prefill.json"),
    ("held-out", "repeat-turn", "ruler/ruler_2k_repeat_turn.json"),
)


@table("ruler_repeat", *(f for *_, f in _REPEAT))
def _ruler_repeat(data: list[dict[str, Any]]) -> list[list[str]]:
    """Per split and source: our kvzip's cells at 10x and 20x ("(n items)"; "-": not run),
    then at each ratio the items it answers right where the split's other source answers
    wrong.

    Raises:
        ValueError: the two sources of a split ran on different items at a ratio.
    """
    right = [_right(d, "kvzip") for d in data]  # per file: {ratio: {item: right}}
    rows = [["split", "reference queries", "10x", "20x", "right where the other is wrong"]]
    for i, ((split, source, _), d) in enumerate(zip(_REPEAT, data, strict=True)):
        cells = {s["ratio"]: s for s in overall(d["summary"]) if s["method"] == "kvzip"}
        only = []
        for ratio in (0.1, 0.05):
            mine, theirs = right[i].get(ratio, {}), right[i ^ 1].get(ratio, {})  # i ^ 1: other
            if mine.keys() != theirs.keys():
                raise ValueError(f"ruler_repeat: {split} {source} at {1 / ratio:.0f}x: "
                                 f"{len(mine)} items, the other source {len(theirs)}")  # fmt: skip
            only.append(str(sum(v and not theirs[k] for k, v in mine.items())) if mine else "-")
        at = [_ruler_cell(cells[r]) + f" ({cells[r]['items']} items)" if r in cells else "-"
              for r in (0.1, 0.05)]  # fmt: skip
        rows.append([split, source, *at, " / ".join(only)])
    return rows


def paired(
    data: dict[str, Any], a: dict[tuple[Any, ...], bool], b: dict[tuple[Any, ...], bool]
) -> tuple[float | None, tuple[float, float] | None, int, int]:
    """Of two methods' right answers on the same items of `data` ({item: right}): a's
    retention minus b's with its paired 95% interval (:func:`retention_difference`; None where
    stock is right on no item), and the items a answers right where b is wrong, and b where a."""
    stock = {item_key(r): r["stock_score"] == 1.0 for r in data["items"]}
    keys = list(a)
    diff, ci = retention_difference([stock[k] for k in keys], [a[k] for k in keys],
                                    [b[k] for k in keys])  # fmt: skip
    return (diff, ci, sum(a[k] and not b[k] for k in keys),
            sum(b[k] and not a[k] for k in keys))  # fmt: skip


def _right(data: dict[str, Any], method: str) -> dict[float, dict[tuple[Any, ...], bool]]:
    """Whether `method` (query-agnostic) answered each item right, per ratio."""
    got: dict[float, dict[tuple[Any, ...], bool]] = {}
    for r in data["items"]:
        if r["method"] == method and r["setting"] == "agnostic":
            got.setdefault(r["ratio"], {})[item_key(r)] = r["score"] == 1.0
    return got


# Breadth beyond the 2k needles: (what, file). Query-agnostic, held-out.
_BREADTH = (
    ("multi-key needles, ~4k tokens", "ruler/ruler_4k_multikey_merged.json"),
    ("variable tracking, ~2k tokens", "ruler/ruler_2k_vt.json"),
)


@table("ruler_breadth", *(f for _, f in _BREADTH))
def _ruler_breadth(data: list[dict[str, Any]]) -> list[list[str]]:
    """Per file of `_BREADTH` and method: items, stock's accuracy and mean score (a vt answer
    scores the share of the variables it names), then at 10x and 20x the retention / accuracy,
    the mean score and the per-token agreement (kvpress's runs generate only: "-")."""
    rows = [["task", "method", "items", "stock: accuracy / mean score",
             *(f"{x}: retention / accuracy, mean score, agreement" for x in ("10x", "20x"))]]  # fmt: skip
    for (what, _), d in zip(_BREADTH, data, strict=True):
        summary = [s for s in overall(d["summary"]) if s["setting"] == "agnostic"]
        for method in dict.fromkeys(s["method"] for s in summary):
            first = rec(summary, method=method, ratio=0.1)
            recs = [r for r in d["items"] if r["method"] == method and r["setting"] == "agnostic"]
            stock = {item_key(r): r["stock_score"] for r in recs}
            row = [what, method, str(first["items"]),
                   f"{first['stock_accuracy']:.2f} / {sum(stock.values()) / len(stock):.2f}"]  # fmt: skip
            for r in (0.1, 0.05):
                s = rec(summary, method=method, ratio=r)
                scores = [x["score"] for x in recs if x["ratio"] == r]
                agree = "-" if s.get("token_agreement") is None else f"{s['token_agreement']:.2f}"
                row.append(f"{_ruler_cell(s)}, {sum(scores) / len(scores):.2f}, {agree}")
            rows.append(row)
    return rows

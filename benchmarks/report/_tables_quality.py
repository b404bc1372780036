"""Renderers of the compaction-quality tables in the documents (registered in
`benchmarks.report._tables_lib.TABLES`, listed by benchmarks/report/readme_tables.py): quality.json and the
on-policy runs (`quality`, `onpolicy`, `seeds`), methods.json (`methods`), agreement.json
(`agreement`), next_question.json (`next_question`), equal_memory.json (`equal_memory`) and the
RULER-style suite, ruler.json (`ruler`, and per haystack `ruler_haystacks`), our kvzip as the
sinks and then the queries' own tokens joined its softmax (`ruler_kvzip`), and the defaults
before and after they were chosen on it (`ruler_defaults`).
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.offline.ruler import on_every_item, overall
from benchmarks.report._tables_lib import frac, num, rec, short, table


@table("quality", "quality.json")
def _quality(data: list[dict[str, Any]]) -> list[list[str]]:
    rows = [["method", "ratio", "output err", "mass err", "logppl gap", "agreement", "needles"]]
    for r in data[0]["records"]:
        rows.append(
            [r["method"], str(r["ratio"]), num(r["output_rel_err"]), num(r["mass_rel_err"]),
             num(r["logppl_gap"]), f"{r['agreement']:.2f}", f"{r['niah_accuracy']:.2f}"]
        )  # fmt: skip
    return rows


@table("onpolicy", "quality_onpolicy.json", "quality.json")
def _onpolicy(data: list[dict[str, Any]]) -> list[list[str]]:
    on, off = data[0]["records"], data[1]["records"]
    rows = [["method", "ratio", "output err", "mass err", "logppl gap (off-policy)", "agreement"]]
    for r in on:
        if r["method"] == "full":
            continue
        o = rec(off, method=r["method"], ratio=r["ratio"])
        rows.append(
            [r["method"], str(r["ratio"]), num(r["output_rel_err"]), num(r["mass_rel_err"]),
             f"{num(r['logppl_gap'])} ({num(o['logppl_gap'])})", f"{r['agreement']:.2f}"]
        )  # fmt: skip
    return rows


@table("seeds", "quality_onpolicy.json", "quality_onpolicy_seed2.json")
def _seeds(data: list[dict[str, Any]]) -> list[list[str]]:
    ratios = (0.2, 0.1, 0.05)

    def gap(recs: list[dict[str, Any]], method: str, ratio: float) -> float:
        return float(rec(recs, method=method, ratio=ratio)["logppl_gap"])

    sets = [("seeds 0-1 (table above)", [data[0]["records"]]),
            ("seeds 2-3", [data[1]["records"]]),
            ("mean of the four", [data[0]["records"], data[1]["records"]])]  # fmt: skip
    rows = [["documents", *map(str, ratios)]]
    for label, recs in sets:
        cells = []
        for x in ratios:
            am = statistics.mean(gap(rs, "am-omp", x) for rs in recs)
            keep = statistics.mean(gap(rs, "keep-only", x) for rs in recs)
            cells.append(f"{am:.3f} vs {keep:.3f}")
        rows.append([label, *cells])
    return rows


_METHOD_LABELS = {
    "keep-only": "keep-only (AM's keys, β=0)",
    "snapkv:refit=am": "snapkv + AM refit",
    "h2o:refit=am": "h2o + AM refit",
    "streamingllm:n_sink=0": "streamingllm",
    "streamingllm:n_sink=0:refit=am": "streamingllm + AM refit",
    "kvcompose:group_size=3": "kvcompose",
    "compresskv:refit=am": "compresskv + AM refit",
}


@table("methods", "methods.json")
def _methods(data: list[dict[str, Any]]) -> list[list[str]]:
    recs = data[0]["records"]
    ratios = (0.2, 0.1, 0.05, 0.02)
    full = rec(recs, method="full")["kept_tokens"]
    rows = [["method", *map(str, ratios)]]
    methods = list(dict.fromkeys(r["method"] for r in recs if r["method"] != "full"))
    methods.sort(key=lambda m: m == "gvote")  # no fixed budget: last
    for m in methods:

        def cell(r: dict[str, Any]) -> str:
            return " / ".join(
                [short(r["output_rel_err"]), short(r["mass_rel_err"]),
                 short(r["logppl_gap"]), str(round(r["niah_accuracy"]))]
            )  # fmt: skip

        if m == "gvote":  # chooses its own budget: one result whatever the ratio
            r = rec(recs, method=m, ratio=ratios[0])
            label = f"gvote (chooses its own budget: kept {r['kept_tokens'] / full:.0%} here)"
            rows.append([label, cell(r), "", "", ""])
            continue
        rows.append(
            [_METHOD_LABELS.get(m, m), *(cell(rec(recs, method=m, ratio=x)) for x in ratios)]
        )
    return rows


def _stock_needles(examples: list[dict[str, Any]]) -> float:
    """Needle accuracy of the uncompacted answers stored beside the compacted ones."""
    from harness.workload import needle_correct

    first = examples[0]["config"]
    graded = [
        needle_correct(e["question"], e["stock"], e["doc"])
        for e in examples
        if e["config"] == first
    ]
    marks = [g for g in graded if g is not None]
    return sum(marks) / len(marks)


@table("agreement", "agreement.json")
def _agreement(data: list[dict[str, Any]]) -> list[list[str]]:
    meta, recs = data[0]["meta"], data[0]["records"]
    n_fit = meta["docs"] * (6 - meta["held_out"])
    n_held = meta["docs"] * meta["held_out"]
    stock = _stock_needles(data[0]["examples"])
    rows = [["method", "policy", "follow-up answers", "agree, fitted questions",
             "agree, held-out", f"needles (stock {stock:.2f})"]]  # fmt: skip
    for r in recs:
        rows.append(
            [r["method"], "on" if r["on_policy"] else "off", str(r["follow_up_answer_tokens"]),
             frac(r["agree_fitted"], n_fit), frac(r["agree_held_out"], n_held),
             f"{r['needle_accuracy']:.2f}"]
        )  # fmt: skip
    return rows


@table("next_question", "next_question.json")
def _next_question(data: list[dict[str, Any]]) -> list[list[str]]:
    # result files since issue #21 also have kind (needle/prose), unseen_attn_error and
    # target_met_share: those columns appear only then
    rows_in = data[0]["rows"]
    new = any("kind" in r for r in rows_in)
    extra = ["kind"] if new else []
    tail = ["unseen attn error", "targets met"] if new else []
    rows = [["config", *extra, "ratio", "questions fitted (k)", "unseen logppl gap",
             "unseen agree16", "seen agree16", *tail, "s per compaction"]]  # fmt: skip
    for r in rows_in:
        kind = [r["kind"]] if new else []
        met = r.get("target_met_share")
        more = [num(r["unseen_attn_error"]), "-" if met is None else f"{met:.2f}"] if new else []
        rows.append(
            [r["config"], *kind, f"{r['ratio']:.3g}", str(r["k"]), num(r["unseen_logppl_gap"]),
             f"{r['unseen_agree16']:.2f}", f"{r['seen_agree16']:.2f}", *more,
             f"{r['seconds']:.0f}"]
        )  # fmt: skip
    return rows


@table("equal_memory", "equal_memory.json")
def _equal_memory(data: list[dict[str, Any]]) -> list[list[str]]:
    rows = [["document", "budgets", "KV slots held (vs gvote)", "entries kept",
             "unseen logppl gap", "unseen agree16"]]  # fmt: skip
    for r in data[0]["summary"]:
        if r["config"] == "stock":
            continue
        rows.append(
            [r["kind"], r["config"], f"{r['physical_slots']:.0f} ({r['physical_vs_gvote']:.2f}x)",
             f"{r['kept_entries']:.0f}", num(r["unseen_logppl_gap"]), f"{r['unseen_agree']:.2f}"]
        )  # fmt: skip
    return rows


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


@table("ruler", "ruler.json")
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


@table("ruler_haystacks", "ruler.json")
def _ruler_haystacks(data: list[dict[str, Any]]) -> list[list[str]]:
    """Query-agnostic, per haystack: stock's accuracy, then each method's cells."""
    rows = [["haystack", "method", "10x", "20x", "50x"]]
    for s0 in [s for s in data[0]["summary"] if s["task"] == "all" and s["haystack"] != "all"]:
        if (s0["setting"], s0["method"], s0["ratio"]) != ("agnostic", "kvzip", 0.1):
            continue
        hay = s0["haystack"]
        rows.append([hay, f"stock ({s0['items']} items)",
                     *([f"accuracy {s0['stock_accuracy']:.2f}"] * 3)])  # fmt: skip
        mine = [s for s in data[0]["summary"]
                if s["task"] == "all" and s["haystack"] == hay and s["setting"] == "agnostic"]  # fmt: skip
        for method in dict.fromkeys(s["method"] for s in mine):
            rows.append([hay, method, *(_ruler_cell(rec(mine, method=method, ratio=r))
                                        for r in (0.1, 0.05, 0.02))])  # fmt: skip
    return rows


# Our kvzip's softmax, step by step: (split, haystack, what it holds, file); query-agnostic.
_KVZIP_STEPS = (
    ("dev", "filler", "the prefix", "ruler_dev_kvzip_before.json"),
    ("dev", "filler", "+ the sinks", "ruler_dev_kvzip_after.json"),
    ("dev", "filler", "+ the sinks + its own tokens", "ruler_dev_kvzip_suffix.json"),
    ("dev", "essays", "+ the sinks", "ruler_dev_kvzip_essays.json"),
    ("dev", "essays", "+ the sinks + its own tokens", "ruler_dev_kvzip_suffix_essays.json"),
    ("held-out", "filler", "the prefix", "ruler_before_sinks.json"),
    ("held-out", "filler", "+ the sinks", "ruler_agnostic.json"),
    ("held-out", "filler", "+ the sinks + its own tokens", "ruler_suffix_filler_agnostic.json"),
    ("held-out", "essays", "+ the sinks", "ruler_essays.json"),
    ("held-out", "essays", "+ the sinks + its own tokens", "ruler_suffix_essays.json"),
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
     "ruler_dev_spec.json", "am-omp-fast"),
    ("dev", "CLI/service: kvzip, repeat-prefill + self-study, 2048", "ruler_dev_spec.json", "kvzip"),
    ("dev", "CLI/service, new: kvzip, repeat-prefill, 8192", "ruler_dev_kvzip_after.json", "kvzip"),
    ("dev", "plugin, old: am-highest, on-policy", "ruler_dev_plugin.json", "am-highest"),
    ("dev", "plugin: kvzip, on-policy", "ruler_dev_plugin.json", "kvzip"),
    ("dev", "plugin: kvzip, on-policy, 8192", "ruler_dev_plugin_8192.json", "kvzip"),
    ("dev", "plugin: am-highest, off-policy, 8192", "ruler_dev_plugin_offpolicy.json",
     "am-highest"),
    ("dev", "plugin: kvzip:refit=am, off-policy, 8192", "ruler_dev_plugin_offpolicy.json",
     "kvzip:refit=am"),
    ("dev", "plugin, new: kvzip, off-policy, 8192", "ruler_dev_plugin_offpolicy.json", "kvzip"),
    ("held-out", "CLI/service, old", "ruler_default_method.json", "am-omp-fast"),
    ("held-out", "CLI/service, new", "ruler_agnostic.json", "kvzip"),
    ("held-out", "CLI/service, new", "ruler_multiquery.json", "kvzip"),
    ("held-out", "plugin, old", "ruler_plugin_old.json", "am-highest"),
    ("held-out", "plugin, new", "ruler_plugin_new.json", "kvzip"),
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

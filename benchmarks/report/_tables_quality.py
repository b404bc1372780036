"""Renderers of the compaction-quality tables in the documents (registered in
`benchmarks.report._tables_lib.TABLES`, listed by benchmarks/report/readme_tables.py):
quality.json and the on-policy runs (`quality`, `onpolicy`, `seeds`), methods.json (`methods`),
agreement.json (`agreement`), next_question.json (`next_question`), equal_memory.json
(`equal_memory`), and the AM refit's candidates on quality and cost (`quality_am_refit`). The
RULER-style suite's tables are in `_tables_ruler.py` and `_tables_ruler_am.py`.
"""

from __future__ import annotations

import statistics
from typing import Any

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


@table(
    "quality_am_refit",
    "quality_am_refit.json",
    "quality_am_heads.json",
    "quality_kvzip_rms.json",
    "am_refit_speed/compaction_speed.json",
    "am_heads_speed/compaction_speed.json",
)
def _quality_am_refit(data: list[dict[str, Any]]) -> list[list[str]]:
    """Per method of the quality files (all but the last two; not `full`; a method in
    several, kvzip, from the first), at each of their ratios: the log-prob gap / agreement /
    output error on the held-out future queries; then the method's compaction (the fit
    alone, CPU seconds) at the speed files' (the last two) T and ratio, from the first speed
    file that ran it ("-" where none did)."""
    records = [r for d in data[:-2] for r in d["records"] if r["method"] != "full"]
    speeds = data[-2:]
    ratios = sorted({r["ratio"] for r in records}, reverse=True)
    T, ratio = speeds[0]["records"][0]["T"], speeds[0]["meta"]["ratio"]
    if any((d["records"][0]["T"], d["meta"]["ratio"]) != (T, ratio) for d in speeds):
        raise ValueError("the speed files ran at different T or ratios")
    head = ["method", *(f"{1 / x:.0f}x: log-prob gap / agreement / output error" for x in ratios),
            f"compaction at T = {T}, {1 / ratio:.0f}x: CPU s"]  # fmt: skip
    rows = [head]
    for method in dict.fromkeys(r["method"] for r in records):
        cells = []
        for x in ratios:
            r = rec(records, method=method, ratio=x)
            cells.append(
                f"{num(r['logppl_gap'])} / {r['agreement']:.2f} / {num(r['output_rel_err'])}"
            )
        timed = [r for d in speeds for r in d["records"] if r["method"] == method]
        rows.append([method, *cells, f"{timed[0]['cpu_s']['compaction']:.1f}" if timed else "-"])
    return rows

"""Renderers of the cluster tables in the documents (registered in
`benchmarks.report._tables_lib.TABLES`, listed by benchmarks/report/readme_tables.py): PD stock
vs the plugin on decode and its mixed numerics, pd.json (`pd`, `pd_logprobs`), and the cluster
simulator, cluster_sim.json (`cluster`).
"""

from __future__ import annotations

from typing import Any

from benchmarks.report._tables_lib import table


@table("pd", "pd.json")
def _pd(data: list[dict[str, Any]]) -> list[list[str]]:
    """PD stock vs the plugin on decode (benchmarks/server/pd.py)."""
    rows = [["PD pair", "decode KV slots held", "less KV", "decode peak in the run",
             "most running", "req/s", "TTFT p50 / p95 s", "decode step ms",
             "prefill sent MB"]]  # fmt: skip
    base = data[0]["rows"][0]["decode_idle"]["held"]
    for r in data[0]["rows"]:
        held = r["decode_idle"]["held"]
        rows.append([
            r["config"], str(held), f"{base / held:.1f}x", str(r["decode_busy"]["peak_held"]),
            str(r["decode_busy"]["max_running"]), f"{r['request_throughput']:.2f}",
            f"{r['ttft_p50_s']:.2f} / {r['ttft_p95_s']:.2f}", f"{r['decode_step_s'] * 1000:.0f}",
            f"{r['prefill_sent_mb']:.1f}",
        ])  # fmt: skip
    return rows


@table("pd_logprobs", "pd.json")
def _pd_logprobs(data: list[dict[str, Any]]) -> list[list[str]]:
    """PD's mixed numerics: stock's answers scored teacher-forced (benchmarks/server/pd.py)."""
    lp = data[0]["logprobs"]
    rows = [["scored on", "against", "mean abs log-prob gap", "top-1 = stock's answer"]]
    for key, scored, against in (
        ("gap_pd_plugin_vs_pd_stock", "pd_plugin", "pd_stock"),
        ("gap_single_plugin_vs_single_stock", "single_plugin", "single_stock"),
        ("gap_pd_stock_vs_single_stock", "pd_stock", "single_stock"),
    ):
        rows.append([scored.replace("_", " "), against.replace("_", " "), f"{lp[key]:.3f}",
                     f"{lp['top1'][scored]:.2f}"])  # fmt: skip
    return rows


@table("cluster", "cluster_sim.json")
def _cluster(data: list[dict[str, Any]]) -> list[list[str]]:
    d = data[0]
    caps, at_rate = d["capacity"], d["at_rate"]
    stock = next(c["capacity_rps"] for c in caps if c["pool"] == 0)
    rate, T = d["config"]["rate"], d["config"]["duration"]
    rows = [
        ["compaction workers", f"capacity, req/s (p95 queueing ≤ {d['slo_p95_s']:g} s)",
         "x stock", f"p95 queueing at {rate:g} req/s (s)",
         f"compactions done / pending in {T:g} s", "mean wait to install (s)"],
    ]  # fmt: skip
    for c, r in zip(caps, at_rate):
        rows.append(
            [str(c["pool"]) + (" (stock)" if c["pool"] == 0 else ""),
             f"{c['capacity_rps']:.2f}", f"{c['capacity_rps'] / stock:.2f}",
             f"{r['queue_delay_p95_s']:.1f}", f"{r['compactions']} / {r['compactions_pending']}",
             f"{r['compaction_wait_mean_s']:.0f}" if r["compactions"] else "-"]
        )  # fmt: skip
    return rows

"""Renderers of the serving runs on real CPU servers: SGLang's load generator against stock and
the plugin after a warm-up (`serving`) and cold, compactions landing mid-run (`serving_cold`)."""

from __future__ import annotations

from typing import Any

from benchmarks.report._tables_lib import held, seen_unseen, table


@table("serving", "serving_3072.json")
def _serving(data: list[dict[str, Any]]) -> list[list[str]]:
    recs = data[0]["records"]
    base = recs[0]["kv_slots_held"]
    rows = [
        ["config", "KV slots held after warm-up", "less KV", "peak in the run", "after the run",
         "max requests running at once", "req/s", "output tok/s", "TTFT p50 / p95 (s)",
         "agree16, fitted / unseen prompts"],
    ]  # fmt: skip
    for r in recs:
        rows.append(
            [
                *held(r, base),
                str(r["kv_slots_held_peak"]),
                str(r["kv_slots_held_after_run"]),
                str(r["max_running_requests"]),
                f"{r['requests_per_s']:.3f}",
                f"{r['output_tokens_per_s']:.2f}",
                f"{r['ttft_p50_s']:.0f} / {r['ttft_p95_s']:.0f}",
                seen_unseen(r, "agreement"),
            ]
        )
    return rows


@table("serving_cold", "serving_cold_3072.json")
def _serving_cold(data: list[dict[str, Any]]) -> list[list[str]]:
    """The cold run: no warm-up, compactions asked and installed during it."""
    rows = [["config", "req/s", "TTFT p50 / p90 (s)", "max requests running at once",
             "compactions installed (onto an evicted original) / results rejected"]]  # fmt: skip
    for r in data[0]["records"]:
        if r["ratio"] is None:
            done = "-"
        else:
            rejected = sum(r["results_rejected"].values())
            done = (f"{r['compactions_installed']} of {r['compactions_requested']} "
                    f"({r['compactions_installed_evicted']}) / {rejected}")  # fmt: skip
        rows.append([r["config"], f"{r['requests_per_s']:.3f}",
                     f"{r['ttft_p50_s']:.0f} / {r['ttft_p90_s']:.0f}",
                     str(r["max_running_requests"]), done])  # fmt: skip
    return rows

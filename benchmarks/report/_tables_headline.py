"""The README's one results table (`headline`): a figure per row, each read from its result file.

Rows: the KV slots two shared documents hold on real CPU servers (`make demo`), requests/s on
a pool too small for stock with compactions landing mid-run (`serving.py --cold`), needles kept at
10x and 20x against kvpress's KVzip on the same held-out RULER-style items, and the GPU serving
run's KV slots and decode step on an 8B-shaped model's 32k shared prefix. Each row names its
baseline: stock SGLang (the plugin not loaded) or kvpress's KVzip press.
"""

from __future__ import annotations

from typing import Any

from benchmarks.offline.ruler_results import item_key
from benchmarks.report._tables_lib import rec, table
from benchmarks.report._tables_ruler import _HEAD_TO_HEAD, _right


def _kept(data: dict[str, Any], method: str, ratio: float) -> tuple[int, int]:
    """Of the items stock answers right, how many `method` keeps at `ratio`, and how many."""
    stock = {item_key(r): r["stock_score"] == 1.0 for r in data["items"]}
    right = _right(data, method)[ratio]
    keys = [k for k in right if stock[k]]
    return sum(right[k] for k in keys), len(keys)


def _needles(data: dict[str, Any], ratio: float) -> list[str]:
    (_, ours), (_, press) = _HEAD_TO_HEAD
    (a, n), (b, _) = _kept(data, ours, ratio), _kept(data, press, ratio)
    items = len({item_key(r) for r in data["items"]})
    return [f"needles kept at {1 / ratio:.0f}x, of stock's {n} right answers ({items} held-out "
            "items, ~2k tokens, query-agnostic)", f"{b} ({b / n:.2f}), kvpress's KVzip",
            f"{a} ({a / n:.2f})", "CPU, SmolLM2-135M"]  # fmt: skip


@table(
    "headline",
    "demo.json",
    "serving_cold_3072.json",
    "ruler/ruler_2k_10x.json",
    "ruler/ruler_2k_20x.json",
    "gpu_serving.json",
)
def _headline(data: list[dict[str, Any]]) -> list[list[str]]:
    demo, cold, r10, r20, gpu = data
    stock, ours = rec(demo["records"], ratio=None), rec(demo["records"], ratio=0.1)
    s_rps, c_rps = (rec(cold["records"], ratio=r)["requests_per_s"] for r in (None, 0.1))
    s_held, c_held = (
        gpu["details"][p]["pool_after_warmup"]["held"] for p in ("stock8b", "plugin8b")
    )
    s_step, c_step = (gpu["details"][p]["prefix"]["decode_step_s"] for p in ("stock8b", "plugin8b"))
    return [
        ["figure", "baseline", "compacted", "measured on"],
        ["KV slots two shared ~1k-token documents hold (ratio 0.1, real servers)",
         f"{stock['kv_slots_held']}, stock SGLang",
         f"{ours['kv_slots_held']} ({stock['kv_slots_held'] / ours['kv_slots_held']:.1f}x fewer)",
         "CPU, SmolLM2-135M"],
        ["requests/s, 3 shared 1k-token prompts x 6 questions in a pool too small for stock "
         "(compactions during the run)", f"{s_rps:.3f}, stock SGLang",
         f"{c_rps:.3f} ({c_rps / s_rps:.2f}x)", "CPU, SmolLM2-135M"],
        _needles(r10, 0.1),
        _needles(r20, 0.05),
        ["KV slots a 32k shared prefix holds (ratio 0.1, real servers)", f"{s_held}, stock SGLang",
         f"{c_held} ({s_held / c_held:.1f}x fewer)", f"{gpu['device']}, 8B-shaped model"],
        ["decode step, 64 requests on that prefix (compacted batches ran eagerly)",
         f"{s_step * 1e3:.1f} ms, stock SGLang", f"{c_step * 1e3:.1f} ms ({c_step / s_step:.2f}x)",
         f"{gpu['device']}, 8B-shaped model"],
    ]  # fmt: skip

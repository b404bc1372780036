"""The figures of `benchmarks.offline.ruler` result files: summaries and joins.

A result file's records are paired per item (stock and one method on the same context and
question); `summarize` turns them into the per-(setting, method, ratio) figures, `merge` joins
the files of runs that split the suite, and `overall` / `on_every_item` pick the rows the
tables and the plot show.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any


def overall(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The summary rows over every task and haystack (files from before haystacks have no
    "haystack" key: their rows are over the filler)."""
    return [s for s in summary if s["task"] == "all" and s.get("haystack", "all") == "all"]


def on_every_item(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`overall` rows of the methods that ran on every item (a part run on one haystack
    only leaves its methods to the per-haystack rows)."""
    rows = overall(summary)
    n = max(s["items"] for s in rows)
    part = {s["method"] for s in rows if s["items"] < n}
    return [s for s in rows if s["method"] not in part]


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Paired figures per (setting, method, ratio): over all items, per task and per
    haystack."""
    from compactor.eval.paired import paired_summary

    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        key = (r["setting"], r["method"], r["ratio"])
        groups[(*key, "all", "all")].append(r)
        groups[(*key, r["task"], "all")].append(r)
        groups[(*key, "all", r["haystack"])].append(r)
    out = []
    for (setting, method, ratio, task, haystack), rs in sorted(groups.items()):
        per_token = rs[0]["token_agreement"] is not None  # kvpress's rows have none
        summary = paired_summary(
            [r["stock_score"] == 1.0 for r in rs],
            [r["score"] == 1.0 for r in rs],
            [r["token_agreement"] for r in rs] if per_token else [],
            [r["logprob_gap"] for r in rs] if per_token else [],
        )
        out.append({"setting": setting, "method": method, "ratio": ratio, "task": task,
                    "haystack": haystack, "compression": round(1 / ratio, 1),
                    **summary})  # fmt: skip
    return out


def item_key(r: dict[str, Any]) -> tuple[Any, ...]:
    """An item's identity across result files: (task, haystack, tokens, seed)."""
    return (r["task"], r.get("haystack", "filler"), r["tokens"], r["seed"])


def merge(paths: list[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(records, parts) of the result files at `paths` (`benchmarks.offline.ruler --merge`).

    Raises:
        ValueError: an item with two stock scores, or a record in two files.
    """
    records: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    stock: dict[tuple[Any, ...], float] = {}
    seen: set[tuple[Any, ...]] = set()
    for i, path in enumerate(paths):
        data = json.loads(Path(path).read_text())
        parts.append({"file": Path(path).name, "provenance": data["provenance"],
                      "config": data["config"], "base_specs": data.get("base_specs")})  # fmt: skip
        for r in data["items"]:
            key = item_key(r)
            if stock.setdefault(key, r["stock_score"]) != r["stock_score"]:
                raise ValueError(f"{path}: item {key} has stock score {r['stock_score']}, "
                                 f"another file {stock[key]}")  # fmt: skip
            run = (key, r["setting"], r["method"], r["ratio"])
            if run in seen:
                raise ValueError(f"{path}: {run} is in two files")
            seen.add(run)
            records.append({**r, "haystack": key[1], "part": i})
    return records, parts

"""The next-question benchmark's report (``next_question.py``): the rows summarized over
documents, memory against the baseline configuration, the plot and the text table."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["METRICS", "memory_vs_baseline", "plot", "print_rows", "share", "summarize"]

# the per-document readings averaged into each summary row
METRICS = (
    "seen_agree16",
    "unseen_agree16",
    "unseen_logppl_gap",
    "unseen_token_agreement",
    "unseen_needles",
    "unseen_attn_error",
    "kept_ratio",
    "estimated_error",
    "seconds",
)


def plot(
    rows: Sequence[dict[str, Any]],
    path: str | Path,
    title: str,
    per_doc: Sequence[dict[str, Any]] = (),
) -> None:
    """Five panels against k, one line per configuration and kind (prose dashed), and the
    target configurations' realized unseen error against their target, per document."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    panels = (
        ("unseen_agree16", "unseen: strict first-N agreement"),
        ("seen_agree16", "seen (fitted): strict first-N agreement"),
        ("unseen_logppl_gap", "unseen: logppl gap (nats/token)"),
        ("unseen_attn_error", "unseen: relative attention-output error"),
        ("ratio", "ratio (chosen / realized for target, gvote)"),
    )
    for ax, (key, label) in zip(axes.flat, panels):
        for name, kind in dict.fromkeys((r["config"], r["kind"]) for r in rows):
            rs = [r for r in rows if (r["config"], r["kind"]) == (name, kind)]
            rs = sorted((r for r in rs if r[key] is not None), key=lambda r: r["k"])
            if rs:
                style = "o-" if kind == "needle" else "s--"
                ax.plot([r["k"] for r in rs], [r[key] for r in rs], style, label=f"{name} {kind}")
        ax.set_xscale("log", base=2)
        ks = sorted({r["k"] for r in rows})
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_xlabel("k seen questions fitted")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    ax = axes.flat[5]
    targets = [r for r in per_doc if r.get("target_error") is not None]
    for k in sorted({r["k"] for r in targets}):
        rs = [r for r in targets if r["k"] == k]
        ax.scatter(
            [r["target_error"] for r in rs], [r["unseen_attn_error"] for r in rs], label=f"k={k}"
        )
    if targets:
        top = max(max(r["target_error"], r["unseen_attn_error"]) for r in targets) * 1.1
        ax.plot([0, top], [0, top], "k:", lw=1, label="realized = target")
        ax.legend(fontsize=7)
    ax.set_xlabel("target error")
    ax.set_ylabel("realized unseen attention error")
    ax.set_title("target configurations, per document", fontsize=10)
    ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_rows(rows: Sequence[dict[str, Any]]) -> None:
    """The summary rows as a text table on stdout."""

    def num(v: float | None, digits: int) -> str:
        return "-" if v is None else f"{v:.{digits}f}"

    head = f"{'config':<16}{'kind':>7}{'k':>4}{'ratio':>7}{'unseen gap':>12}{'unseen agr':>12}"
    head += f"{'seen agr':>10}{'attn err':>10}{'met':>6}{'needles':>9}{'s':>7}"
    print(head)
    for r in rows:
        print(
            f"{r['config']:<16}{r['kind']:>7}{r['k']:>4}{num(r['ratio'], 3):>7}"
            f"{num(r['unseen_logppl_gap'], 4):>12}{num(r['unseen_agree16'], 2):>12}"
            f"{num(r['seen_agree16'], 2):>10}{num(r['unseen_attn_error'], 4):>10}"
            f"{num(r['target_met_share'], 2):>6}{num(r['unseen_needles'], 2):>9}"
            f"{num(r['seconds'], 1):>7}"
        )


def share(flags: Sequence[bool | None]) -> float | None:
    """The share of True among the non-None flags (None when all are None)."""
    scored = [f for f in flags if f is not None]
    return sum(scored) / len(scored) if scored else None


def summarize(per_doc: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (configuration, k, kind): the metrics' means over documents, with `docs` (count),
    `ratio` (mean: the chosen / realized one for target and gvote configurations),
    `mean_chosen_ratio` and `target_met_share` (target configurations; else None).

    The uncompacted ``full`` rows (answers only) are left out.
    """
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for r in per_doc:
        if r["config"] != "full":
            groups.setdefault((r["config"], r["k"], r.get("kind", "needle")), []).append(r)
    out = []
    for (name, k, kind), rs in groups.items():
        row: dict[str, Any] = {
            "config": name,
            "kind": kind,
            "method": rs[0]["method"],
            "ratio": _mean([r["ratio"] for r in rs]),
            "sources": rs[0]["sources"],
            "k": k,
            "docs": len(rs),
            "target_error": rs[0].get("target_error"),
            "mean_chosen_ratio": _mean([r.get("chosen_ratio") for r in rs]),
            "target_met_share": share([r.get("target_met") for r in rs]),
        }
        for m in METRICS:
            row[m] = _mean([r.get(m) for r in rs])
        out.append(row)
    return out


def memory_vs_baseline(
    rows: Sequence[dict[str, Any]], baseline_ratio: float | None
) -> list[dict[str, Any]]:
    """For each summary row of a target or gvote configuration: its mean (chosen / realized)
    ratio against `baseline_ratio` (the plugin's fixed one): ``memory_vs_baseline`` > 1 keeps
    more entries than the plugin does today. Empty when the plugin has no fixed ratio."""
    if not baseline_ratio:
        return []
    return [
        {
            "config": r["config"],
            "kind": r["kind"],
            "k": r["k"],
            "mean_ratio": r["ratio"],
            "baseline_ratio": baseline_ratio,
            "memory_vs_baseline": r["ratio"] / baseline_ratio,
            "target_met_share": r["target_met_share"],
        }
        for r in rows
        if r["target_error"] is not None or r["method"] == "gvote"
    ]


def _mean(vals: Sequence[float | None]) -> float | None:
    """The mean of the non-None values (None when all are None)."""
    got = [v for v in vals if v is not None]
    return sum(got) / len(got) if got else None

"""The next-question benchmark's report: its plot and its text table (``next_question.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["plot", "print_rows"]


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

"""Accuracy vs compression of the RULER-style suite, per setting and method, stock as a line.

    python -m benchmarks.report.ruler_plot     # the files of docs/results.md's `ruler` table
    python -m benchmarks.report.ruler_plot A.json B.json --out X.png

Reads `benchmarks.offline.ruler` result files (their "all tasks" summaries, each with its
bootstrap interval) and draws one panel per setting: a line per method (ours and kvpress's
presses), the accuracy with its 95% interval at each compression, and stock's accuracy on
the same items as a dashed line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks import RESULTS
from benchmarks.offline.ruler_results import on_every_item

FILES = ("ruler/ruler.json",)


def curves(summaries: list[dict[str, Any]]) -> dict[str, dict[str, list[tuple[float, ...]]]]:
    """setting -> method -> [(compression, accuracy, ci low, ci high)] by compression."""
    out: dict[str, dict[str, list[tuple[float, ...]]]] = defaultdict(lambda: defaultdict(list))
    for s in on_every_item(summaries):
        lo, hi = s["accuracy_ci"]
        out[s["setting"]][s["method"]].append((s["compression"], s["accuracy"], lo, hi))
    for methods in out.values():
        for points in methods.values():
            points.sort()
    return out


def plot(files: list[Path], png: Path) -> None:
    """Draw `files`' curves to `png` (raises ValueError when their items' stock differs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = [json.loads(f.read_text()) for f in files]
    summaries = [s for d in data for s in d["summary"]]
    stock = {round(s["stock_accuracy"], 6) for s in on_every_item(summaries)}
    if len(stock) != 1:
        raise ValueError(f"the files score different items: stock accuracies {sorted(stock)}")
    by_setting = curves(summaries)
    colors = plt.get_cmap("tab20").colors  # type: ignore[attr-defined]
    names = sorted({m for methods in by_setting.values() for m in methods})
    color = {m: colors[i % len(colors)] for i, m in enumerate(names)}  # one per method
    fig, axes = plt.subplots(1, len(by_setting), figsize=(6 * len(by_setting), 4.5), sharey=True)
    for ax, (setting, methods) in zip(
        [axes] if len(by_setting) == 1 else axes, sorted(by_setting.items()), strict=True
    ):
        for method, points in sorted(methods.items()):
            x, y, lo, hi = zip(*points, strict=True)
            err = [[a - b for a, b in zip(y, lo, strict=True)],
                   [b - a for a, b in zip(y, hi, strict=True)]]  # fmt: skip
            style = ":" if method.startswith("kvpress:") else "-"  # the presses dotted
            ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=method, linestyle=style,
                        color=color[method])  # fmt: skip
        ax.axhline(next(iter(stock)), color="black", linestyle="--", label="stock")
        ax.set_xscale("log")
        ticks = sorted({x for points in methods.values() for x, *_ in points})
        ax.set_xticks(ticks, [f"{t:g}x" for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("compression (x fewer KV entries)")
        ax.set_title(f"{setting} ({summaries[0]['items']} items)")
        ax.legend(fontsize=7)
    first = axes if len(by_setting) == 1 else axes[0]
    first.set_ylabel("accuracy (95% interval)")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "files", nargs="*", type=Path, help=f"result files (default: {', '.join(FILES)})"
    )
    p.add_argument("--out", type=Path, default=RESULTS / "ruler" / "ruler.png", help="the PNG")
    args = p.parse_args(argv)
    plot(args.files or [RESULTS / f for f in FILES], args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

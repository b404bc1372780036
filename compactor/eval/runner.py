"""Sweep (method, ratio) over eval cases; table and plot helpers used by the CLI and benchmarks.

One record per (method, ratio), averaged over cases: method, ratio, kept_tokens (kept
entries summed over layers and heads), kept_per_head (mean t_h), head_budgets ("uniform" or
"sensitivity"), output_rel_err,
mass_rel_err, logppl, logppl_full, logppl_gap, agreement, niah_accuracy, seconds (mean
compaction wall time per case, from compact_prefix's StageTimes) and stage times. The
prefill and reference queries of a case are computed once and reused by every (method,
ratio) (``Hooks(reuse=...)``). The reused stages would report ~0 s, so a
case would count selection + fit only; ``seconds`` therefore adds the case's first prefill
and query times to each record's own selection + fit time (``stage_seconds`` splits it). The
``full`` method is the uncompacted cache (errors 0).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from compactor import hf
from compactor.eval.harness import EvalCase, build_reference, evaluate_prefix, summarize
from compactor.spec import CompactionSpec

__all__ = [
    "TABLE_COLUMNS",
    "format_table",
    "make_niah_cases",
    "method_spec",
    "plot_records",
    "run_eval",
    "write_json",
]

TABLE_COLUMNS = (
    "method",
    "ratio",
    "kept_per_head",
    "output_rel_err",
    "mass_rel_err",
    "logppl_gap",
    "agreement",
    "niah_accuracy",
    "seconds",
)


def make_niah_cases(
    tokenizer: Any,
    count: int,
    num_tokens: int,
    kinds: Sequence[str] = ("single", "multi-key"),
    seed: int = 0,
) -> list[EvalCase]:
    """`count` NIAH cases (kinds cycled, seeds seed, seed+1, ...) as EvalCases.

    Each case gets its needle questions (scored) plus one open question (unscored) so the
    held-out future tokens include free-form text about the document.
    """
    from compactor.eval.niah import make_niah, question_text

    generic = question_text(tokenizer, "What is the text above about? Describe it in detail.")
    cases = []
    for i in range(count):
        kind = kinds[i % len(kinds)]
        c = make_niah(tokenizer, num_tokens, kind, seed + i)
        enc = lambda s: list(tokenizer(s, add_special_tokens=False)["input_ids"])  # noqa: E731
        cases.append(
            EvalCase(
                name=f"niah-{kind}-{seed + i}",
                prefix_ids=enc(c.prefix),
                questions=[enc(q.text) for q in c.questions] + [enc(generic)],
                expected=[q.answers for q in c.questions] + [()],
            )
        )
    return cases


def parse_method_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"snapkv:refit=am:window=32"`` -> ("snapkv", {"refit": "am", "window": 32}).

    Values parse as int, then float, then ``true``/``false`` as bools, else stay strings.
    Raises ValueError on a part without ``=``.
    """
    name, *parts = spec.split(":")
    params: dict[str, Any] = {}
    for part in parts:
        key, sep, raw = part.partition("=")
        if not sep or not key:
            raise ValueError(f"bad method parameter {part!r} in {spec!r}; use name:key=value")
        value: Any = {"true": True, "false": False}.get(raw.lower(), raw)
        for cast in (int, float):
            try:
                value = cast(raw)
                break
            except ValueError:
                continue
        params[key] = value
    return name, params


def method_spec(base: CompactionSpec, method: str, ratio: float) -> CompactionSpec:
    """`base` for one method entry of a sweep (``name`` or ``name:key=value:...``, see
    :func:`parse_method_spec`) at `ratio`; a ``head_budgets=`` value overrides the base's."""
    name, params = parse_method_spec(method)
    head_budgets = str(params.pop("head_budgets", base.head_budgets))
    return base.replace(
        method=name, method_params=params, ratio=ratio, tokens=None, head_budgets=head_budgets
    )


def run_eval(
    model: Any,
    tokenizer: Any,
    cases: Sequence[EvalCase],
    methods: Sequence[str],
    ratios: Sequence[float],
    spec: CompactionSpec | None = None,
    niah: bool = False,
    answer_tokens: int = 16,
    progress: bool = True,
    model_fingerprint: str | None = None,
) -> list[dict[str, Any]]:
    """Evaluate every (method, ratio) on every case; `full` adds the uncompacted baseline.

    `spec` (default ``CompactionSpec()``) holds every knob but the swept ones: each method
    entry and ratio replace its method, parameters and budget (:func:`method_spec`); a
    method entry's own ``head_budgets=...`` overrides ``spec.head_budgets``, so one sweep
    can hold ``am-omp`` and ``am-omp:head_budgets=auto`` side by side.
    """
    from compactor.pipeline import Hooks, compact_prefix

    if not cases:
        raise ValueError("run_eval: no cases")
    for r in ratios:
        if not 0 < r <= 1:
            raise ValueError(f"ratio must be in (0, 1], got {r}")
    base = spec if spec is not None else CompactionSpec()
    refs = [build_reference(model, tokenizer, c, answer_tokens) for c in cases]
    info = hf.model_info(model)
    records: list[dict[str, Any]] = []
    # prefill + queries per case, shared by all methods/ratios
    hooks = Hooks(progress=progress, reuse={}, model_fingerprint=model_fingerprint)
    base_times: dict[int, tuple[float, float]] = {}  # first (prefill, queries) s per case
    if "full" in methods:
        rows = [evaluate_prefix(model, tokenizer, ref, None, niah) for ref in refs]
        T = sum(len(c.prefix_ids) for c in cases) / len(cases)
        rec = {
            "method": "full",
            "ratio": 1.0,
            "kept_tokens": T * info.num_layers * info.num_kv_heads,
            "kept_per_head": T,
        }
        rec.update(summarize(rows))
        rec.update({"seconds": 0.0, "stage_seconds": {}})
        records.append(rec)
    for method in [m for m in methods if m != "full"]:
        for ratio in ratios:
            run_spec = method_spec(base, method, ratio)
            rows, kept, secs, stages, chosen = [], [], [], [], []
            for ci, ref in enumerate(refs):
                prefix, times = compact_prefix(
                    model, tokenizer, ref.case.prefix_ids, run_spec, hooks=hooks
                )
                rows.append(evaluate_prefix(model, tokenizer, ref, prefix, niah))
                kept.append(prefix.kept_tokens())
                budget = prefix.budget
                if budget is not None and budget.ratio_chosen is not None:  # a chosen budget
                    chosen.append(budget.ratio_chosen)
                first = base_times.setdefault(ci, (times.prefill, times.queries))
                st = {"prefill": first[0], "queries": first[1], "compaction": times.compaction}
                st["total"] = sum(st.values())
                secs.append(st["total"])
                stages.append(st)
            rec = {
                "method": method,
                "ratio": ratio,
                "kept_tokens": sum(kept) / len(kept),
                "kept_per_head": sum(kept) / len(kept) / (info.num_layers * info.num_kv_heads),
                "head_budgets": None if prefix.budget is None else prefix.budget.per_head,
            }
            rec.update(summarize(rows))
            if chosen:
                rec["chosen_ratio"] = sum(chosen) / len(chosen)
            rec["seconds"] = sum(secs) / len(secs)
            rec["stage_seconds"] = {k: sum(s[k] for s in stages) / len(stages) for k in stages[0]}
            records.append(rec)
    return records


def format_table(records: Sequence[dict[str, Any]], columns: Sequence[str] = TABLE_COLUMNS) -> str:
    """A fixed-width text table of `records`."""

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.4f}" if abs(v) < 100 else f"{v:.1f}"
        return str(v)

    rows = [[cell(r.get(c)) for c in columns] for r in records]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(columns)]
    line = lambda xs: "  ".join(x.rjust(w) for x, w in zip(xs, widths))  # noqa: E731
    return "\n".join([line(list(columns)), line(["-" * w for w in widths]), *map(line, rows)])


def write_json(
    records: Sequence[dict[str, Any]],
    path: str | Path,
    meta: dict[str, Any] | None = None,
    provenance: dict[str, Any] | None = None,
) -> None:
    """Write {"provenance": ... (when given), "meta": ..., "records": [...]} to `path`."""
    out: dict[str, Any] = {} if provenance is None else {"provenance": provenance}
    out.update({"meta": meta or {}, "records": list(records)})
    Path(path).write_text(json.dumps(out, indent=2) + "\n")


def plot_records(records: Sequence[dict[str, Any]], path: str | Path) -> None:
    """Three panels vs ratio (output error, mass error, logppl gap), one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = ("output_rel_err", "mass_rel_err", "logppl_gap")
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3.2))
    for ax, metric in zip(axes, metrics):
        for method in dict.fromkeys(r["method"] for r in records):
            pts = sorted((r["ratio"], r[metric]) for r in records if r["method"] == method)
            if method == "full":
                ax.axhline(pts[0][1], color="k", lw=0.8, ls="--", label="full")
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
        ax.set_xscale("log")
        ax.set_xlabel("ratio (kept / T)")
        ax.set_title(metric)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(str(path), dpi=120)
    plt.close(fig)

"""Beta NNLS solvers side by side: fixed-round active set vs the reference's clamped least
squares + projected gradient, on SmolLM2-135M documents (CPU, one thread by default).

For each document: one held-out reference (compactor.eval: greedy answers, held-out
queries), then one compaction per (method, ratio, solver) with the same reference queries
(reused), switching ``compactor.methods.refit.NNLS_SOLVER`` / ``PG_ITERS``. Reports the
project's held-out metrics (output_rel_err, mass_rel_err, logppl_gap) and the wall time
spent in the beta fit (``fit_beta_nnls``, summed over layers) and in the whole compaction.
Each solver variant is also re-timed alone on the captured per-layer problems
(A [H_kv, n, t], mass [H_kv, n]), best of ``--repeats``.

Shape legend: T prefix tokens, t kept per head, n reference queries, H_kv KV heads.

    .venv/bin/python -m benchmarks.offline.nnls_solvers --json benchmarks/results/nnls_solvers.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import add_options, script_parser


def _variants(spec: str) -> list[tuple[str, str, int]]:
    """'active-set,projected:2,projected:0' -> [(label, solver, pg_iters)]."""
    out = []
    for item in spec.split(","):
        name, _, it = item.partition(":")
        iters = int(it) if it else 2
        label = name if name == "active-set" else f"{name}:{iters}"
        out.append((label, name, iters))
    return out


def main(argv: list[str] | None = None) -> int:
    p = script_parser(__doc__)
    add_options(p, model="smollm2-135m", docs=2, tokens=1024, seed=0, methods="am-highest")
    add_options(p, ratios="0.1", solvers="active-set,projected:2,projected:0,projected:20")
    add_options(p, answer_tokens=16, repeats=3, threads=1)
    add_options(p, json="benchmarks/results/nnls_solvers.json")
    args = p.parse_args(argv)

    import torch

    from compactor import hf
    from compactor.eval.harness import build_reference, evaluate_prefix
    from compactor.eval.runner import make_niah_cases, method_spec
    from compactor.methods import refit as rf
    from compactor.models import resolve_model
    from compactor.pipeline import Hooks, compact_prefix
    from compactor.spec import CompactionSpec
    from harness.provenance import provenance

    torch.set_num_threads(args.threads)
    model, tok = hf.load_model(resolve_model(args.model))
    cases = make_niah_cases(tok, args.docs, args.tokens, seed=args.seed)
    variants = _variants(args.solvers)
    orig_fit = rf.fit_beta_nnls
    clock = {"s": 0.0}
    captured: list[tuple[torch.Tensor, ...]] = []

    def timed_fit(A, mass, mask, bounds, **kw):  # type: ignore[no-untyped-def]
        if capture:
            captured.append((A.clone(), mass.clone(), mask.clone(), tuple(bounds), kw))
        t0 = time.perf_counter()
        out = orig_fit(A, mass, mask, bounds, **kw)
        clock["s"] += time.perf_counter() - t0
        return out

    rf.fit_beta_nnls = timed_fit  # type: ignore[assignment]
    rows: list[dict[str, Any]] = []
    iso: dict[str, list[float]] = {label: [] for label, _, _ in variants}
    for case in cases:
        ref = build_reference(model, tok, case, args.answer_tokens)
        hooks = Hooks(progress=False, reuse={})
        for method in [m for m in args.methods.split(",") if m]:
            for ratio in [float(r) for r in args.ratios.split(",") if r]:
                spec = method_spec(CompactionSpec(), method, ratio)
                captured.clear()
                for vi, (label, solver, iters) in enumerate(variants):
                    rf.NNLS_SOLVER, rf.PG_ITERS = solver, iters
                    capture = vi == 0
                    clock["s"] = 0.0
                    prefix, times = compact_prefix(model, tok, case.prefix_ids, spec, hooks=hooks)
                    ev = evaluate_prefix(model, tok, ref, prefix)
                    rows.append(
                        {
                            "case": case.name,
                            "T": len(case.prefix_ids),
                            "method": method,
                            "ratio": ratio,
                            "solver": label,
                            "output_rel_err": ev["output_rel_err"],
                            "mass_rel_err": ev["mass_rel_err"],
                            "logppl_gap": ev["logppl_gap"],
                            "agreement": ev["agreement"],
                            "beta_fit_s": clock["s"],
                            "compaction_s": times.compaction,
                        }
                    )
                    print(json.dumps(rows[-1]), flush=True)
                capture = False
                # the beta fits alone, on the same captured problems, best of repeats
                for label, solver, iters in variants:
                    rf.PG_ITERS = iters
                    best = float("inf")
                    for _ in range(args.repeats):
                        t0 = time.perf_counter()
                        for A, mass, mask, bounds, kw in captured:
                            orig_fit(A, mass, mask, bounds, solver=solver, **kw)
                        best = min(best, time.perf_counter() - t0)
                    iso[label].append(best)
    capture = False
    rf.fit_beta_nnls = orig_fit  # type: ignore[assignment]
    rf.NNLS_SOLVER, rf.PG_ITERS = "active-set", 2

    summary = {}
    for label, _, _ in variants:
        mine = [r for r in rows if r["solver"] == label]
        summary[label] = {
            k: sum(r[k] for r in mine) / len(mine)
            for k in ("output_rel_err", "mass_rel_err", "logppl_gap", "beta_fit_s", "compaction_s")
        }
        summary[label]["beta_fit_alone_s"] = sum(iso[label]) / len(iso[label])
    out = {
        "provenance": provenance(argv),
        "meta": {
            "model": args.model,
            "threads": args.threads,
            "cases": [c.name for c in cases],
            "prefix_tokens": [len(c.prefix_ids) for c in cases],
            "methods": args.methods,
            "ratios": args.ratios,
            "solvers": [v[0] for v in variants],
            "note": "beta_fit_s: in-pipeline time of fit_beta_nnls summed over layers; "
            "beta_fit_alone_s: the same fits re-run alone (best of repeats), mean per "
            "(case, method, ratio); errors on held-out queries (compactor.eval)",
        },
        "summary": summary,
        "rows": rows,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    for label, s in summary.items():
        print(label, {k: round(v, 5) for k, v in s.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Compaction speed per stage vs prefix length, on the real model (CPU unless CUDA is given).

    python benchmarks/compaction_speed.py [--lengths 256,512,1024,2048] \
        [--methods am-highest,am-omp-fast] [--ratio 0.1] [--device cpu]

For each prefix length T (a needle document from the shipped filler): one prefill and one
draw of reference queries (repeat-prefill + self-study, as `compact_prefix` does by default),
then for each method, summed over all layers and KV heads (batched per layer):
- selection: the method's key choice (AM: reference targets + top-attention / OMP);
- beta: the NNLS fit of beta for the kept keys (a refit without values);
- values: the least-squares value fit (full refit minus the beta-only refit).
One torch thread (the service's worker setting). Scaling with workers is measured through
the service by `benchmarks/service.py --workers N`; layers and heads scale linearly here
(every layer is the same work). Writes benchmarks/results/compaction_speed.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def stage_times(
    method: Any, pre: Any, queries: dict[int, Any], ratio: float, scale: float
) -> dict[str, float]:
    """Seconds of selection / beta / values summed over the layers of one prefill."""
    from compactor.budgets import head_budgets
    from compactor.methods.refit import refit

    out = {"selection": 0.0, "beta": 0.0, "values": 0.0}
    # the method's own refit bounds: am-highest [-3, 3], am-omp beta >= prune_beta
    bounds = getattr(method, "beta_bounds", None) or (getattr(method, "prune_beta", -7.0), None)
    for li in range(len(pre.keys)):
        k, v, q = pre.keys[li], pre.values[li], queries[li]
        budgets = head_budgets(k.shape[1], k.shape[0], ratio=ratio)
        sel, t_sel = _timed(method.select, k, v, q, budgets, scale)
        _, t_beta = _timed(
            refit, k, v, q, sel, sm_scale=scale, beta_bounds=bounds, fit_values=False
        )
        _, t_full = _timed(refit, k, v, q, sel, sm_scale=scale, beta_bounds=bounds)
        out["selection"] += t_sel
        out["beta"] += t_beta
        out["values"] += max(0.0, t_full - t_beta)
    return out


def plot(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = sorted({r["method"] for r in records})
    fig, axes = plt.subplots(1, len(methods), figsize=(5 * len(methods), 3.6), squeeze=False)
    stages = ["prefill", "queries", "selection", "beta", "values"]
    for ax, m in zip(axes[0], methods):
        rows = [r for r in records if r["method"] == m]
        xs = [str(r["T"]) for r in rows]
        bottom = [0.0] * len(rows)
        for st in stages:
            ys = [r[st] for r in rows]
            ax.bar(xs, ys, bottom=bottom, label=st)
            bottom = [b + y for b, y in zip(bottom, ys)]
        ax.set_title(f"{m}: seconds per compaction (all layers)", fontsize=9)
        ax.set_xlabel("prefix tokens T")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(str(path), dpi=120)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", default="256,512,1024,2048")
    ap.add_argument("--methods", default="am-highest,am-omp-fast")
    ap.add_argument("--ratio", type=float, default=0.1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    a = ap.parse_args()

    import torch

    from compactor import hf
    from compactor.methods import get_method
    from compactor.models import resolve_model
    from compactor.niah import make_niah
    from compactor.pipeline import Hooks, compact_prefix
    from compactor.spec import CompactionSpec

    torch.set_num_threads(a.threads)
    model, tok = hf.load_model(resolve_model(a.model))
    if a.device != "cpu":
        model = model.to(a.device)
    scale = hf.model_info(model).sm_scale
    records = []
    for T in [int(x) for x in a.lengths.split(",")]:
        ids = tok(make_niah(tok, T, seed=T).prefix, add_special_tokens=False).input_ids
        reuse: dict[Any, Any] = {}
        # one full compaction times prefill + queries (and fills `reuse` with them)
        spec = CompactionSpec(method=a.methods.split(",")[0], ratio=a.ratio)
        _, times = compact_prefix(model, tok, ids, spec, hooks=Hooks(progress=False, reuse=reuse))
        ((pre, _plan, queries),) = reuse.values()
        for name in a.methods.split(","):
            st = stage_times(get_method(name), pre, queries, a.ratio, scale)
            rec = {
                "T": len(ids),
                "method": name,
                "ratio": a.ratio,
                "prefill": times.prefill,
                "queries": times.queries,
                **st,
            }
            rec["total"] = sum(
                rec[s] for s in ("prefill", "queries", "selection", "beta", "values")
            )
            records.append(rec)
            print(
                f"T={rec['T']:>5} {name:<12} prefill {rec['prefill']:6.2f}  queries {rec['queries']:6.2f}  "
                f"selection {rec['selection']:6.2f}  beta {rec['beta']:6.2f}  values {rec['values']:6.2f}  "
                f"total {rec['total']:6.2f} s",
                flush=True,
            )
    a.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": platform.processor() or platform.machine(),
        "threads": a.threads,
        "device": a.device,
        "model": a.model,
    }
    (a.out / "compaction_speed.json").write_text(
        json.dumps({"meta": meta, "records": records}, indent=1)
    )
    plot(records, a.out / "compaction_speed.png")
    print(f"wrote {a.out / 'compaction_speed.json'} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

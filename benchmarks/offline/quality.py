"""Quality + speed of compaction on SmolLM2-135M over 1k-token documents (CPU).

Runs the held-out-future-query eval (compactor.eval) over `--docs` generated needle
documents (filler prose + needles, ~`--tokens` tokens each), for each method x ratio plus
the uncompacted `full` baseline, prints the table and writes JSON (with its provenance) + PNG.
Then times one standalone compaction (`--speed-method` at `--speed-ratio`, all layers and
heads, all stages included) of the first document.

    .venv/bin/python -m benchmarks.offline.quality --json out/quality.json --plot out/quality.png
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

from benchmarks import add_options, script_parser


def main(argv: list[str] | None = None) -> int:
    p = script_parser(__doc__)
    add_options(p, model="smollm2-135m", docs=2, tokens=1024)
    p.add_argument(
        "--seed", type=int, default=0, help="first document seed (documents seed, seed+1, ...)"
    )
    p.add_argument(
        "--methods",
        default="full,am-omp,keep-only",
        help="comma-separated methods; parameters as name:key=value (e.g. snapkv:refit=am)",
    )
    add_options(p, ratios="0.2,0.1,0.05", query_sources="repeat-prefill,self-study")
    add_options(p, max_queries=2048, self_study_tokens=24, answer_tokens=24)
    add_options(p, speed_method="am-omp-fast", speed_ratio=0.1, no_speed=False)
    p.add_argument(
        "--on-policy",
        action="store_true",
        help="on-policy queries (layer l fitted with layers < l compacted)",
    )
    add_options(p, threads=1, json="benchmarks/results/quality.json")
    add_options(p, plot="benchmarks/results/quality.png")
    args = p.parse_args(argv)

    import torch

    from harness.provenance import provenance

    prov = provenance(argv)

    from compactor import hf
    from compactor.eval.runner import (
        format_table,
        make_niah_cases,
        plot_records,
        run_eval,
        write_json,
    )
    from compactor.models import resolve_model
    from compactor.pipeline import Hooks, compact_prefix
    from compactor.spec import CompactionSpec, QueryConfig

    torch.set_num_threads(args.threads)
    model, tok = hf.load_model(resolve_model(args.model))
    cases = make_niah_cases(tok, args.docs, args.tokens, seed=args.seed)
    qcfg = QueryConfig(
        sources=tuple(s for s in args.query_sources.split(",") if s),
        max_queries_per_head=args.max_queries,
        self_study_tokens=args.self_study_tokens,
    )
    methods = [m for m in args.methods.split(",") if m]
    ratios = [float(r) for r in args.ratios.split(",") if r]
    t0 = time.perf_counter()
    records = run_eval(
        model,
        tok,
        cases,
        methods,
        ratios,
        spec=CompactionSpec(queries=qcfg, on_policy=args.on_policy),
        niah=True,
        answer_tokens=args.answer_tokens,
        progress=False,
    )
    eval_s = time.perf_counter() - t0
    speed = None
    if not args.no_speed:
        speed_spec = CompactionSpec(method=args.speed_method, ratio=args.speed_ratio, queries=qcfg)
        _, times = compact_prefix(
            model, tok, cases[0].prefix_ids, speed_spec, hooks=Hooks(progress=False)
        )
        speed = {
            "method": args.speed_method,
            "ratio": args.speed_ratio,
            "T": len(cases[0].prefix_ids),
            **times.as_dict(),
            "per_layer_max": max(times.per_layer),
        }
    meta = {
        "model": args.model,
        "threads": args.threads,
        "cases": [c.name for c in cases],
        "prefix_tokens": [len(c.prefix_ids) for c in cases],
        "query_sources": list(qcfg.sources),
        "max_queries": args.max_queries,
        "self_study_tokens": args.self_study_tokens,
        "answer_tokens": args.answer_tokens,
        "on_policy": args.on_policy,
        "eval_seconds": eval_s,
        "speed": speed,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "argv": sys.argv[1:],
    }
    for path in (args.json, args.plot):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_json(records, args.json, meta, prov)
    if args.plot:
        plot_records(records, args.plot)
    print(format_table(records))
    if speed:
        print(
            "speed:",
            json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in speed.items()}),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

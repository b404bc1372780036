"""Greedy agreement after compaction, offline: the plugin's shared-document workload in transformers.

For each needle document of ``harness.workload`` (the plugin test's ~1.9k-token ledger) the
six question prompts are tokenized, their common prefix minus the plugin's boundary margin is
the shared prefix, and each question's suffix is answered greedily (`--answer-tokens`) twice:
on the full prefix and on the compacted one. The compaction is fitted the way the plugin asks
for it: query source ``follow-up`` (``--sources``) with the suffixes of the first
``6 - --held-out`` questions (what the sharing requests sent), optionally with the model's own
answers to them (``--follow-up-answers``), off- or on-policy. Reported per configuration:
strict first-N-token agreement with the full-prefix answers on the fitted and on the held-out
questions, needle accuracy, and the compaction's seconds.

    .venv/bin/python -m benchmarks.server.agreement   # am-highest, am-omp-fast x off/on x 0/32, ratio 0.1
"""

from __future__ import annotations

import itertools
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import add_options, script_parser


def main(argv: list[str] | None = None) -> int:
    p = script_parser(__doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--docs", type=int, default=2, help="needle documents (workload index 0..)")
    p.add_argument("--sentences", type=int, default=110, help="sentences per document")
    p.add_argument(
        "--methods",
        default="am-highest,am-omp-fast",
        help="comma-separated; parameters as name:key=value (e.g. am-highest:value_ridge=1)",
    )
    p.add_argument("--ratios", default="0.1")
    p.add_argument("--policies", default="off,on", help="off and/or on (on-policy fitting)")
    p.add_argument(
        "--follow-up-answers", default="0,32", help="answer tokens appended to each follow-up"
    )
    p.add_argument("--sources", default="follow-up", help="query sources, comma-separated")
    p.add_argument("--held-out", type=int, default=2, help="questions not sent as follow-ups")
    p.add_argument("--margin", type=int, default=32, help="the plugin's boundary margin")
    p.add_argument("--follow-up-tokens", type=int, default=128, help="suffix cut, as the plugin")
    add_options(p, answer_tokens=16, json="benchmarks/results/agreement.json")
    args = p.parse_args(argv)

    import torch

    from benchmarks.server._shared_prefix import (
        common_length,
        greedy_answers,
        ints,
        prompt_ids,
        same_first,
    )
    from compactor import hf
    from compactor.eval.runner import parse_method_spec
    from compactor.models import resolve_model
    from compactor.pipeline import Hooks, compact_prefix
    from compactor.spec import CompactionSpec, QueryConfig
    from harness.workload import document, needle_correct, questions

    torch.set_num_threads(1)
    model, tok = hf.load_model(resolve_model(args.model))
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    qs = questions()
    if not 0 <= args.held_out < len(qs):
        raise SystemExit(f"--held-out must be in [0, {len(qs) - 1}], got {args.held_out}")
    fitted = len(qs) - args.held_out
    sources = tuple(x for x in args.sources.split(",") if x)
    configs = list(
        itertools.product(
            [m for m in args.methods.split(",") if m],
            [float(r) for r in args.ratios.split(",") if r],
            [x for x in args.policies.split(",") if x],
            ints(args.follow_up_answers),
        )
    )
    rows: dict[tuple[Any, ...], dict[str, Any]] = {
        c: {"fit_agree": 0, "held_agree": 0, "needles": 0, "seconds": 0.0} for c in configs
    }
    stock_needles = needle_total = 0
    examples: list[dict[str, Any]] = []
    for d in range(args.docs):
        doc = document(args.sentences, d)
        prompts = prompt_ids(tok, doc, qs)
        prefix = prompts[0][: common_length(prompts) - args.margin]
        suffixes = [x[len(prefix) :] for x in prompts]
        follow = [s[: args.follow_up_tokens] for s in suffixes[:fitted]]
        full = hf.PrefixState.full(hf.prefill(model, prefix))
        stock = greedy_answers(model, full, suffixes, args.answer_tokens, eos)
        for q, a in zip(qs, stock):
            ok = needle_correct(q, tok.decode(a), d)
            stock_needles += bool(ok)
            needle_total += ok is not None
        for method, ratio, policy, n_ans in configs:
            qcfg = QueryConfig(sources=sources, follow_up_answer_tokens=n_ans)
            t0 = time.perf_counter()
            name, params = parse_method_spec(method)
            spec = CompactionSpec(
                method=name, method_params=params, ratio=ratio, queries=qcfg,
                on_policy=policy == "on",
            )  # fmt: skip
            compacted, _ = compact_prefix(model, tok, prefix, spec, follow, Hooks(progress=False))
            row = rows[(method, ratio, policy, n_ans)]
            row["seconds"] += time.perf_counter() - t0
            state = hf.PrefixState.from_compacted(compacted)
            got = greedy_answers(model, state, suffixes, args.answer_tokens, eos)
            for i, (q, a, b) in enumerate(zip(qs, stock, got)):
                same = same_first(a, b, args.answer_tokens)
                row["fit_agree" if i < fitted else "held_agree"] += same
                row["needles"] += bool(needle_correct(q, tok.decode(b), d))
                examples.append(
                    {"doc": d, "config": [method, ratio, policy, n_ans], "question": q,
                     "stock": tok.decode(a), "compacted": tok.decode(b)}
                )  # fmt: skip
    n_fit, n_held = fitted * args.docs, args.held_out * args.docs
    header = (
        f"{'method':<12}|{'ratio':>6} |{'policy':>7} |{'answers':>8} |"
        f"{'agree fitted':>13} |{'agree held-out':>15} |{'needles':>8} |{'seconds':>8}"
    )
    lines = [header, "-" * len(header)]
    records = []
    for (method, ratio, policy, n_ans), row in rows.items():
        rec = {
            "method": method,
            "ratio": ratio,
            "on_policy": policy == "on",
            "follow_up_answer_tokens": n_ans,
            "agree_fitted": row["fit_agree"] / max(1, n_fit),
            "agree_held_out": row["held_agree"] / max(1, n_held),
            "needle_accuracy": row["needles"] / max(1, needle_total),
            "seconds_per_compaction": row["seconds"] / args.docs,
        }
        records.append(rec)
        lines.append(
            f"{method:<12}|{ratio:>6} |{policy:>7} |{n_ans:>8} |"
            f"{row['fit_agree']:>9}/{n_fit:<3} |{row['held_agree']:>11}/{n_held:<3} |"
            f"{rec['needle_accuracy']:>8.2f} |{rec['seconds_per_compaction']:>8.1f}"
        )
    lines.append(f"stock needle accuracy {stock_needles / max(1, needle_total):.2f}")
    meta = {
        "model": args.model,
        "docs": args.docs,
        "sentences": args.sentences,
        "prefix_tokens": len(prefix),
        "held_out": args.held_out,
        "sources": list(sources),
        "margin": args.margin,
        "answer_tokens": args.answer_tokens,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "argv": sys.argv[1:],
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps({"meta": meta, "records": records, "examples": examples}, indent=1)
        )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

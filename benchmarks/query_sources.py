"""Which reference queries keep the answers? Agreement and needles after compaction (CPU).

The plugin's workload (`sglang_ext/workload.py`: a ~1.9k-token document with three needles and
six questions) is compacted with each (method, query sources) pair at `--ratio`; each question
is then answered greedily (`--tokens` tokens) from the compacted prefix with transformers and
compared with the uncompacted answer: exact agreement of the tokens and needle correctness.
The `follow-up` source is the six questions themselves, as the plugin sends them in serving.

    .venv/bin/python benchmarks/query_sources.py --json benchmarks/results/query_sources.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

DEFAULT_RUNS = (
    "am-highest@follow-up",
    "am-highest@repeat-prefill+follow-up",
    "am-omp-fast@repeat-prefill+follow-up",
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--runs", default=",".join(DEFAULT_RUNS), help="method@source+source,...")
    p.add_argument("--ratio", type=float, default=0.1)
    p.add_argument("--tokens", type=int, default=16, help="greedy answer tokens compared")
    p.add_argument("--json", type=Path, default=Path("benchmarks/results/query_sources.json"))
    args = p.parse_args(argv)

    import torch

    from compactor import hf
    from compactor.hf.decode import PrefixState, greedy_generate
    from compactor.models import prepare_model
    from compactor.pipeline import compact_prefix
    from sglang_ext.workload import document, needle_correct, questions

    torch.set_num_threads(1)
    model, tok = hf.load_model(prepare_model("smollm2-135m"))
    ids = tok(document(), add_special_tokens=True)["input_ids"]
    qs = questions()
    q_ids = [tok(f"\nQuestion: {q}\nAnswer:", add_special_tokens=False)["input_ids"] for q in qs]
    pre = hf.prefill(model, ids)
    full = [greedy_generate(model, PrefixState.full(pre), q, args.tokens) for q in q_ids]
    rows = []
    for run in [r for r in args.runs.split(",") if r]:
        method, _, sources = run.partition("@")
        t0 = time.perf_counter()
        prefix, _ = compact_prefix(
            model,
            tok,
            ids,
            method,
            ratio=args.ratio,
            query_sources=tuple(sources.split("+")),
            follow_ups=q_ids,
            progress=False,
        )
        seconds = time.perf_counter() - t0
        outs = [
            greedy_generate(model, PrefixState.from_compacted(prefix), q, args.tokens)
            for q in q_ids
        ]
        needles = [needle_correct(q, tok.decode(o)) for q, o in zip(qs, outs)]
        row = {
            "method": method,
            "query_sources": sources.split("+"),
            "ratio": args.ratio,
            "T": len(ids),
            "agreement": sum(a == b for a, b in zip(full, outs)),
            "questions": len(qs),
            "needles_correct": sum(bool(n) for n in needles if n is not None),
            "needles": sum(n is not None for n in needles),
            "seconds": round(seconds, 1),
        }
        rows.append(row)
        print(
            f"{method:<12} {sources:<28} agree {row['agreement']}/{row['questions']} "
            f"needles {row['needles_correct']}/{row['needles']} ({row['seconds']} s)",
            flush=True,
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

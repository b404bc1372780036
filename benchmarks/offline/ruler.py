"""RULER-style accuracy of compacted prefixes, paired against the full cache on the same items.

Each item is one context of a RULER task (`compactor.eval.ruler`) and its scored question. The
full cache ("stock") answers it greedily; then every method x ratio compacts the context and
answers again, in one or both settings:

- agnostic: the compaction never sees the question (its queries come from the context
  alone, `--query-sources`), the setting of kvpress's leaderboard;
- multi-query: the compaction also fits on other questions about the same context (the
  `follow-up` source), then the scored question is asked: the serving setting.

Per (setting, method, ratio) it reports accuracy, retention = P(compacted correct | stock
correct) with McNemar counts, and the teacher-forced per-token agreement and log-prob gap on
stock's answers, each with a bootstrap 95% interval (`compactor.eval.paired`). Seeds come from
a split: `dev` (0, 1, ...) to choose defaults, `heldout` (1000, 1001, ...) to report them.

    .venv/bin/python -m benchmarks.offline.ruler --quick     # a minute or two: structure, pairing
    .venv/bin/python -m benchmarks.offline.ruler             # the suite
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks import RESULTS, add_options, script_parser

SPLIT_SEED = {"dev": 0, "heldout": 1000}
GENERIC = ("What is the text above about?", "Summarize the text above in one sentence.")


def _parse(argv: list[str] | None) -> Any:
    p = script_parser(__doc__)
    add_options(p, model="smollm2-135m", tokens="2000", seeds=4, split="heldout", threads=1)
    add_options(p, tasks="niah_single,niah_multikey,niah_multivalue,niah_multiquery,vt,cwe,fwe")
    add_options(p, methods="am-highest,am-highest:score_by=max", ratios="0.1,0.05,0.02")
    add_options(p, settings="agnostic,multi-query", query_sources="repeat-prefill,self-study")
    add_options(p, json=str(RESULTS / "ruler.json"))
    add_options(p, quick=(False, "2 tasks, 1 seed, 512 tokens, 1 ratio, repeat-prefill queries"))
    args = p.parse_args(argv)
    if args.split not in SPLIT_SEED:
        p.error(f"--split must be one of {sorted(SPLIT_SEED)}, got {args.split!r}")
    if args.quick:
        args.tasks, args.tokens, args.seeds, args.ratios = "niah_single,vt", "512", 1, "0.1"
        args.methods, args.query_sources = "am-highest", "repeat-prefill"
    return args


def _csv(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def run_items(args: Any, model: Any, tok: Any) -> list[dict[str, Any]]:
    """One record per (item, setting, method, ratio), stock's outcome beside ours."""
    from compactor.eval.harness import EvalCase, build_reference, evaluate_prefix
    from compactor.eval.niah import question_text
    from compactor.eval.ruler import make_ruler
    from compactor.eval.runner import method_spec
    from compactor.pipeline import Hooks, compact_prefix
    from compactor.spec import CompactionSpec, QueryConfig

    def enc(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"])

    records = []
    sources = tuple(_csv(args.query_sources))
    seed0 = SPLIT_SEED[args.split]
    for tokens in (int(t) for t in _csv(args.tokens)):
        for task in _csv(args.tasks):
            for seed in range(seed0, seed0 + args.seeds):
                case = make_ruler(tok, task, tokens, seed)
                ids, scored = enc(case.prefix), case.questions[0]
                ref = build_reference(
                    model, tok, EvalCase(f"{task}-{seed}", ids, [enc(scored.text)],
                                         [scored.answers]), case.answer_tokens)  # fmt: skip
                others = [q.text for q in case.questions[1:]]
                others += [question_text(tok, g) for g in GENERIC]
                item = {"task": task, "tokens": len(ids), "seed": seed,
                        "stock_score": ref.niah_scores[0]}  # fmt: skip
                for setting in _csv(args.settings):
                    multi = setting == "multi-query"
                    qs = (*sources, "follow-up") if multi else sources
                    base = CompactionSpec(queries=QueryConfig(sources=qs))
                    follow_ups = [enc(t) for t in others] if multi else None
                    hooks = Hooks(progress=False, reuse={})  # one prefill per item and setting
                    for method in _csv(args.methods):
                        for ratio in (float(r) for r in _csv(args.ratios)):
                            t0 = time.perf_counter()
                            spec = method_spec(base, method, ratio)
                            prefix, _ = compact_prefix(model, tok, ids, spec, follow_ups, hooks)
                            m = evaluate_prefix(model, tok, ref, prefix, niah=True)
                            records.append({**item, "setting": setting, "method": method,
                                            "ratio": ratio, "score": m["niah_accuracy"],
                                            "token_agreement": m["agreement"],
                                            "logprob_gap": m["logppl_gap"],
                                            "seconds": time.perf_counter() - t0})  # fmt: skip
                print(
                    f"{task} T={len(ids)} seed={seed}: stock {ref.niah_scores[0]:.2f}", flush=True
                )
    return records


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Paired figures per (setting, method, ratio), over all tasks and per task."""
    from compactor.eval.paired import paired_summary

    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        groups[(r["setting"], r["method"], r["ratio"], "all")].append(r)
        groups[(r["setting"], r["method"], r["ratio"], r["task"])].append(r)
    out = []
    for (setting, method, ratio, task), rs in sorted(groups.items()):
        summary = paired_summary(
            [r["stock_score"] == 1.0 for r in rs],
            [r["score"] == 1.0 for r in rs],
            [r["token_agreement"] for r in rs],
            [r["logprob_gap"] for r in rs],
        )
        out.append({"setting": setting, "method": method, "ratio": ratio, "task": task,
                    "compression": round(1 / ratio, 1), **summary})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    import json

    import torch

    from compactor import hf
    from compactor.models import resolve_model
    from harness.provenance import provenance

    prov = provenance(argv)
    torch.set_num_threads(args.threads)
    model, tok = hf.load_model(resolve_model(args.model))
    t0 = time.perf_counter()
    records = run_items(args, model, tok)
    out = {
        "provenance": prov,
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "seconds": time.perf_counter() - t0,
        "summary": summarize(records),
        "items": records,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    for s in out["summary"]:
        if s["task"] == "all":
            print(f"{s['setting']:12} {s['method']:28} {s['compression']:5}x  "
                  f"stock {s['stock_accuracy']:.2f}  ours {s['accuracy']:.2f}  "
                  f"retention {s['retention']}  agree/token {s['token_agreement']:.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a user's NEXT question gets after a compaction, offline (transformers, CPU).

For each needle document of ``harness.workload`` (``--docs``, index 0..) the prompts of the
SEEN questions (``questions()``: the sharing requests the plugin fits on) and the UNSEEN ones
(``unseen_questions()``: asked only after the install, never in the fit) are tokenized. The
shared prefix is cut as the plugin's trigger cuts it (``harness.workload.compacted_length``:
the seen questions' branch point, less the boundary margin, down to the alignment). The full
prefix answers every question greedily (``--answer-tokens``; ``compactor.eval``'s reference).

Each configuration (``--configs``: a name in CONFIGS = the plugin's ``PLUGIN_SPEC`` with a
few fields overridden; ``baseline`` overrides none) is fitted, for each refit step k
(``--refit-steps``), on the first k seen questions' suffixes (cut to the plugin's
``follow_up_tokens``) as the plugin sends them. Reported per configuration and k, averaged
over documents:

- seen_agree16 / unseen_agree16: the share of fitted / unseen questions whose first
  ``--answer-tokens`` greedy tokens on the compacted prefix equal those on the full prefix;
- unseen_logppl_gap: mean log-prob gap of the full prefix's greedy answer tokens on the
  unseen questions, teacher-forced under the compacted vs the full prefix (nats per token,
  ``compactor.eval.evaluate_prefix``); also unseen_token_agreement (teacher-forced argmax)
  and unseen_needles (needle answers that name the needle);
- seconds: one compaction (all stages).

    .venv/bin/python benchmarks/next_question.py --docs 2 --configs baseline,ratio-0.2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["CONFIGS", "config_spec", "main", "measure_document", "plot", "summarize"]

# name -> CompactionSpec.replace(...) overrides of the plugin's spec
CONFIGS: dict[str, dict[str, Any]] = {
    "baseline": {},
    "ratio-0.2": {"ratio": 0.2},
    "ratio-0.05": {"ratio": 0.05},
    "repeat-prefill": {"queries": {"sources": ("follow-up", "repeat-prefill")}},
    "self-study": {"queries": {"sources": ("follow-up", "self-study")}},
    "no-answers": {"queries": {"follow_up_answer_tokens": 0}},
    "off-policy": {"on_policy": False},
    "am-omp-fast": {"method": "am-omp-fast"},
}
_METRICS = (
    "seen_agree16",
    "unseen_agree16",
    "unseen_logppl_gap",
    "unseen_token_agreement",
    "unseen_needles",
    "seconds",
)


def config_spec(name: str) -> Any:
    """The ``CompactionSpec`` of configuration `name`: ``PLUGIN_SPEC`` with CONFIGS[name].

    Raises ValueError naming an unknown configuration.
    """
    from sglang_ext.config import PLUGIN_SPEC

    if name not in CONFIGS:
        raise ValueError(f"unknown configuration {name!r}; choose from {', '.join(CONFIGS)}")
    return PLUGIN_SPEC.replace(**CONFIGS[name])


def measure_document(
    model: Any,
    tokenizer: Any,
    index: int,
    sentences: int,
    configs: Sequence[str],
    refit_steps: Sequence[int],
    answer_tokens: int = 16,
) -> list[dict[str, Any]]:
    """One row per (configuration, k) for document `index` (see the module docstring).

    Raises ValueError on a refit step outside [1, len(questions())] or a document too short
    for the plugin to compact.
    """
    from benchmarks._shared_prefix import common_length, greedy_answers, prompt_ids, same_first
    from compactor import hf
    from compactor.eval.harness import EvalCase, build_reference, evaluate_prefix
    from compactor.pipeline import Hooks, compact_prefix
    from harness.workload import (
        compacted_length,
        document,
        needle_correct,
        questions,
        unseen_questions,
    )
    from sglang_ext.config import CompactionConfig

    seen_q, unseen_q = questions(), unseen_questions()
    for k in refit_steps:
        if not 1 <= k <= len(seen_q):
            raise ValueError(f"refit step {k} not in [1, {len(seen_q)}]")
    doc = document(sentences, index)
    seen_p, unseen_p = prompt_ids(tokenizer, doc, seen_q), prompt_ids(tokenizer, doc, unseen_q)
    t = compacted_length(common_length(seen_p))
    if t < 2 or common_length([seen_p[0], *unseen_p]) < t:
        raise ValueError(f"document {index} with {sentences} sentences: prefix of {t} tokens")
    prefix = seen_p[0][:t]
    seen_s, unseen_s = [p[t:] for p in seen_p], [p[t:] for p in unseen_p]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ref_unseen = build_reference(
        model, tokenizer, EvalCase(f"doc{index}-unseen", prefix, unseen_s), answer_tokens
    )
    full = hf.PrefixState.full(ref_unseen.prefill)
    stock_seen = greedy_answers(model, full, seen_s, answer_tokens, eos)
    cut = CompactionConfig.follow_up_tokens
    rows = []
    for name in configs:
        spec = config_spec(name)
        for k in refit_steps:
            t0 = time.perf_counter()
            follow = [s[:cut] for s in seen_s[:k]]
            compacted, _ = compact_prefix(
                model, tokenizer, prefix, spec, follow, Hooks(progress=False)
            )
            seconds = time.perf_counter() - t0
            state = hf.PrefixState.from_compacted(compacted)
            got_seen = greedy_answers(model, state, seen_s[:k], answer_tokens, eos)
            got_unseen = greedy_answers(model, state, unseen_s, answer_tokens, eos)
            ev = evaluate_prefix(model, tokenizer, ref_unseen, compacted)
            needles = [
                needle_correct(q, tokenizer.decode(a), index) for q, a in zip(unseen_q, got_unseen)
            ]
            rows.append(
                {
                    "config": name,
                    "method": spec.method,
                    "ratio": spec.ratio,
                    "sources": list(spec.queries.sources),
                    "k": k,
                    "doc": index,
                    "prefix_tokens": t,
                    "seen_agree16": sum(
                        same_first(a, b, answer_tokens) for a, b in zip(stock_seen, got_seen)
                    )
                    / k,
                    "unseen_agree16": sum(
                        same_first(a, b, answer_tokens)
                        for a, b in zip(ref_unseen.answers, got_unseen)
                    )
                    / len(unseen_s),
                    "unseen_logppl_gap": ev["logppl_gap"],
                    "unseen_token_agreement": ev["agreement"],
                    "unseen_needles": _share(needles),
                    "seconds": seconds,
                    "unseen_answers": [tokenizer.decode(a) for a in got_unseen],
                }
            )
    rows.append(
        {
            "config": "full",
            "doc": index,
            "prefix_tokens": t,
            "unseen_needles": _share(
                [
                    needle_correct(q, tokenizer.decode(a), index)
                    for q, a in zip(unseen_q, ref_unseen.answers)
                ]
            ),
            "unseen_answers": [tokenizer.decode(a) for a in ref_unseen.answers],
        }
    )
    return rows


def _share(flags: Sequence[bool | None]) -> float | None:
    """The share of True among the non-None flags (None when all are None)."""
    scored = [f for f in flags if f is not None]
    return sum(scored) / len(scored) if scored else None


def summarize(per_doc: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (configuration, k): the metrics' means over documents, with `docs` (count).

    The uncompacted ``full`` rows (answers only) are left out.
    """
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in per_doc:
        if r["config"] != "full":
            groups.setdefault((r["config"], r["k"]), []).append(r)
    out = []
    for (name, k), rs in groups.items():
        row: dict[str, Any] = {
            "config": name,
            "method": rs[0]["method"],
            "ratio": rs[0]["ratio"],
            "sources": rs[0]["sources"],
            "k": k,
            "docs": len(rs),
        }
        for m in _METRICS:
            vals = [r[m] for r in rs if r[m] is not None]
            row[m] = sum(vals) / len(vals) if vals else None
        out.append(row)
    return out


def plot(rows: Sequence[dict[str, Any]], path: str | Path, title: str) -> None:
    """Unseen agreement and logppl gap against k, one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = (
        ("unseen_agree16", "unseen: strict first-N agreement"),
        ("seen_agree16", "seen (fitted): strict first-N agreement"),
        ("unseen_logppl_gap", "unseen: logppl gap (nats/token)"),
    )
    for ax, (key, label) in zip(axes, panels):
        for name in dict.fromkeys(r["config"] for r in rows):
            rs = sorted((r for r in rows if r["config"] == name), key=lambda r: r["k"])
            ax.plot([r["k"] for r in rs], [r[key] for r in rs], "o-", label=name)
        ax.set_xlabel("k seen questions fitted")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--docs", type=int, default=2, help="needle documents (workload index 0..)")
    p.add_argument("--sentences", type=int, default=110, help="sentences per document")
    p.add_argument(
        "--configs",
        default="baseline,ratio-0.2,repeat-prefill,am-omp-fast",
        help=f"comma-separated, from: {', '.join(CONFIGS)}",
    )
    p.add_argument("--refit-steps", default="2,6", help="k: seen questions fitted")
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default="benchmarks/results/next_question.json")
    p.add_argument("--plot", default="benchmarks/results/next_question.png")
    args = p.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        if c not in CONFIGS:
            p.error(f"unknown configuration {c!r}; choose from {', '.join(CONFIGS)}")

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks._shared_prefix import ints

    steps = ints(args.refit_steps)
    from benchmarks._meta import provenance
    from compactor import hf
    from compactor.models import resolve_model
    from sglang_ext.config import PLUGIN_SPEC

    prov = provenance(argv)
    torch.set_num_threads(args.threads)
    model, tok = hf.load_model(resolve_model(args.model))
    t0 = time.perf_counter()
    per_doc: list[dict[str, Any]] = []
    for d in range(args.docs):
        per_doc += measure_document(
            model, tok, d, args.sentences, configs, steps, args.answer_tokens
        )
        print(f"document {d} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    rows = summarize(per_doc)
    meta = {
        "model": args.model,
        "docs": args.docs,
        "sentences": args.sentences,
        "answer_tokens": args.answer_tokens,
        "threads": args.threads,
        "plugin_spec": PLUGIN_SPEC.to_dict(),
        "configs": {c: CONFIGS[c] for c in configs},
        "refit_steps": steps,
        "seconds": time.perf_counter() - t0,
    }
    out = {"provenance": prov, "meta": meta, "rows": rows, "per_document": per_doc}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1, default=list))
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        title = (
            f"next question after a compaction: {args.model}, {args.docs} documents, "
            f"plugin spec {PLUGIN_SPEC.method} ratio {PLUGIN_SPEC.ratio} + overrides"
        )
        plot(rows, args.plot, title)
    head = f"{'config':<16}{'k':>3}{'ratio':>7}{'unseen gap':>12}{'unseen agr':>12}"
    head += f"{'seen agr':>10}{'needles':>9}{'s':>7}"
    print(head)
    for r in rows:
        needles = "-" if r["unseen_needles"] is None else f"{r['unseen_needles']:.2f}"
        print(
            f"{r['config']:<16}{r['k']:>3}{r['ratio']:>7}{r['unseen_logppl_gap']:>12.4f}"
            f"{r['unseen_agree16']:>12.2f}{r['seen_agree16']:>10.2f}{needles:>9}"
            f"{r['seconds']:>7.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

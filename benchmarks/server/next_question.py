"""What a user's NEXT question gets after a compaction, offline (transformers, CPU).

Documents (``harness.workload``): ``--docs`` needle documents (index 0..) and ``--prose-docs``
prose documents with no needles (``prose_document``, index 0..; rows say ``kind``). Each is
asked ``--seen-questions`` N SEEN questions (``many_questions(N)``: the sharing requests the
plugin fits on; the six ``questions()`` first) and six UNSEEN ones (``unseen_questions()`` /
``prose_unseen_questions()``: asked only after the install, never in the fit). The shared
prefix is cut as the plugin's trigger cuts it (``harness.workload.compacted_length``: the seen
questions' branch point, less the boundary margin, down to the alignment). The full prefix
answers every question greedily (``--answer-tokens``; ``compactor.eval``'s reference).

Each configuration (``--configs``: a name in CONFIGS = the plugin's ``PLUGIN_SPEC`` with a
few fields overridden; ``baseline`` overrides none) is fitted, for each refit step k
(``--refit-steps``, up to N; the plugin itself sends at most ``CompactionConfig.max_follow_ups``
follow-ups, so larger k is a what-if), on the first k seen questions' suffixes (cut to the
plugin's ``follow_up_tokens``) as the plugin sends them. ``target-x`` configurations choose
their ratio by held-out error (``spec.target_error`` x, ``ratio`` the ceiling; they need
k >= 2: smaller k are skipped, listed in the meta's ``skipped``); ``gvote`` chooses its own
budget per head. Per document and (configuration, k):

- seen_agree16 / unseen_agree16: the share of fitted / unseen questions whose first
  ``--answer-tokens`` greedy tokens on the compacted prefix equal those on the full prefix;
- unseen_logppl_gap: mean log-prob gap of the full prefix's greedy answer tokens on the
  unseen questions, teacher-forced under the compacted vs the full prefix (nats per token,
  ``compactor.eval.evaluate_prefix``); also unseen_token_agreement (teacher-forced argmax)
  and unseen_needles (needle answers that name the needle; None for prose documents);
- unseen_attn_error: the measure ``spec.target_error`` targets, on the unseen questions: the
  relative attention-output error of their queries (each with the full prefix's greedy
  answer of the plugin's ``follow_up_answer_tokens`` appended, recorded on the full prefix,
  as ``compactor.pipeline.target`` records its held-out queries) vs the full prefix
  (``target.held_out_error``);
- ratio: the configured ratio; for target configurations the chosen one (``chosen_ratio``,
  with ``estimated_error``, ``target_error`` and ``target_met``: unseen_attn_error <=
  target), for gvote its realized kept fraction; kept_ratio: kept entries / (L H_kv T);
- seconds: one compaction (all stages).

The summary rows (per configuration, k and kind) average them over documents, with
``target_met_share`` (targets) and ``mean_chosen_ratio``; the meta's ``memory_vs_baseline``
compares the target and gvote configurations' mean ratio with the plugin's ratio.

    .venv/bin/python -m benchmarks.server.next_question --docs 2 --prose-docs 2 \\
        --configs baseline,target-0.2,gvote --refit-steps 2,8,32
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import add_options, script_parser
from benchmarks.server._next_question_report import (
    memory_vs_baseline,
    plot,
    print_rows,
    share,
    summarize,
)

__all__ = [
    "CONFIGS",
    "config_spec",
    "main",
    "measure_document",
]

# name -> CompactionSpec.replace(...) overrides of the plugin's spec
CONFIGS: dict[str, dict[str, Any]] = {
    # the plugin's defaults when issue #21 was filed: am-highest, on-policy, the questions
    # (with the model's answers) alone as reference queries
    "baseline": {
        "method": "am-highest",
        "on_policy": True,
        "queries": {"sources": ("follow-up",), "max_queries_per_head": 2048},
    },
    # the plugin's defaults at the time of the run (sglang_ext.config.PLUGIN_SPEC, recorded
    # in the result's meta.plugin_spec): follow-up + repeat-prefill in the committed result
    "default": {},
    "ratio-0.2": {"ratio": 0.2},
    "ratio-0.05": {"ratio": 0.05},
    "repeat-prefill": {"queries": {"sources": ("follow-up", "repeat-prefill")}},
    "self-study": {"queries": {"sources": ("follow-up", "self-study")}},
    "no-answers": {"queries": {"follow_up_answer_tokens": 0}},
    "off-policy": {"on_policy": False},
    "am-omp-fast": {"method": "am-omp-fast"},
    # the ratio is the ceiling of the search (spec.candidate_ratios)
    "target-0.1": {"target_error": 0.1, "ratio": 0.3},
    "target-0.2": {"target_error": 0.2, "ratio": 0.3},
    # GVote ignores the ratio: it keeps each head's nucleus (compactor.methods.gvote)
    "gvote": {"method": "gvote"},
}
KINDS = ("needle", "prose")


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
    kind: str = "needle",
    seen_questions: int = 6,
    steps_of: dict[str, Sequence[int]] | None = None,
) -> list[dict[str, Any]]:
    """One row per (configuration, k) for document `index` of `kind` (module docstring),
    then its ``full`` row (the uncompacted answers). `steps_of` gives some configurations
    their own refit steps (else `refit_steps`). Target configurations at k < 2 are left out
    (their search holds one of >= 2 follow-ups out).

    Raises ValueError on an unknown kind, a refit step outside [1, seen_questions] or a
    document too short for the plugin to compact.
    """
    from benchmarks.server._shared_prefix import (
        attention_error,
        common_length,
        greedy_answers,
        prompt_ids,
        question_queries,
        same_first,
    )
    from compactor import hf
    from compactor.eval.harness import EvalCase, build_reference, evaluate_prefix
    from compactor.pipeline import Hooks, compact_prefix
    from harness import workload as wl
    from sglang_ext.config import PLUGIN_SPEC, CompactionConfig

    if kind not in KINDS:
        raise ValueError(f"document kind {kind!r} not in {KINDS}")
    prose = kind == "prose"
    seen_q = wl.many_questions(seen_questions, prose=prose)
    unseen_q = wl.prose_unseen_questions() if prose else wl.unseen_questions()
    steps = {name: list((steps_of or {}).get(name, refit_steps)) for name in configs}
    for k in (k for ks in steps.values() for k in ks):
        if not 1 <= k <= len(seen_q):
            raise ValueError(f"refit step {k} not in [1, {len(seen_q)}]")
    doc = wl.prose_document(sentences, index) if prose else wl.document(sentences, index)
    seen_p, unseen_p = prompt_ids(tokenizer, doc, seen_q), prompt_ids(tokenizer, doc, unseen_q)
    t = wl.compacted_length(common_length(seen_p))
    if t < 2 or common_length([seen_p[0], *unseen_p]) < t:
        raise ValueError(f"{kind} document {index} with {sentences} sentences: prefix of {t}")
    prefix = seen_p[0][:t]
    seen_s, unseen_s = [p[t:] for p in seen_p], [p[t:] for p in unseen_p]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ref_unseen = build_reference(
        model, tokenizer, EvalCase(f"{kind}{index}-unseen", prefix, unseen_s), answer_tokens
    )
    full = hf.PrefixState.full(ref_unseen.prefill)
    cut = CompactionConfig.follow_up_tokens
    max_k = max(k for ks in steps.values() for k in ks)
    stock_seen = greedy_answers(model, full, seen_s[:max_k], answer_tokens, eos)
    unseen_queries = question_queries(
        model,
        tokenizer,
        prefix,
        ref_unseen.prefill,
        [s[:cut] for s in unseen_s],
        PLUGIN_SPEC.queries.follow_up_answer_tokens,
    )

    def needleshare(answers: Sequence[list[int]]) -> float | None:
        if prose:
            return None
        return share(
            [wl.needle_correct(q, tokenizer.decode(a), index) for q, a in zip(unseen_q, answers)]
        )

    rows = []
    for name in configs:
        spec = config_spec(name)
        for k in steps[name]:
            if spec.target_error is not None and k < 2:
                continue
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
            attn = attention_error(model, compacted, ref_unseen.prefill, unseen_queries)
            row = {
                "config": name,
                "kind": kind,
                "method": spec.method,
                **_budget_fields(spec, compacted, attn),
                "sources": list(spec.queries.sources),
                "k": k,
                "doc": index,
                "prefix_tokens": t,
                "seen_agree16": sum(
                    same_first(a, b, answer_tokens) for a, b in zip(stock_seen, got_seen)
                )
                / k,
                "unseen_agree16": sum(
                    same_first(a, b, answer_tokens) for a, b in zip(ref_unseen.answers, got_unseen)
                )
                / len(unseen_s),
                "unseen_logppl_gap": ev["logppl_gap"],
                "unseen_token_agreement": ev["agreement"],
                "unseen_needles": needleshare(got_unseen),
                "unseen_attn_error": attn,
                "seconds": seconds,
                "unseen_answers": [tokenizer.decode(a) for a in got_unseen],
            }
            rows.append(row)
    rows.append(
        {
            "config": "full",
            "kind": kind,
            "doc": index,
            "prefix_tokens": t,
            "unseen_needles": needleshare(ref_unseen.answers),
            "unseen_answers": [tokenizer.decode(a) for a in ref_unseen.answers],
        }
    )
    return rows


def _budget_fields(spec: Any, compacted: Any, attn: float) -> dict[str, Any]:
    """ratio (configured; chosen for a target spec; realized for gvote), kept_ratio, and the
    target's chosen_ratio / estimated_error / target_error / target_met (None otherwise)."""
    kept = compacted.kept_fraction()
    search = None if compacted.budget is None else compacted.budget.search
    out: dict[str, Any] = {
        "ratio": kept if spec.method == "gvote" else spec.ratio,
        "kept_ratio": kept,
        "chosen_ratio": None,
        "estimated_error": None,
        "target_error": spec.target_error,
        "target_met": None,
    }
    if search is not None:
        out["ratio"] = out["chosen_ratio"] = search["chosen_ratio"]
        out["estimated_error"] = search["estimated_error"]
        out["target_met"] = attn <= search["target_error"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = script_parser(__doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--docs", type=int, default=3, help="needle documents (workload index 0..)")
    p.add_argument("--prose-docs", type=int, default=2, help="prose documents (no needles)")
    p.add_argument("--sentences", type=int, default=110, help="sentences per document")
    p.add_argument(
        "--configs",
        default="baseline,repeat-prefill,target-0.1:8,gvote:8",
        help=f"comma-separated, from: {', '.join(CONFIGS)}; NAME:K+K... gives a "
        "configuration its own refit steps (else --refit-steps)",
    )
    p.add_argument("--refit-steps", default="2,8,32", help="k: seen questions fitted")
    p.add_argument("--seen-questions", type=int, default=32, help="seen questions per document")
    add_options(p, answer_tokens=16, threads=1, json="benchmarks/results/next_question.json")
    add_options(p, plot="benchmarks/results/next_question.png")
    args = p.parse_args(argv)
    own_steps = dict(c.split(":", 1) if ":" in c else (c, "") for c in args.configs.split(",") if c)
    configs = list(own_steps)
    for c in configs:
        if c not in CONFIGS:
            p.error(f"unknown configuration {c!r}; choose from {', '.join(CONFIGS)}")

    import torch

    from benchmarks.server._shared_prefix import ints

    steps = ints(args.refit_steps)
    steps_of = {c: ints(ks.replace("+", ",")) for c, ks in own_steps.items() if ks}
    for k in [*steps, *(k for ks in steps_of.values() for k in ks)]:
        if not 1 <= k <= args.seen_questions:
            p.error(f"refit step {k} not in [1, --seen-questions {args.seen_questions}]")
    from compactor import hf
    from compactor.models import resolve_model
    from harness.provenance import provenance
    from sglang_ext.config import PLUGIN_SPEC, CompactionConfig

    prov = provenance(argv)
    torch.set_num_threads(args.threads)
    model, tok = hf.load_model(resolve_model(args.model))
    t0 = time.perf_counter()
    per_doc: list[dict[str, Any]] = []
    docs = [("needle", d) for d in range(args.docs)] + [
        ("prose", d) for d in range(args.prose_docs)
    ]
    for kind, d in docs:
        per_doc += measure_document(
            model, tok, d, args.sentences, configs, steps, args.answer_tokens, kind,
            args.seen_questions, steps_of,
        )  # fmt: skip
        print(f"{kind} document {d} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    rows = summarize(per_doc)
    skipped = [
        {"config": c, "k": k, "why": "target_error holds out one of >= 2 follow-ups"}
        for c in configs
        for k in steps_of.get(c, steps)
        if k < 2 and "target_error" in CONFIGS[c]
    ]
    meta = {
        "model": args.model,
        "docs": args.docs,
        "prose_docs": args.prose_docs,
        "sentences": args.sentences,
        "seen_questions": args.seen_questions,
        "answer_tokens": args.answer_tokens,
        "threads": args.threads,
        "plugin_spec": PLUGIN_SPEC.to_dict(),
        "plugin_max_follow_ups": CompactionConfig.max_follow_ups,
        "configs": {c: CONFIGS[c] for c in configs},
        "refit_steps": {c: steps_of.get(c, steps) for c in configs},
        "skipped": skipped,
        "memory_vs_baseline": memory_vs_baseline(rows, PLUGIN_SPEC.ratio),
        "seconds": time.perf_counter() - t0,
    }
    out = {"provenance": prov, "meta": meta, "rows": rows, "per_document": per_doc}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1, default=list))
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        title = (
            f"next question after a compaction: {args.model}, {args.docs} needle + "
            f"{args.prose_docs} prose documents, plugin spec {PLUGIN_SPEC.method} ratio "
            f"{PLUGIN_SPEC.ratio} + overrides"
        )
        plot(rows, args.plot, title, per_doc)
    print_rows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

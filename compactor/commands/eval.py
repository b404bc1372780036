"""`compactor eval`: sweep methods x ratios on held-out future tokens; table, JSON, plot."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from compactor.commands._common import (
    add_head_budget_args,
    add_model_args,
    add_query_args,
    encode,
    head_budget_error,
    load,
    parse_floats,
    query_config,
)

DEFAULT_QUESTIONS = (
    "\n\nQuestion: What is the text above about?\nAnswer:",
    "\n\nQuote the first sentence of the text above.\n",
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("eval", help="evaluate compaction methods on held-out future queries")
    add_model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", help="text file holding the prefix")
    src.add_argument(
        "--niah", type=int, metavar="N", help="use N generated needle-in-a-haystack cases"
    )
    p.add_argument("--niah-tokens", type=int, default=1000, help="prefix length of NIAH cases")
    p.add_argument(
        "--questions", default=None, help="with --input: file with one question per line"
    )
    p.add_argument(
        "--methods",
        default="full,am-omp,keep-only",
        help=(
            "comma-separated methods ('full' = no compaction), each name or name:key=value; "
            "name:head_budgets=auto|uniform|PATH overrides --head-budgets for that method"
        ),
    )
    p.add_argument("--ratios", default="0.1", help="comma-separated kept ratios")
    p.add_argument(
        "--answer-tokens", type=int, default=16, help="greedy answer tokens per question"
    )
    p.add_argument("--json", required=True, help="output JSON path")
    p.add_argument("--plot", default=None, help="output PNG path")
    add_head_budget_args(p)
    add_query_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from compactor.eval.harness import EvalCase
    from compactor.eval.runner import (
        format_table,
        make_niah_cases,
        parse_method_spec,
        plot_records,
        run_eval,
        write_json,
    )

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    ratios = parse_floats(args.ratios, "--ratios")
    if not methods:
        raise ValueError(f"--methods is empty: {args.methods!r}")
    model, tok = load(args)
    for m in methods:
        if m == "full":
            continue
        name, params = parse_method_spec(m)
        spec = str(params.get("head_budgets", args.head_budgets))
        err = head_budget_error(spec, model, [name])
        if err:
            print(f"compactor eval: error: {m}: {err}", file=sys.stderr)
            return 2
    if args.niah is not None:
        if args.niah < 1:
            raise ValueError(f"--niah must be >= 1, got {args.niah}")
        cases = make_niah_cases(tok, args.niah, args.niah_tokens)
    else:
        qs: tuple[str, ...] = DEFAULT_QUESTIONS
        if args.questions:
            qs = tuple(
                "\n\n" + ln
                for ln in Path(args.questions).read_text(encoding="utf-8").splitlines()
                if ln.strip()
            )
        text = Path(args.input).read_text(encoding="utf-8")
        cases = [EvalCase(Path(args.input).name, encode(tok, text), [encode(tok, q) for q in qs])]
    records = run_eval(
        model,
        tok,
        cases,
        methods,
        ratios,
        query_config=query_config(args),
        niah=args.niah is not None,
        answer_tokens=args.answer_tokens,
        keep_sink_tokens=args.keep_sink_tokens,
        chunk_size=args.chunk_size,
        on_policy=args.on_policy,
        progress=not args.no_progress,
        head_budgets=args.head_budgets,
    )
    meta = {
        "model": args.model,
        "cases": [c.name for c in cases],
        "query_sources": args.query_sources,
        "head_budgets": args.head_budgets,
    }
    write_json(records, args.json, meta)
    print(format_table(records))
    if args.plot:
        plot_records(records, args.plot)
    return 0

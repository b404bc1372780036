"""`compactor eval`: sweep methods x ratios on held-out future tokens; table, JSON, plot."""

from __future__ import annotations

import argparse
from pathlib import Path

from compactor.commands._common import (
    UsageError,
    add_model_args,
    add_progress_arg,
    check_head_budgets,
    encode,
    load,
    parse_floats,
    read_lines,
    require_file,
)
from compactor.spec import CompactionSpec
from compactor.spec.cli_args import add_spec_args, spec_from_args

DEFAULT_QUESTIONS = (
    "\n\nQuestion: What is the text above about?\nAnswer:",
    "\n\nQuote the first sentence of the text above.\n",
)


HELP = "evaluate compaction methods on held-out future queries"


def add_arguments(p: argparse.ArgumentParser) -> None:
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
    # every spec knob but the swept ones (--methods, --ratios)
    add_spec_args(p, exclude=("method", "method_params", "ratio", "tokens"))
    add_progress_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from compactor.eval.harness import EvalCase
    from compactor.eval.runner import (
        format_table,
        make_niah_cases,
        method_spec,
        plot_records,
        run_eval,
        write_json,
    )

    base = spec_from_args(args)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    ratios = parse_floats(args.ratios, "--ratios")
    if not methods:
        raise UsageError(f"--methods is empty: {args.methods!r}", "--methods")
    if not ratios:
        raise UsageError(f"--ratios is empty: {args.ratios!r}", "--ratios")
    swept: list[tuple[str, CompactionSpec]] = []  # (entry of --methods, its spec)
    for m in methods:
        if m == "full":
            continue
        try:
            for ratio in ratios:
                spec = method_spec(base, m, ratio)
                spec.validate()
        except ValueError as exc:
            raise UsageError(f"{m}: {exc}", "--methods") from None
        swept.append((m, spec))
    if args.niah is not None and args.niah < 1:
        raise UsageError(f"--niah must be >= 1, got {args.niah}", "--niah")
    text = require_file(args.input, "--input").read_text(encoding="utf-8") if args.input else ""
    questions = require_file(args.questions, "--questions") if args.questions else None
    model, tok = load(args)
    for m, spec in swept:
        check_head_budgets(model, spec, m)
    if args.niah is not None:
        cases = make_niah_cases(tok, args.niah, args.niah_tokens)
    else:
        qs: tuple[str, ...] = DEFAULT_QUESTIONS
        if questions is not None:
            qs = tuple("\n\n" + ln for ln in read_lines(questions, "--questions"))
        cases = [EvalCase(Path(args.input).name, encode(tok, text), [encode(tok, q) for q in qs])]
    records = run_eval(
        model,
        tok,
        cases,
        methods,
        ratios,
        spec=base,
        niah=args.niah is not None,
        answer_tokens=args.answer_tokens,
        progress=not args.no_progress,
    )
    meta = {
        "model": args.model,
        "cases": [c.name for c in cases],
        "query_sources": ",".join(base.queries.sources),
        "head_budgets": base.head_budgets,
        "spec": base.to_dict(),
    }
    write_json(records, args.json, meta)
    print(format_table(records))
    if args.plot:
        plot_records(records, args.plot)
    return 0

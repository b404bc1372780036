"""`compactor compact`: compact one text prefix and save the CompactedPrefix (safetensors)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from compactor.commands._common import (
    add_head_budget_args,
    add_model_args,
    add_query_args,
    encode,
    head_budget_error,
    load,
    query_config,
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "compact", help="compact a text prefix into a .safetensors CompactedPrefix"
    )
    add_model_args(p)
    p.add_argument("--input", required=True, help="text file holding the prefix")
    p.add_argument("--method", default="am-omp-fast", help="registered method name")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--ratio", type=float, help="kept fraction per KV head, e.g. 0.1")
    budget.add_argument("--tokens", type=int, help="kept entries per KV head")
    p.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="method hyper-parameter (repeatable)",
    )
    p.add_argument(
        "--follow-ups",
        default=None,
        help="file with one follow-up question per line (follow-up source)",
    )
    p.add_argument("--output", required=True, help="output .safetensors path")
    add_head_budget_args(p)
    add_query_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from compactor.pipeline import compact_prefix

    params = {}
    for item in args.param:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--param must be KEY=JSON, got {item!r}")
        params[key] = json.loads(value)
    model, tok = load(args)
    err = head_budget_error(args.head_budgets, model, [args.method])
    if err:
        print(f"compactor compact: error: {err}", file=sys.stderr)
        return 2
    ids = encode(tok, Path(args.input).read_text(encoding="utf-8"))
    follow = None
    if args.follow_ups:
        lines = [
            ln
            for ln in Path(args.follow_ups).read_text(encoding="utf-8").splitlines()
            if ln.strip()
        ]
        follow = [encode(tok, "\n\n" + ln) for ln in lines]
    prefix, times = compact_prefix(
        model,
        tok,
        ids,
        args.method,
        ratio=args.ratio,
        tokens=args.tokens,
        query_sources=query_config(args),
        follow_ups=follow,
        chunk_size=args.chunk_size,
        on_policy=args.on_policy,
        progress=not args.no_progress,
        keep_sink_tokens=args.keep_sink_tokens,
        method_params=params,
        head_budgets=args.head_budgets,
    )
    prefix.save(args.output)
    summary = {
        "output": str(args.output),
        "method": prefix.method,
        "logical_length": prefix.logical_length,
        "kept_tokens": prefix.kept_tokens(),
        "kept_fraction": round(prefix.kept_fraction(), 4),
        "head_budgets": prefix.params["head_budgets"],
        "seconds": {k: round(v, 3) for k, v in times.as_dict().items()},
    }
    print(json.dumps(summary, indent=2))
    return 0

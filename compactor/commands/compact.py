"""`compactor compact`: compact one text prefix and save the CompactedPrefix (safetensors)."""

from __future__ import annotations

import argparse
import json

from compactor.commands._common import (
    add_model_args,
    add_progress_arg,
    check_head_budgets,
    encode,
    load,
    read_lines,
    require_file,
)
from compactor.spec.cli_args import add_spec_args, spec_from_args

HELP = "compact a text prefix into a .safetensors CompactedPrefix"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--input", required=True, help="text file holding the prefix")
    p.add_argument(
        "--follow-ups",
        default=None,
        help="file with one follow-up question per line (follow-up source)",
    )
    p.add_argument("--output", required=True, help="output .safetensors path")
    add_spec_args(p, budget_required=True)
    add_progress_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from compactor.pipeline import Hooks, compact_prefix

    spec = spec_from_args(args)  # every argument is checked before the model loads
    text = require_file(args.input, "--input").read_text(encoding="utf-8")
    lines = read_lines(args.follow_ups, "--follow-ups") if args.follow_ups else None
    model, tok = load(args)
    check_head_budgets(model, spec)
    ids = encode(tok, text)
    follow = [encode(tok, "\n\n" + ln) for ln in lines] if lines is not None else None
    prefix, times = compact_prefix(
        model, tok, ids, spec, follow, Hooks(progress=not args.no_progress)
    )
    prefix.save(args.output)
    summary = {
        "output": str(args.output),
        "method": prefix.method,
        "logical_length": prefix.logical_length,
        "kept_tokens": prefix.kept_tokens(),
        "kept_fraction": round(prefix.kept_fraction(), 4),
        "head_budgets": None if prefix.budget is None else prefix.budget.per_head,
        "seconds": {k: round(v, 3) for k, v in times.as_dict().items()},
    }
    print(json.dumps(summary, indent=2))
    return 0

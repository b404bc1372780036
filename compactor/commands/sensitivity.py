"""`compactor sensitivity --model M`: per-(layer, KV head) sensitivity curves for head budgets.

Prefill one needle document of about --tokens tokens cut from the shipped filler, compact
every layer at each kept fraction with fit queries (repeat-prefill) and score each KV head
on held-out future queries (the eval harness's greedy answers to the document's questions).
Writes sensitivity.<method>.json into the model directory (or --out), read by `compactor
compact --head-budgets auto`.
"""

from __future__ import annotations

import argparse
import json
import sys

from compactor.commands._common import add_model_args, add_progress_arg, parse_floats
from compactor.spec import CompactionSpec, QueryConfig
from compactor.spec.cli_args import add_spec_args, spec_from_args

# What is measured by default: am-highest fitted to repeat-prefill queries (the budget,
# chunking, policy and head budgets of the spec are not used).
SENSITIVITY_SPEC = CompactionSpec(
    method="am-highest", queries=QueryConfig(sources=("repeat-prefill",))
)


HELP = "measure sensitivity curves for non-uniform head budgets (--head-budgets auto)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    add_spec_args(
        p,
        defaults=SENSITIVITY_SPEC,
        fields=(
            "method",
            "method_params",
            "queries.sources",
            "queries.max_queries_per_head",
            "keep_sink_tokens",
        ),
        flags={"queries.sources": "--fit-sources"},
    )
    p.add_argument(
        "--fractions",
        default="0.05,0.1,0.2,0.4",
        help="comma-separated increasing kept fractions in (0, 1]",
    )
    p.add_argument("--tokens", type=int, default=1024, help="document length (default 1024)")
    p.add_argument("--seed", type=int, default=0, help="document seed")
    p.add_argument(
        "--answer-tokens", type=int, default=16, help="greedy answer tokens per question"
    )
    p.add_argument("--out", default=None, help="JSON path (default: in the model directory)")
    add_progress_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from compactor import hf
    from compactor.eval.sensitivity import (
        check_fractions,
        measure_sensitivity,
        sensitivity_case,
    )
    from compactor.head_budgets.curves import save_sensitivity_json, sensitivity_path
    from compactor.models import ModelNotAvailableError, resolve_model

    try:
        spec = spec_from_args(args)  # unknown method / parameter: fail before loading
        fractions = check_fractions(parse_floats(args.fractions, "--fractions"))
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
        model_dir = resolve_model(args.model)
        model, tok = hf.load_model(model_dir)
        case = sensitivity_case(tok, args.tokens, args.seed)
        curves = measure_sensitivity(
            model,
            tok,
            case,
            spec,
            fractions,
            answer_tokens=args.answer_tokens,
            progress=not args.no_progress,
        )
    except (ValueError, ModelNotAvailableError) as exc:
        print(f"compactor sensitivity: error: {exc}", file=sys.stderr)
        return 2
    path = Path(args.out) if args.out else sensitivity_path(model_dir, curves.method)
    save_sensitivity_json(path, curves)
    first = [sum(h[0] for h in layer) / len(layer) for layer in curves.errors]
    worst = sorted(range(len(first)), key=lambda i: -first[i])[:4]
    summary = {
        "path": str(path),
        "shape": list(curves.shape),
        "fractions": curves.fractions,
        "seconds": curves.meta["seconds"],
        "most_sensitive_layers": worst,
    }
    print(json.dumps(summary))
    return 0

"""Arguments and helpers shared by `compactor compact` and `compactor eval`."""

from __future__ import annotations

import argparse
from typing import Any


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        help="a known model name (e.g. smollm2-135m) or a checkpoint directory",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: two threads beside another busy process run many times slower)",
    )


def add_query_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--query-sources",
        default="repeat-prefill,self-study",
        help="comma-separated reference-query sources (context-prefill, repeat-prefill, self-study, random, follow-up)",
    )
    p.add_argument(
        "--max-queries", type=int, default=2048, help="reservoir cap of queries per KV head"
    )
    p.add_argument(
        "--self-study-tokens", type=int, default=24, help="tokens generated per self-study prompt"
    )
    p.add_argument(
        "--keep-sink-tokens", type=int, default=4, help="first tokens kept uncompacted (beta 0)"
    )
    p.add_argument(
        "--chunk-size", type=int, default=None, help="compact the KV in chunks of this many tokens"
    )
    p.add_argument(
        "--on-policy", action="store_true", help="draw layer l's queries with layers < l compacted"
    )
    p.add_argument(
        "--follow-up-answer-tokens",
        type=int,
        default=0,
        help="append the model's greedy answer (this many tokens) to each follow-up query text",
    )
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")


def add_head_budget_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--head-budgets",
        default="uniform",
        metavar="uniform|auto|PATH",
        help=(
            "per-head budgets: uniform (default); auto = the model's sensitivity curves "
            "(made by `compactor sensitivity`); or a curves JSON path. Same total either way"
        ),
    )


def head_budget_error(spec: str, model: Any, methods: list[str]) -> str | None:
    """Why `spec` cannot be used with `model` and each method name (None when it can)."""
    from compactor.pipeline import head_budget_curves

    for name in methods:
        try:
            head_budget_curves(model, name, spec)
        except ValueError as exc:
            return str(exc)
    return None


def query_config(args: argparse.Namespace) -> Any:
    from compactor.queries import QueryConfig

    sources = tuple(s.strip() for s in args.query_sources.split(",") if s.strip())
    return QueryConfig(
        sources=sources,
        max_queries_per_head=args.max_queries,
        self_study_tokens=args.self_study_tokens,
        follow_up_answer_tokens=args.follow_up_answer_tokens,
    )


def load(args: argparse.Namespace) -> tuple[Any, Any]:
    """(model, tokenizer) for --model; sets the torch thread count to --threads."""
    import torch

    from compactor.hf import load_model
    from compactor.models import resolve_model

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    return load_model(resolve_model(args.model))


def parse_floats(text: str, what: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated numbers, got {text!r}") from None


def encode(tokenizer: Any, text: str) -> list[int]:
    if tokenizer is None:
        raise ValueError("this model has no tokenizer; text input needs one")
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])

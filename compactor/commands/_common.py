"""Arguments and helpers shared by the `compactor` subcommands.

Argument problems found before any model is loaded (a bad spec knob, a missing input file,
an unknown model) raise :class:`~compactor.spec.cli_args.UsageError`: `compactor.cli` prints it
as one ``compactor <command>: error: ...`` line and exits 2.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compactor.spec.cli_args import UsageError

if TYPE_CHECKING:
    from compactor.spec import CompactionSpec

__all__ = [
    "UsageError",
    "add_model_args",
    "add_progress_arg",
    "check_head_budgets",
    "encode",
    "load",
    "parse_floats",
    "read_lines",
    "require_file",
]


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


def add_progress_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")


def require_file(path: str | Path | None, flag: str) -> Path:
    """`path` as a Path; UsageError naming `flag` when it is not a readable file."""
    if path is None or not Path(path).is_file():
        raise UsageError(f"{flag}: no such file: {path}", flag)
    return Path(path)


def read_lines(path: str | Path | None, flag: str) -> list[str]:
    """The non-blank lines of the UTF-8 text file `path` (UsageError naming `flag` when it
    is not a readable file)."""
    text = require_file(path, flag).read_text(encoding="utf-8")
    return [ln for ln in text.splitlines() if ln.strip()]


def check_head_budgets(model: Any, spec: CompactionSpec, label: str = "") -> None:
    """UsageError (--head-budgets, its message after ``label: `` when given) when the
    spec's head budgets cannot be used with `model` and the spec's method."""
    from compactor.pipeline import head_budget_curves

    try:
        head_budget_curves(model, spec.method, spec.head_budgets)
    except ValueError as exc:
        raise UsageError(f"{label}: {exc}" if label else str(exc), "--head-budgets") from None


def load(args: argparse.Namespace) -> tuple[Any, Any]:
    """(model, tokenizer) for --model; sets the torch thread count to --threads.

    Raises UsageError for --threads < 1 or a model that is neither known nor a directory.
    """
    import torch

    from compactor.hf import load_model
    from compactor.models import ModelNotAvailableError, resolve_model

    if args.threads is not None:
        if args.threads < 1:
            raise UsageError(f"--threads must be >= 1, got {args.threads}", "--threads")
        torch.set_num_threads(args.threads)
    try:
        model_dir = resolve_model(args.model)
    except (ValueError, ModelNotAvailableError) as exc:
        raise UsageError(str(exc), "--model") from None
    return load_model(model_dir)


def parse_floats(text: str, what: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{what} must be comma-separated numbers, got {text!r}", what) from None


def encode(tokenizer: Any, text: str) -> list[int]:
    if tokenizer is None:
        raise ValueError("this model has no tokenizer; text input needs one")
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])

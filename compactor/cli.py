"""The `compactor` command line: `compactor <command> [...]`; `compactor -h` lists commands.

A command's argument checks (the compaction spec, input files, the model name) raise
:class:`~compactor.spec.cli_args.UsageError` before any model is loaded: it is printed as one
``compactor <command>: error: <why>`` line on stderr and the exit status is 2 (as argparse
does for its own errors). Any other exception keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from compactor import __version__
from compactor.commands import COMMANDS
from compactor.spec.cli_args import UsageError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="compactor",
        description="Compact shared-prefix KV caches and serve them to SGLang.",
    )
    parser.add_argument("--version", action="version", version=f"compactor {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"compactor.commands.{name}")
        _, _, body = (module.__doc__ or "").partition("\n\n")  # after the summary paragraph
        p = subparsers.add_parser(name, help=module.HELP, description=body.strip() or None)
        module.add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        print(f"compactor {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""Scripts that measure the project, grouped by what they need; each writes its figures to
`benchmarks/results/` (JSON, often a PNG beside it) with the command, commit, machine and date
inside (`harness.provenance`). Run them from the repository root with `python -m`:

- `offline/`: a CPU and the embedded model, no server;
- `server/`: real SGLang servers (and `compactor serve`) started on loopback;
- `gpu/`: a CUDA machine, and the tools that prepare a run there without network;
- `report/`: the documents' tables rendered from the result files, and `run_all`.

`benchmarks/README.md` maps each script to its result files and the document that shows them.
"""

import argparse
from pathlib import Path

from harness.provenance import ROOT

RESULTS = ROOT / "benchmarks" / "results"

__all__ = ["RESULTS", "ROOT", "add_options", "script_parser"]


def script_parser(doc: str | None) -> argparse.ArgumentParser:
    """A script's parser: its module docstring, as written, is the `--help` text."""
    return argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def add_options(parser: argparse.ArgumentParser, **options: object) -> None:
    """`--some-name` for each keyword `some_name=default` or `some_name=(default, help)`.

    The option's type is its default's (str, int, float or Path), and its help shows the
    default; a default of False makes a flag (store_true).
    """
    for name, spec in options.items():
        default, help_text = spec if isinstance(spec, tuple) else (spec, None)
        flag = "--" + name.replace("_", "-")
        if default is False:
            parser.add_argument(flag, action="store_true", help=help_text)
        elif isinstance(default, str | int | float | Path) and not isinstance(default, bool):
            shown = f"{help_text} (default: %(default)s)" if help_text else "default: %(default)s"
            parser.add_argument(flag, type=type(default), default=default, help=shown)
        else:
            raise ValueError(f"add_options: {name}={default!r} is not a str, int, float or Path")

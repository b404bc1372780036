"""Subcommands of the `compactor` CLI: one module each, exposing `add_parser(subparsers)`.

`compactor.cli` imports every module named in COMMANDS (lazily: a command's heavy imports
belong inside its handler, so `compactor --help` stays fast).
"""

COMMANDS: tuple[str, ...] = (
    "models",
    "methods",
    "compact",
    "eval",
    "calibrate",
    "sensitivity",
    "serve",
    "request",
)

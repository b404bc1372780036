"""Subcommands of the `compactor` CLI: one module each, named as the command.

A command module exposes ``HELP`` (its line in `compactor -h`) and
``add_arguments(parser)`` (its arguments, and ``func``, the handler, as a parser default).
The description `compactor <command> -h` prints is the body of the module's docstring: what
follows its summary paragraph (none when there is no body).

`compactor.cli` imports every module named in COMMANDS (lazily: a command's heavy imports
belong inside its handler, so `compactor --help` stays fast) and adds its parser.
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

"""`compactor methods [NAME ...] [--json]`: the registered compaction methods and their
parameters (types, defaults, one line of doc), read from the method dataclasses.

List every registered compaction method (or the NAMEs given): one line of doc and each
parameter with its type and default. Set a parameter with `compactor compact --method NAME
--param KEY=JSON` or `compactor eval --methods NAME:KEY=VALUE`.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

HELP = "list the compaction methods with their parameters and defaults"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("names", nargs="*", metavar="NAME", help="only these methods")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from compactor.methods import describe_methods

    try:
        infos = describe_methods(args.names or None)
    except ValueError as exc:
        raise SystemExit(f"compactor methods: error: {exc}") from exc
    if args.json:
        rows = [
            {
                "name": m.name,
                "doc": m.doc,
                "selects": m.selects,
                "needs_context": m.needs_context,
                "params": [
                    {
                        "name": p.name,
                        "type": p.type,
                        "default": _jsonable(p.default),
                        "required": p.required,
                    }
                    for p in m.params
                ],
            }
            for m in infos
        ]
        print(json.dumps({"methods": rows}, indent=2))
        return 0
    for i, m in enumerate(infos):
        if i:
            print()
        tags = [
            t for t, on in (("selects keys", m.selects), ("needs context", m.needs_context)) if on
        ]
        print(f"{m.name}" + (f"  [{', '.join(tags)}]" if tags else ""))
        print(f"  {m.doc}")
        if not m.params:
            print("  (no parameters)")
        width_n = max((len(p.name) for p in m.params), default=0)
        width_t = max((len(p.type) for p in m.params), default=0)
        for p in m.params:
            default = "(required)" if p.required else f"= {p.default!r}"
            print(f"    {p.name:<{width_n}}  {p.type:<{width_t}}  {default}")
    return 0


def _jsonable(value: Any) -> Any:
    """Defaults as JSON: tuples become lists; anything else JSON cannot hold, its repr."""
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return repr(value)

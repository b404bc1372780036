"""argparse flags generated from :class:`~compactor.spec.CompactionSpec`'s fields.

    add_spec_args(parser)                                # --method, --ratio, --query-sources, ...
    add_spec_args(group, prefix="compaction-", defaults=PLUGIN_SPEC)   # --compaction-method, ...
    spec = spec_from_args(parser.parse_args(argv))       # validated; UsageError names the flag

Each knob's flag name, help text and parsing come from its field metadata in
``compactor.spec`` (``--<prefix><flag>``; booleans get ``--[no-]<prefix><flag>``; ``--ratio``
and ``--tokens`` are mutually exclusive; ``--param KEY=JSON`` and ``--self-study-prompt``
repeat). `add_spec_args` records what it added in a hidden parser default, so
:func:`spec_from_args` needs only the namespace and the prefix. Torch-free.

Any other frozen dataclass whose fields carry the same metadata (``flag``, ``help``, ``kind``
str | int | float | opt_int | bool, or ``parse``: a callable that converts the text) gets its
flags the same way: :func:`add_field_args` / :func:`field_values` (``sglang_ext.config``).
Optional metadata: ``metavar`` (None: argparse's default) and ``show_default`` (False: no
``(default: ...)`` appended to the help).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from compactor.spec.compaction import CompactionSpec, SpecError, spec_fields
from compactor.spec.fields import LabelledError

__all__ = [
    "UsageError",
    "add_field_args",
    "add_spec_args",
    "field_values",
    "spec_flags",
    "spec_from_args",
    "usage_error",
]


class UsageError(LabelledError):
    """A bad command-line value (the CLI exits 2); `flag` names its option ("" if none)."""

    @property
    def flag(self) -> str:
        return self.label

    def with_flag(self) -> str:
        """``"--flag: message"`` (the message alone when no flag is known)."""
        return f"{self.flag}: {self}" if self.flag else str(self)


_METAVARS = {
    "str": "NAME",
    "int": "N",
    "opt_int": "N",
    "tokens": "N",
    "float": "X",
    "ratio": "X",
    "csv": "A,B,...",
    "lines": "TEXT",
}


@dataclass(frozen=True)
class _Added:
    """What one add_spec_args call added: the base spec, its knobs and their options."""

    defaults: CompactionSpec
    fields: tuple[str, ...]
    options: dict[str, str]  # dotted path -> option string ("--compaction-ratio")


def spec_flags(prefix: str = "") -> dict[str, str]:
    """The default option string of every knob: dotted path -> ``--<prefix><flag>``."""
    return {
        path: f"--{prefix}{f.metadata['flag']}" for path, f in spec_fields() if _kind(f) != "group"
    }


def add_spec_args(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    prefix: str = "",
    defaults: CompactionSpec | None = None,
    fields: Iterable[str] | None = None,
    exclude: Iterable[str] = (),
    budget_required: bool = False,
    flags: Mapping[str, str] | None = None,
) -> None:
    """Add a flag for each knob (mutates `parser`).

    Args:
        prefix: prepended to every flag name (``"compaction-"`` -> ``--compaction-ratio``).
        defaults: the spec the flags start from (default ``CompactionSpec()``).
        fields / exclude: dotted knob paths to add (default all) / to leave out.
        budget_required: one of ``--ratio`` / ``--tokens`` must be given.
        flags: per-path option strings replacing the generated ones (``--fit-sources``).
    """
    base = defaults if defaults is not None else CompactionSpec()
    paths = [p for p, _ in spec_fields()]
    wanted = set(paths if fields is None else fields)
    unknown = (wanted | set(exclude) | set(flags or {})) - set(paths)
    if unknown:
        raise ValueError(f"unknown spec field(s) {sorted(unknown)}; known: {paths}")
    chosen = tuple(p for p in paths if p in wanted and p not in set(exclude))
    options = {**spec_flags(prefix), **(flags or {})}
    budget: Any = None
    for path, f in spec_fields():
        if path not in chosen:
            continue
        kind, opt = _kind(f), options[path]
        default = _get(base, path)
        if kind in ("ratio", "tokens"):
            if budget is None:
                budget = parser.add_mutually_exclusive_group(required=budget_required)
            kw = _argument(f, None, _dest(prefix, path))
            shown = f" (default: {default})" if default is not None else ""
            kind_type = float if kind == "ratio" else int
            budget.add_argument(opt, **{**kw, "type": kind_type, "help": kw["help"] + shown})
            continue
        parser.add_argument(opt, **_argument(f, default, _dest(prefix, path)))
    parser.set_defaults(**{_hidden(prefix): _Added(base, chosen, {p: options[p] for p in chosen})})


def spec_from_args(
    ns: argparse.Namespace, prefix: str = "", validate: bool = True
) -> CompactionSpec:
    """The spec the parsed flags describe (knobs without a flag keep the defaults' values).

    Raises UsageError naming the flag of the first bad value (`validate`: also the checks
    of :meth:`CompactionSpec.validate`, which builds the method).
    """
    added = getattr(ns, _hidden(prefix), None)
    if not isinstance(added, _Added):
        raise ValueError(f"no spec flags with prefix {prefix!r} in this namespace")
    base = added.defaults
    top: dict[str, Any] = {}
    queries: dict[str, Any] = {}
    try:
        for path in added.fields:
            f = dict(spec_fields())[path]
            raw = getattr(ns, _dest(prefix, path))
            kind = _kind(f)
            if kind in ("ratio", "tokens"):
                continue
            if kind == "csv":
                value: Any = tuple(s.strip() for s in raw.split(",") if s.strip())
            elif kind == "params":
                value = {**base.method_params, **_parse_params(raw)}
            elif kind == "lines":
                value = _get(base, path) if raw is None else tuple(raw)
            else:
                value = raw
            if path.startswith("queries."):
                queries[path.split(".", 1)[1]] = value
            else:
                top[path] = value
        ratio = getattr(ns, _dest(prefix, "ratio"), None) if "ratio" in added.fields else None
        tokens = getattr(ns, _dest(prefix, "tokens"), None) if "tokens" in added.fields else None
        if ratio is not None or tokens is not None:
            top.update(ratio=ratio, tokens=tokens)
        spec = dataclasses.replace(
            base, queries=dataclasses.replace(base.queries, **queries), **top
        )
        if validate:
            spec.validate()
    except SpecError as exc:
        raise usage_error(exc, ns, prefix) from None
    return spec


def add_field_args(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    prefix: str = "",
    fields: Iterable[str] | None = None,
    exclude: Iterable[str] = (),
) -> None:
    """Add ``--<prefix><flag>`` for each field of the dataclass `cls` with flag metadata
    (mutates `parser`; `fields` / `exclude`: field names to add, in the class's order / to
    leave out). The flag's default is the field's (None for a field without one); dest
    ``<prefix><flag>``."""
    chosen = [f for f in _flagged(cls, fields) if f.name not in set(exclude)]
    for f in chosen:
        if _kind(f) not in _FIELD_KINDS and "parse" not in f.metadata:
            raise ValueError(f"{cls.__name__}.{f.name}: kind {_kind(f)!r} is for spec knobs only")
    for f in chosen:
        default = None if f.default is dataclasses.MISSING else f.default
        dest = (prefix + f.metadata["flag"]).replace("-", "_")
        parser.add_argument(f"--{prefix}{f.metadata['flag']}", **_argument(f, default, dest))


def field_values(ns: argparse.Namespace, cls: type, prefix: str = "") -> dict[str, Any]:
    """The parsed values of `cls`'s flags (:func:`add_field_args`), by field name."""
    return {
        f.name: getattr(ns, (prefix + f.metadata["flag"]).replace("-", "_"))
        for f in _flagged(cls, None)
    }


def usage_error(exc: ValueError, ns: argparse.Namespace, prefix: str = "") -> UsageError:
    """`exc` as a UsageError whose flag is the option of its SpecError field (if known)."""
    if isinstance(exc, UsageError):
        return exc
    added = getattr(ns, _hidden(prefix), None)
    options = added.options if isinstance(added, _Added) else {}
    return UsageError(str(exc), options.get(getattr(exc, "field", ""), ""))


# ---- private helpers -------------------------------------------------------------------


_FIELD_KINDS = ("str", "int", "opt_int", "float", "bool")


def _kind(f: dataclasses.Field[Any]) -> str:
    return str(f.metadata.get("kind", "str"))


def _argument(f: dataclasses.Field[Any], default: Any, dest: str) -> dict[str, Any]:
    """`add_argument` keywords of one field: dest, help, metavar, and its kind's action,
    type and default (`default`: the flag's)."""
    kind, meta = _kind(f), f.metadata
    kw: dict[str, Any] = {"dest": dest, "help": meta["help"]}
    metavar = meta.get("metavar", _METAVARS.get(kind))
    if metavar is not None:
        kw["metavar"] = metavar
    show = meta.get("show_default", True)
    if kind == "bool":
        kw.update(action=argparse.BooleanOptionalAction, default=default)
    elif kind == "params":
        kw.update(action="append", default=[])
    elif kind == "lines":
        kw.update(action="append", default=None)
    elif kind == "csv":
        kw.update(default=",".join(default))
        kw["help"] += f" (default: {kw['default']})" if show else ""
    else:
        convert = meta.get("parse") or {"int": int, "opt_int": int, "float": float}.get(kind, str)
        kw.update(type=convert, default=default)
        if default is not None and show:
            kw["help"] += f" (default: {default})"
    return kw


def _flagged(cls: type, names: Iterable[str] | None) -> list[dataclasses.Field[Any]]:
    """The fields of dataclass `cls` that have a flag (`names`: only these; unknown: error)."""
    flagged = [f for f in dataclasses.fields(cls) if "flag" in f.metadata]
    if names is None:
        return flagged
    wanted = set(names)
    unknown = wanted - {f.name for f in flagged}
    if unknown:
        raise ValueError(f"{cls.__name__} has no flag field(s) {sorted(unknown)}")
    return [f for f in flagged if f.name in wanted]


def _get(spec: CompactionSpec, path: str) -> Any:
    obj: Any = spec
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _dest(prefix: str, path: str) -> str:
    flag = dict(spec_fields())[path].metadata["flag"]
    return (prefix + flag).replace("-", "_")


def _hidden(prefix: str) -> str:
    return "_spec_args_" + prefix.replace("-", "_")


def _parse_params(items: Iterable[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SpecError(f"a method parameter must be KEY=JSON, got {item!r}", "method_params")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            raise SpecError(
                f"method parameter {key}={value!r} is not JSON", "method_params"
            ) from None
    return out

"""The knob machinery of the spec dataclasses (torch-free): `SpecError`, and the field
metadata that :mod:`compactor.spec.cli_args` turns into flags."""

from __future__ import annotations

from dataclasses import field
from typing import Any

__all__ = ["LabelledError", "SpecError", "is_int", "is_number", "knob", "meta"]


class LabelledError(ValueError):
    """A ValueError about one named thing, its `label` ("" if none); picklable (message,
    label), so that it crosses process boundaries whole."""

    def __init__(self, message: str, label: str = "") -> None:
        super().__init__(message)
        self.label = label

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.label))


class SpecError(LabelledError):
    """A bad spec value; `field` is the dotted path of the knob (``"queries.sources"``)."""

    @property
    def field(self) -> str:
        return self.label


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def meta(flag: str, help: str, kind: str, **extra: Any) -> dict[str, Any]:
    """Field metadata that drives :mod:`compactor.spec.cli_args`: the flag name (without
    ``--`` and prefix), its help text and how it parses: kind is one of str | int | float |
    opt_int | bool | csv (comma-separated tuple) | params (repeatable KEY=JSON -> dict) |
    lines (repeatable string -> tuple) | ratio | tokens (the exclusive budget pair)."""
    return {"flag": flag, "help": help, "kind": kind, **extra}


def knob(default: Any, flag: str, help: str, kind: str, **extra: Any) -> Any:
    """A field with an immutable default and :func:`meta` metadata."""
    return field(default=default, metadata=meta(flag, help, kind, **extra))

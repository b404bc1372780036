"""Every compaction method by name, in one table, built on demand.

    from compactor.methods import get_method, method_class
    method = get_method("am-omp-fast", k=4, tau=2)   # imports attention_matching only
    method_class("kv-compress").own_budget            # a class-level fact, nothing built

`METHODS` names each method's class as ``module:Class``; a name imports its module only when
asked for. A method class is a ``@dataclass`` decorated with :func:`register_method` under its
name (the decorator checks the table agrees); a method defined elsewhere (a test, an
extension) registers itself the same way and is found once its module is imported.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

if TYPE_CHECKING:
    from compactor.methods.base import CompactionMethod

__all__ = [
    "METHODS",
    "MethodInfo",
    "ParamInfo",
    "describe_methods",
    "get_method",
    "list_methods",
    "method_class",
    "register_method",
]

_AM = "compactor.methods.attention_matching"
_BASE = "compactor.methods.baselines"
METHODS: dict[str, str] = {
    "am-highest": f"{_AM}:AMHighest",
    "am-omp": f"{_AM}:AMOMP",
    "am-omp-fast": f"{_AM}:AMOMPFast",
    "keep-only": f"{_AM}:KeepOnly",
    "snapkv": f"{_BASE}:SnapKV",
    "h2o": f"{_BASE}:H2O",
    "streamingllm": f"{_BASE}:StreamingLLM",
    "kvzip": f"{_BASE}:KVzip",
    "compresskv": "compactor.methods.compresskv:CompressKV",
    "gvote": "compactor.methods.gvote:GVote",
    "kv-compress": "compactor.methods.kv_compress:KVCompress",
    "kvcompose": "compactor.methods.kvcompose:KVCompose",
}

# Methods registered from outside the table (their module imported by whoever uses them).
_EXTRA: dict[str, type[CompactionMethod]] = {}
M = TypeVar("M", bound="type[CompactionMethod]")


def register_method(name: str) -> Callable[[M], M]:
    """Class decorator: name a CompactionMethod dataclass ``name`` (TypeError if not a
    dataclass; ValueError if `METHODS` gives that name another class, or another class
    registered it first)."""

    def deco(cls: M) -> M:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"method {cls.__name__} must be a @dataclass")
        where = f"{cls.__module__}:{cls.__qualname__}"
        if name in METHODS and METHODS[name] != where:
            raise ValueError(f"method name {name!r} belongs to {METHODS[name]}, not {where}")
        existing = _EXTRA.get(name)
        if existing is not None and existing.__qualname__ != cls.__qualname__:
            raise ValueError(f"method name {name!r} already registered by {existing.__name__}")
        cls.name = name
        if name not in METHODS:
            _EXTRA[name] = cls
        return cls

    return deco


def method_class(name: str) -> type[CompactionMethod]:
    """The class of method ``name`` (imports its module; builds nothing): what to read its
    class-level facts from (``needs_context``, ``own_budget``, ``heads_independent``, ...).
    ValueError for an unknown name."""
    if name in METHODS:
        module, cls = METHODS[name].split(":")
        found: type[CompactionMethod] = getattr(importlib.import_module(module), cls)
        return found
    if name in _EXTRA:
        return _EXTRA[name]
    raise ValueError(f"unknown compaction method {name!r}; available: {list_methods()}")


def get_method(name: str, **params: Any) -> CompactionMethod:
    """Build method ``name`` with hyper-parameters ``params``.

    Raises ValueError for an unknown name, an unknown parameter, or a bad value.
    """
    cls = method_class(name)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(params) - fields)
    if unknown:
        raise ValueError(f"method {name!r} has no parameter(s) {unknown}; known: {sorted(fields)}")
    return cls(**params)


def list_methods() -> list[str]:
    """Names of every method: the table's and any registered beside it."""
    return sorted(set(METHODS) | set(_EXTRA))


class ParamInfo(NamedTuple):
    """One hyper-parameter: its name, its annotated type (as written) and default
    (``required`` when it has none)."""

    name: str
    type: str
    default: Any
    required: bool = False


class MethodInfo(NamedTuple):
    """A method: name, one line of doc, parameters, whether it picks a key subset
    (``selects``) and whether it needs a LayerContext (``needs_context``)."""

    name: str
    doc: str
    params: tuple[ParamInfo, ...]
    selects: bool
    needs_context: bool


def describe_methods(names: Sequence[str] | None = None) -> list[MethodInfo]:
    """MethodInfo of every method (or of ``names``; ValueError if unknown), read from the
    dataclasses: their init fields and the first paragraph of their doc."""
    from compactor.methods.base import SelectingMethod

    out = []
    for name in list_methods() if names is None else names:
        cls = method_class(name)
        params = []
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            if f.default is not dataclasses.MISSING:
                default, required = f.default, False
            elif f.default_factory is not dataclasses.MISSING:
                default, required = f.default_factory(), False
            else:
                default, required = None, True
            kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            params.append(ParamInfo(f.name, kind, default, required))
        doc = (cls.__doc__ or "").strip().split("\n\n")[0]
        selects = issubclass(cls, SelectingMethod)
        out.append(MethodInfo(name, " ".join(doc.split()), tuple(params), selects,
                              cls.needs_context))  # fmt: skip
    return out

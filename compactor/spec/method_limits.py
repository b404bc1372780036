"""What a remote request may set of each method's parameters: one allow-list per method.

A service compacts with the method a client names and the `method_params` it sends, so every
parameter a request may set is listed here with its type and bounds; anything else (an
unknown parameter, a server-side path such as CompressKV's `calibration`, a float where an
int belongs, a value past its bound) is refused before any work, naming the field. Nested
methods (`keep-only`'s `inner` / `inner_params`) are checked against their own list.

Bounds are numbers, or the name of a size the request or the server fixes (`Caps`):
"prefix" (the prefix's tokens T), "queries" (the server's reference-query cap) and
"iterations" (its solver-round cap). Torch-free; keyed by method name (the names of
`compactor.methods.registry.METHODS`, checked by a test).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from compactor.spec.fields import SpecError

__all__ = ["METHOD_PARAMS", "Caps", "Param", "check_method_params"]

MAX_NESTING = 2  # keep-only wrapping a method; no deeper
MAX_STR = 64  # characters of a string parameter (a choice name)


class Caps(NamedTuple):
    """The sizes a symbolic bound names: the prefix's tokens, and the server's caps on
    reference queries and solver rounds."""

    prefix: int
    queries: int
    iterations: int


class Param(NamedTuple):
    """One settable parameter: `kind` int | float | bool | str | pair (two floats) | method |
    params (a nested method's parameters); numeric bounds `lo` <= value <= `hi` (a number
    or a `Caps` field name; pairs bound both ends)."""

    kind: str
    lo: float = 0
    hi: float | str = 0


_REFIT = {"refit": Param("str"), "refit_beta_bounds": Param("pair", -20.0, 20.0)}
# the selection baselines' (RefitOption) refit: the above and the keys it holds verbatim
_REFIT_OPTION = {**_REFIT, "refit_verbatim": Param("float", 0.0, 1.0), "refit_hold": Param("str")}
_RIDGE = Param("float", 0.0, 1e3)
_OMP = {
    "k": Param("int", 1, "prefix"),
    "tau": Param("int", 1, "prefix"),
    "prune_beta": Param("float", -50.0, 0.0),
    "value_ridge": _RIDGE,
    "nnls_iters": Param("int", 0, "iterations"),
    "fit_values": Param("bool"),
}
# fmt: off
METHOD_PARAMS: dict[str, dict[str, Param]] = {
    "am-highest": {
        "beta_bounds": Param("pair", -20.0, 20.0),
        "value_ridge": _RIDGE,
        "fit_values": Param("bool"),
    },
    "am-omp": _OMP,
    "am-omp-fast": _OMP,
    "keep-only": {"inner": Param("method"), "inner_params": Param("params")},
    "snapkv": {**_REFIT_OPTION, "window": Param("int", 0, "prefix"), "kernel": Param("int", 1, "prefix")},
    "h2o": {
        **_REFIT_OPTION,
        "recent_fraction": Param("float", 0.0, 1.0),
        "window": Param("int", 0, "prefix"),
    },
    "streamingllm": {**_REFIT_OPTION, "n_sink": Param("int", 0, "prefix")},
    "kvzip": {
        **_REFIT_OPTION, "non_uniform": Param("bool"), "layerwise": Param("bool"), "reduce": Param("str"),
    },
    # `calibration` (a path on the server) is not settable by a request
    "compresskv": {
        **_REFIT_OPTION,
        "top_heads": Param("int", 1, 4096),
        "kernel": Param("int", 1, "prefix"),
        "window": Param("int", 0, "prefix"),
        "min_scale": Param("float", 0.0, 100.0),
        "max_scale": Param("float", 0.0, 100.0),
    },
    "gvote": {
        **_REFIT_OPTION,
        "p": Param("float", 0.0, 1.0),
        "S": Param("int", 1, "queries"),
        "n_sink": Param("int", 0, "prefix"),
        "horizon": Param("int", 1, "prefix"),
        "seed": Param("int", 0, 2**31 - 1),
        "vote_last_query": Param("bool"),
    },
    "kv-compress": {
        **_REFIT,
        "window": Param("int", 0, "prefix"),
        "min_fraction": Param("float", 0.0, 1.0),
        "per_head": Param("bool"),
        "across_layers": Param("bool"),
    },
    "kvcompose": {
        **_REFIT_OPTION,
        "group_size": Param("int", 1, "prefix"),
        "agg_task": Param("str"),
        "agg_group": Param("str"),
        "add_mean_across_heads": Param("bool"),
        "min_per_layer": Param("int", 0, "prefix"),
    },
}
# fmt: on


def check_method_params(method: str, params: Any, caps: Caps, where: str = "method_params",
                        depth: int = 0) -> None:  # fmt: skip
    """SpecError naming `where.<param>` for the first parameter of `method` a request may
    not set, or sets to a value of the wrong type or out of its bounds (recursing into a
    nested method's parameters)."""
    allowed = METHOD_PARAMS.get(method, {})  # a method without a list: nothing settable
    if not isinstance(params, dict):
        raise SpecError(f"{where} must be an object, got {type(params).__name__}", where)
    for name, value in params.items():
        field = f"{where}.{name}"
        spec = allowed.get(name)
        if spec is None:
            raise SpecError(
                f"{field} is not a parameter a request may set for {method!r} "
                f"(allowed: {sorted(allowed)})", field,
            )  # fmt: skip
        _check_value(field, spec, value, caps)
        if spec.kind == "params":
            if depth + 1 >= MAX_NESTING:
                raise SpecError(f"{field}: methods nest at most {MAX_NESTING} deep", field)
            inner = params.get("inner")
            inner_name = inner if isinstance(inner, str) else "am-omp"  # keep-only's default
            check_method_params(inner_name, value, caps, field, depth + 1)


def _check_value(field: str, spec: Param, value: Any, caps: Caps) -> None:
    """SpecError unless `value` has `spec`'s type and lies within its bounds."""
    kind = spec.kind
    if kind == "bool":
        ok = isinstance(value, bool)
    elif kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "float":
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif kind == "str":
        ok = value is None or (isinstance(value, str) and len(value) <= MAX_STR)
    elif kind == "method":
        ok = isinstance(value, str) and value in METHOD_PARAMS and value != "keep-only"
    elif kind == "pair":
        ok = isinstance(value, list | tuple) and len(value) == 2 and all(
            isinstance(x, int | float) and not isinstance(x, bool) for x in value)  # fmt: skip
    else:  # params: checked by the caller, recursively
        ok = isinstance(value, dict)
    if not ok:
        want = {"int": "an integer", "float": "a number", "bool": "true or false",
                "str": f"a string of at most {MAX_STR} characters", "pair": "two numbers",
                "method": "a method name other than keep-only",
                "params": "an object"}[kind]  # fmt: skip
        raise SpecError(f"{field} must be {want}, got {value!r}"[:300], field)
    if kind not in ("int", "float", "pair"):
        return
    hi = getattr(caps, spec.hi) if isinstance(spec.hi, str) else spec.hi
    for x in value if kind == "pair" else (value,):
        if not (math.isfinite(x) and spec.lo <= x <= hi):
            bound = f"{spec.hi} = {hi}" if isinstance(spec.hi, str) else f"{hi:g}"
            raise SpecError(f"{field} = {value!r} is outside [{spec.lo:g}, {bound}]", field)

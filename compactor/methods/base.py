"""Method registry, the CompactionMethod base class, and layer-level helpers.

Shape legend: T prefix tokens, t kept (t_max = max over heads), n reference queries,
H_q/H_kv heads, D head dim, indptr [H_kv+1] int32.

Device: methods compute on the device of the keys they are given (CPU or CUDA) and return
their CompactedLayer there; every tensor they allocate follows an input's device.

A method is a ``@dataclass`` of hyper-parameters registered by name with
:func:`register_method`; :func:`get_method` builds one, importing the module that
defines it on first use (modules under ``compactor.methods`` are discovered lazily).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import pkgutil
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple, TypeVar

import torch

from compactor.types import CompactedLayer

__all__ = [
    "CompactionMethod",
    "Selection",
    "check_layer_inputs",
    "get_method",
    "list_methods",
    "pack_layer",
    "register_method",
    "resolve_sm_scale",
]

_REGISTRY: dict[str, type[CompactionMethod]] = {}
# Known names -> defining module, so the common case imports exactly one module.
_BUILTIN: dict[str, str] = {
    "am-highest": "compactor.methods.attention_matching",
    "am-omp": "compactor.methods.attention_matching",
    "am-omp-fast": "compactor.methods.attention_matching",
    "keep-only": "compactor.methods.attention_matching",
}

M = TypeVar("M", bound="type[CompactionMethod]")


def register_method(name: str) -> Callable[[M], M]:
    """Class decorator: register a CompactionMethod dataclass under ``name``."""

    def deco(cls: M) -> M:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"method {cls.__name__} must be a @dataclass")
        existing = _REGISTRY.get(name)
        if existing is not None and existing.__qualname__ != cls.__qualname__:
            raise ValueError(f"method name {name!r} already registered by {existing.__name__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def get_method(name: str, **params: Any) -> CompactionMethod:
    """Build the method registered as ``name`` with hyper-parameters ``params``.

    Raises ValueError for an unknown name, an unknown parameter, or a bad value.
    """
    cls = _lookup(name)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(params) - fields)
    if unknown:
        raise ValueError(f"method {name!r} has no parameter(s) {unknown}; known: {sorted(fields)}")
    return cls(**params)


def list_methods() -> list[str]:
    """Names of all available methods (imports the method modules to discover them)."""
    _discover()
    return sorted(set(_REGISTRY) | set(_BUILTIN))


class Selection(NamedTuple):
    """Kept token indices per KV head, padded to t_max.

    indices: [H_kv, t_max] int64 (padding entries are 0); mask: [H_kv, t_max] bool
    (True = kept). Valid entries of a row are distinct.
    """

    indices: torch.Tensor
    mask: torch.Tensor

    @classmethod
    def from_lists(
        cls,
        per_head: Sequence[Sequence[int] | torch.Tensor],
        device: torch.device | str | None = None,
    ) -> Selection:
        """Build from one index list per KV head (ragged).

        device: where the Selection lives (default: that of the first tensor row, else CPU).
        """
        if device is None:
            device = next((x.device for x in per_head if isinstance(x, torch.Tensor)), "cpu")
        t_max = max((len(x) for x in per_head), default=0)
        idx = torch.zeros(len(per_head), t_max, dtype=torch.int64, device=device)
        mask = torch.zeros(len(per_head), t_max, dtype=torch.bool, device=device)
        for h, x in enumerate(per_head):
            row = torch.as_tensor(x, dtype=torch.int64, device=device).reshape(-1)
            idx[h, : row.numel()] = row
            mask[h, : row.numel()] = True
        return cls(idx, mask)

    @classmethod
    def from_mask(cls, selected: torch.Tensor) -> Selection:
        """[H_kv, T] bool (True = kept) -> Selection with ascending indices, on its device.

        One host sync (t_max), whatever H_kv.
        """
        counts = selected.sum(-1)
        t_max = int(counts.max()) if counts.numel() else 0
        order = torch.sort(selected.to(torch.int8), dim=-1, descending=True, stable=True).indices
        idx = order[:, :t_max]
        mask = torch.arange(t_max, device=selected.device).unsqueeze(0) < counts.unsqueeze(1)
        return cls(torch.where(mask, idx, idx.new_zeros(())), mask)

    def budgets(self) -> list[int]:
        """t_h per head."""
        return self.mask.sum(-1).tolist()

    def per_head(self) -> list[torch.Tensor]:
        """Ragged list of [t_h] int64 index tensors."""
        return [self.indices[h][self.mask[h]] for h in range(self.indices.shape[0])]


@dataclasses.dataclass
class CompactionMethod(ABC):
    """Base of all methods: a dataclass of hyper-parameters with one job.

    Subclasses validate their fields in ``__post_init__`` (ValueError, never assert) and
    implement :meth:`compact_layer`. Methods that pick a subset of the original keys
    also implement :meth:`select`, so wrappers (e.g. ``keep-only``) and the AM refit
    can reuse the selection.
    """

    name: ClassVar[str] = ""

    @abstractmethod
    def compact_layer(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        queries: torch.Tensor,
        budgets: Sequence[int],
        sm_scale: float | None = None,
    ) -> CompactedLayer:
        """Compact one layer.

        Args:
            keys: [H_kv, T, D] post-RoPE keys (model dtype).
            values: [H_kv, T, D].
            queries: [H_kv, n, D] post-RoPE reference queries (GQA groups pooled).
            budgets: t_h per KV head, 1 <= t_h <= T.
            sm_scale: logit scale (default 1/sqrt(D)).

        Returns:
            CompactedLayer with keys/values in the input dtype, beta fp32.
        """

    def select(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        queries: torch.Tensor,
        budgets: Sequence[int],
        sm_scale: float | None = None,
    ) -> Selection:
        """Pick kept token indices per head (same arguments as :meth:`compact_layer`)."""
        raise NotImplementedError(f"method {self.name!r} does not select a key subset")

    def params(self) -> dict[str, Any]:
        """JSON-serializable hyper-parameters (nested methods become {'name', 'params'})."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if not f.init:
                continue
            v = getattr(self, f.name)
            if isinstance(v, CompactionMethod):
                v = {"name": v.name, "params": v.params()}
            elif isinstance(v, tuple):
                v = list(v)
            out[f.name] = v
        return out


def resolve_sm_scale(sm_scale: float | None, head_dim: int) -> float:
    """sm_scale, defaulting to 1/sqrt(D); ValueError if not positive and finite."""
    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not (math.isfinite(sm_scale) and sm_scale > 0):
        raise ValueError(f"sm_scale must be positive and finite, got {sm_scale}")
    return float(sm_scale)


def check_layer_inputs(
    keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, budgets: Sequence[int]
) -> list[int]:
    """Validate compact_layer arguments (see its docstring); return budgets as ints."""
    if keys.dim() != 3:
        raise ValueError(f"keys must be [H_kv, T, D], got {tuple(keys.shape)}")
    H, T, D = keys.shape
    if values.shape != keys.shape:
        raise ValueError(f"values {tuple(values.shape)} must match keys {tuple(keys.shape)}")
    if queries.dim() != 3 or queries.shape[0] != H or queries.shape[2] != D:
        raise ValueError(f"queries must be [H_kv={H}, n, D={D}], got {tuple(queries.shape)}")
    if queries.shape[1] < 1:
        raise ValueError("need at least one reference query")
    if T < 1:
        raise ValueError("empty prefix (T = 0)")
    b = [int(x) for x in budgets]
    if len(b) != H:
        raise ValueError(f"need one budget per KV head ({H}), got {len(b)}")
    for h, x in enumerate(b):
        if not 1 <= x <= T:
            raise ValueError(f"budget of head {h} is {x}; must be in [1, T={T}]")
    return b


def pack_layer(
    keys: torch.Tensor,
    values: torch.Tensor,
    beta: torch.Tensor,
    sel: Selection,
    dtype: torch.dtype,
) -> CompactedLayer:
    """Ragged-pack padded per-head results into a CompactedLayer.

    Args:
        keys, values: [H_kv, t_max, D] (any float dtype; cast to ``dtype``).
        beta: [H_kv, t_max] (cast to fp32).
        sel: the Selection whose mask marks valid rows; indices become kept_indices.
    """
    m = sel.mask
    counts = m.sum(-1)
    indptr = torch.zeros(m.shape[0] + 1, dtype=torch.int32, device=m.device)
    indptr[1:] = torch.cumsum(counts, 0).to(torch.int32)
    return CompactedLayer(
        keys=keys[m].to(dtype).contiguous(),
        values=values[m].to(dtype).contiguous(),
        beta=beta[m].to(torch.float32).contiguous(),
        indptr=indptr,
        kept_indices=sel.indices[m].to(torch.int64).contiguous(),
    )


# ---- private helpers -------------------------------------------------------------------


def _lookup(name: str) -> type[CompactionMethod]:
    if name not in _REGISTRY and name in _BUILTIN:
        importlib.import_module(_BUILTIN[name])
    if name not in _REGISTRY:
        _discover()
    if name not in _REGISTRY:
        raise ValueError(f"unknown compaction method {name!r}; available: {list_methods()}")
    return _REGISTRY[name]


def _discover() -> None:
    """Import every module of compactor.methods (they register themselves)."""
    import compactor.methods as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if not info.name.startswith("_") and info.name != "base":
            importlib.import_module(f"{pkg.__name__}.{info.name}")

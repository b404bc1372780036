"""Core data: a compacted prefix and its per-layer tensors.

Shape legend (used in every docstring of this package):
    T    prefix tokens (the *logical* length the compacted prefix keeps)
    t    kept (compacted) entries of one KV head; t_h for head h
    N    sum_h t_h, rows of one layer (ragged over KV heads)
    n    reference queries
    H_q / H_kv  query / key-value heads
    D    head dim
    indptr [H_kv+1] int32: head h owns rows indptr[h]:indptr[h+1] (CSR-style)

Keys are stored post-RoPE, exactly as the model's KV cache holds them. ``beta`` is a
natural-log bias added to the *scaled* logit: ``logit = q.k * sm_scale + beta``;
``beta = -inf`` masks an entry.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from compactor.budget_report import BudgetReport

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["FORMAT_VERSION", "CompactedLayer", "CompactedPrefix", "prefix_hash"]

FORMAT_VERSION = 1
_META_KEY = "compactor"
_D = TypeVar("_D", bound="DataclassInstance")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def prefix_hash(token_ids: Sequence[int]) -> str:
    """sha256 (hex) of the token ids as int32 little-endian bytes.

    Raises ValueError if an id does not fit in int32.
    """
    arr = np.asarray(list(token_ids), dtype=np.int64)
    if arr.size and (arr.min() < -(2**31) or arr.max() >= 2**31):
        raise ValueError("prefix_hash: token id out of int32 range")
    return hashlib.sha256(arr.astype("<i4").tobytes()).hexdigest()


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16 etc.; ValueError for unsupported dtypes."""
    for name, dt in _DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype}; expected one of {sorted(_DTYPES)}")


def tensors_to(obj: _D, device: torch.device | str, names: Sequence[str]) -> _D:
    """The frozen dataclass ``obj`` with its tensor fields ``names`` on ``device`` (None
    stays None), or ``obj`` itself when they all are there already. Mutates nothing."""
    dev = torch.device(device)
    ts = {n: getattr(obj, n) for n in names}
    if all(t is None or t.device == dev for t in ts.values()):
        return obj
    return replace(obj, **{n: None if t is None else t.to(dev) for n, t in ts.items()})


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(
            f"unsupported KV dtype {name!r}; expected one of {sorted(_DTYPES)}"
        ) from None


@dataclass(frozen=True)
class CompactedLayer:
    """One layer of a compacted prefix, ragged over KV heads.

    Attributes:
        keys:    [N, D] model dtype, post-RoPE.
        values:  [N, D] model dtype.
        beta:    [N] fp32 log-bias (-inf = masked).
        indptr:  [H_kv+1] int32; head h owns rows indptr[h]:indptr[h+1].
        kept_indices: optional [N] int64, original token position of each row
            (-1 for synthesized rows).
    """

    keys: torch.Tensor
    values: torch.Tensor
    beta: torch.Tensor
    indptr: torch.Tensor
    kept_indices: torch.Tensor | None = None

    @property
    def num_kv_heads(self) -> int:
        return int(self.indptr.numel()) - 1

    def head_lengths(self) -> list[int]:
        """t_h for each KV head (length H_kv)."""
        return torch.diff(self.indptr.to(torch.int64)).tolist()

    @property
    def device(self) -> torch.device:
        """Where the keys live (every tensor of a layer built here shares it)."""
        return self.keys.device

    def to(self, device: torch.device | str) -> CompactedLayer:
        """The same layer with every tensor on ``device`` (self when already there)."""
        return tensors_to(self, device, ("keys", "values", "beta", "indptr", "kept_indices"))

    def head(self, h: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys [t_h, D], values [t_h, D], beta [t_h]) of KV head h (views)."""
        lo, hi = int(self.indptr[h]), int(self.indptr[h + 1])
        return self.keys[lo:hi], self.values[lo:hi], self.beta[lo:hi]

    def padded(
        self, slots: int, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dense per-head layout: (keys [H_kv, S, D], values [H_kv, S, D], beta [H_kv, S] fp32).

        Head h fills slots [0, t_h); the rest hold zeros with beta = -inf (masked). S = `slots`
        must be >= every t_h. `dtype` casts keys/values (default: as stored). On the layer's
        device; one host sync (the indptr), whatever H_kv.
        """
        ip = self.indptr.tolist()
        lengths = [b - a for a, b in itertools.pairwise(ip)]
        if slots < max(lengths, default=0):
            raise ValueError(f"slots={slots} < longest head ({max(lengths)})")
        dt = dtype or self.keys.dtype
        h_kv, d, dev = self.num_kv_heads, self.keys.shape[-1], self.keys.device
        k = torch.zeros(h_kv, slots, d, dtype=dt, device=dev)
        v = torch.zeros(h_kv, slots, d, dtype=dt, device=dev)
        beta = torch.full((h_kv, slots), float("-inf"), dtype=torch.float32, device=dev)
        for h in range(h_kv):
            lo, hi = ip[h], ip[h + 1]
            k[h, : hi - lo] = self.keys[lo:hi].to(dt)
            v[h, : hi - lo] = self.values[lo:hi].to(dt)
            beta[h, : hi - lo] = self.beta[lo:hi].float()
        return k, v, beta

    def nbytes(self) -> int:
        """Bytes held by this layer's tensors."""
        ts = [self.keys, self.values, self.beta, self.indptr]
        if self.kept_indices is not None:
            ts.append(self.kept_indices)
        return sum(t.numel() * t.element_size() for t in ts)

    def validate(
        self,
        *,
        head_dim: int | None = None,
        num_kv_heads: int | None = None,
        dtype: torch.dtype | None = None,
        logical_length: int | None = None,
        where: str = "layer",
    ) -> None:
        """Raise ValueError naming the first problem found; mutates nothing."""
        k, v, b, ip = self.keys, self.values, self.beta, self.indptr
        if k.dim() != 2:
            raise ValueError(f"{where}: keys must be 2-D [N, D], got shape {tuple(k.shape)}")
        if v.shape != k.shape:
            raise ValueError(
                f"{where}: values shape {tuple(v.shape)} != keys shape {tuple(k.shape)}"
            )
        n_rows, d = k.shape
        if head_dim is not None and d != head_dim:
            raise ValueError(f"{where}: head_dim {d} != expected {head_dim}")
        if dtype is not None and (k.dtype != dtype or v.dtype != dtype):
            raise ValueError(f"{where}: keys/values dtype {k.dtype}/{v.dtype} != expected {dtype}")
        if k.dtype != v.dtype:
            raise ValueError(f"{where}: keys dtype {k.dtype} != values dtype {v.dtype}")
        if b.dim() != 1 or b.numel() != n_rows:
            raise ValueError(f"{where}: beta must be [N]=[{n_rows}], got {tuple(b.shape)}")
        if b.dtype != torch.float32:
            raise ValueError(f"{where}: beta dtype must be float32, got {b.dtype}")
        if ip.dim() != 1 or ip.numel() < 2:
            raise ValueError(
                f"{where}: indptr must be [H_kv+1] with H_kv >= 1, got {tuple(ip.shape)}"
            )
        if ip.dtype != torch.int32:
            raise ValueError(f"{where}: indptr dtype must be int32, got {ip.dtype}")
        if num_kv_heads is not None and ip.numel() != num_kv_heads + 1:
            raise ValueError(
                f"{where}: indptr has {ip.numel() - 1} heads, expected num_kv_heads={num_kv_heads}"
            )
        if int(ip[0]) != 0:
            raise ValueError(f"{where}: indptr must start at 0, got {int(ip[0])}")
        lengths = torch.diff(ip.to(torch.int64))
        if bool((lengths < 0).any()):
            raise ValueError(f"{where}: indptr is not monotone non-decreasing: {ip.tolist()}")
        if int(ip[-1]) != n_rows:
            raise ValueError(f"{where}: indptr[-1]={int(ip[-1])} != N={n_rows} rows")
        if not bool(torch.isfinite(k).all()):
            raise ValueError(f"{where}: keys contain non-finite values")
        if not bool(torch.isfinite(v).all()):
            raise ValueError(f"{where}: values contain non-finite values")
        if bool(torch.isnan(b).any()):
            raise ValueError(f"{where}: beta contains NaN")
        if bool(torch.isposinf(b).any()):
            raise ValueError(f"{where}: beta contains +inf (only -inf, masked, is allowed)")
        if logical_length is not None and lengths.numel() and int(lengths.max()) > logical_length:
            raise ValueError(
                f"{where}: a head keeps {int(lengths.max())} entries > logical_length {logical_length}"
            )
        ki = self.kept_indices
        if ki is not None:
            if ki.dtype != torch.int64 or ki.shape != (n_rows,):
                raise ValueError(
                    f"{where}: kept_indices must be [N]=[{n_rows}] int64, got "
                    f"{tuple(ki.shape)} {ki.dtype}"
                )
            hi = logical_length if logical_length is not None else None
            if bool((ki < -1).any()) or (hi is not None and bool((ki >= hi).any())):
                raise ValueError(f"{where}: kept_indices outside [-1, logical_length)")


@dataclass(frozen=True)
class CompactedPrefix:
    """A compacted shared prefix for one model (all layers).

    Attributes:
        model_fingerprint: identifies the model (weights + config) it was made for.
        logical_length: T, the prefix length the following tokens' positions assume.
        prefix_hash: :func:`prefix_hash` of the prefix's token ids.
        method: registered method name (e.g. ``"am-omp-fast"``).
        params: JSON-serializable method hyper-parameters (what the method ran with).
        layers: one :class:`CompactedLayer` per model layer.
        head_dim: D. num_kv_heads: H_kv. dtype: keys/values dtype (model dtype).
        budget: how many entries it kept and how that was chosen (None: not recorded).
    """

    model_fingerprint: str
    logical_length: int
    prefix_hash: str
    method: str
    params: dict[str, Any]
    layers: list[CompactedLayer]
    head_dim: int
    num_kv_heads: int
    dtype: torch.dtype
    extra: dict[str, Any] = field(default_factory=dict)
    budget: BudgetReport | None = None

    # ---- helpers -------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def kept_tokens(self) -> int:
        """Total kept entries over all layers and KV heads (sum of N over layers)."""
        return sum(int(layer.keys.shape[0]) for layer in self.layers)

    def kept_per_head(self) -> list[list[int]]:
        """t_h per layer per KV head: [num_layers][H_kv]."""
        return [layer.head_lengths() for layer in self.layers]

    def nbytes(self) -> int:
        """Bytes held by all layers' tensors."""
        return sum(layer.nbytes() for layer in self.layers)

    def original_entries(self) -> int:
        """T * H_kv * num_layers: KV entries of the uncompacted prefix."""
        return self.logical_length * self.num_kv_heads * self.num_layers

    def kept_fraction(self) -> float:
        """kept entries / original entries (e.g. 0.1 at ratio 0.1)."""
        orig = self.original_entries()
        return self.kept_tokens() / orig if orig else 0.0

    def times_smaller(self) -> float:
        """original entries / kept entries (e.g. 10.0 at ratio 0.1); inf if nothing kept."""
        kept = self.kept_tokens()
        return self.original_entries() / kept if kept else math.inf

    # ---- validation ----------------------------------------------------------------
    def validate(
        self,
        expected_fingerprint: str | None = None,
        num_layers: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
    ) -> None:
        """Raise ValueError naming what is wrong; returns None when the prefix is sound."""
        if expected_fingerprint is not None and self.model_fingerprint != expected_fingerprint:
            raise ValueError(
                f"model fingerprint {self.model_fingerprint!r} is for another model "
                f"(expected {expected_fingerprint!r})"
            )
        if self.logical_length < 1:
            raise ValueError(f"logical_length must be >= 1, got {self.logical_length}")
        if num_kv_heads is not None and self.num_kv_heads != num_kv_heads:
            raise ValueError(f"num_kv_heads {self.num_kv_heads} != expected {num_kv_heads}")
        if head_dim is not None and self.head_dim != head_dim:
            raise ValueError(f"head_dim {self.head_dim} != expected {head_dim}")
        if num_layers is not None and len(self.layers) != num_layers:
            raise ValueError(f"{len(self.layers)} layers != expected num_layers={num_layers}")
        if not self.layers:
            raise ValueError("no layers")
        try:
            json.dumps(self.params)
        except (TypeError, ValueError) as e:
            raise ValueError(f"params are not JSON-serializable: {e}") from None
        for i, layer in enumerate(self.layers):
            layer.validate(
                head_dim=self.head_dim,
                num_kv_heads=self.num_kv_heads,
                dtype=self.dtype,
                logical_length=self.logical_length,
                where=f"layer {i}",
            )

    # ---- persistence ---------------------------------------------------------------
    def metadata(self) -> dict[str, Any]:
        """The JSON-able header (everything but the tensors)."""
        return {
            "format_version": FORMAT_VERSION,
            "model_fingerprint": self.model_fingerprint,
            "logical_length": self.logical_length,
            "prefix_hash": self.prefix_hash,
            "method": self.method,
            "params": self.params,
            "num_layers": len(self.layers),
            "head_dim": self.head_dim,
            "num_kv_heads": self.num_kv_heads,
            "dtype": dtype_name(self.dtype),
            "extra": self.extra,
            "budget": None if self.budget is None else self.budget.as_dict(),
        }

    def tensors(self) -> dict[str, torch.Tensor]:
        """Flat name -> contiguous CPU tensor map (``layers.{i}.keys`` etc.)."""
        out: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            out[f"layers.{i}.keys"] = layer.keys
            out[f"layers.{i}.values"] = layer.values
            out[f"layers.{i}.beta"] = layer.beta
            out[f"layers.{i}.indptr"] = layer.indptr
            if layer.kept_indices is not None:
                out[f"layers.{i}.kept_indices"] = layer.kept_indices
        return {k: v.detach().to("cpu").contiguous() for k, v in out.items()}

    def save(self, path: str | Path) -> None:
        """Write one safetensors file (metadata JSON under the key 'compactor')."""
        from safetensors.torch import save_file

        save_file(self.tensors(), str(path), metadata={_META_KEY: json.dumps(self.metadata())})

    @classmethod
    def from_parts(cls, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> CompactedPrefix:
        """Rebuild from :meth:`metadata` + :meth:`tensors`; ValueError if parts are missing."""
        try:
            version = int(meta.get("format_version", -1))
            if version != FORMAT_VERSION:
                raise ValueError(f"unsupported format_version {version}")
            layers = []
            for at in (f"layers.{i}." for i in range(int(meta["num_layers"]))):
                kv = (tensors[at + "keys"], tensors[at + "values"])
                layers.append(CompactedLayer(*kv, tensors[at + "beta"], tensors[at + "indptr"],
                                             tensors.get(at + "kept_indices")))  # fmt: skip
            return cls(
                model_fingerprint=str(meta["model_fingerprint"]),
                logical_length=int(meta["logical_length"]),
                prefix_hash=str(meta["prefix_hash"]),
                method=str(meta["method"]),
                params=dict(meta["params"]),
                layers=layers,
                head_dim=int(meta["head_dim"]),
                num_kv_heads=int(meta["num_kv_heads"]),
                dtype=dtype_from_name(str(meta["dtype"])),
                extra=dict(meta.get("extra", {})),
                budget=BudgetReport.from_dict(meta["budget"]) if meta.get("budget") else None,
            )
        except KeyError as e:
            raise ValueError(f"compacted prefix is missing {e.args[0]!r}") from None

    @classmethod
    def load(cls, path: str | Path, device: str = "cpu") -> CompactedPrefix:
        """Read a file written by :meth:`save` (does not validate; call :meth:`validate`)."""
        from safetensors import safe_open

        with safe_open(str(path), framework="pt", device=device) as f:
            raw = (f.metadata() or {}).get(_META_KEY)
            if raw is None:
                raise ValueError(f"{path}: not a compacted prefix (no '{_META_KEY}' metadata)")
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        return cls.from_parts(json.loads(raw), tensors)

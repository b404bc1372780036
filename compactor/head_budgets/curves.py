"""Sensitivity curves: per (layer, KV head), a compaction's error at each kept fraction, how
one is measured on a layer, and where they are kept (JSON beside the model).

Shape legend: T prefix tokens, n reference queries, H_kv KV heads, D head dim, L layers, F kept
fractions of a curve. `compactor.head_budgets.allocate` turns curves into budgets;
`compactor.eval.sensitivity` measures a model's (`compactor sensitivity`).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from compactor.head_budgets.uniform import head_budgets
from compactor.solvers import attend

__all__ = [
    "SensitivityCurves",
    "load_sensitivity_json",
    "resolve_curves",
    "save_sensitivity_json",
    "sensitivity_curve",
    "sensitivity_path",
]


@dataclass(frozen=True)
class SensitivityCurves:
    """Compaction error per (layer, KV head) at each kept fraction.

    fractions: [F] increasing, in (0, 1]. errors: [L][H_kv][F] (lower is better).
    method: the method name they were measured with; meta: anything JSON-able.
    """

    fractions: list[float]
    errors: list[list[list[float]]]
    method: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        f = self.fractions
        if (
            not f
            or any(not (0 < x <= 1) for x in f)
            or any(a >= b for a, b in itertools.pairwise(f))
        ):
            raise ValueError(f"fractions must be increasing values in (0, 1], got {f!r}")
        if not self.errors or not self.errors[0]:
            raise ValueError("errors must be a non-empty [L][H_kv][F] nested list")
        H = len(self.errors[0])
        for i, layer in enumerate(self.errors):
            if len(layer) != H:
                raise ValueError(f"layer {i} has {len(layer)} heads, expected {H}")
            for h, row in enumerate(layer):
                if len(row) != len(f) or not all(math.isfinite(x) and x >= 0 for x in row):
                    raise ValueError(f"errors[{i}][{h}] must be {len(f)} finite values >= 0")

    @property
    def shape(self) -> tuple[int, int, int]:
        """(L, H_kv, F)."""
        return len(self.errors), len(self.errors[0]), len(self.fractions)


def sensitivity_curve(
    keys: torch.Tensor,
    values: torch.Tensor,
    queries: torch.Tensor,
    fractions: Sequence[float],
    method: Any,
    *,
    sm_scale: float | None = None,
    eval_queries: torch.Tensor | None = None,
) -> torch.Tensor:
    """Relative attention-output error of one layer per KV head and kept fraction.

    Args:
        keys, values: [H_kv, T, D]; queries: [H_kv, n, D] fit queries.
        fractions: [F] kept fractions in (0, 1].
        method: a CompactionMethod (anything with ``compact_layer``).
        eval_queries: [H_kv, n', D] to measure on (default: ``queries``; prefer held-out).

    Returns:
        err [H_kv, F] fp32 on the keys' device: ||o_c - o|| / ||o|| over the evaluation
        queries, where o is the original and o_c the compacted attention output of the
        prefix block.
    """
    H, T, _ = keys.shape
    ev = queries if eval_queries is None else eval_queries
    ref, _ = attend(ev, keys, values, sm_scale=sm_scale)
    err = torch.zeros(H, len(fractions), dtype=torch.float32, device=keys.device)
    for j, f in enumerate(fractions):
        layer = method.compact_layer(keys, values, queries, head_budgets(T, H, ratio=f), sm_scale)
        for h in range(H):
            k, v, b = layer.head(h)
            o, _ = attend(ev[h], k, v, b, sm_scale=sm_scale)
            err[h, j] = (o - ref[h]).norm() / ref[h].norm().clamp_min(1e-30)
    return err


def sensitivity_path(model_dir: str | Path, method: str) -> Path:
    """Where a model's curves live: ``<model_dir>/sensitivity.<method>.json``."""
    return Path(model_dir) / f"sensitivity.{method}.json"


def save_sensitivity_json(path: str | Path, curves: SensitivityCurves) -> None:
    """Write curves as JSON (creates nothing but the file)."""
    payload = {
        "format_version": 1,
        "fractions": curves.fractions,
        "errors": curves.errors,
        "method": curves.method,
        "meta": curves.meta,
    }
    Path(path).write_text(json.dumps(payload, indent=1))


def load_sensitivity_json(path: str | Path) -> SensitivityCurves:
    """Read curves written by :func:`save_sensitivity_json`; ValueError if malformed."""
    try:
        d = json.loads(Path(path).read_text())
        return SensitivityCurves(
            fractions=[float(x) for x in d["fractions"]],
            errors=[[[float(x) for x in row] for row in layer] for layer in d["errors"]],
            method=str(d.get("method", "")),
            meta=dict(d.get("meta", {})),
        )
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a sensitivity-curve file ({e})") from None


def resolve_curves(
    spec: str | Path | SensitivityCurves | None, model_dir: str | Path | None, method: str
) -> tuple[SensitivityCurves | None, str]:
    """Resolve a head-budget choice to (curves or None, where they came from).

    Args:
        spec: None or "uniform" (uniform budgets: returns (None, "uniform")); "auto" (the
            model's ``sensitivity_path(model_dir, method)``); another string / Path (a curves
            JSON file); or SensitivityCurves (returned as is, source "curves").
        model_dir: the model's checkpoint directory (needed by "auto").
        method: the registered method name the curves are looked up for.
    Raises:
        ValueError: "auto" without a model directory, a missing or malformed curves file.
    """
    if spec is None or spec == "uniform":
        return None, "uniform"
    if isinstance(spec, SensitivityCurves):
        return spec, "curves"
    if spec == "auto":
        if model_dir is None:
            raise ValueError(
                "head_budgets='auto' needs the model's directory (load the model with "
                "compactor.hf.load_model) or pass a curves file / SensitivityCurves"
            )
        path = sensitivity_path(model_dir, method)
        hint = f"compactor sensitivity --model {model_dir} --method {method}"
    else:
        path = Path(spec)
        hint = "compactor sensitivity --model MODEL --method METHOD --out PATH"
    if not path.is_file():
        raise ValueError(
            f"no sensitivity curves at {path} (head_budgets={str(spec)!r}); create them with: {hint}"
        )
    return load_sensitivity_json(path), str(path)


# ---- private helpers -------------------------------------------------------------------

"""Per-head budgets: uniform from a ratio / token count, non-uniform from sensitivity curves.

Shape legend: T prefix tokens, t kept, n reference queries, H_kv KV heads, D head dim,
L layers, F kept fractions of a sensitivity curve.

Non-uniform allocation (Attention Matching, sec. on head budgets): measure, per (layer,
head), the compaction error as a function of the kept fraction, then start from the
uniform split and greedily move budget from the head whose error grows least to the
head whose error shrinks most, keeping the total fixed, while that lowers the summed
error.
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

from compactor.solvers import attend

__all__ = [
    "SensitivityCurves",
    "allocate",
    "head_budgets",
    "load_sensitivity_json",
    "resolve_curves",
    "save_sensitivity_json",
    "sensitivity_curve",
    "sensitivity_path",
]


def head_budgets(
    T: int, H_kv: int, ratio: float | None = None, tokens: int | None = None
) -> list[int]:
    """Uniform budget t per KV head: round(ratio * T), or ``tokens`` capped at T; >= 1.

    Exactly one of ratio (in (0, 1]) / tokens (>= 1) must be given; ValueError otherwise.
    """
    if isinstance(T, bool) or not isinstance(T, int) or T < 1:
        raise ValueError(f"T must be an int >= 1, got {T!r}")
    if isinstance(H_kv, bool) or not isinstance(H_kv, int) or H_kv < 1:
        raise ValueError(f"H_kv must be an int >= 1, got {H_kv!r}")
    if (ratio is None) == (tokens is None):
        raise ValueError("give exactly one of ratio= or tokens=")
    if ratio is not None:
        if not (isinstance(ratio, int | float) and math.isfinite(ratio) and 0 < ratio <= 1):
            raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")
        t = max(1, min(T, round(ratio * T)))
    else:
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"tokens must be an int >= 1, got {tokens!r}")
        t = min(T, tokens)
    return [t] * H_kv


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


def allocate(
    curves: SensitivityCurves,
    total_budget: int,
    T: int,
    *,
    min_tokens: int = 1,
    max_tokens: int | None = None,
    step: int | None = None,
    per_layer: bool = False,
    max_swaps: int = 100_000,
) -> list[list[int]]:
    """Greedy-swap non-uniform budgets with a fixed total.

    Args:
        curves: errors [L][H_kv][F] at fractions [F]; interpolated linearly in the kept
            fraction, with the implicit end points (0, max(1, err at f_1)) (nothing kept:
            output lost) and (1, 0) (everything kept: exact).
        total_budget: kept entries summed over all L * H_kv heads.
        T: prefix length. min_tokens / max_tokens: per-head bounds (max default T).
        step: tokens moved per swap (default max(1, T // 100)).
        per_layer: keep each layer's total fixed (swap only within a layer).

    Returns:
        budgets [L][H_kv] ints with the exact requested total.
    """
    L, H, _ = curves.shape
    hi_tok = T if max_tokens is None else min(T, max_tokens)
    if T < 1 or min_tokens < 1 or hi_tok < min_tokens:
        raise ValueError(f"bad bounds: T={T}, min_tokens={min_tokens}, max_tokens={max_tokens}")
    if not L * H * min_tokens <= total_budget <= L * H * hi_tok:
        raise ValueError(
            f"total_budget {total_budget} outside [{L * H * min_tokens}, {L * H * hi_tok}] "
            f"for {L}x{H} heads"
        )
    if per_layer and total_budget % L:
        raise ValueError("per_layer allocation needs total_budget divisible by the layer count")
    stride = max(1, T // 100) if step is None else step
    if stride < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    b = _uniform_split(total_budget, L, H, per_layer)
    b = [min(max(x, min_tokens), hi_tok) for x in b]
    # uniform split may need a fix-up after clamping (only when bounds bite)
    _rebalance(b, total_budget, min_tokens, hi_tok)
    xs = [0.0, *curves.fractions] + ([1.0] if curves.fractions[-1] < 1 else [])
    flat = [row for layer in curves.errors for row in layer]
    tables = []
    for row in flat:
        ys = [max(1.0, row[0]), *row] + ([0.0] if curves.fractions[-1] < 1 else [])
        tables.append((xs, ys))

    def err(i: int, tokens: int) -> float:
        return _interp(tokens / T, *tables[i])

    groups = (
        [list(range(li * H, (li + 1) * H)) for li in range(L)]
        if per_layer
        else [list(range(L * H))]
    )
    for group in groups:
        for _ in range(max_swaps):
            best_gain, r = -math.inf, -1
            best_loss, d = math.inf, -1
            for i in group:
                if b[i] < hi_tok:
                    up = min(stride, hi_tok - b[i])
                    g = (err(i, b[i]) - err(i, b[i] + up)) / up
                    if g > best_gain:
                        best_gain, r = g, i
                if b[i] > min_tokens:
                    dn = min(stride, b[i] - min_tokens)
                    lo = (err(i, b[i] - dn) - err(i, b[i])) / dn
                    if lo < best_loss:
                        best_loss, d = lo, i
            if r < 0 or d < 0 or r == d or best_gain <= best_loss + 1e-12:
                break
            amount = min(stride, hi_tok - b[r], b[d] - min_tokens)
            before = err(r, b[r]) + err(d, b[d])
            after = err(r, b[r] + amount) + err(d, b[d] - amount)
            if after >= before - 1e-12:
                break
            b[r] += amount
            b[d] -= amount
    return [b[li * H : (li + 1) * H] for li in range(L)]


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


def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    if x <= xs[0]:
        return ys[0]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            a = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            return ys[i - 1] + a * (ys[i] - ys[i - 1])
    return ys[-1]


def _uniform_split(total: int, L: int, H: int, per_layer: bool) -> list[int]:
    if per_layer:
        per = total // L
        return [per // H + (1 if h < per % H else 0) for _ in range(L) for h in range(H)]
    n = L * H
    return [total // n + (1 if i < total % n else 0) for i in range(n)]


def _rebalance(b: list[int], total: int, lo: int, hi: int) -> None:
    """Mutates b so sum(b) == total within [lo, hi] per entry (feasibility checked)."""
    i = 0
    while sum(b) != total:
        diff = total - sum(b)
        j = i % len(b)
        if diff > 0 and b[j] < hi:
            b[j] += 1
        elif diff < 0 and b[j] > lo:
            b[j] -= 1
        i += 1

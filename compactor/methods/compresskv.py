"""CompressKV (arXiv 2508.02401): Semantic-Retrieval-Head token selection + layer budgets.

Shape legend: L layers, T prefix tokens (of the keys handed in), n reference queries per
query head, H_q / H_kv query / KV heads, G = H_q // H_kv, D head dim, indptr [H_kv+1] int32.

Offline (``compactor calibrate compresskv --model M``, see :mod:`compactor.eval.compresskv_calibration`), per
model: ``srh_scores`` [L][H_q] — the attention mass each query head puts on the answer span
while the model produces correct answer tokens on needle cases — and ``layer_errors`` [L]
— each layer's normalized attention-output error when it alone is cut to a minimal budget.
Both are saved as ``compresskv_calibration.json`` in the model directory.

Online, per layer: the ``top_heads`` query heads with the highest SRH score score the keys
SnapKV-style (mean attention over the observation queries, average-pooled with ``kernel``;
summed over those heads); one token set, the top b_l, is shared by all KV heads of the
layer. b_l = the layer's share of L * budget, proportional to its error and clamped to
[min_scale * budget, max_scale * budget] (see :func:`layer_budgets`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import torch

from compactor.methods._scoring import (
    RefitOption,
    attention_probs,
    avg_pool,
    check_positive_int,
    group_view,
    topk_selection,
)
from compactor.methods.base import LayerInput, Picked, ScoreMethod
from compactor.methods.registry import register_method

__all__ = [
    "CALIBRATION_FILE",
    "CompressKV",
    "cached_calibration",
    "layer_budgets",
    "load_calibration",
    "srh_token_scores",
]

CALIBRATION_FILE = "compresskv_calibration.json"


def load_calibration(path: str | Path) -> dict[str, Any]:
    """Read and check a CompressKV calibration JSON (ValueError when malformed)."""
    p = _calibration_file(path)
    if not p.is_file():
        raise ValueError(
            f"no CompressKV calibration at {p}; run `compactor calibrate compresskv --model M`"
        )
    data = json.loads(p.read_text())
    srh, err = data.get("srh_scores"), data.get("layer_errors")
    if not isinstance(srh, list) or not isinstance(err, list) or len(srh) != len(err) or not srh:
        raise ValueError(f"{p}: need srh_scores [L][H_q] and layer_errors [L] of equal L")
    if len({len(r) for r in srh}) != 1:
        raise ValueError(f"{p}: srh_scores rows differ in length")
    return dict(data)


def cached_calibration(path: str | Path) -> dict[str, Any]:
    """:func:`load_calibration`, read once per file version (path, mtime, size) per process.

    The same dict is handed to every caller: treat it as read-only.
    """
    p = _calibration_file(path)
    if not p.is_file():
        return load_calibration(p)  # raises the usual error
    st = p.stat()
    return _load_cached(str(p.resolve()), st.st_mtime_ns, st.st_size)


def layer_budgets(
    errors: Sequence[float], budget: float, T: int, min_scale: float, max_scale: float
) -> list[int]:
    """Per-layer budgets b_l in [min_scale*budget, max_scale*budget] (and [1, T]),
    proportional to errors[l], summing to about L * budget (bisection on the scale).

    Host-side planning: computed on the CPU whatever the default device.
    """
    e = torch.as_tensor(list(errors), dtype=torch.float64, device="cpu").clamp_min(1e-12)
    L = e.numel()
    lo_b = max(1.0, min_scale * budget)
    hi_b = min(float(T), max(lo_b, max_scale * budget))
    target = min(L * budget, L * hi_b)
    lo, hi = 0.0, float(hi_b / e.min())
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if float((mid * e).clamp(lo_b, hi_b).sum()) < target:
            lo = mid
        else:
            hi = mid
    x = (hi * e).clamp(lo_b, hi_b)
    return [int(v) for v in x.round().clamp(1, T).tolist()]


def srh_token_scores(
    keys: torch.Tensor,
    queries: torch.Tensor,
    heads: Sequence[int],
    group_size: int,
    scale: float,
    kernel: int,
    window: int = 0,
) -> torch.Tensor:
    """Shared token scores [T]: sum over query heads ``heads`` of their pooled mean attention.

    keys [H_kv, T, D]; queries [H_kv, G*n, D] pooled (query head j = KV head j // G, rows
    (j % G)*n : (j % G + 1)*n). window > 0: causal window queries, window tokens scored
    max + 1 (always kept).
    """
    T = keys.shape[1]
    total = torch.zeros(T, device=keys.device)
    for j in heads:
        kv, g = divmod(int(j), group_size)
        q = group_view(queries[kv : kv + 1], group_size)[0, g].unsqueeze(0)  # [1, n, D]
        probs = attention_probs(keys[kv : kv + 1], q, scale, window)[0]  # [n, T]
        s = avg_pool(probs[:, : T - window].mean(0).unsqueeze(0), kernel)[0]
        total[: T - window] += s
    if window:
        total[T - window :] = total.max() + 1
    return total


@register_method("compresskv")
@dataclasses.dataclass
class CompressKV(RefitOption, ScoreMethod):
    """CompressKV: the layer's top semantic-retrieval heads score the tokens; one token set
    of a calibrated per-layer size, shared by the layer's KV heads (see module docstring).

    calibration: JSON path (or model directory); None reads it from the context's
    ``model_dir``. top_heads: SRHs per layer. kernel: pooling width (odd). window: as in
    snapkv (0: the pooled reference queries are the observation window). min_scale /
    max_scale: per-layer budget bounds [m, M] as multiples of the uniform budget.
    Report: {"layer", "budget": b_l, "srh_heads": the scoring query heads}.
    """

    needs_context: ClassVar[bool] = True

    calibration: str | None = None
    top_heads: int = 4
    kernel: int = 5
    window: int = 0
    min_scale: float = 0.25
    max_scale: float = 3.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int("top_heads", self.top_heads)
        check_positive_int("kernel", self.kernel)
        check_positive_int("window", self.window, 0)
        if self.kernel % 2 == 0:
            raise ValueError(f"kernel must be odd, got {self.kernel}")
        if not 0 < float(self.min_scale) <= 1.0 <= float(self.max_scale):
            raise ValueError(
                f"need 0 < min_scale <= 1 <= max_scale, got {self.min_scale}, {self.max_scale}"
            )

    def calibration_data(self, model_dir: str | None = None) -> dict[str, Any]:
        """The calibration (``calibration``, else ``model_dir``'s), read once per file."""
        src = self.calibration or model_dir
        if src is None:
            raise ValueError("compresskv needs `calibration` or a context with model_dir")
        return cached_calibration(src)

    def score(self, x: LayerInput) -> torch.Tensor:
        """The layer's shared token scores, the same row [T] for each of the H_kv heads."""
        return self._score(x, self._plan(x))

    def pick(self, x: LayerInput) -> Picked:
        """One token set per layer (the same for all KV heads), b_l tokens.

        Needs ``x.context.layer`` (which calibration row) unless the calibration has one layer.
        """
        plan = self._plan(x)
        sel = topk_selection(self._score(x, plan), [plan.budget] * x.H)
        report = {"layer": plan.layer, "budget": plan.budget, "srh_heads": sorted(plan.heads)}
        return Picked(sel, report)

    def _plan(self, x: LayerInput) -> _Plan:
        """Calibration row, b_l and the SRH query heads of the layer (host-side)."""
        ctx = x.context
        data = self.calibration_data(None if ctx is None else ctx.model_dir)
        srh, err = data["srh_scores"], data["layer_errors"]
        layer = 0 if ctx is None else int(ctx.layer)
        if not 0 <= layer < len(srh) or (ctx is None and len(srh) != 1):
            raise ValueError(f"no calibration row for layer {layer} (have {len(srh)})")
        if len(srh[layer]) % x.H:
            raise ValueError(
                f"calibration has {len(srh[layer])} query heads, not a multiple of {x.H}"
            )
        mean_b = sum(x.budgets) / len(x.budgets)
        b_l = layer_budgets(err, mean_b, x.T, self.min_scale, self.max_scale)[layer]
        row = torch.as_tensor(srh[layer], dtype=torch.float64, device="cpu")  # host planning
        heads = row.topk(min(self.top_heads, row.numel())).indices.tolist()
        return _Plan(layer, b_l, heads, len(srh[layer]) // x.H)

    def _score(self, x: LayerInput, plan: _Plan) -> torch.Tensor:
        shared = srh_token_scores(
            x.keys, x.queries, plan.heads, plan.group_size, x.scale, self.kernel, self.window
        )
        return shared.unsqueeze(0).expand(x.H, x.T)


# ---- private helpers -------------------------------------------------------------------


class _Plan(NamedTuple):
    layer: int
    budget: int
    heads: list[int]
    group_size: int


def _calibration_file(path: str | Path) -> Path:
    p = Path(path)
    return p / CALIBRATION_FILE if p.is_dir() else p


@functools.lru_cache(maxsize=16)
def _load_cached(path: str, mtime_ns: int, size: int) -> dict[str, Any]:
    return load_calibration(path)

"""Shared pieces of the score-then-keep baselines (private: not a registry module).

Shape legend: T prefix tokens (of the keys handed in), t kept, n reference queries,
H_kv KV heads, G query heads per KV head, w window tokens, D head dim.

Reference queries come pooled per KV head (``[H_kv, G*n, D]``, query head h*G+g owns rows
g*n:(g+1)*n; see ``compactor.hf.pool_gqa``), so a mean or a max over all rows of a KV head
equals the mean / max over its query heads of their own mean / max.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F

from compactor.methods.base import LayerInput, RefitSpec, Selection
from compactor.methods.selection import topk_selection

# What a selection baseline's `refit` fits after its pick: name -> (beta, values). "am" is
# the whole Attention-Matching refit; "beta" and "values" are its halves alone (the other
# half kept as selected: beta 0 / the original values). None keeps the pick as it is.
REFIT_MODES: dict[str, tuple[bool, bool]] = {
    "am": (True, True),
    "beta": (True, False),
    "values": (False, True),
}
REFIT_CHOICES = (None, *REFIT_MODES)
# What a sharp read holds verbatim through the refit (RefitOption.refit_hold).
REFIT_HOLDS = ("keys", "heads")


def attention_probs(
    keys: torch.Tensor,
    queries: torch.Tensor,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    suffix_lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention [H, n, T] fp32 of queries [H, n, D] over keys [H, T, D].

    window > 0: the queries are the last ``window`` prefix tokens' own queries, stacked per
    query head (n = G*window; row r is token T - window + r % window), so each is causally
    masked (key j > its position is dropped), as during the prefill.
    sinks: [H, s, D] keys before ``keys`` that share the softmax (the pipeline's verbatim sink
    tokens): they take their share of every query's mass, as in the model, and their columns
    are dropped from the result. Without them, a query that mostly reads the sinks looks as
    sharp as one that reads a single key.
    suffix_lse: [H, n] the log of each query's softmax mass over the keys after the prefix
    (its own continuation's, causally: ``compactor.query_capture``), one more term of its softmax;
    -inf where there is none. Without it, a query that mostly reads its own recent tokens
    looks like a sharp read of whichever prefix key gets its leftover mass.
    """
    s = 0
    if sinks is not None and sinks.shape[1]:
        s = int(sinks.shape[1])
        keys = torch.cat([sinks.to(keys.dtype), keys], dim=1)
    logits = torch.bmm(queries.float(), keys.float().transpose(1, 2)).mul_(scale)
    if window > 0:
        T, n = keys.shape[1], queries.shape[1]
        if n % window:
            raise ValueError(f"{n} window queries are not a multiple of window={window}")
        dev = logits.device
        pos = (T - window) + torch.arange(n, device=dev) % window  # [n], sinks included in T
        future = torch.arange(T, device=dev).unsqueeze(0) > pos.unsqueeze(1)  # [n, T]
        logits.masked_fill_(future.unsqueeze(0), -math.inf)
    if suffix_lse is None:
        return torch.softmax(logits, dim=-1)[..., s:]
    logits = torch.cat([logits, suffix_lse.float().unsqueeze(-1)], dim=-1)
    return torch.softmax(logits, dim=-1)[..., s:-1]


def group_view(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """[H, G*n, ...] -> [H, G, n, ...] (ValueError if rows do not split into G groups)."""
    if group_size < 1 or x.shape[1] % group_size:
        raise ValueError(f"{x.shape[1]} pooled query rows do not split into {group_size} heads")
    return x.reshape(x.shape[0], group_size, x.shape[1] // group_size, *x.shape[2:])


def avg_pool(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """1-D average pooling over the last dim, same length (zero padding counted, odd kernel)."""
    if kernel <= 1:
        return scores
    return F.avg_pool1d(scores.unsqueeze(1), kernel, stride=1, padding=kernel // 2).squeeze(1)


def global_topk_budgets(scores: torch.Tensor, total: int, floor: int = 1) -> list[int]:
    """Split ``total`` kept entries over heads by a global top-k of scores [H, T].

    Every head keeps at least ``floor`` (then the global top-k fills the rest). One host
    sync (the budgets come back as a list).
    """
    H, T = scores.shape
    total = max(min(total, H * T), H * floor)
    boosted = scores.clone()
    if floor > 0:
        top = scores.topk(min(floor, T), dim=-1).indices
        boosted.scatter_(1, top, math.inf)
    flat = boosted.flatten().topk(total).indices // T
    return torch.bincount(flat, minlength=H).tolist()


@dataclasses.dataclass
class RefitOption:
    """Mixin of the selection baselines: what follows their pick (see ``refit_spec``).

    refit: None keeps the selected keys as they are (beta 0, original values); ``"am"``
    applies the Attention-Matching refit (NNLS beta within refit_beta_bounds + LS values,
    :func:`compactor.methods.refit.refit`) on the reference queries; ``"beta"`` fits beta
    alone (original values), ``"values"`` the values alone (beta 0) (`REFIT_MODES`).
    refit_verbatim: None, or p in (0, 1]: a kept key that some reference query reads with at
    least p of its attention (the sinks and, where the method has it, the query's own
    continuation in the softmax, as kvzip scores) stays as it is through the refit (beta 0,
    its own value), and the others are fitted to what it leaves (:meth:`held_verbatim`).
    refit_hold: what such a sharp read holds: ``"keys"``, the key read; ``"heads"``, every
    kept entry of its KV head (a head some query reads sharply is kept as selected, the fit
    is spent on the heads that read diffusely).
    """

    refit: str | None = None
    refit_beta_bounds: tuple[float, float] = (-3.0, 3.0)
    refit_verbatim: float | None = None
    refit_hold: str = "keys"

    def __post_init__(self) -> None:
        if self.refit not in REFIT_CHOICES:
            raise ValueError(f"refit must be one of {REFIT_CHOICES}, got {self.refit!r}")
        self.refit_verbatim = check_verbatim(self.refit_verbatim, self.refit)
        if self.refit_hold not in REFIT_HOLDS:
            raise ValueError(f"refit_hold must be one of {REFIT_HOLDS}, got {self.refit_hold!r}")
        if self.refit_hold != "keys" and self.refit_verbatim is None:
            raise ValueError(
                f"refit_hold={self.refit_hold!r} needs refit_verbatim (what a sharp read is)"
            )
        try:
            lo, hi = (float(x) for x in self.refit_beta_bounds)
        except (TypeError, ValueError):
            raise ValueError(
                f"refit_beta_bounds must be a (lo, hi) pair, got {self.refit_beta_bounds!r}"
            ) from None
        if not (math.isfinite(lo) and math.isfinite(hi) and lo <= 0 <= hi):
            raise ValueError(f"refit_beta_bounds need lo <= 0 <= hi, got {(lo, hi)}")
        self.refit_beta_bounds = (lo, hi)

    def refit_spec(self) -> RefitSpec | None:
        """None (keep as is) or the AM refit with refit_beta_bounds (see `REFIT_MODES`)."""
        return refit_spec_for(self.refit, self.refit_beta_bounds)

    def held_verbatim(self, x: LayerInput, selection: Selection) -> torch.Tensor | None:
        """The kept entries some reference query reads with >= refit_verbatim of its
        attention, or every kept entry of a head with such a read (``refit_hold="heads"``)
        ([H_kv, t_max] bool); None without refit_verbatim."""
        if self.refit_verbatim is None:
            return None
        reads = attention_probs(
            x.keys, x.queries, x.scale, sinks=x.sinks, suffix_lse=x.suffix_lse
        ).amax(1)
        sharp = (torch.gather(reads, 1, selection.indices) >= self.refit_verbatim) & selection.mask
        if self.refit_hold == "heads":
            return sharp.any(1, keepdim=True) & selection.mask
        return sharp


def check_verbatim(value: Any, refit: str | None) -> float | None:
    """refit_verbatim as a float in (0, 1] or None; ValueError otherwise, or when there is no
    refit to hold entries out of."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise ValueError(f"refit_verbatim must be None or a number in (0, 1], got {value!r}")
    if refit is None or refit == "none":
        raise ValueError("refit_verbatim needs a refit (refit='am', 'beta' or 'values')")
    return float(value)


def refit_spec_for(refit: str | None, beta_bounds: tuple[float, float]) -> RefitSpec | None:
    """The RefitSpec of a `refit` choice (`REFIT_MODES`; None or "none": no refit)."""
    if refit is None or refit == "none":
        return None
    fit_beta, fit_values = REFIT_MODES[refit]
    return RefitSpec(beta_bounds, fit_values=fit_values, fit_beta=fit_beta)


def check_positive_int(name: str, value: Any, minimum: int = 1) -> int:
    """ValueError unless value is an int >= minimum (bools rejected)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


__all__ = [
    "REFIT_CHOICES",
    "REFIT_MODES",
    "RefitOption",
    "attention_probs",
    "avg_pool",
    "check_positive_int",
    "check_verbatim",
    "global_topk_budgets",
    "group_view",
    "refit_spec_for",
    "topk_selection",
]

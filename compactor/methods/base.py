"""The method base classes, and the one input/result types of a layer.

Shape legend: T prefix tokens, t kept (t_max = max over heads), n reference queries,
H_q/H_kv heads, D head dim, indptr [H_kv+1] int32.

Device: methods compute on the device of the keys they are given (CPU or CUDA) and return
their CompactedLayer there; every tensor they allocate follows an input's device.

A method is a ``@dataclass`` of hyper-parameters, named in the one table of
:mod:`compactor.methods.registry` (which builds them). Methods are stateless: :meth:`CompactionMethod.compact` takes a :class:`LayerInput` and
returns a :class:`MethodResult` (the layer + a report dict); nothing is stored on the method.

Class hierarchy (each level has exactly one abstract method, taking only a LayerInput):

* :class:`CompactionMethod` — ``compact(x) -> MethodResult``;
* :class:`SelectingMethod` — ``pick(x) -> Picked`` (kept key indices + report); its
  ``compact`` keeps the picked keys as they are or applies the AM refit (``refit_spec``);
* :class:`ScoreMethod` — ``score(x) -> [H_kv, T]``; its ``pick`` keeps the top t_h per head.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, final

import torch

from compactor.methods.context import check_sinks, check_suffix_lse
from compactor.methods.refit import Stage, no_stage
from compactor.methods.refit import refit as am_refit
from compactor.methods.selection import Selection, keep_selected, pack_layer, topk_selection
from compactor.methods.targets import Targets, reference_targets
from compactor.types import CompactedLayer

if TYPE_CHECKING:
    from compactor.methods.context import LayerContext

__all__ = [
    "CompactionMethod",
    "LayerInput",
    "MethodResult",
    "Picked",
    "RefitSpec",
    "ScoreMethod",
    "SelectingMethod",
    "Selection",
    "check_layer_inputs",
    "pack_layer",
    "resolve_sm_scale",
    "topk_selection",
]


@dataclasses.dataclass(frozen=True, eq=False)
class LayerInput:
    """One layer handed to a method; validated on construction (ValueError).

    Attributes:
        keys: [H_kv, T, D] post-RoPE keys (model dtype).
        values: [H_kv, T, D].
        queries: [H_kv, n, D] post-RoPE reference queries (GQA groups pooled).
        budgets: t_h per KV head, 1 <= t_h <= T (stored as a tuple of ints).
        sm_scale: logit scale (None: 1/sqrt(D)); see :attr:`scale`.
        context: what the layer saw during the prefill, for methods with
            ``needs_context`` (GVote, CompressKV); None otherwise.
        sinks: [H_kv, s, D] the keys kept verbatim before these (the pipeline's sink tokens),
            which share the reference queries' softmax; None when there are none. Scoring
            methods normalise with them (``attention_probs(..., sinks=)``).
        suffix_lse: [H_kv, n] the log of each reference query's softmax mass over the keys
            after the prefix (its own continuation's, causal), for methods with
            ``needs_suffix_lse`` (KVzip); None otherwise, or where the pipeline has none
            (on-policy).
    """

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    budgets: tuple[int, ...]
    sm_scale: float | None = None
    context: LayerContext | None = None
    sinks: torch.Tensor | None = None
    suffix_lse: torch.Tensor | None = None

    def __post_init__(self) -> None:
        budgets = check_layer_inputs(self.keys, self.values, self.queries, self.budgets)
        object.__setattr__(self, "budgets", tuple(budgets))
        check_sinks(self.sinks, self.keys)
        check_suffix_lse(self.suffix_lse, self.queries)
        resolve_sm_scale(self.sm_scale, self.D)

    @property
    def H(self) -> int:
        """H_kv, the number of KV heads."""
        return int(self.keys.shape[0])

    @property
    def T(self) -> int:
        """T, the number of tokens handed in."""
        return int(self.keys.shape[1])

    @property
    def D(self) -> int:
        """D, the head dim."""
        return int(self.keys.shape[2])

    @property
    def scale(self) -> float:
        """The logit scale: sm_scale, or 1/sqrt(D) when None."""
        return resolve_sm_scale(self.sm_scale, self.D)

    @functools.cached_property
    def targets(self) -> Targets:
        """:func:`~compactor.methods.refit.reference_targets` of the layer, computed on
        first use and then kept on this input (so a selection and its refit share them)."""
        return reference_targets(self.keys, self.values, self.queries, self.scale)


class MethodResult(NamedTuple):
    """What :meth:`CompactionMethod.compact` returns: the compacted layer and a JSON-ready
    report of what the method decided ({} when it has nothing to say)."""

    layer: CompactedLayer
    report: dict[str, Any]


class Picked(NamedTuple):
    """What :meth:`SelectingMethod.pick` returns: kept keys and a report ({} if none)."""

    selection: Selection
    report: dict[str, Any]


class RefitSpec(NamedTuple):
    """How a SelectingMethod finishes its pick with the AM refit
    (:func:`compactor.methods.refit.refit`): beta bounds (None = unbounded on that side),
    whether values are fitted, the value ridge, and whether beta is fitted (False: 0)."""

    beta_bounds: tuple[float | None, float | None]
    fit_values: bool = True
    value_ridge: float = 1e-3
    fit_beta: bool = True


@dataclasses.dataclass
class CompactionMethod(ABC):
    """Base of all methods: a dataclass of hyper-parameters with one job.

    Subclasses validate their fields in ``__post_init__`` (ValueError, never assert) and
    implement :meth:`compact`. A method that needs a LayerContext sets ``needs_context``; one
    that reads ``LayerInput.suffix_lse`` sets ``needs_suffix_lse``; one that chooses its own
    budget, whatever the spec's ratio or tokens, sets ``own_budget``.
    One whose result for a KV head depends on that head's keys, values, queries and budget
    alone (no state across heads, no context, an empty report) sets ``heads_independent``:
    the pipeline may then compact several chunks of a layer in one call, stacked along
    the head dim (``compactor.pipeline.layers``).
    """

    name: ClassVar[str] = ""
    needs_context: ClassVar[bool] = False
    needs_suffix_lse: ClassVar[bool] = False
    own_budget: ClassVar[bool] = False
    heads_independent: ClassVar[bool] = False

    @abstractmethod
    def compact(self, x: LayerInput) -> MethodResult:
        """Compact one layer: the CompactedLayer (keys/values in the input dtype, beta
        fp32, on the keys' device) and a report dict. Mutates nothing."""

    @final
    def compact_layer(self, *args: Any, **kwargs: Any) -> CompactedLayer:
        """``compact(LayerInput(*args, **kwargs)).layer``: keys, values, queries, budgets,
        sm_scale=None, context=None, as :class:`LayerInput` takes them."""
        return self.compact(LayerInput(*args, **kwargs)).layer

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


@dataclasses.dataclass
class SelectingMethod(CompactionMethod):
    """A method that picks a subset of the original keys (:meth:`pick`); ``compact`` then
    keeps them as they are (beta 0, original values) or, when :meth:`refit_spec` says so,
    applies the AM refit (NNLS beta + least-squares values) on the reference queries."""

    @abstractmethod
    def pick(self, x: LayerInput) -> Picked:
        """Kept token indices per KV head (at most budgets[h] unless the method sets its
        own budgets) and a report dict."""

    def refit_spec(self) -> RefitSpec | None:
        """None keeps the picked keys as they are; a RefitSpec applies the AM refit."""
        return None

    def held_verbatim(self, x: LayerInput, selection: Selection) -> torch.Tensor | None:
        """[H_kv, t_max] bool: the picked entries the refit leaves as they are (beta 0, their
        own values; :func:`compactor.methods.refit.refit`'s ``verbatim``); None: none."""
        return None

    @final
    def compact(self, x: LayerInput) -> MethodResult:
        """Pick, then keep as is or refit (see :meth:`refit_spec`)."""
        return self.compact_in_stages(x, no_stage)

    @final
    def compact_in_stages(self, x: LayerInput, stage: Stage) -> MethodResult:
        """:meth:`compact`, each of its stages ("selection", then "beta" and "values" of
        the refit, or "values" alone when the picked entries are kept as they are) run
        inside ``stage(name)``: a benchmark's clock (`benchmarks.offline.compaction_speed`)."""
        with stage("selection"):
            sel, report = self.pick(x)
        spec = self.refit_spec()
        if spec is None:
            with stage("values"):
                return MethodResult(keep_selected(x.keys, x.values, sel), report)
        with stage("beta"):
            verbatim = self.held_verbatim(x, sel)
        layer = am_refit(
            x.keys,
            x.values,
            x.queries,
            sel,
            sm_scale=x.scale,
            beta_bounds=spec.beta_bounds,
            fit_beta=spec.fit_beta,
            fit_values=spec.fit_values,
            value_ridge=spec.value_ridge,
            targets=x.targets,
            verbatim=verbatim,
            stage=stage,
        )
        return MethodResult(layer, report)

    @final
    def select(self, *args: Any, **kwargs: Any) -> Selection:
        """``pick(LayerInput(*args, **kwargs)).selection`` (the arguments of
        :meth:`compact_layer`)."""
        return self.pick(LayerInput(*args, **kwargs)).selection


@dataclasses.dataclass
class ScoreMethod(SelectingMethod):
    """A selecting method that scores every key (:meth:`score`) and, by default, keeps
    the budgets[h] best of each KV head (indices ascending), with an empty report."""

    @abstractmethod
    def score(self, x: LayerInput) -> torch.Tensor:
        """Key scores [H_kv, T] (higher = keep)."""

    def pick(self, x: LayerInput) -> Picked:
        return Picked(topk_selection(self.score(x), x.budgets), {})


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
    """Validate one layer's inputs (see :class:`LayerInput`); return budgets as ints."""
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

"""Per-layer model context for methods that need more than (keys, values, queries).

Shape legend: T prefix tokens, P positions, H_q / H_kv query / KV heads, G = H_q // H_kv,
D head dim, E hidden size.

GVote needs the layer's attention *inputs* (the input-layernorm outputs of the prefix), the
layer's query projection and RoPE, and the real last query; CompressKV needs the layer index
and the model directory (its calibration JSON lives there). A method that wants this sets the
class attribute ``needs_context = True`` and reads ``LayerInput.context``; the pipeline builds
the contexts once per prefix with :func:`build_layer_contexts` and passes
``context.for_span(start, stop)`` for each chunk.

A method whose per-layer budgets depend on *all* layers (KVCompose's global layer-adaptive
budget) implements :class:`LayerBudgetPlanner`; the pipeline calls it once before the layer
loop and uses its per-layer budgets instead of the uniform one.

Everything here is plain tensors + ints (picklable: it may cross a Ray boundary).
:func:`build_layer_contexts` leaves the tensors on the model's device; methods move a
context to their keys' device with :meth:`LayerContext.to` (a no-op when it is there).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, final

import torch

from compactor.types import tensors_to

__all__ = [
    "LayerBudgetPlanner",
    "LayerContext",
    "PlannerInput",
    "apply_rope",
    "build_layer_contexts",
    "rope_cos_sin",
    "wants_context",
    "wants_suffix_lse",
]


def check_sinks(sinks: torch.Tensor | None, keys: torch.Tensor) -> None:
    """ValueError unless `sinks` is None or [H_kv, s, D] beside keys [H_kv, T, D]."""
    if sinks is None:
        return
    H, _, D = keys.shape
    if sinks.dim() != 3 or sinks.shape[0] != H or sinks.shape[2] != D:
        raise ValueError(f"sinks must be [H_kv={H}, s, D={D}], got {tuple(sinks.shape)}")


def check_suffix_lse(suffix_lse: torch.Tensor | None, queries: torch.Tensor) -> None:
    """ValueError unless `suffix_lse` is None or [H_kv, n] beside queries [H_kv, n, D]."""
    if suffix_lse is not None and tuple(suffix_lse.shape) != tuple(queries.shape[:2]):
        raise ValueError(
            f"suffix_lse must be [H_kv, n]={tuple(queries.shape[:2])}, "
            f"got {tuple(suffix_lse.shape)}"
        )


@dataclasses.dataclass(frozen=True)
class LayerContext:
    """What one layer saw during the prefill of the prefix.

    Attributes:
        layer, num_layers: layer index and count.
        hidden: [T, E] fp32 input of the attention module (input-layernorm output).
        q_weight: [H_q*D, E] fp32 query projection (q_bias [H_q*D] or None).
        inv_freq: [D/2] fp32 RoPE inverse frequencies; rope_scale: cos/sin multiplier.
        last_query: [H_q, D] fp32 post-RoPE query of the last prefix token (position T-1).
        num_q_heads, head_dim: geometry.
        span: (start, stop) token range of the keys handed to the method (a chunk).
        model_dir: checkpoint directory (CompressKV calibration lives next to it), or None.
    """

    layer: int
    num_layers: int
    hidden: torch.Tensor
    q_weight: torch.Tensor
    q_bias: torch.Tensor | None
    inv_freq: torch.Tensor
    rope_scale: float
    last_query: torch.Tensor
    num_q_heads: int
    head_dim: int
    span: tuple[int, int] = (0, 0)
    model_dir: str | None = None

    def __post_init__(self) -> None:
        T = self.hidden.shape[0]
        if self.hidden.dim() != 2 or T < 1:
            raise ValueError(f"hidden must be [T>=1, E], got {tuple(self.hidden.shape)}")
        if self.q_weight.shape != (self.num_q_heads * self.head_dim, self.hidden.shape[1]):
            raise ValueError(
                f"q_weight must be [H_q*D={self.num_q_heads * self.head_dim}, "
                f"E={self.hidden.shape[1]}], got {tuple(self.q_weight.shape)}"
            )
        if self.last_query.shape != (self.num_q_heads, self.head_dim):
            raise ValueError(f"last_query must be [H_q, D], got {tuple(self.last_query.shape)}")
        if self.inv_freq.shape != (self.head_dim // 2,):
            raise ValueError(f"inv_freq must be [D/2], got {tuple(self.inv_freq.shape)}")
        if self.span == (0, 0):
            object.__setattr__(self, "span", (0, T))
        a, b = self.span
        if not 0 <= a < b <= T:
            raise ValueError(f"span {self.span} outside [0, T={T}]")

    @property
    def logical_length(self) -> int:
        """T, the number of prefix tokens."""
        return int(self.hidden.shape[0])

    def to(self, device: torch.device | str) -> LayerContext:
        """The same context with its tensors on ``device`` (self when they already are)."""
        return tensors_to(self, device, ("hidden", "q_weight", "q_bias", "inv_freq", "last_query"))

    def for_span(self, start: int, stop: int) -> LayerContext:
        """The same context for the keys of tokens [start, stop) (a chunk or the non-sinks)."""
        return dataclasses.replace(self, span=(int(start), int(stop)))

    def project_queries(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Post-RoPE queries [H_q, N, D] of hidden states [N, E] at positions [N] (float ok)."""
        q = hidden.float() @ self.q_weight.t()
        if self.q_bias is not None:
            q = q + self.q_bias
        q = q.view(-1, self.num_q_heads, self.head_dim).transpose(0, 1)  # [H_q, N, D]
        cos, sin = rope_cos_sin(self.inv_freq, positions, self.rope_scale)
        return apply_rope(q, cos, sin)


@dataclasses.dataclass(frozen=True)
class PlannerInput:
    """The arguments of one :meth:`LayerBudgetPlanner.plan_layer_budgets` call, checked.

    Shape legend: L layers (one entry each), H_kv KV heads, T tokens, n queries, D head dim.

    Attributes:
        keys: keys[l] [H_kv, T, D], every layer with the same H_kv and T.
        queries: queries[l] [H_kv, n, D].
        budget: t, the mean kept per KV head and layer, in [1, T].
        sm_scale: logit scale (None: 1/sqrt(D)).
        sinks: sinks[l] [H_kv, s, D], the verbatim keys before keys[l] that share the
            softmax (see :class:`~compactor.methods.base.LayerInput`), or None.
        suffix_lse: suffix_lse[l] [H_kv, n], the log of each query's softmax mass after the
            prefix (see :class:`~compactor.methods.base.LayerInput`), or None.

    Raises:
        ValueError: keys and queries not one per layer, layers of different [H_kv, T], or
            `budget` outside [1, T].
    """

    keys: Sequence[torch.Tensor]
    queries: Sequence[torch.Tensor]
    budget: int
    sm_scale: float | None = None
    sinks: Sequence[torch.Tensor] | None = None
    suffix_lse: Sequence[torch.Tensor] | None = None

    def __post_init__(self) -> None:
        keys, queries = self.keys, self.queries
        if self.suffix_lse is not None:
            if len(self.suffix_lse) != len(queries):
                raise ValueError(
                    f"need suffix_lse for every layer, got {len(self.suffix_lse)}/{len(queries)}"
                )
            for lse, q in zip(self.suffix_lse, queries, strict=True):
                check_suffix_lse(lse, q)
        if self.sinks is not None:
            if len(self.sinks) != len(keys):
                raise ValueError(f"need sinks for every layer, got {len(self.sinks)}/{len(keys)}")
            for sk, k in zip(self.sinks, keys, strict=True):
                check_sinks(sk, k)
        if len(keys) != len(queries) or not keys:
            raise ValueError(
                f"need keys and queries for every layer, got {len(keys)}/{len(queries)}"
            )
        H, T = self.H, self.T
        if any(tuple(k.shape[:2]) != (H, T) for k in keys):
            raise ValueError("every layer's keys must be [H_kv, T, D] with the same H_kv and T")
        if not 1 <= self.budget <= T:
            raise ValueError(f"budget {self.budget} must be in [1, T={T}]")

    @property
    def L(self) -> int:
        return len(self.keys)

    @property
    def H(self) -> int:
        return int(self.keys[0].shape[0])

    @property
    def T(self) -> int:
        return int(self.keys[0].shape[1])


class LayerBudgetPlanner(ABC):
    """A method that sets per-layer budgets from all layers at once (e.g. KVCompose): it
    implements :meth:`plan_layers`; the pipeline calls :meth:`plan_layer_budgets`."""

    @final
    def plan_layer_budgets(
        self,
        keys: Sequence[torch.Tensor],
        queries: Sequence[torch.Tensor],
        budget: int,
        sm_scale: float | None = None,
        sinks: Sequence[torch.Tensor] | None = None,
        suffix_lse: Sequence[torch.Tensor] | None = None,
    ) -> list[int]:
        """Per-layer budget per KV head from keys[l] [H_kv, T, D] and queries[l] [H_kv, n, D]
        (sinks[l] [H_kv, s, D] before them, suffix_lse[l] [H_kv, n], or None); the mean over
        layers equals ``budget`` (up to rounding and per-layer floors). ValueError when the
        arguments do not fit (see :class:`PlannerInput`)."""
        return self.plan_layers(PlannerInput(keys, queries, budget, sm_scale, sinks, suffix_lse))

    @abstractmethod
    def plan_layers(self, x: PlannerInput) -> list[int]:
        """:meth:`plan_layer_budgets` on its checked arguments: [L] budgets per KV head."""


def wants_context(method: Any) -> bool:
    """True when ``method`` declares ``needs_context = True``."""
    return bool(getattr(method, "needs_context", False))


def wants_suffix_lse(method: Any) -> bool:
    """True when ``method`` declares ``needs_suffix_lse = True`` (it reads
    ``LayerInput.suffix_lse``, which costs one more attention pass per continuation)."""
    return bool(getattr(method, "needs_suffix_lse", False))


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [P, D] of the llama RoPE (half-split layout) at positions [P]."""
    ang = positions.float().reshape(-1, 1) * inv_freq.float().reshape(1, -1)  # [P, D/2]
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos() * scale, emb.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., P, D] rotated by (cos, sin) [P, D] (llama rotate_half convention)."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


@torch.inference_mode()
def build_layer_contexts(
    model: Any, token_ids: Sequence[int], model_dir: str | None = None
) -> list[LayerContext]:
    """Run the prefix once through ``model`` and return one :class:`LayerContext` per layer.

    Records each attention module's input hidden states with forward pre-hooks (removed on
    exit; the model is not otherwise mutated). Llama-like models only (q_proj + RoPE with
    ``rotary_emb.inv_freq``); a model with ``q_norm`` is rejected (not handled yet). The
    contexts' tensors stay on the model's device (fp32; q_weight may share the parameter's
    storage when the model is fp32).
    """
    dev = model.device
    ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=dev).reshape(1, -1)
    if ids.shape[1] < 1:
        raise ValueError("build_layer_contexts: empty prefix")
    cfg = model.config
    hq = int(cfg.num_attention_heads)
    layers = model.model.layers
    d = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // hq)
    rot = model.model.rotary_emb
    inv_freq = rot.inv_freq.detach().float()
    scale = float(getattr(rot, "attention_scaling", 1.0))
    seen: dict[int, torch.Tensor] = {}
    handles = []

    def make_hook(i: int) -> Any:
        def hook(_m: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            hs = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            seen[i] = hs[0].detach().float()

        return hook

    try:
        for i, layer in enumerate(layers):
            if getattr(layer.self_attn, "q_norm", None) is not None:
                raise ValueError("build_layer_contexts: models with q_norm are not supported")
            handles.append(
                layer.self_attn.register_forward_pre_hook(make_hook(i), with_kwargs=True)
            )
        model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    T = ids.shape[1]
    out = []
    for i, layer in enumerate(layers):
        qp = layer.self_attn.q_proj
        bias = qp.bias.detach().float() if qp.bias is not None else None
        ctx = LayerContext(
            layer=i,
            num_layers=len(layers),
            hidden=seen[i],
            q_weight=qp.weight.detach().float(),
            q_bias=bias,
            inv_freq=inv_freq,
            rope_scale=scale,
            last_query=torch.zeros(hq, d, device=dev),
            num_q_heads=hq,
            head_dim=d,
            model_dir=model_dir,
        )
        last = ctx.project_queries(seen[i][-1:], torch.tensor([T - 1], device=dev))[:, 0]
        out.append(dataclasses.replace(ctx, last_query=last))
    return out

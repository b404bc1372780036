"""GVote (arXiv 2509.03136): adaptive per-head budgets by voting of sampled future queries.

Shape legend: T prefix tokens, T_c keys handed in (a span of the prefix), S samples,
E hidden size, H_q / H_kv query / KV heads, G = H_q // H_kv, D head dim,
indptr [H_kv+1] int32.

Per layer (needs a :class:`~compactor.methods.context.LayerContext`):

1. budget: for each query head j, b_j = size of the nucleus (smallest set whose attention
   mass >= p) of the *real last query* (the last prefix token's query) over the span keys;
2. a diagonal Gaussian N(mu, sigma^2) is fitted to the layer's attention inputs (the
   input-layernorm outputs) of the prefix, the first ``n_sink`` tokens skipped;
3. S hidden states are sampled from it and projected with the layer's q_proj; RoPE is
   applied with the *average* rotation over the future positions T .. T+horizon-1;
4. each sampled query of head j keeps its top-b_j keys; the kept set of a KV head is the
   union over its G query heads and the S samples (plus the real last query's own top-b_j
   when ``vote_last_query``).

No ratio is set: the input's ``budgets`` are ignored. The chosen kept count per KV head
(and the kept fraction, ``"ratio"``) is in the report of each result; the pipeline collects
them into ``params["method_report"]`` and their mean ratio into the prefix's
``budget.ratio_chosen``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from compactor.methods._scoring import RefitOption, check_positive_int
from compactor.methods.base import LayerInput, Picked, SelectingMethod, Selection
from compactor.methods.context import LayerContext, apply_rope, rope_cos_sin
from compactor.methods.registry import register_method

__all__ = ["GVote", "nucleus_size"]


def nucleus_size(probs: torch.Tensor, p: float) -> torch.Tensor:
    """[..., T] probabilities -> [...] int64: smallest k whose top-k mass >= p (>= 1)."""
    srt = probs.sort(-1, descending=True).values
    csum = srt.cumsum(-1)
    k = (csum < p * csum[..., -1:]).sum(-1) + 1
    return k.clamp(max=probs.shape[-1])


@register_method("gvote")
@dataclasses.dataclass
class GVote(RefitOption, SelectingMethod):
    """GVote: union of the top-b_j keys of S sampled future queries (see module docstring).

    p: nucleus mass of the real last query that sets b_j. S: sampled queries per layer.
    n_sink: first tokens left out of the Gaussian fit. horizon: future positions averaged
    in the RoPE. seed: sampling seed (per layer: seed + layer). vote_last_query: the real
    last query votes too.
    """

    needs_context: ClassVar[bool] = True
    own_budget: ClassVar[bool] = True  # the nucleus sets it, not the spec

    p: float = 0.95
    S: int = 16
    n_sink: int = 4
    horizon: int = 64
    seed: int = 0
    vote_last_query: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < float(self.p) <= 1.0:
            raise ValueError(f"p must be in (0, 1], got {self.p!r}")
        check_positive_int("S", self.S, 0)
        check_positive_int("n_sink", self.n_sink, 0)
        check_positive_int("horizon", self.horizon)
        if not self.vote_last_query and self.S == 0:
            raise ValueError("S = 0 needs vote_last_query=True (nothing would vote)")

    def sample_queries(self, ctx: LayerContext) -> torch.Tensor:
        """S sampled post-RoPE queries [H_q, S, D] for the layer of ``ctx``."""
        h = ctx.hidden[min(self.n_sink, ctx.logical_length - 1) :].float()
        mu, sigma = h.mean(0), h.std(0, unbiased=False)
        # drawn on the CPU (same samples whatever the device), then moved to h's device
        gen = torch.Generator().manual_seed(int(self.seed) + 1000 * ctx.layer)
        eps = [torch.randn(h.shape[1], generator=gen, device="cpu") for _ in range(self.S)]
        samples = mu + sigma * torch.stack(eps).to(h.device) if eps else h[:0]
        q = samples @ ctx.q_weight.t()
        if ctx.q_bias is not None:
            q = q + ctx.q_bias
        q = q.view(-1, ctx.num_q_heads, ctx.head_dim).transpose(0, 1)  # [H_q, S, D]
        T = ctx.logical_length
        pos = torch.arange(T, T + self.horizon, device=ctx.inv_freq.device)
        cos, sin = rope_cos_sin(ctx.inv_freq, pos, ctx.rope_scale)
        return apply_rope(q, cos.mean(0, keepdim=True), sin.mean(0, keepdim=True))

    def pick(self, x: LayerInput) -> Picked:
        """Kept keys per KV head (``x.budgets`` are ignored) and the report: layer, span,
        nucleus budget per query head, kept count per KV head, kept fraction ``ratio``."""
        context = x.context
        if context is None:
            raise ValueError("gvote needs a LayerContext (hidden states, q_proj, last query)")
        keys = x.keys
        H, Tc, D = keys.shape
        a, b = context.span
        if b - a != Tc or context.head_dim != D or context.num_q_heads % H:
            raise ValueError(
                f"context (span {context.span}, H_q={context.num_q_heads}, D={context.head_dim})"
                f" does not match keys {tuple(keys.shape)}"
            )
        context = context.to(keys.device)
        G = context.num_q_heads // H
        scale = x.scale
        kq = keys.float().repeat_interleave(G, dim=0)  # [H_q, Tc, D]
        last = torch.einsum("hd,htd->ht", context.last_query.float(), kq) * scale
        nb = nucleus_size(torch.softmax(last, -1), float(self.p))  # [H_q]
        voters = self.sample_queries(context)  # [H_q, S, D]
        if self.vote_last_query:
            voters = torch.cat([voters, context.last_query.float().unsqueeze(1)], dim=1)
        logits = torch.bmm(voters, kq.transpose(1, 2))  # [H_q, V, Tc]
        keep_q = torch.zeros(context.num_q_heads, Tc, dtype=torch.bool, device=keys.device)
        nb_list = nb.tolist()  # one host sync for every head's top-k size
        for j in range(context.num_q_heads):
            top = logits[j].topk(nb_list[j], dim=-1).indices  # [V, b_j]
            keep_q[j, top.flatten()] = True
        keep = keep_q.view(H, G, Tc).any(1)
        kept = keep.sum(-1).tolist()
        report = {
            "layer": context.layer,
            "span": [a, b],
            "nucleus_budget_per_q_head": nb_list,
            "kept_per_kv_head": kept,
            "ratio": sum(kept) / float(H * Tc),
        }
        return Picked(Selection.from_mask(keep), report)

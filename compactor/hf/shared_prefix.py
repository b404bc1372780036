"""Batched decoding after one shared prefix whose keys and values are held once.

Shape legend: T prefix tokens (logical length), S prefix slots per head, B rows, n tokens
every row has appended so far (its padding included), q tokens one call appends, H_q / H_kv
query / KV heads, G = H_q // H_kv, D head dim, V vocabulary, R = B*G*q query rows per KV head.

The prefix's keys / values [H_kv, S, D] and beta [H_kv, S] of each layer are shared by all
rows, never expanded or copied per row; the transformers ``DynamicCache`` of a batch holds
only the rows' own tokens, [B, H_kv, n, D] per layer. Each attention layer computes two
partial results with :func:`kernels.biased_attention.reference.biased_attention`
(``biased_attention_lse``, fp32) and merges them by their log-sum-exp
(:func:`kernels.merge_state.reference.merge_state`):

1. every row's queries against the prefix, beta as the logit bias (-inf on padding slots);
   the rows and the G query heads of a KV head are folded into one query dim
   ``[H_kv, R, D]``, so the prefix broadcasts over them as it is;
2. each row's queries against its own tokens: causal, its padding masked (a float mask
   ``[B, 1, q, n + q]`` given to the model, the same for every layer).

A row's real tokens get the logical positions T + (real tokens the row already has), ...
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from compactor.hf.model import model_info, use_attention
from kernels.biased_attention.reference import attention_bias, biased_attention_lse
from kernels.merge_state.reference import merge_state

__all__ = ["SharedPrefixRows", "shared_prefix_attention"]

_SHARED = "compactor_shared_prefix"
# Bytes of fp32 logits one prefix attention call makes ([H_kv, rows, S]): the R query rows
# of a layer run in blocks of at most this many (bounded memory, cache-sized passes).
PREFIX_LOGITS_BYTES = 16 << 20
# Bytes of fp32 logits over the rows' own tokens ([B, H_q, q, n + q]) one forward call may
# make: a longer append runs in several forward calls of fewer tokens.
TAIL_LOGITS_BYTES = 64 << 20


def shared_prefix_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    shared_prefix: SharedPrefixRows | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over the shared prefix of `shared_prefix` and the rows' own tokens.

    query [B, H_q, q, D]; key / value [B, H_kv, n + q, D] (the rows' cache after this call's
    update); attention_mask [B, 1, q, n + q] float (causal, padding -inf). The prefix of
    layer ``module.layer_idx`` comes from `shared_prefix` (passed by
    :meth:`SharedPrefixRows.forward` through the model's keyword arguments). Returns
    ``(out [B, q, H_q, D] in query's dtype, None)``, transformers' layout.
    """
    if shared_prefix is None:
        raise ValueError("shared_prefix_attention needs the shared_prefix keyword argument")
    pk, pv, pb = shared_prefix.layer(module.layer_idx)
    b, hq, q, d = query.shape
    hkv, s = pb.shape
    g = hq // hkv
    # query head i*G + j reads KV head i: fold (B, G, q) into the rows of KV head i
    rows = query.reshape(b, hkv, g * q, d).transpose(0, 1).reshape(hkv, b * g * q, d)
    step = max(1, PREFIX_LOGITS_BYTES // (4 * hkv * max(1, s)))
    parts = [
        biased_attention_lse(rows[:, a : a + step], pk, pv, pb, sm_scale=scaling)
        for a in range(0, rows.shape[1], step)
    ]
    p_out = torch.cat([p.out for p in parts], dim=1).reshape(hkv, b, g, q, d)
    p_lse = torch.cat([p.lse for p in parts], dim=1).reshape(hkv, b, g, q)
    p_out = p_out.permute(1, 3, 0, 2, 4).reshape(b * q, hq, d)  # [B*q, H_q, D]
    p_lse = p_lse.permute(1, 3, 0, 2).reshape(b * q, hq)
    own = biased_attention_lse(query, key, value, sm_scale=scaling, bias=attention_mask)
    o_out = own.out.transpose(1, 2).reshape(b * q, hq, d)
    o_lse = own.lse.transpose(1, 2).reshape(b * q, hq)
    merged = merge_state(p_out, p_lse, o_out, o_lse).out
    return merged.reshape(b, q, hq, d).to(query.dtype), None


class SharedPrefixRows:
    """B rows decoding after one shared prefix: one growing batch of sequences.

    Attributes:
        keys / values: per layer [H_kv, S, D] on the model's device in its dtype (the
            caller's tensors, not copied, when already there).
        bias: [L, H_kv, S] fp32 beta (-inf on padding slots).
        logical_length: T.
        cache: a ``DynamicCache`` of the rows' own tokens only, [B, H_kv, n, D] per layer.
    The padding and real-token counts per row live on the model's device, so appending
    never waits for the device.
    Mutates: :meth:`forward` appends to `cache` and the per-row bookkeeping.
    """

    def __init__(
        self,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        bias: torch.Tensor,
        logical_length: int,
        batch: int,
        model: Any,
    ) -> None:
        from transformers import DynamicCache

        dev, dt = model.device, model.dtype
        self.keys = [k.to(dev, dt) for k in keys]
        self.values = [v.to(dev, dt) for v in values]
        self.bias = bias.to(dev, torch.float32)
        self.logical_length, self.batch = int(logical_length), int(batch)
        self.cache: Any = DynamicCache()
        self._pad = torch.zeros(batch, 0, dtype=torch.bool, device=dev)  # [B, n] True = pad
        self._num_real = torch.zeros(batch, dtype=torch.long, device=dev)  # [B]

    def layer(self, idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer `idx`'s prefix: keys [H_kv, S, D], values [H_kv, S, D], beta [H_kv, S]."""
        return self.keys[idx], self.values[idx], self.bias[idx]

    @property
    def num_new(self) -> int:
        """n, tokens every row has appended (padding included)."""
        return int(self._pad.shape[1])

    def append_block(self, model: Any, q_len: int) -> int:
        """Tokens per forward call when appending `q_len`: all of them when the logits over
        the rows' own tokens [B, H_q, q_len, n + q_len] fp32 fit in TAIL_LOGITS_BYTES, else
        the most that do (at least 1)."""
        per_token = 4 * self.batch * model_info(model).num_q_heads * (self.num_new + q_len)
        if per_token * q_len <= TAIL_LOGITS_BYTES:
            return q_len
        return max(1, TAIL_LOGITS_BYTES // per_token)

    @torch.inference_mode()
    def forward(
        self,
        model: Any,
        ids: torch.Tensor,
        last_only: bool = False,
        pad: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append ids [B, q] (`pad` [B, q] bool marks padding) -> logits [B, q or 1, V] fp32.

        Runs in forward calls of :meth:`append_block` tokens (one for a short append;
        ``hf.record_queries`` records one entry per call).
        """
        bsz, q_len = ids.shape
        if bsz != self.batch:
            raise ValueError(f"this state decodes {self.batch} rows, got {bsz}")
        block = self.append_block(model, q_len)
        outs = []
        for a in range(0, q_len, block):
            part = None if pad is None else pad[:, a : a + block]
            outs.append(self._call(model, ids[:, a : a + block], last_only, part))
        return outs[-1] if last_only or len(outs) == 1 else torch.cat(outs, dim=1)

    def _call(
        self, model: Any, ids: torch.Tensor, last_only: bool, pad: torch.Tensor | None
    ) -> torch.Tensor:
        """One forward call of ids [B, q]: logits [B, q or 1, V] fp32."""
        dev = model.device
        bsz, q_len = ids.shape
        padm = (
            torch.zeros(bsz, q_len, dtype=torch.bool, device=dev)
            if pad is None
            else pad.to(dev, torch.bool)
        )
        real = (~padm).long()
        pos = self.logical_length + self._num_real[:, None] + torch.cumsum(real, 1) - real
        cols = torch.cat([self._pad, padm], dim=1)  # [B, n + q]
        zero = torch.zeros(bsz, 1, cols.shape[1], dtype=model.dtype, device=dev)
        beta = zero.masked_fill(cols[:, None], float("-inf"))
        mask = attention_bias(beta, q_len, causal_offset=self.num_new)  # [B, 1, q, n + q]
        with use_attention(model, _SHARED, shared_prefix_attention):
            out = model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=pos,
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=1 if last_only else 0,
                shared_prefix=self,
            )
        self._pad = cols
        self._num_real = self._num_real + real.sum(1)
        return out.logits.float()

"""Run token sequences after a prefix one decoder layer at a time (on-policy compaction).

Shape legend: T prefix tokens (logical length), S prefix slots of one layer, n_j tokens of
sequence j, H_q / H_kv query / KV heads, D head dim.

On-policy compaction fits layer l to the queries that the continuations produce when the
layers before l already read the compacted prefix. Re-running every continuation through
the whole model once per layer costs L forwards; a :class:`LayerStream` keeps each
sequence's hidden state between layers instead, so the whole on-policy sweep costs one
forward of the continuations, the same as off-policy query collection::

    stream = LayerStream(model, T, sequences)
    for l in range(L):
        queries = stream.queries()        # layer l's, layers < l having read what advance() got
        k, v, beta = compact(l, queries)  # layer l's prefix slots [H_kv, S, D] / [H_kv, S]
        stream.advance(k, v, beta)        # run layer l over them

The prefix's own keys and values never change (its tokens attend only to the prefix), so
only the continuations run. Llama-like decoder stacks (``model.model.layers``) only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from compactor.hf.decode import _use_gqa_sdpa, heads_share_bias, prefix_mask
from compactor.hf.model import model_info, post_rope_queries

__all__ = ["LayerStream"]


class _PrefixKV:
    """The cache one decoder layer's attention appends to: prefix slots, then the tokens so far.

    Implements the one method transformers' attention modules call, ``update``.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys, values  # [1, H_kv, S + appended, D]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys = torch.cat([self.keys, key_states], dim=2)
        self.values = torch.cat([self.values, value_states], dim=2)
        return self.keys, self.values


class LayerStream:
    """Hidden states of `sequences` appended after a T-token prefix, advanced layer by layer.

    Args:
        model: a loaded llama-like causal LM (``compactor.hf.load_model``).
        logical_length: T; every sequence starts at position T.
        sequences: token id lists, each run independently after the prefix.
        block: tokens per attention call in :meth:`advance` (bounds the mask to
            [H_q, block, S + n_j] floats).
    Mutates: :meth:`advance` replaces the hidden states and moves to the next layer.
    """

    def __init__(
        self,
        model: Any,
        logical_length: int,
        sequences: Sequence[Sequence[int]],
        block: int = 512,
    ) -> None:
        if logical_length < 1:
            raise ValueError(f"logical_length must be >= 1, got {logical_length}")
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        self.model, self.info, self.block = model, model_info(model), block
        self.layer = 0
        self._hidden: list[torch.Tensor] = []  # [1, n_j, hidden]
        self._rope: list[tuple[torch.Tensor, torch.Tensor]] = []
        dev = model.device
        with torch.inference_mode():
            for j, seq in enumerate(sequences):
                ids = torch.as_tensor(list(seq), dtype=torch.long, device=dev).reshape(1, -1)
                if ids.shape[1] < 1:
                    raise ValueError(f"sequence {j} is empty")
                h = model.model.embed_tokens(ids)
                pos = torch.arange(logical_length, logical_length + ids.shape[1], device=dev)
                self._hidden.append(h)
                self._rope.append(model.model.rotary_emb(h, position_ids=pos[None]))

    def _check_layer(self) -> Any:
        if self.layer >= self.info.num_layers:
            raise ValueError(f"the stream is past the last layer ({self.info.num_layers})")
        return self.model.model.layers[self.layer]

    @torch.inference_mode()
    def queries(self) -> list[torch.Tensor]:
        """Post-RoPE queries of the current layer, one [H_q, n_j, D] per sequence."""
        dec = self._check_layer()
        return [
            post_rope_queries(dec.self_attn, dec.input_layernorm(h), rope)[0]
            for h, rope in zip(self._hidden, self._rope)
        ]

    @torch.inference_mode()
    def advance(self, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor) -> None:
        """Run the current layer with prefix slots keys/values [H_kv, S, D], beta `bias` [H_kv, S].

        Padding slots carry beta -inf. Each sequence attends to the prefix slots and causally
        to itself, in blocks of `block` tokens. The inputs are moved to the model's device
        (no-op when there); one host sync per call (whether the heads share beta).
        """
        dec = self._check_layer()
        hkv = self.info.num_kv_heads
        if keys.dim() != 3 or keys.shape != values.shape or keys.shape[0] != hkv:
            raise ValueError(
                f"keys/values must be [H_kv={hkv}, S, D], got {tuple(keys.shape)}/"
                f"{tuple(values.shape)}"
            )
        if bias.shape != keys.shape[:2]:
            raise ValueError(
                f"bias must be [H_kv, S]={tuple(keys.shape[:2])}, got {tuple(bias.shape)}"
            )
        dt, dev = self.model.dtype, self.model.device
        k, v, b = keys[None].to(dev, dt), values[None].to(dev, dt), bias.to(dev).float()
        uniform = heads_share_bias(b)
        with _use_gqa_sdpa(self.model):
            for j, (h, (cos, sin)) in enumerate(zip(self._hidden, self._rope)):
                cache, outs = _PrefixKV(k, v), []
                for a in range(0, h.shape[1], self.block):
                    e = min(a + self.block, h.shape[1])
                    mask = prefix_mask(b, a, e - a, self.info.num_q_heads, dt, uniform)
                    out = dec(
                        h[:, a:e],
                        attention_mask=mask,
                        position_embeddings=(cos[:, a:e], sin[:, a:e]),
                        past_key_values=cache,
                        use_cache=True,
                    )
                    outs.append(out[0] if isinstance(out, tuple) else out)
                self._hidden[j] = torch.cat(outs, dim=1)
        self.layer += 1

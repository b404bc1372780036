"""Batched decoding after one shared prefix whose keys and values are held once.

Shape legend: T prefix tokens (logical length), S prefix slots per head, B rows, n tokens
every row has appended so far (its padding included), q tokens one call appends, H_q / H_kv
query / KV heads, G = H_q // H_kv, D head dim, V vocabulary, R = B*G*q query rows per KV head.

The prefix's keys / values [H_kv, S, D] and beta [H_kv, S] of each layer are shared by all
rows, never expanded or copied per row; the transformers ``DynamicCache`` of a batch holds
only the rows' own tokens, [B, H_kv, n, D] per layer. Each attention layer computes two
partial results with :func:`compaction_kernels.biased_attention.reference.biased_attention`
(``biased_attention_lse``, fp32) and merges them by their log-sum-exp
(:func:`compaction_kernels.merge_state.reference.merge_state`):

1. every row's queries against the prefix, beta as the logit bias (-inf on padding slots);
   the rows and the G query heads of a KV head are folded into one query dim
   ``[H_kv, R, D]``, so the prefix broadcasts over them as it is;
2. each row's queries against its own tokens: causal, its padding masked (a float mask
   ``[B, 1, q, n + q]`` given to the model, the same for every layer).

A row's real tokens get the logical positions T + (real tokens the row already has), ...

With a ``capacity`` N (the number of tokens a row will ever append, known up front by
``hf.batched_generate``) the rows' cache is static instead (:class:`_StaticRows`: [B, H_kv,
N, D] per layer, written in place, the unwritten columns masked): every call then has the
same shapes, nothing grows per token, and :meth:`SharedPrefixRows.greedy` runs the decode
steps as one step function over device state only (no host sync, no Python value that
changes per step), which on CUDA is captured once as a CUDA graph and replayed per token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from compaction_kernels.biased_attention.reference import attention_bias, biased_attention_lse
from compaction_kernels.merge_state.reference import merge_state
from compactor.hf.model import model_info, use_attention

__all__ = ["SharedPrefixRows", "shared_prefix_attention"]

_SHARED = "compactor_shared_prefix"
# Bytes of fp32 logits one prefix attention call makes ([H_kv, rows, S]): the R query rows
# of a layer run in blocks of at most this many (bounded memory, cache-sized passes on the
# CPU; on an accelerator PREFIX_LOGITS_BYTES_ACCEL, so that a prompt's rows take a few
# large calls instead of one small call per 16 rows).
PREFIX_LOGITS_BYTES = 16 << 20
PREFIX_LOGITS_BYTES_ACCEL = 1 << 30
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
    budget = PREFIX_LOGITS_BYTES if query.device.type == "cpu" else PREFIX_LOGITS_BYTES_ACCEL
    step = max(1, budget // (4 * hkv * max(1, s)))
    if step < rows.shape[1]:  # several blocks: convert the prefix to fp32 once, not per block
        pk, pv = pk.float(), pv.float()
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


class _StaticRows:
    """The rows' own tokens in fixed buffers: keys / values [B, H_kv, N, D] per layer.

    Implements the one cache method transformers' attention modules call, ``update``: it
    writes the call's tokens at the columns ``write_at`` [q] (a device tensor, set by the
    caller before each forward) and returns the whole buffers (unwritten columns are
    masked by the caller). Mutated by ``update`` and by the caller's ``write_at``.
    """

    def __init__(self, layers: int, batch: int, heads: int, capacity: int, dim: int, model: Any):
        dev, dt = model.device, model.dtype
        shape = (batch, heads, capacity, dim)
        self.keys = [torch.zeros(shape, dtype=dt, device=dev) for _ in range(layers)]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.write_at = torch.zeros(0, dtype=torch.long, device=dev)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k.index_copy_(2, self.write_at, key_states.to(k.dtype))
        v.index_copy_(2, self.write_at, value_states.to(v.dtype))
        return k, v


class SharedPrefixRows:
    """B rows decoding after one shared prefix: one growing batch of sequences.

    Attributes:
        keys / values: per layer [H_kv, S, D] on the model's device in its dtype (the
            caller's tensors, not copied, when already there).
        bias: [L, H_kv, S] fp32 beta (-inf on padding slots).
        logical_length: T.
        capacity: N, the most tokens a row may append (None: unbounded).
        cache: the rows' own tokens only: a ``DynamicCache`` [B, H_kv, n, D] per layer, or
            with a capacity a :class:`_StaticRows` [B, H_kv, N, D] per layer.
    The padding and real-token counts per row live on the model's device, so appending
    never waits for the device.
    Mutates: :meth:`forward` and :meth:`greedy` append to `cache` and the bookkeeping.
    """

    def __init__(
        self,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        bias: torch.Tensor,
        logical_length: int,
        batch: int,
        model: Any,
        capacity: int | None = None,
    ) -> None:
        from transformers import DynamicCache

        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity must be None or >= 1, got {capacity}")
        dev, dt = model.device, model.dtype
        self.keys = [k.to(dev, dt) for k in keys]
        self.values = [v.to(dev, dt) for v in values]
        self.bias = bias.to(dev, torch.float32)
        self.logical_length, self.batch = int(logical_length), int(batch)
        self.capacity = capacity
        self.cache: Any = DynamicCache()
        width = 0
        if capacity is not None:
            hkv, _, d = self.keys[0].shape
            self.cache = _StaticRows(len(self.keys), batch, hkv, capacity, d, model)
            width = capacity
        # [B, n] (static: [B, N]) True = padding (static: or not written yet)
        self._pad = torch.ones(batch, width, dtype=torch.bool, device=dev)
        self._n = 0  # columns appended so far (padding included)
        self._cur = torch.zeros(1, dtype=torch.long, device=dev)  # static: _n on the device
        self._num_real = torch.zeros(batch, dtype=torch.long, device=dev)  # [B]

    def layer(self, idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer `idx`'s prefix: keys [H_kv, S, D], values [H_kv, S, D], beta [H_kv, S]."""
        return self.keys[idx], self.values[idx], self.bias[idx]

    @property
    def num_new(self) -> int:
        """n, tokens every row has appended (padding included)."""
        return self._n

    def append_block(self, model: Any, q_len: int) -> int:
        """Tokens per forward call when appending `q_len`: all of them when the logits over
        the rows' own tokens [B, H_q, q_len, n + q_len] fp32 fit in TAIL_LOGITS_BYTES, else
        the most that do (at least 1). With a capacity, n + q_len is N."""
        cols = self.capacity if self.capacity is not None else self.num_new + q_len
        per_token = 4 * self.batch * model_info(model).num_q_heads * cols
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
        ``hf.record_queries`` records one entry per call). ValueError past the capacity.
        """
        bsz, q_len = ids.shape
        if bsz != self.batch:
            raise ValueError(f"this state decodes {self.batch} rows, got {bsz}")
        if self.capacity is not None and self._n + q_len > self.capacity:
            raise ValueError(f"{self._n} + {q_len} tokens exceed the capacity {self.capacity}")
        block = self.append_block(model, q_len)
        outs = []
        for a in range(0, q_len, block):
            part = None if pad is None else pad[:, a : a + block]
            outs.append(self._call(model, ids[:, a : a + block], last_only, part))
        return outs[-1] if last_only or len(outs) == 1 else torch.cat(outs, dim=1)

    @torch.inference_mode()
    def greedy(
        self,
        model: Any,
        logits: torch.Tensor,
        steps: int,
        check: Callable[[], None] | None = None,
        graph: bool = True,
    ) -> torch.Tensor:
        """Greedy tokens [B, steps] from the last logits [B, V]: the first is their argmax,
        each next one the argmax after appending the one before (steps - 1 appends).

        Needs a capacity with room for steps - 1 more tokens (ValueError otherwise). Each
        append is :meth:`_step`, which reads and writes device state only; on CUDA (with
        `graph`) it is captured once as a CUDA graph after one eager step and replayed for
        the rest (an eager loop if the capture fails). `check` is called before each append
        (it may raise to abort). Tokens stay on the device (no host sync).
        """
        if self.capacity is None or self._n + steps - 1 > self.capacity:
            raise ValueError(f"greedy: {steps - 1} appends need a capacity past {self._n}")
        tok = logits.argmax(-1, keepdim=True)  # [B, 1], the step's static input and output
        out = torch.empty(self.batch, steps, dtype=torch.long, device=tok.device)
        out[:, 0] = tok[:, 0]

        def step() -> None:
            self._step(model, tok)

        run = step
        for i in range(1, steps):
            if check is not None:
                check()
            if i == 2 and graph and tok.is_cuda:  # after one eager step (the warm-up)
                run = _captured(step) or step
            run()
            self._n += 1
            out[:, i] = tok[:, 0]
        return out

    def _step(self, model: Any, tok: torch.Tensor) -> None:
        """Append tok [B, 1] (real tokens) at column ``_cur`` and overwrite tok with the
        argmax of the new logits. Reads and writes device tensors only (graph-safe)."""
        self._pad.index_fill_(1, self._cur, False)
        self.cache.write_at = self._cur
        zero = torch.zeros(
            self.batch, 1, 1, self._pad.shape[1], dtype=model.dtype, device=tok.device
        )
        mask = zero.masked_fill(self._pad[:, None, None], float("-inf"))  # [B, 1, 1, N]
        pos = self.logical_length + self._num_real[:, None]
        logits = self._model(model, tok, mask, pos, True)
        tok.copy_(logits[:, -1].argmax(-1, keepdim=True))
        self._num_real.add_(1)
        self._cur.add_(1)

    def _model(
        self, model: Any, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, last_only: bool
    ) -> torch.Tensor:
        """The model over ids [B, q] with the rows' mask and positions: logits fp32."""
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
        return out.logits.float()

    def _call(
        self, model: Any, ids: torch.Tensor, last_only: bool, pad: torch.Tensor | None
    ) -> torch.Tensor:
        """One forward call of ids [B, q]: logits [B, q or 1, V] fp32."""
        dev = model.device
        bsz, q_len = ids.shape
        n = self._n
        padm = (
            torch.zeros(bsz, q_len, dtype=torch.bool, device=dev)
            if pad is None
            else pad.to(dev, torch.bool)
        )
        real = (~padm).long()
        pos = self.logical_length + self._num_real[:, None] + torch.cumsum(real, 1) - real
        if self.capacity is None:
            self._pad = torch.cat([self._pad, padm], dim=1)  # [B, n + q]
        else:
            self._pad[:, n : n + q_len] = padm  # [B, N]: the later columns stay masked
            self.cache.write_at = torch.arange(n, n + q_len, device=dev)
        zero = torch.zeros(bsz, 1, self._pad.shape[1], dtype=model.dtype, device=dev)
        beta = zero.masked_fill(self._pad[:, None], float("-inf"))
        mask = attention_bias(beta, q_len, causal_offset=n)  # [B, 1, q, n + q or N]
        logits = self._model(model, ids, mask, pos, last_only)
        self._n += q_len
        self._cur.fill_(self._n)
        self._num_real = self._num_real + real.sum(1)
        return logits


def _captured(step: Callable[[], None]) -> Callable[[], None] | None:
    """`step` captured as a CUDA graph (its work is recorded, not run), as a replay
    function; None when the capture fails (then nothing was run either)."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            step()
    except Exception:  # any capture failure: run the step eagerly instead
        return None
    return graph.replay

"""Decoding after a (full or compacted) prefix in transformers.

Shape legend: T prefix tokens (logical length), S cache slots per head of the prefix (T for
a full prefix, max t_h over all layers and heads for a compacted one), L layers, B rows,
H_q / H_kv query / KV heads, D head dim, V vocabulary.

The prefix is S slots per KV head and layer (ragged heads padded with beta = -inf, layers
padded to the same S); new tokens get the *logical* positions ``T, T+1, ...`` whatever S is.
Two ways to append, by the shape of the tokens:

- one sequence (ids [q]): the sequence's cache starts with the S prefix slots, and the
  per-slot beta enters SDPA as a float 4-D attention mask ``[1, H_q or 1, q_len, S + past +
  q_len]`` (beta on the prefix columns, 0 on earlier new tokens, 0/-inf causal on the
  current ones; one mask per layer, swapped in by a pre-hook): one fused SDPA call per
  layer, also for long appends (query collection).
- a batch (ids [B, q], e.g. the answers to several follow-ups): the prefix is held once and
  every row's cache holds only its own tokens (:mod:`compactor.hf.shared_prefix`: attention
  over the shared prefix and over the row's tokens, merged by log-sum-exp).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from compaction_kernels.biased_attention.reference import attention_bias, biased_attention
from compactor.hf.model import PrefillResult, _attn_modules, model_info, use_attention
from compactor.hf.shared_prefix import SharedPrefixRows
from compactor.types import CompactedPrefix

_GQA_SDPA = "compactor_gqa_sdpa"
# Largest attention mask one forward call of a one-sequence PrefixState.forward builds
# (bytes): a longer append (a repeat-prefill continuation of a long prefix) runs in blocks
# of tokens whose [1, H_q or 1, block, S + past + block] float mask fits. Appends under it
# run in one call.
APPEND_MASK_BYTES = 256 << 20


def _gqa_sdpa(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Biased attention (SDPA, GQA inside the kernel: no repeat_kv copy of the cache).

    query [B, H_q, q, D], key/value [B, H_kv, kv, D], float mask [B, 1|H_q, q, kv] (beta,
    padding and causal tail, from :func:`prefix_mask`) -> output [B, q, H_q, D] (the layout
    transformers' attention functions return). A layout adapter over
    :func:`compaction_kernels.biased_attention.reference.biased_attention`.
    """
    out = biased_attention(query, key, value, sm_scale=scaling, bias=attention_mask)
    return out.transpose(1, 2).contiguous(), None


@contextmanager
def _use_gqa_sdpa(model: Any) -> Iterator[None]:
    """Run `model`'s attention through :func:`_gqa_sdpa` inside the block (restored after)."""
    with use_attention(model, _GQA_SDPA, _gqa_sdpa):
        yield


def prefix_mask(
    bias: torch.Tensor,
    num_new: int,
    q_len: int,
    num_q_heads: int,
    dtype: torch.dtype,
    uniform: bool | None = None,
) -> torch.Tensor:
    """One layer's float SDPA mask [1, H_q or 1, q_len, S + num_new + q_len], on bias's device.

    Columns: the prefix slots get their beta `bias` [H_kv, S] (-inf = padding), the
    `num_new` tokens appended earlier 0, the current `q_len` tokens 0/-inf causal. The head
    dim is 1 (broadcast) when every KV head has the same beta; `uniform` says whether they
    do (None: checked here, a host sync when bias is on an accelerator).
    """
    hkv, s = bias.shape
    if uniform is None:
        uniform = heads_share_bias(bias)
    # beta on the prefix slots, 0 on the appended tokens; the current ones sit at s + num_new
    cols = torch.nn.functional.pad(bias[:1] if uniform else bias, (0, num_new + q_len))
    group = 1 if uniform else num_q_heads // hkv
    mask = attention_bias(cols, q_len, group=group, causal_offset=s + num_new, dtype=dtype)
    return mask.unsqueeze(0)


def heads_share_bias(bias: torch.Tensor) -> bool:
    """True when every KV head of `bias` [H_kv, S] has the same beta (one host sync)."""
    return bool((bias == bias[:1]).all())


class PrefixState:
    """A (full or compacted) prefix to decode after; one instance = one growing sequence, or
    one growing batch of rows sharing the prefix (whichever its first append is).

    Attributes:
        keys / values: per layer [H_kv, S, D] (model dtype); all layers share S.
        bias: [L, H_kv, S] fp32 beta per layer and slot (0 for a full prefix, -inf on padding).
        logical_length: T; the first new token gets position T.
    Device: keys/values are copied to the model's device when the cache is built (no copy
    when already there); one sequence's masks are built on the bias's device (moved to the
    model's if elsewhere); a batch keeps its bookkeeping on the model's device.
    Mutates: :meth:`forward` appends to this state's own cache (:meth:`fork` for a fresh copy).
    """

    def __init__(
        self,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        bias: torch.Tensor,
        logical_length: int,
    ):
        if not keys or len(keys) != len(values):
            raise ValueError(
                f"need one keys and values tensor per layer, got {len(keys)}/{len(values)}"
            )
        hkv, s = keys[0].shape[0], keys[0].shape[1]
        for i, (k, v) in enumerate(zip(keys, values)):
            if k.dim() != 3 or k.shape != v.shape or k.shape[:2] != (hkv, s):
                raise ValueError(
                    f"layer {i}: keys/values must be [H_kv={hkv}, S={s}, D], got "
                    f"{tuple(k.shape)}/{tuple(v.shape)}"
                )
        if bias.shape != (len(keys), hkv, s):
            raise ValueError(
                f"bias must be [L, H_kv, S]={(len(keys), hkv, s)}, got {tuple(bias.shape)}"
            )
        if logical_length < 1:
            raise ValueError(f"logical_length must be >= 1, got {logical_length}")
        self.keys, self.values, self.bias = keys, values, bias.float()
        self.logical_length = int(logical_length)
        self.num_new = 0  # tokens appended to the one sequence
        self._cache: Any = None  # one sequence: prefix slots + its tokens, [1, H_kv, S + n, D]
        self._rows: SharedPrefixRows | None = None  # a batch: the rows' own tokens only
        self._uniform: list[bool] | None = None  # per layer: heads share beta (lazy)

    @classmethod
    def full(cls, pre: PrefillResult) -> PrefixState:
        """The uncompacted prefix (beta = 0 everywhere)."""
        hkv, t, _ = pre.keys[0].shape
        bias = torch.zeros(len(pre.keys), hkv, t, device=pre.keys[0].device)
        return cls(list(pre.keys), list(pre.values), bias, t)

    @classmethod
    def from_compacted(
        cls,
        prefix: CompactedPrefix,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> PrefixState:
        """Pad a ragged :class:`CompactedPrefix` into S = max_{layer,h} t_h slots (beta -inf pads).

        device: where the padded tensors go (default: where the prefix's layers are).
        """
        s = max(1, max(max(layer.head_lengths()) for layer in prefix.layers))
        dt = dtype or prefix.dtype
        layers = [layer if device is None else layer.to(device) for layer in prefix.layers]
        padded = [layer.padded(s, dt) for layer in layers]
        keys = [k for k, _, _ in padded]
        values = [v for _, v, _ in padded]
        bias = torch.stack([b for _, _, b in padded])
        return cls(keys, values, bias, prefix.logical_length)

    def fork(self) -> PrefixState:
        """A fresh state over the same prefix tensors (no appended tokens)."""
        out = PrefixState(self.keys, self.values, self.bias, self.logical_length)
        out._uniform = self._uniform
        return out

    @property
    def slots(self) -> int:
        """S, cache slots per head of the prefix."""
        return int(self.keys[0].shape[1])

    def mask(self, layer: int, q_len: int, num_q_heads: int, dtype: torch.dtype) -> torch.Tensor:
        """One sequence's [1, H_q or 1, q_len, S + num_new + q_len] float mask: beta | 0 |
        causal 0/-inf. The head dim is 1 (broadcast) when every KV head of `layer` has the
        same beta. On the bias's device.
        """
        uniform = self._uniform_layers()[layer]  # once per state: one host sync
        return prefix_mask(self.bias[layer], self.num_new, q_len, num_q_heads, dtype, uniform)

    def appended_keys(self, layer: int) -> torch.Tensor:
        """The post-RoPE keys [H_kv, num_new, D] of the tokens this one sequence appended, in
        `layer` (a view of the cache). ValueError before the first append or on a batch."""
        if self._cache is None:
            raise ValueError("appended_keys: this state has appended no sequence")
        return self._cache.layers[layer].keys[0, :, self.slots :]

    def _ensure_cache(self, device: torch.device) -> Any:
        """The one sequence's cache, starting with the prefix slots [1, H_kv, S, D]."""
        if self._cache is None:
            from transformers import DynamicCache

            cache: Any = DynamicCache()
            for i, (k, v) in enumerate(zip(self.keys, self.values)):
                cache.update(k.to(device).unsqueeze(0), v.to(device).unsqueeze(0), i)
            self._cache = cache
        return self._cache

    @torch.inference_mode()
    def forward(
        self,
        model: Any,
        token_ids: Sequence[int] | torch.Tensor,
        last_only: bool = False,
        pad: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append `token_ids` and return their logits (fp32). Mutates the cache.

        `token_ids` [q] (one sequence) gives logits [q, V]; a batch [B, q] (rows share the
        prefix; `pad` [B, q] bool marks padding, e.g. left padding of unequal prompts) gives
        [B, q, V] (:class:`~compactor.hf.shared_prefix.SharedPrefixRows`: the prefix is not
        copied per row). A state appends either one sequence or one batch of B rows, never
        both. Real tokens of a row get positions T + (real tokens the row already has), ...
        With `last_only` only the last column's logits are computed (q = 1 in the output).
        One sequence: each attention module gets its own layer's mask through a forward
        pre-hook (built on the fly, so a long append never holds L masks at once); an append
        whose mask would exceed APPEND_MASK_BYTES runs as several forward calls of
        :meth:`append_block` tokens each (``hf.record_queries`` then records one entry per
        call; the logits are the same up to float rounding).
        """
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=model.device)
        batched = ids.dim() == 2
        ids = ids.reshape(1, -1) if not batched else ids
        bsz, q_len = ids.shape
        if q_len < 1:
            raise ValueError("forward: no tokens")
        if pad is not None and (not batched or pad.shape != ids.shape):
            raise ValueError(f"pad must be [B, q]={tuple(ids.shape)}, got {tuple(pad.shape)}")
        self._check_model(model)
        if batched:
            if self._cache is not None:
                raise ValueError("this state decodes one sequence, got a batch")
            if self._rows is None:
                t = self.logical_length
                self._rows = SharedPrefixRows(self.keys, self.values, self.bias, t, bsz, model)
            return self._rows.forward(model, ids, last_only, pad)
        if self._rows is not None:
            raise ValueError(f"this state decodes {self._rows.batch} rows, got one sequence")
        block = self.append_block(model, q_len)
        outs = []
        for a in range(0, q_len, block):
            outs.append(self._forward_call(model, ids[:, a : a + block], last_only))
        logits = outs[-1] if last_only or len(outs) == 1 else torch.cat(outs, dim=1)
        return logits[0]

    def append_block(self, model: Any, q_len: int) -> int:
        """Tokens per forward call for appending `q_len` tokens to the one sequence: all of
        them when the call's float mask [1, H_q or 1, q_len, S + past + q_len] fits in
        APPEND_MASK_BYTES, else the most whose mask does (at least 1).

        A per-head mask (heads with different beta) is counted with H_q heads whatever the
        layer.
        """
        cols = self.slots + self.num_new + q_len
        per_token = 4 * model_info(model).num_q_heads * cols
        if per_token * q_len <= APPEND_MASK_BYTES:  # fits even per head: no sync needed
            return q_len
        if all(self._uniform_layers()):
            per_token = 4 * cols
        return (
            q_len
            if per_token * q_len <= APPEND_MASK_BYTES
            else max(1, APPEND_MASK_BYTES // per_token)
        )

    def start_rows(self, model: Any, batch: int, capacity: int | None) -> SharedPrefixRows:
        """Make this fresh state decode a batch of `batch` rows sharing the prefix, each
        appending at most `capacity` tokens (a static cache; None: unbounded), and return
        it; :meth:`forward` with ids [batch, q] then appends to it. ValueError when this
        state has appended anything already."""
        if self._cache is not None or self._rows is not None:
            raise ValueError("start_rows needs a fresh state (PrefixState.fork())")
        self._check_model(model)
        t = self.logical_length
        self._rows = SharedPrefixRows(self.keys, self.values, self.bias, t, batch, model, capacity)
        return self._rows

    def _uniform_layers(self) -> list[bool]:
        """Per layer: whether every KV head has the same beta (computed once: one host sync)."""
        if self._uniform is None:
            flat = self.bias.flatten(2)
            self._uniform = (flat == flat[:, :1]).flatten(1).all(-1).tolist()
        return self._uniform

    def _check_model(self, model: Any) -> None:
        info = model_info(model)
        if (info.num_layers, info.num_kv_heads) != tuple(self.bias.shape[:2]):
            raise ValueError(
                f"prefix has {self.bias.shape[0]} layers x {self.bias.shape[1]} KV heads, model has "
                f"{info.num_layers} x {info.num_kv_heads}"
            )

    def _forward_call(self, model: Any, ids: torch.Tensor, last_only: bool) -> torch.Tensor:
        """One forward call of the one sequence, ids [1, q]: logits [1, q or 1, V] fp32."""
        dev, dt = model.device, model.dtype
        q_len = ids.shape[1]
        hq = model_info(model).num_q_heads
        cache = self._ensure_cache(dev)
        pos = torch.arange(q_len, device=dev)[None] + self.logical_length + self.num_new

        def make_hook(li: int) -> Any:
            def hook(_m: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
                kwargs["attention_mask"] = self.mask(li, q_len, hq, dt).to(dev)
                return args, kwargs

            return hook

        mods = _attn_modules(model)
        handles = [
            m.register_forward_pre_hook(make_hook(i), with_kwargs=True) for i, m in enumerate(mods)
        ]
        try:
            first = self.mask(0, q_len, hq, dt).to(dev)
            with _use_gqa_sdpa(model):
                out = model(
                    input_ids=ids,
                    attention_mask=first,
                    position_ids=pos,
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1 if last_only else 0,
                )
        finally:
            for h in handles:
                h.remove()
        self.num_new += q_len
        return out.logits.float()

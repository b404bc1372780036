"""`CompactionTorchNativeBackend`: SGLang's torch_native attention plus per-slot beta.

Once per forward (`init_forward_metadata`) the backend looks at each request's KV row
`req_to_token[row, :n]`: if none of its slots is compacted (`BetaStore.compacted`), the request
takes the stock SDPA code path, unchanged. Otherwise its row is a compacted node's T entries
(t_max physical slots, then T - t_max aliases of `ALIAS_SLOT`) and then its own tail;
`physical_entries` drops the aliases once, and every layer attends only the m = n - (T - t_max)
entries left, with beta [L, S, H_kv] of their slots added to the logits (-inf masks a head's
padding) and the causal mask of the new tokens, which are the last q of them. Keys are stored
after RoPE, so which entries are read does not move anyone's position: the new tokens keep
their logical positions (T + ...), which SGLang computes from the row and seq_lens. The work
per layer scales with t_max + the tail, not with T.

Legend: q new tokens of one request, n = seq_len KV entries of its row, m entries it reads,
T / t_max logical / physical length of a compacted prefix, H_q / H_kv heads, D head dim.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

from sglang_ext.kv_store import ALIAS_SLOT, BetaStore
from sglang_ext.sdpa import biased_sdpa

__all__ = ["CompactionTorchNativeBackend", "biased_sdpa", "create_backend", "physical_entries"]


def physical_entries(row: torch.Tensor, alias_slot: int = ALIAS_SLOT) -> torch.Tensor:
    """The slots of a compacted request's KV row its attention reads: all but the aliases.

    Args:
        row: [n] int slot ids, `req_to_token[r, :n]`.
        alias_slot: the slot aliases point at (SGLang's padding slot, never a token's).
    Returns:
        [m] int64, the row's other slots in row order (its t_max physical slots, then its tail).
    """
    row = row.to(torch.int64)
    return row[row != alias_slot]


class CompactionTorchNativeBackend(TorchNativeAttnBackend):
    """torch_native + beta for requests whose KV rows touch compacted slots.

    `reads` [per request of the forward]: the [m] int64 slots a compacted request attends
    (`physical_entries` of its row), None for a request on the stock path.
    """

    def __init__(self, model_runner: Any):
        super().__init__(model_runner)
        self.beta_store = BetaStore.for_pool(self.token_to_kv_pool)
        self.reads: list[torch.Tensor | None] = []
        self._layer = 0

    def init_forward_metadata(self, forward_batch: Any) -> None:
        """Plan the forward: which requests are compacted and what they read (sets `reads`)."""
        super().init_forward_metadata(forward_batch)
        store = self.beta_store
        self.reads = []
        if not store.alias_ready or forward_batch.seq_lens is None:
            return
        r2t = self.req_to_token_pool.req_to_token
        for row, seq_len in zip(
            forward_batch.req_pool_indices.tolist(), forward_batch.seq_lens.tolist()
        ):
            slots = r2t[row, :seq_len].to(torch.int64)
            self.reads.append(physical_entries(slots) if store.touches(slots) else None)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):  # type: ignore[no-untyped-def]
        self._layer = layer.layer_id - self.token_to_kv_pool.start_layer
        return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):  # type: ignore[no-untyped-def]
        self._layer = layer.layer_id - self.token_to_kv_pool.start_layer
        return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)

    def _run_sdpa_forward_extend(self, *args: Any, **kwargs: Any) -> Any:
        stock = super()._run_sdpa_forward_extend
        if all(r is None for r in self.reads):
            return stock(*args, **kwargs)
        return self._run_mixed(stock, False, *args, **kwargs)

    def _run_sdpa_forward_decode(self, *args: Any, **kwargs: Any) -> Any:
        stock = super()._run_sdpa_forward_decode
        if all(r is None for r in self.reads):
            return stock(*args, **kwargs)
        return self._run_mixed(stock, True, *args, **kwargs)

    def _run_mixed(
        self,
        stock: Any,
        decode: bool,
        query: torch.Tensor,
        output: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        *rest: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Per request: biased SDPA over its `reads` if compacted, else the stock code.

        query/output [tokens, H_q, D], k_cache/v_cache [S, H_kv, D]; mutates `output`.
        """
        n_extra = 0 if decode else 2
        encoder_lens = rest[n_extra] if len(rest) > n_extra else kwargs.get("encoder_lens")
        if encoder_lens is not None or kwargs.get("sliding_window_size") is not None:
            raise ValueError(
                "compacted prefixes support neither encoder nor sliding-window attention"
            )
        q_lens = [1] * seq_lens.shape[0] if decode else rest[1].tolist()
        scale = kwargs.get("scaling")
        start = 0
        for i, slots in enumerate(self.reads):
            end = start + q_lens[i]
            if slots is None:
                per_req = [x[i : i + 1] for x in rest[:n_extra]]
                stock(
                    query[start:end], output[start:end], k_cache, v_cache, req_to_token,
                    req_pool_indices[i : i + 1], seq_lens[i : i + 1], *per_req, None, **kwargs,
                )  # fmt: skip
            else:  # the new tokens are the last q of the m entries read
                q = query[start:end].movedim(0, 1)  # [H_q, q, D]
                k = k_cache[slots].movedim(0, 1).to(q.dtype)  # [H_kv, m, D]
                v = v_cache[slots].movedim(0, 1).to(q.dtype)
                beta = self.beta_store.beta[self._layer, slots]  # [m, H_kv]
                out = biased_sdpa(q, k, v, beta, slots.numel() - (end - start), scale)
                output[start:end] = out.movedim(0, 1)
            start = end
        return output


def create_backend(runner: Any) -> CompactionTorchNativeBackend:
    """Factory for `register_attention_backend` (lazy import keeps the plugin light)."""
    return CompactionTorchNativeBackend(runner)

"""`CompactionTorchNativeBackend`: SGLang's torch_native attention plus per-slot beta.

For each request the backend gathers the slots of its KV row (as torch_native does); if none
of them is compacted (`BetaStore.compacted`), the request takes the stock SDPA code path,
unchanged. Otherwise the logits get a float mask: beta [L, S, H_kv] of the row's slots,
expanded to the query heads, plus the causal mask of the new tokens. Aliased entries have
beta = -inf and drop out; positions are the row positions, so they continue at T.

Legend: q new tokens of one request, n = seq_len KV entries, H_q / H_kv heads, D head dim.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

from sglang_ext.kv_store import BetaStore
from sglang_ext.sdpa import biased_sdpa

__all__ = ["CompactionTorchNativeBackend", "biased_sdpa", "create_backend"]


class CompactionTorchNativeBackend(TorchNativeAttnBackend):
    """torch_native + beta for requests whose KV rows touch compacted slots."""

    def __init__(self, model_runner: Any):
        super().__init__(model_runner)
        self.beta_store = BetaStore.for_pool(self.token_to_kv_pool)
        self._biased: list[bool] = []
        self._layer = 0

    def init_forward_metadata(self, forward_batch: Any) -> None:
        super().init_forward_metadata(forward_batch)
        store = self.beta_store
        self._biased = []
        if not store.alias_ready or forward_batch.seq_lens is None:
            return
        r2t = self.req_to_token_pool.req_to_token
        for row, seq_len in zip(
            forward_batch.req_pool_indices.tolist(), forward_batch.seq_lens.tolist()
        ):
            self._biased.append(store.touches(r2t[row, :seq_len].to(torch.int64)))

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):  # type: ignore[no-untyped-def]
        self._layer = layer.layer_id - self.token_to_kv_pool.start_layer
        return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):  # type: ignore[no-untyped-def]
        self._layer = layer.layer_id - self.token_to_kv_pool.start_layer
        return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)

    def _run_sdpa_forward_extend(self, *args: Any, **kwargs: Any) -> Any:
        stock = super()._run_sdpa_forward_extend
        if not any(self._biased):
            return stock(*args, **kwargs)
        return self._run_mixed(stock, False, *args, **kwargs)

    def _run_sdpa_forward_decode(self, *args: Any, **kwargs: Any) -> Any:
        stock = super()._run_sdpa_forward_decode
        if not any(self._biased):
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
        """Per request: biased SDPA if its row touches compacted slots, else the stock code.

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
        for i, (row, n) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
            end = start + q_lens[i]
            if not self._biased[i]:
                per_req = [x[i : i + 1] for x in rest[:n_extra]]
                stock(
                    query[start:end], output[start:end], k_cache, v_cache, req_to_token,
                    req_pool_indices[i : i + 1], seq_lens[i : i + 1], *per_req, None, **kwargs,
                )  # fmt: skip
            else:
                slots = req_to_token[row, :n].to(torch.int64)
                q = query[start:end].movedim(0, 1)  # [H_q, q, D]
                k = k_cache[slots].movedim(0, 1).to(q.dtype)  # [H_kv, n, D]
                v = v_cache[slots].movedim(0, 1).to(q.dtype)
                beta = self.beta_store.beta[self._layer, slots]  # [n, H_kv]
                out = biased_sdpa(q, k, v, beta, n - (end - start), scale)
                output[start:end] = out.movedim(0, 1)
            start = end
        return output


def create_backend(runner: Any) -> CompactionTorchNativeBackend:
    """Factory for `register_attention_backend` (lazy import keeps the plugin light)."""
    return CompactionTorchNativeBackend(runner)

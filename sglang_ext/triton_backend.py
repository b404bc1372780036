"""`CompactionTritonBackend`: SGLang's Triton attention plus per-slot beta, for GPUs.

`init_forward_metadata` runs the stock metadata, then checks once per batch whether any
request's KV row touches a compacted slot (`BetaStore.touches`). If none does, every layer
takes the stock `forward_extend` / `forward_decode`, unchanged. Otherwise each layer writes
the new K/V into the pool as the stock code does and computes the whole batch with
`attention_triton.run_batch` over beta [S, H_kv] of that layer: ordinary slots have beta 0,
so one call serves mixed batches. Slot tables are planned once per batch (per logit scale
and head shape).

CUDA graphs would replay the stock kernels, so `server_args.apply_to_server_args` disables them
when it selects this backend. Legend: n new tokens, H_q / H_kv heads, D head dim, S slots.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from sglang_ext.attention_triton import BatchPlan, plan_batch, row_slots, run_batch
from sglang_ext.kv_store import BetaStore

__all__ = ["CompactionTritonBackend"]

_KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class _Batch:
    """Host copies of a batch that touches compacted slots, and its plans by (scale, heads)."""

    def __init__(self, rows: torch.Tensor, seq_lens: torch.Tensor, q_lens: torch.Tensor):
        self.rows, self.seq_lens, self.q_lens = rows, seq_lens, q_lens
        self.plans: dict[tuple[Any, ...], BatchPlan] = {}


class CompactionTritonBackend(TritonAttnBackend):
    """Triton attention + beta for batches whose KV rows touch compacted slots.

    Raises:
        ValueError: at construction for MLA, decode context parallelism or a KV cache
            dtype the kernels do not read (fp8); at a biased forward for encoder, cross,
            sliding-window, bidirectional, soft-capped or sink attention.
    """

    def __init__(self, model_runner: Any):
        super().__init__(model_runner)
        self._setup()

    def _setup(self) -> None:
        pool = self.token_to_kv_pool
        dtype = pool.get_key_buffer(pool.start_layer).dtype
        if self.use_mla or self.dcp_size > 1 or dtype not in _KV_DTYPES:
            raise ValueError(
                "compacted prefixes on the Triton backend need plain MHA/GQA with an fp16/bf16/"
                f"fp32 KV cache; got mla={self.use_mla} dcp_size={self.dcp_size} kv dtype={dtype}"
            )
        self.beta_store = BetaStore.for_pool(pool)
        self._batch: _Batch | None = None

    def init_forward_metadata(self, forward_batch: Any) -> None:
        super().init_forward_metadata(forward_batch)
        self._batch = self._biased_batch(forward_batch)

    def _biased_batch(self, fb: Any) -> _Batch | None:
        """A `_Batch` when some request's row [0, seq_len) touches a compacted slot."""
        if not self.beta_store.alias_ready or fb.seq_lens is None or fb.seq_lens.numel() == 0:
            return None
        rows, lens = (_host(fb, name) for name in ("req_pool_indices", "seq_lens"))
        if not self.beta_store.touches(row_slots(self.req_to_token, rows, lens)):
            return None
        mode = fb.forward_mode
        if mode.is_decode():
            q_lens = torch.ones_like(lens)
        elif mode.is_extend() and not (mode.is_target_verify() or mode.is_dllm_extend()):
            ext = getattr(fb, "extend_seq_lens_cpu", None)
            q_lens = torch.tensor(ext) if ext is not None else fb.extend_seq_lens.cpu()
        else:
            raise ValueError(f"compacted prefixes do not support forward mode {mode!r}")
        return _Batch(rows, lens, q_lens.long())

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):  # type: ignore[no-untyped-def]
        if self._batch is None:
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        return self._forward_biased(
            self._batch, q, k, v, layer, forward_batch, save_kv_cache, kwargs
        )

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):  # type: ignore[no-untyped-def]
        if self._batch is None:
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        return self._forward_biased(
            self._batch, q, k, v, layer, forward_batch, save_kv_cache, kwargs
        )

    def _forward_biased(
        self,
        batch: _Batch,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: Any,
        forward_batch: Any,
        save_kv_cache: bool,
        extras: dict[str, Any],
    ) -> torch.Tensor:
        """Save K/V like the stock code, then biased attention for the whole batch.

        q [n, H_q * D] (or [n, H_q, D]); returns [n, H_q * D]. Mutates the KV pool.
        """
        _check_layer(layer, forward_batch, extras)
        if save_kv_cache and k is not None and v is not None:
            loc = KVWriteLoc.for_batch(
                forward_batch, swa_loc=self.forward_metadata.swa_out_cache_loc
            )
            self._set_kv_buffer(forward_batch, layer, loc, k, v)
        h_q, h_kv, dim = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
        key = (layer.scaling, h_q, h_kv, dim)
        plan = batch.plans.get(key)
        if plan is None:
            plan = plan_batch(
                self.req_to_token, batch.rows, batch.seq_lens, batch.q_lens,
                num_qo_heads=h_q, num_kv_heads=h_kv, head_dim=dim, sm_scale=layer.scaling,
            )  # fmt: skip
            batch.plans[key] = plan
        pool = self.token_to_kv_pool
        beta = self.beta_store.beta[layer.layer_id - pool.start_layer]  # [S, H_kv]
        out = run_batch(
            plan, q.reshape(-1, h_q, dim), pool.get_key_buffer(layer.layer_id),
            pool.get_value_buffer(layer.layer_id), beta,
        )  # fmt: skip
        return out.reshape(-1, h_q * dim)


def _host(forward_batch: Any, name: str) -> torch.Tensor:
    """`forward_batch.<name>` as a host int64 tensor, from its `<name>_cpu` copy if it has one."""
    cpu = getattr(forward_batch, f"{name}_cpu", None)
    return (cpu if cpu is not None else getattr(forward_batch, name)).cpu().long()


def _check_layer(layer: Any, forward_batch: Any, extras: dict[str, Any]) -> None:
    """ValueError for the attention variants the biased kernels do not implement."""
    problems = [
        name
        for name, bad in (
            ("encoder", forward_batch.encoder_lens is not None),
            ("cross attention", bool(layer.is_cross_attention)),
            ("sliding window", (layer.sliding_window_size or -1) > -1),  # as RadixAttention
            ("non-causal", layer.attn_type != AttentionType.DECODER),
            ("logit soft cap", (layer.logit_cap or 0) > 0),
            ("xai temperature", getattr(layer, "xai_temperature_len", -1) > 0),
            ("kv scales", layer.k_scale is not None),
            ("v head dim != qk head dim", layer.v_head_dim != layer.qk_head_dim),
            (f"extra inputs {sorted(extras)}", any(x is not None for x in extras.values())),
        )
        if bad
    ]
    if problems:
        raise ValueError(
            "compacted prefixes support neither encoder nor sliding-window attention nor "
            f"these variants; layer {layer.layer_id} has: {', '.join(problems)}"
        )

"""What the compacted (biased) attention path refuses, checked where `CompactionBackend` is
built (`check_runner`) and at a biased forward (`check_layer`): each raises a ValueError
naming every variant the biased path does not implement."""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.layers.radix_attention import AttentionType

__all__ = ["check_layer", "check_runner"]

_KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_runner(model_runner: Any, inner: Any, inner_name: str) -> None:
    """ValueError naming `--attention-backend` for a layout the biased path cannot serve."""
    pool = model_runner.token_to_kv_pool
    dtype = pool.get_key_buffer(pool.start_layer).dtype
    model_config = getattr(model_runner, "model_config", None)
    problems = [
        what
        for what, bad in (
            ("MLA", bool(getattr(model_runner, "use_mla_backend", False))),
            ("decode context parallelism", (getattr(inner, "dcp_size", 1) or 1) > 1),
            (f"KV cache dtype {dtype}", dtype not in _KV_DTYPES),
            ("encoder-decoder model", bool(getattr(model_config, "is_encoder_decoder", False))),
        )
        if bad
    ]
    if problems:
        raise ValueError(
            f"--attention-backend {inner_name!r} with --compaction-endpoint: compacted prefixes "
            f"need plain MHA/GQA with an fp16/bf16/fp32 KV cache; got {', '.join(problems)}"
        )


def check_layer(layer: Any, forward_batch: Any, extras: dict[str, Any]) -> None:
    """ValueError for the attention variants the biased path does not implement."""
    problems = [
        name
        for name, bad in (
            ("encoder", getattr(forward_batch, "encoder_lens", None) is not None),
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

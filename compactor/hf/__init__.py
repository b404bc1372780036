"""transformers glue: load a causal LM, read its KV cache and queries, decode from a compacted prefix.

Shape legend: T prefix tokens, S cache slots per head of the prefix (T for a full prefix,
max_h t_h over all layers for a compacted one), n queries, H_q / H_kv query / KV heads,
G = H_q // H_kv, D head dim, V vocabulary.

Everything here runs the model in eval mode under ``torch.inference_mode`` and in the
model's dtype (fp32 on CPU). Keys, values and queries are post-RoPE, exactly as the model's
``DynamicCache`` holds keys.

Modules: ``model`` (load, geometry, prefill, query recording), ``decode``
(:class:`PrefixState`: decoding after a full or compacted prefix with beta as an SDPA float
mask and logical positions), ``generate`` (greedy and batched generation), ``shared_prefix`` (a batch of
rows over one prefix held once: attention over the prefix and over each row's own tokens,
merged by log-sum-exp) and ``stream`` (:class:`LayerStream`: continuations advanced one
layer at a time, for on-policy fitting).
"""

from compactor.hf.decode import PrefixState
from compactor.hf.generate import batched_generate, greedy_generate
from compactor.hf.model import (
    ModelInfo,
    PrefillResult,
    load_model,
    model_info,
    pool_gqa,
    post_rope_queries,
    prefill,
    record_queries,
)
from compactor.hf.stream import LayerStream

__all__ = [
    "LayerStream",
    "ModelInfo",
    "PrefillResult",
    "PrefixState",
    "batched_generate",
    "greedy_generate",
    "load_model",
    "model_info",
    "pool_gqa",
    "post_rope_queries",
    "prefill",
    "record_queries",
]

"""The random Llama checkpoints of the GPU serving run, written on the machine that runs it.

The 8B-shaped checkpoint: Llama-3-8B's shape (32 layers, hidden 4096, 32 query heads and 8
KV heads of D = 128, MLP 14336, RoPE theta 500000) with random bf16 weights, and the embedded
SmolLM2's vocabulary size (49152 ids) instead of Llama-3's 128256. That makes the embedding and
LM head 0.2B parameters each instead of 0.53B (7.4B in all instead of 8.0B): 1.3 GB less read
per decode step out of ~15 GB. The identity phase's one (`IDENTITY`, 8 layers) has the 8B one's
attention shape (head_dim 128, 4:1 GQA), so FlashInfer compiles its kernels once per run. Neither needs a tokenizer: servers run with
`--skip-tokenizer-init`, ids in and ids out, so no model file has to travel to a GPU machine.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["IDENTITY", "LLAMA3_8B", "TOKENIZER_FILES", "LlamaShape", "make_model"]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)


@dataclass(frozen=True)
class LlamaShape:
    """A Llama checkpoint's shape (defaults: Llama-3-8B's, vocabulary aside: see module doc)."""

    layers: int = 32
    hidden: int = 4096
    intermediate: int = 14336
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    max_positions: int = 40960
    rope_theta: float = 500000.0
    vocab: int = 49152

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"LlamaShape.{name} must be > 0, got {getattr(self, name)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")

    def tensors(self, vocab: int | None = None) -> dict[str, tuple[int, ...]]:
        """Tensor name -> shape, in HF Llama naming (untied LM head)."""
        vocab = self.vocab if vocab is None else vocab
        h, q, kv, m = (
            self.hidden,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
            self.intermediate,
        )
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out |= {
                p + "input_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "post_attention_layernorm.weight": (h,),
                p + "mlp.gate_proj.weight": (m, h),
                p + "mlp.up_proj.weight": (m, h),
                p + "mlp.down_proj.weight": (h, m),
            }
        return out | {"model.norm.weight": (h,), "lm_head.weight": (vocab, h)}


LLAMA3_8B = LlamaShape()  # vocabulary aside (see the module doc)
# The identity phase's model: small, with the 8B one's attention (head_dim 128, 4 query heads
# per KV head, its RoPE theta), so FlashInfer JIT-compiles one set of kernels for the whole run.
IDENTITY = LlamaShape(layers=8, hidden=1024, intermediate=2816, heads=8, kv_heads=2,
                      head_dim=128, max_positions=8192)  # fmt: skip


def make_model(
    out: Path,
    tokenizer_dir: Path | None,
    shape: LlamaShape,
    device: str = "cuda",
    dtype: str = "bfloat16",
    seed: int = 0,
    shard_bytes: int = 4 << 30,
) -> dict[str, Any]:
    """Write a random-weight Llama checkpoint (config.json, safetensors shards + index, and
    the tokenizer files of `tokenizer_dir` when given) to `out`; returns its summary.

    Weights are N(0, 0.02) (norms 1), drawn on `device` tensor by tensor and moved to the host
    shard by shard, so host memory holds at most one shard. Vocabulary: the tokenizer's when
    given, else `shape.vocab` (serve it with `--skip-tokenizer-init`).
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir)) if tokenizer_dir else None
    vocab = len(tok) if tok is not None else shape.vocab
    torch_dtype = getattr(torch, dtype)
    out.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id if tok is not None else 1,
        eos_token_id=tok.eos_token_id if tok is not None else 2,
        dtype=dtype,
        architectures=["LlamaForCausalLM"],
    )
    config.save_pretrained(str(out))
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copy2(tokenizer_dir / name, out / name)
    gen = torch.Generator(device=device).manual_seed(seed)
    weight_map: dict[str, str] = {}
    shard: dict[str, Any] = {}
    shard_size, shards, params = 0, 0, 0

    def flush() -> None:
        nonlocal shard, shard_size, shards
        if shard:
            shards += 1
            save_file(shard, str(out / f"model-{shards:05d}.safetensors"), {"format": "pt"})
            weight_map.update(dict.fromkeys(shard, f"model-{shards:05d}.safetensors"))
        shard, shard_size = {}, 0

    for name, dims in shape.tensors(vocab).items():
        if len(dims) == 1:
            t = torch.ones(dims, dtype=torch_dtype)
        else:
            t = (torch.randn(dims, generator=gen, device=device) * 0.02).to(torch_dtype).cpu()
        nbytes = t.numel() * t.element_size()
        if shard and shard_size + nbytes > shard_bytes:
            flush()
        shard[name] = t
        shard_size += nbytes
        params += t.numel()
    flush()
    # shard names are final only now: rename to the HF "-of-" convention
    renamed = {}
    for i in range(1, shards + 1):
        old, new = f"model-{i:05d}.safetensors", f"model-{i:05d}-of-{shards:05d}.safetensors"
        (out / old).rename(out / new)
        renamed[old] = new
    index = {
        "metadata": {"total_size": params * torch.empty((), dtype=torch_dtype).element_size()},
        "weight_map": {k: renamed[v] for k, v in weight_map.items()},
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    summary = {"path": str(out), "params": params, "vocab": vocab, "shards": shards}
    summary |= {"shape": asdict(shape), "dtype": dtype, "seed": seed}
    (out / "random_model.json").write_text(json.dumps(summary, indent=1))
    return summary

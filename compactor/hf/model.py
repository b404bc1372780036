"""Model side of the transformers glue: load, geometry, KV cache and query extraction.

Shape legend: T prefix tokens, n queries, H_q / H_kv query / KV heads, G = H_q // H_kv,
D head dim, V vocabulary. Keys, values and queries are post-RoPE, exactly as the model's
``DynamicCache`` holds keys.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class ModelInfo:
    """Attention geometry of a llama-like model."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def group_size(self) -> int:
        """G = H_q // H_kv."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def sm_scale(self) -> float:
        return float(self.head_dim) ** -0.5


def load_model(model_dir: str | Path, device: str = "cpu") -> tuple[Any, Any]:
    """Load (model, tokenizer-or-None) from a local HF checkpoint, fp32, eval, SDPA attention.

    Raises:
        ValueError: `model_dir` is not a directory with a config.json.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ValueError(f"not a model directory (no config.json): {path}")
    model: Any = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="sdpa"
    )
    model.to(device).eval()
    model.compactor_model_dir = str(path)  # read by the pipeline for the fingerprint
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError):
        tokenizer = None
    return model, tokenizer


def model_info(model: Any) -> ModelInfo:
    """Geometry of `model` (a HF causal LM with a llama-like config)."""
    cfg = model.config
    hq = int(cfg.num_attention_heads)
    hkv = int(getattr(cfg, "num_key_value_heads", None) or hq)
    d = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // hq)
    if hq % hkv:
        raise ValueError(f"num_attention_heads={hq} is not a multiple of num_key_value_heads={hkv}")
    return ModelInfo(int(cfg.num_hidden_layers), hq, hkv, d)


def pool_gqa(queries: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Pool query heads onto their KV head: [H_q, n, D] -> [H_kv, G*n, D].

    Query heads i*G .. i*G+G-1 read KV head i; their queries are concatenated along n
    (head i*G first).
    """
    if queries.dim() != 3:
        raise ValueError(f"queries must be [H_q, n, D], got shape {tuple(queries.shape)}")
    hq, n, d = queries.shape
    if num_kv_heads < 1 or hq % num_kv_heads:
        raise ValueError(f"H_q={hq} is not a multiple of num_kv_heads={num_kv_heads}")
    g = hq // num_kv_heads
    return queries.reshape(num_kv_heads, g * n, d)


def _attn_modules(model: Any) -> list[Any]:
    layers = model.model.layers
    return [layer.self_attn for layer in layers]


@contextmanager
def use_attention(model: Any, name: str, fn: Any) -> Iterator[None]:
    """Run `model`'s attention through `fn` (a transformers attention function) inside the
    block; the model's own implementation is restored after.

    Registers `fn` under `name` with transformers' AttentionInterface on first use (a named
    addition to its registry, with SDPA's mask function; nothing existing is replaced).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, fn)
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    cfg = model.config
    saved = cfg._attn_implementation
    cfg._attn_implementation = name
    try:
        yield
    finally:
        cfg._attn_implementation = saved


def post_rope_queries(
    attn: Any, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """The queries attention module `attn` computes from its input [B, q, hidden]: [B, H_q, q, D].

    ``q_proj`` -> (``q_norm`` if the model has one) -> RoPE with `position_embeddings` (cos, sin).
    """
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    b, q_len, _ = hidden_states.shape
    q = attn.q_proj(hidden_states).view(b, q_len, -1, attn.head_dim).transpose(1, 2)
    if getattr(attn, "q_norm", None) is not None:
        q = attn.q_norm(q)
    cos, sin = position_embeddings
    q, _ = apply_rotary_pos_emb(q, q, cos, sin)
    return q


@contextmanager
def record_queries(
    model: Any, layers: Sequence[int] | None = None
) -> Iterator[dict[int, list[torch.Tensor]]]:
    """Record post-RoPE queries of every forward run inside the block.

    Yields ``{layer: [q [H_q, q_len, D], ...]}`` (one entry per forward call, batch row 0),
    filled as forwards run. The queries are recomputed from the attention module's input
    exactly as the module does: ``q_proj`` -> (``q_norm`` if the model has one) -> RoPE with
    the module's ``position_embeddings``. Hooks are removed on exit (mutates nothing else).
    """
    mods = _attn_modules(model)
    wanted = set(range(len(mods)) if layers is None else layers)
    out: dict[int, list[torch.Tensor]] = {i: [] for i in sorted(wanted)}
    handles = []

    def make_hook(idx: int, mod: Any) -> Any:
        def hook(_m: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            hs = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            out[idx].append(post_rope_queries(mod, hs, kwargs["position_embeddings"])[0].detach())

        return hook

    try:
        for i in sorted(wanted):
            handles.append(
                mods[i].register_forward_pre_hook(make_hook(i, mods[i]), with_kwargs=True)
            )
        yield out
    finally:
        for h in handles:
            h.remove()


# Tokens per forward call of :func:`prefill`: a longer prefix runs in chunks of at most this
# many tokens over the growing cache, so its activations (MLP [chunk, intermediate], the
# causal mask [chunk, T]) stay bounded; a prefix of at most this many tokens runs in one
# call, as it always did (bit-identical results).
PREFILL_CHUNK = 4096
# ... and, on the CPU, fewer when the chunk's causal mask would exceed this (SDPA on the
# CPU turns the bool [chunk, T] mask into a float one): chunk = PREFILL_MASK_BYTES // (4 T),
# at least 256. Not on an accelerator: there every chunk copies the growing cache once (a
# 128k prefix in 512-token chunks copied its KV 256 times: 36 s of an H200's 44 s), and a
# [4096, T] mask is small beside the KV cache.
PREFILL_MASK_BYTES = 256 << 20


@dataclass(frozen=True)
class PrefillResult:
    """A prefilled prefix: keys/values per layer [H_kv, T, D] and last-token logits [V]."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    last_logits: torch.Tensor
    queries: list[torch.Tensor] | None  # per layer [H_q, T, D] when asked


@torch.inference_mode()
def prefill(
    model: Any,
    token_ids: Sequence[int] | torch.Tensor,
    with_queries: bool = False,
    chunk: int | None = None,
) -> PrefillResult:
    """Run the prefix [T] through `model`; return its KV cache (and queries if asked).

    The prefix runs in forward calls of at most `chunk` tokens over the growing cache
    (None: :func:`prefill_chunk` of T on the model's device; one call when T <= chunk): peak memory is the KV
    cache (and the queries, when asked: [H_q, T, D] per layer, G times the keys) plus one
    chunk's activations and mask, not T's. Everything returned is on the model's device.

    Raises:
        ValueError: an empty prefix, `chunk` < 1.
    """
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=model.device).reshape(1, -1)
    if ids.shape[1] < 1:
        raise ValueError("prefill: empty prefix")
    T = ids.shape[1]
    chunk = prefill_chunk(T, ids.device) if chunk is None else chunk
    if chunk < 1:
        raise ValueError(f"prefill: chunk must be >= 1, got {chunk}")
    from transformers import DynamicCache

    cache: Any = DynamicCache()
    with record_queries(model) if with_queries else nullcontext() as rec:
        for a in range(0, T, chunk):
            out = model(
                input_ids=ids[:, a : a + chunk],
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
    queries = None if rec is None else [_cat_calls(rec[i]) for i in sorted(rec)]
    keys = [layer.keys[0] for layer in cache.layers]
    values = [layer.values[0] for layer in cache.layers]
    return PrefillResult(keys, values, out.logits[0, -1].float(), queries)


def prefill_chunk(num_tokens: int, device: torch.device | str = "cpu") -> int:
    """Tokens per forward call of :func:`prefill` for a `num_tokens` prefix on `device`: all
    of them up to PREFILL_CHUNK, else PREFILL_CHUNK on an accelerator and
    min(PREFILL_CHUNK, max(256, PREFILL_MASK_BYTES // (4 T))) on the CPU."""
    if num_tokens <= PREFILL_CHUNK:
        return max(1, num_tokens)
    if torch.device(device).type != "cpu":
        return PREFILL_CHUNK
    return min(PREFILL_CHUNK, max(256, PREFILL_MASK_BYTES // (4 * num_tokens)))


def _cat_calls(parts: list[torch.Tensor]) -> torch.Tensor:
    """The queries [H_q, q, D] of several forward calls, joined along q (no copy for one)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

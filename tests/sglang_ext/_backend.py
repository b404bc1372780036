"""The plugin's attention backend around SGLang's real TorchNativeAttnBackend on real CPU pools,
and what SGLang hands it: layers, forward batches, new K/V; a spy on the inner backend."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sglang_ext.adapter.factory import _create_attention_backend
from sglang_ext.adapter.hooks import verify_serving
from sglang_ext.adapter.server_args import INNER_ATTR
from sglang_ext.adapter.wrapped_backend import CompactionBackend
from tests.sglang_ext._attention import H_KV, D

H_Q, SCALE = 2 * H_KV, 0.25
SPIED = ("init_forward_metadata", "init_forward_metadata_out_graph", "forward",
         "forward_extend", "forward_decode")  # fmt: skip


def wrapped(runner: Any) -> CompactionBackend:
    runner.server_args = SimpleNamespace(**{INNER_ATTR: "torch_native"})
    be = _create_attention_backend(runner, verify=verify_serving)
    assert isinstance(be, CompactionBackend) and type(be.inner) is TorchNativeAttnBackend
    return be


def spy(obj: Any, names: tuple[str, ...]) -> list[tuple[str, tuple[Any, ...], dict[str, Any], Any]]:
    """Wrap `obj`'s bound methods `names` with a recorder of (name, args, kwargs, result)."""
    calls: list[tuple[str, tuple[Any, ...], dict[str, Any], Any]] = []

    def recorder(name: str, bound: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            result = bound(*args, **kwargs)
            calls.append((name, args, kwargs, result))
            return result

        return call

    for name in names:
        setattr(obj, name, recorder(name, getattr(obj, name)))
    return calls


def layer(layer_id: int = 0, **kw: Any) -> Any:
    base = dict(layer_id=layer_id, tp_q_head_num=H_Q, tp_k_head_num=H_KV, qk_head_dim=D,
                v_head_dim=D, scaling=SCALE, is_cross_attention=False, sliding_window_size=-1,
                logit_cap=0.0, attn_type=AttentionType.DECODER, k_scale=None, v_scale=None)  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


def forward_batch(
    rows: list[list[int]], pool_rows: list[int], q_lens: list[int], decode: bool
) -> Any:
    """The ForwardBatch fields SGLang's torch_native backend and the wrapper read."""
    seq_lens = torch.tensor([len(r) for r in rows])
    q = torch.tensor(q_lens)
    new = torch.cat([torch.tensor(r[len(r) - n :]) for r, n in zip(rows, q_lens)])
    return SimpleNamespace(
        forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
        req_pool_indices=torch.tensor(pool_rows), req_pool_indices_cpu=None,
        seq_lens=seq_lens, seq_lens_cpu=seq_lens.clone(), extend_prefix_lens=seq_lens - q,
        extend_seq_lens=q, extend_seq_lens_cpu=q_lens, encoder_lens=None, out_cache_loc=new,
        out_cache_loc_is_physical=False,
    )  # fmt: skip


def new_kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [n, H_q * D], k/v [n, H_kv, D], as RadixAttention hands them to a backend."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, H_Q * D, generator=g), torch.randn(n, H_KV, D, generator=g),
            torch.randn(n, H_KV, D, generator=g))  # fmt: skip

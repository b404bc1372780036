"""The compacted decode graph variant through SGLang's own graph-runner code, on real CPU pools:
the runner is given both labels, a capture of `stock` reaches the inner backend as before
and a capture of `compacted` never does, `select` and SGLang's `_resolve_attention_variant`
answer `compacted` for a compacted batch that fits, and what the graph replays (the launches
recorded at capture, over SGLang's replay view) matches the full-row reference."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.runner.decode_cuda_graph_runner import (
    DecodeCudaGraphRunner,
    build_replay_fb_view,
)
from sglang.srt.model_executor.runner_utils.capture_mode import _set_capture_attention_variant

from sglang_ext.adapter.graph_variant import COMPACTED, STOCK, CompactedVariants
from sglang_ext.adapter.wrapped_backend import graph_gate
from tests.sglang_ext._attention import H_KV, LAYERS, D, full_row_reference, mixed_rows, real_runner
from tests.sglang_ext._backend import H_Q, SCALE, forward_batch, layer, new_kv, spy, wrapped
from tests.sglang_ext._fixtures import serving_registration

BS = 4  # the graph's batch size: the mixed batch's 3 requests and one padding slot
INNER = ("init_forward_metadata_out_graph", "init_forward_metadata_in_graph", "forward_decode")


def graphs_backend() -> tuple[Any, Any, Any]:
    """A wrapped backend whose runner sized its graphs for BS requests (the inner CPU
    backend keeps no graph state of its own), and a decode graph runner stand-in with
    SGLang's capture buffers; the plugin's BEFORE hook on `capture` has run on it."""
    runner = real_runner()
    runner.model_config.num_attention_heads = H_Q
    runner.model_config.get_total_num_kv_heads = lambda: H_KV
    be = wrapped(runner)
    be.cascade = True  # the Triton path on CPU tensors (interpreted)
    be.inner.init_cuda_graph_state = lambda *a, **k: None
    be.init_cuda_graph_state(BS, BS)
    assert be.graphs is not None
    buffers = SimpleNamespace(
        input_ids=torch.zeros(BS, dtype=torch.int64), positions=torch.zeros(BS, dtype=torch.int64),
        req_pool_indices=torch.zeros(BS, dtype=torch.int64), seq_lens=torch.ones(BS, dtype=torch.int64),
        seq_lens_cpu=torch.ones(BS, dtype=torch.int64), encoder_lens=None, mamba_track_indices=None,
    )  # fmt: skip
    graph_runner = SimpleNamespace(attn_backend=be, attention_graph_variants=None, buffers=buffers)
    return runner, be, graph_runner


def capture_batch(buffers: Any) -> Any:
    """The ForwardBatch SGLang captures with: its static buffers, the new tokens' slot 0."""
    return SimpleNamespace(
        forward_mode=ForwardMode.DECODE, batch_size=BS, req_pool_indices=buffers.req_pool_indices,
        seq_lens=buffers.seq_lens, seq_lens_cpu=buffers.seq_lens_cpu,
        out_cache_loc=torch.zeros(BS, dtype=torch.int64), out_cache_loc_is_physical=False,
        encoder_lens=None,
    )  # fmt: skip


def graph_body(be: Any, fb: Any, save_kv: bool) -> list[torch.Tensor]:
    """What a captured graph runs: the in-graph metadata, then each layer's attention (q
    fixed per layer, the new K/V written when `save_kv`)."""
    be.init_forward_metadata_in_graph(fb)
    outs = []
    for i in range(LAYERS):
        q, k, v = new_kv(BS, seed=20 + i)
        outs.append(be.forward_decode(q, k, v, layer(i), fb, save_kv))
    return outs


def test_plugin_registers_the_variant_hook_before_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    plugin = serving_registration(monkeypatch)
    target = f"{DecodeCudaGraphRunner.__module__}.DecodeCudaGraphRunner.capture"
    hooks = HookRegistry._hooks[target]
    assert any(h is plugin._graph_variants and t is HookType.BEFORE for t, h, _ in hooks)
    _, be, graph_runner = graphs_backend()
    plugin._graph_variants(graph_runner)
    assert isinstance(graph_runner.attention_graph_variants, CompactedVariants)
    assert graph_runner.attention_graph_variants.capture_labels == (STOCK, COMPACTED)
    theirs = SimpleNamespace(attn_backend=be, attention_graph_variants=object())
    plugin._graph_variants(theirs)  # SGLang's own variants stay: compacted batches go eager
    assert not isinstance(theirs.attention_graph_variants, CompactedVariants)


def test_capture_then_replay_through_sglangs_runner_code() -> None:
    runner, be, graph_runner = graphs_backend()
    from sglang_ext.adapter.graph_variant import install_variants

    install_variants(graph_runner)
    variants = graph_runner.attention_graph_variants
    buffers = graph_runner.buffers
    calls = spy(be.inner, INNER)
    be.inner.forward_decode = lambda q, *a, **k: q  # the CPU inner backend has no graphs
    traces = {}
    for label in variants.capture_labels:  # SGLang's order: stock, then compacted
        _set_capture_attention_variant(label)
        try:
            fb = capture_batch(buffers)
            be.init_forward_metadata_out_graph(fb, in_capture=True)
            be.graphs.static.trace = []
            graph_body(be, fb, save_kv=False)
            traces[label] = be.graphs.static.trace
        finally:
            _set_capture_attention_variant(None)
    stock_calls = [c[0] for c in calls]
    assert stock_calls == ["init_forward_metadata_out_graph", "init_forward_metadata_in_graph"]
    assert calls[0][2] == {"in_capture": True} and traces[STOCK] == []
    assert len(traces[COMPACTED]) == 1 + 3 * LAYERS  # the tails' gather, 3 launches a layer
    calls.clear()

    # replay: a compacted decode batch of 3 requests (plain, compacted, compacted + child)
    rows, q_lens = mixed_rows(runner, decode=True)
    fb = forward_batch(rows, [1, 2, 3], q_lens, decode=True)
    # the rest of what SGLang's replay view copies from a ForwardBatch
    fb.batch_size, fb.seq_lens_sum = 3, int(fb.seq_lens.sum())
    unset = ("max_seq_len_host out_cache_loc_virtual kv_loc_plan kv_loc_cols "
             "max_seq_len_override spec_info lora_ids can_run_decode_cuda_graph")  # fmt: skip
    for name in unset.split():
        setattr(fb, name, None)
    assert graph_gate(True, graph_runner, fb) is None  # fits the compacted graph
    assert DecodeCudaGraphRunner._resolve_attention_variant(graph_runner, fb, BS) == COMPACTED
    buffers.req_pool_indices[:3] = torch.tensor([1, 2, 3])  # load_batch fills the buffers
    buffers.seq_lens[:3] = fb.seq_lens
    view = build_replay_fb_view(fb, buffers, BS, 3, BS, None, 1, ForwardMode.DECODE, False)
    before = be.beta_store.compacted_rows
    be.init_forward_metadata_out_graph(view)
    assert calls == [] and be.beta_store.compacted_rows == before + 2  # counted, inner unasked
    be.graphs.static.trace = []
    be.graphs.capturing = True  # replay: the recorded launches run again on the new tables
    outs = graph_body(be, capture_batch(buffers), save_kv=False)
    assert _launches(be.graphs.static.trace) == _launches(traces[COMPACTED])
    for i, out in enumerate(outs):
        q = new_kv(BS, seed=20 + i)[0].view(BS, H_Q, D)[:3]
        want = full_row_reference(runner, i, q, rows, q_lens, SCALE)
        torch.testing.assert_close(out.view(BS, H_Q, D)[:3], want, atol=2e-5, rtol=2e-5)

    # a plain batch replays the stock graph: the inner backend's metadata, as before
    plain = forward_batch([list(range(10, 16))], [1], [1], decode=True)
    assert variants.select(plain) == STOCK
    be.graphs.capturing = False
    be.init_forward_metadata_out_graph(plain)
    assert [c[0] for c in calls] == ["init_forward_metadata_out_graph"]


def _launches(trace: list[Any]) -> list[Any]:
    """The launches with their buffers' addresses and shapes; q only by shape (the model's
    activations: under a graph they sit in its memory pool, here each call allocates)."""
    return [(what, {n: (tuple(t.shape), None if n == "q" else t.data_ptr())
                     for n, t in tensors.items()}, scalars)
            for what, tensors, scalars in trace]  # fmt: skip


def test_what_the_graph_cannot_serve_runs_eagerly_and_is_counted() -> None:
    runner, be, graph_runner = graphs_backend()
    from sglang_ext.adapter.graph_variant import install_variants

    rows, q_lens = mixed_rows(runner, decode=False)
    extend = forward_batch(rows, [1, 2, 3], q_lens, decode=False)
    install_variants(graph_runner)
    assert graph_gate(True, graph_runner, extend) is False
    be.init_forward_metadata(extend)
    decode = forward_batch(rows, [1, 2, 3], [1, 1, 1], decode=True)
    stock_only = SimpleNamespace(attn_backend=be, attention_graph_variants=None)
    assert graph_gate(True, stock_only, decode) is False  # the runner has no compacted graphs
    be.init_forward_metadata(decode)
    be.init_forward_metadata(forward_batch(rows, [1, 2, 3], [1, 1, 1], decode=True))
    assert dict(be.beta_store.eager_batches) == {"extend": 1, "variants": 1, "no_graph": 1}

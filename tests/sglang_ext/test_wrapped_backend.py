"""`CompactionBackend` around SGLang's real TorchNativeAttnBackend on real CPU pools: plain
batches reach the inner backend untouched, mixed batches match the full-row reference."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sglang_ext.adapter.compacted_node import beta_store_of
from sglang_ext.adapter.factory import _create_attention_backend, inner_attention_backend
from sglang_ext.adapter.hooks import verify_serving
from sglang_ext.adapter.marks import HostMarks, mark_forward_batch
from sglang_ext.adapter.server_args import INNER_ATTR
from sglang_ext.adapter.wrapped_backend import CompactionBackend, graph_gate
from sglang_ext.kv_store import ALIAS_SLOT
from sglang_ext.packing import PackedLayout
from tests.sglang_ext._attention import (
    CHILD,
    COUNTS,
    LAYERS,
    PHYS,
    PLAIN_ROW,
    D,
    T,
    full_row_reference,
    mixed_rows,
    real_runner,
)
from tests.sglang_ext._backend import (
    H_Q,
    SCALE,
    SPIED,
    forward_batch,
    layer,
    new_kv,
    spy,
    wrapped,
)
from tests.sglang_ext._fixtures import serving_registration


@pytest.mark.parametrize("decode", [True, False])
def test_plain_batch_reaches_the_inner_backend_unchanged(decode: bool) -> None:
    torch.manual_seed(0)
    runner = real_runner()
    be = wrapped(runner)
    mixed_rows(runner, decode)  # a compacted prefix is installed: the check runs, finds none
    calls = spy(be.inner, SPIED)
    q_lens = [1] if decode else [3]
    fb = forward_batch([PLAIN_ROW], [1], q_lens, decode)
    assert be.init_forward_metadata(fb) is calls[-1][3]
    assert calls == [("init_forward_metadata", (fb,), {}, None)]
    assert be.beta_store.compacted_forwards == be.beta_store.compacted_rows == 0  # not counted
    q, k, v = new_kv(sum(q_lens), seed=1)
    lay = layer()
    out = be.forward(q, k, v, lay, fb, save_kv_cache=True)
    forward = [c for c in calls if c[0] == "forward"]
    assert forward == [("forward", (q, k, v, lay, fb), {"save_kv_cache": True}, out)]
    name = "forward_decode" if decode else "forward_extend"
    direct = getattr(be, name)(q, k, v, lay, fb, False)
    assert calls[-1][0] == name and calls[-1][1] == (q, k, v, lay, fb, False)
    assert calls[-1][3] is direct and torch.equal(direct, out)
    be.init_forward_metadata_out_graph(fb, in_capture=True)
    assert calls[-1][:3] == ("init_forward_metadata_out_graph", (fb,), {"in_capture": True})
    assert be.needs_cpu_seq_lens is be.inner.needs_cpu_seq_lens  # attributes read through
    assert graph_gate(True, SimpleNamespace(attn_backend=be), fb) is None  # its graph may replay


@pytest.mark.parametrize("cascade", [False, True])  # the CPU path; the CUDA one (interpreted)
@pytest.mark.parametrize("decode", [True, False])
def test_mixed_batch_saves_kv_and_matches_full_rows(decode: bool, cascade: bool) -> None:
    torch.manual_seed(2)
    runner = real_runner()
    be = wrapped(runner)
    be.cascade = cascade
    rows, q_lens = mixed_rows(runner, decode)
    calls = spy(be.inner, SPIED)
    fb = forward_batch(rows, [1, 2, 3], q_lens, decode)
    assert graph_gate(True, SimpleNamespace(attn_backend=be), fb) is False  # runs eagerly
    store = be.beta_store
    assert (store.compacted_forwards, store.compacted_rows) == (0, 0)
    pool = runner.token_to_kv_pool
    steps = 2 if decode else 1
    rows = [list(r) for r in rows]  # grown below: not the shared constants
    for step in range(steps):  # decode: the rows grow by one token each step
        if step:
            for i, row in enumerate(rows):
                row.append(90 + i)
                runner.req_to_token_pool.req_to_token[i + 1, len(row) - 1] = row[-1]
            fb = forward_batch(rows, [1, 2, 3], q_lens, decode)
        be.init_forward_metadata(fb)
        # counted once per forward: two of its three requests read the compacted prefix
        assert (store.compacted_forwards, store.compacted_rows) == (step + 1, 2 * (step + 1))
        for layer_id in range(LAYERS):
            q, k, v = new_kv(sum(q_lens), seed=10 + layer_id + step)
            alias = pool.get_key_buffer(layer_id)[ALIAS_SLOT].clone()
            pool.get_key_buffer(layer_id)[ALIAS_SLOT] = float("nan")  # never read
            out = be.forward(q, k, v, layer(layer_id), fb, save_kv_cache=True)
            pool.get_key_buffer(layer_id)[ALIAS_SLOT] = alias
            assert torch.equal(pool.get_key_buffer(layer_id)[fb.out_cache_loc], k)
            assert torch.equal(pool.get_value_buffer(layer_id)[fb.out_cache_loc], v)
            want = full_row_reference(runner, layer_id, q.view(-1, H_Q, D), rows, q_lens, SCALE)
            torch.testing.assert_close(out, want.reshape(-1, H_Q * D), atol=1e-5, rtol=1e-5)
    # inner metadata per forward, no inner forward
    assert [c[0] for c in calls] == ["init_forward_metadata"] * steps
    if cascade:  # the prefix calls of the (node, tokens) composition: planned once in all
        assert be.prefix_plans is not None and be.prefix_plans.made == 1


def test_inner_backend_name_comes_from_the_flag_or_sglang_default() -> None:
    runner = real_runner()
    runner.server_args = SimpleNamespace(**{INNER_ATTR: "flashinfer"})
    assert inner_attention_backend(runner) == "flashinfer"
    runner.server_args = SimpleNamespace()  # unset: SGLang's default for the device
    assert inner_attention_backend(runner) == "torch_native"
    be = _create_attention_backend(runner, verify=verify_serving)
    assert type(be.inner) is TorchNativeAttnBackend and be.inner_name == "torch_native"


def test_refuses_what_the_biased_path_cannot_serve() -> None:
    runner = real_runner()
    runner.use_mla_backend = True
    with pytest.raises(ValueError, match=r"--attention-backend 'torch_native'.*MLA"):
        CompactionBackend(runner, "torch_native")
    runner = real_runner()
    runner.model_config.is_encoder_decoder = True
    with pytest.raises(ValueError, match="encoder-decoder"):
        CompactionBackend(runner, "torch_native")
    with pytest.raises(ValueError, match="'compaction' cannot be wrapped"):
        CompactionBackend(real_runner(), "compaction")


@pytest.mark.parametrize(("kw", "what"), [({"sliding_window_size": 64}, "sliding window"),
                                          ({"is_cross_attention": True}, "cross attention"),
                                          ({"logit_cap": 30.0}, "logit soft cap")])  # fmt: skip
def test_biased_forward_refuses_unsupported_layers(kw: dict[str, Any], what: str) -> None:
    runner = real_runner()
    be = wrapped(runner)
    rows, q_lens = mixed_rows(runner, True)
    fb = forward_batch(rows, [1, 2, 3], q_lens, True)
    be.init_forward_metadata(fb)
    q, k, v = new_kv(3, seed=0)
    with pytest.raises(ValueError, match=what):
        be.forward_decode(q, k, v, layer(**kw), fb)


def test_speculative_modes_are_refused_on_compacted_rows_only() -> None:
    runner = real_runner()
    be = wrapped(runner)
    rows, q_lens = mixed_rows(runner, True)
    fb = forward_batch(rows, [1, 2, 3], q_lens, True)
    fb.forward_mode = ForwardMode.TARGET_VERIFY
    with pytest.raises(ValueError, match="do not support forward mode"):
        be.init_forward_metadata(fb)
    plain = forward_batch([PLAIN_ROW], [1], [1], True)
    plain.forward_mode = ForwardMode.TARGET_VERIFY
    be.init_forward_metadata(plain)  # plain rows: the inner backend's business
    assert be.compacted_batch(plain) is None


def test_no_installed_prefix_costs_no_lookup() -> None:
    runner = real_runner()
    be = wrapped(runner)
    assert not beta_store_of(runner.token_to_kv_pool).prefixes
    fb = forward_batch([PLAIN_ROW], [1], [1], True)
    fb.req_pool_indices = None  # never read while nothing is compacted
    be.init_forward_metadata(fb)
    assert be.compacted_batch(fb) is None


def test_plugin_gates_both_graph_runners(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    plugin = serving_registration(monkeypatch)
    for runner in plugin._GRAPH_RUNNERS:
        hooks = HookRegistry._hooks[f"{runner}.can_run_graph"]
        assert any(hook is plugin._graph_gate for _, hook, _ in hooks), runner
    runner = real_runner()
    be = wrapped(runner)
    rows, q_lens = mixed_rows(runner, True)
    graph_runner = SimpleNamespace(attn_backend=None, model_runner=SimpleNamespace(attn_backend=be))
    mixed = forward_batch(rows, [1, 2, 3], q_lens, True)
    assert plugin._graph_gate(True, graph_runner, mixed) is False
    assert plugin._graph_gate(False, graph_runner, mixed) is None  # SGLang said no already
    plain = forward_batch([PLAIN_ROW], [1], [1], True)
    assert plugin._graph_gate(True, graph_runner, plain) is None


def schedule_batch(runner: Any, be: CompactionBackend, rows: list[list[int]]) -> Any:
    """What `mark_forward_batch` reads of a ScheduleBatch: the tree cache's beta store, and
    requests with their row and `last_node`. Request 1 sits on a real compacted node (its
    prefix `T` tokens, the `PHYS` slots), request 2 on an ordinary child of it, request 0 on
    a plain node off the root."""
    from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

    from sglang_ext.adapter.compacted_node import new_compacted_node
    from sglang_ext.prefix_tree import CompactionInfo

    root = TreeNode()
    layout = be.beta_store.prefix_of(PHYS[0]) or PackedLayout(COUNTS, torch.tensor(PHYS), T)
    node = new_compacted_node(root, list(range(T)), CompactionInfo(layout, "h", "am-highest", 0))
    child, plain = TreeNode(), TreeNode()
    child.parent, plain.parent = node, root
    child.key, plain.key = RadixKey([1] * len(CHILD), None), RadixKey([2] * 6, None)
    reqs = [SimpleNamespace(last_node=n) for n in (plain, node, child)]
    return SimpleNamespace(tree_cache=SimpleNamespace(beta_store=be.beta_store), reqs=reqs,
                           req_pool_indices_cpu=torch.tensor([1, 2, 3]))  # fmt: skip


@pytest.mark.parametrize("decode", [True, False])
def test_host_marks_decide_without_reading_the_rows(decode: bool) -> None:
    runner = real_runner()
    be = wrapped(runner)
    rows, q_lens = mixed_rows(runner, decode)
    fb = forward_batch(rows, [1, 2, 3], q_lens, decode)
    mark_forward_batch(fb, schedule_batch(runner, be, rows))
    layout = be.beta_store.prefix_of(PHYS[0])
    assert fb.compaction_marks == HostMarks([1, 2, 3], [None, layout, layout])
    slots = be.compacted_batch(SimpleNamespace(**{**vars(fb), "compaction_marks": None}))
    fb.req_pool_indices = None  # the marks carry the rows: the device copy is never read
    runner.req_to_token_pool.req_to_token = runner.req_to_token_pool.req_to_token.to("meta")
    be.req_to_token_pool = runner.req_to_token_pool  # not on the CPU: no check either
    marked = be.compacted_batch(fb)
    assert marked is not None and slots is not None
    assert marked.prefixes == slots.prefixes and torch.equal(marked.rows, slots.rows)
    assert torch.equal(marked.seq_lens, slots.seq_lens) and torch.equal(marked.q_lens, slots.q_lens)
    assert be.beta_store.mark_mismatches == 0


def test_wrong_host_marks_are_counted_and_the_slots_serve() -> None:
    runner = real_runner()
    be = wrapped(runner)
    rows, q_lens = mixed_rows(runner, True)
    fb = forward_batch(rows, [1, 2, 3], q_lens, True)
    layout = be.beta_store.prefix_of(PHYS[0])
    fb.compaction_marks = HostMarks([1, 2, 3], [None, None, layout])  # request 1 missed
    batch = be.compacted_batch(fb)
    assert batch is not None and batch.prefixes == [None, layout, layout]
    assert be.beta_store.mark_mismatches == 1


def test_no_marks_without_an_installed_prefix_or_a_row() -> None:
    runner = real_runner()
    be = wrapped(runner)
    fb = SimpleNamespace()
    sched = schedule_batch(runner, be, [])
    mark_forward_batch(fb, sched)  # nothing installed yet
    assert not hasattr(fb, "compaction_marks")
    mixed_rows(runner, True)
    sched.req_pool_indices_cpu = None  # no host rows: leave it to the slot look-up
    mark_forward_batch(fb, sched)
    assert not hasattr(fb, "compaction_marks")
    sched.req_pool_indices_cpu = torch.tensor([1, 2])  # not one row per request
    mark_forward_batch(fb, sched)
    assert not hasattr(fb, "compaction_marks")


def test_plugin_marks_every_forward_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    plugin = serving_registration(monkeypatch)
    hooks = HookRegistry._hooks[
        "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
    ]
    assert any(hook is plugin._mark_batch for _, hook, _ in hooks)
    runner = real_runner()
    be = wrapped(runner)
    rows, _ = mixed_rows(runner, True)
    fb = SimpleNamespace()
    plugin._mark_batch(fb, object, schedule_batch(runner, be, rows), runner)
    assert fb.compaction_marks.prefixes[0] is None and fb.compaction_marks.prefixes[2] is not None


def test_a_failing_mark_never_reaches_the_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_ext.adapter import hooks

    runner = real_runner()
    be = wrapped(runner)
    mixed_rows(runner, True)
    sched = schedule_batch(runner, be, [])
    sched.req_pool_indices_cpu = object()  # SGLang changed under us: marking raises
    monkeypatch.setattr(hooks, "_mark_failed", False)
    fb = SimpleNamespace()
    hooks._mark_batch(fb, object, sched, runner)
    assert not hasattr(fb, "compaction_marks") and hooks._mark_failed

"""compactor.hf.LayerStream: layer-by-layer continuations equal whole-model forwards."""

from __future__ import annotations

import pytest
import torch

from compactor import hf
from compactor.pipeline import Hooks, compact_prefix
from compactor.query_capture import QueryConfig, collect_queries, plan_queries
from compactor.spec import CompactionSpec
from tests._tiny import random_ids
from tests.compactor import _methods  # noqa: F401  (registers the test-first method)


def _recorded(model, state, seq):
    """Whole-model reference: every layer's queries of `seq` appended to `state`."""
    with hf.record_queries(model) as rec:
        state.fork().forward(model, seq)
    return [rec[i][0] for i in sorted(rec)]


@pytest.mark.parametrize("block", [512, 3])
def test_full_prefix_stream_equals_forward(tiny, block):
    ids = random_ids(40, seed=1)
    pre = hf.prefill(tiny, ids[:30])
    seqs = [ids[30:], ids[35:38]]
    full = hf.PrefixState.full(pre)
    stream = hf.LayerStream(tiny, 30, seqs, block=block)
    want = [_recorded(tiny, full, s) for s in seqs]
    for li in range(2):
        got = stream.queries()
        for j in range(len(seqs)):
            torch.testing.assert_close(got[j], want[j][li], atol=1e-5, rtol=1e-5)
        stream.advance(pre.keys[li], pre.values[li], torch.zeros(2, 30))
    with pytest.raises(ValueError, match="past the last layer"):
        stream.queries()


def test_on_policy_queries_match_hybrid_forward(tiny):
    """Layer l's streamed queries = a whole forward with layers < l compacted (the definition)."""
    ids = random_ids(36, seed=2)
    prefix = ids[:28]
    pre = hf.prefill(tiny, prefix)
    spec = CompactionSpec(
        method="test-first", tokens=6, queries=QueryConfig(sources=("repeat-prefill",)),
        keep_sink_tokens=0,
    )  # fmt: skip
    compacted, _ = compact_prefix(tiny, None, prefix, spec, hooks=Hooks(progress=False))
    seq = ids[28:]
    stream = hf.LayerStream(tiny, 28, [seq])
    stream.advance(*compacted.layers[0].padded(6, torch.float32))
    # hybrid: layer 0 compacted (padded to T slots, beta -inf on pads), layer 1 full
    k0, v0, b0 = compacted.layers[0].padded(28, torch.float32)
    bias = torch.zeros(2, 2, 28)
    bias[0] = b0
    hybrid = hf.PrefixState([k0, pre.keys[1]], [v0, pre.values[1]], bias, 28)
    want = _recorded(tiny, hybrid, seq)[1]
    torch.testing.assert_close(stream.queries()[0], want, atol=1e-5, rtol=1e-5)
    # and it differs from the off-policy queries (layer 0 really was compacted)
    off = _recorded(tiny, hf.PrefixState.full(pre), seq)[1]
    assert (stream.queries()[0] - off).abs().max() > 1e-3


def test_pipeline_on_policy_uses_streamed_queries(tiny):
    """compact_prefix with spec.on_policy fits layer 1 to the stream's queries (not off-policy ones)."""
    ids = random_ids(30, seed=3)
    cfg = QueryConfig(sources=("repeat-prefill",))
    spec = CompactionSpec(method="am-highest", tokens=8, queries=cfg)
    quiet = Hooks(progress=False)
    a, _ = compact_prefix(tiny, None, ids, spec.replace(on_policy=True), hooks=quiet)
    b, _ = compact_prefix(tiny, None, ids, spec, hooks=quiet)
    assert a.params["on_policy"] is True and a.kept_per_head() == b.kept_per_head()
    # layer 0 sees the same queries either way; layer 1 does not
    torch.testing.assert_close(a.layers[0].beta, b.layers[0].beta)
    assert not torch.allclose(a.layers[1].values, b.layers[1].values)
    # reference: collect layer 1's queries on the hybrid state, fit, compare
    pre = hf.prefill(tiny, ids)
    plan = plan_queries(tiny, None, ids, pre, cfg)
    k0, v0, b0 = a.layers[0].padded(30, torch.float32)
    bias = torch.zeros(2, 2, 30)
    bias[0] = b0
    hybrid = hf.PrefixState([k0, pre.keys[1]], [v0, pre.values[1]], bias, 30)
    q1 = collect_queries(tiny, hybrid, plan, layers=[1])[1]
    from compactor.methods import get_method

    info = hf.model_info(tiny)
    ref = get_method("am-highest").compact_layer(
        pre.keys[1][:, 4:], pre.values[1][:, 4:], q1, [4, 4], info.sm_scale
    )
    torch.testing.assert_close(a.layers[1].values[4:8], ref.values[:4], atol=1e-4, rtol=1e-4)


def test_stream_errors(tiny):
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        hf.LayerStream(tiny, 10, [[1, 2], []])
    with pytest.raises(ValueError, match="logical_length"):
        hf.LayerStream(tiny, 0, [[1]])
    stream = hf.LayerStream(tiny, 10, [[1, 2]])
    with pytest.raises(ValueError, match=r"keys/values must be \[H_kv=2"):
        stream.advance(torch.zeros(3, 5, 16), torch.zeros(3, 5, 16), torch.zeros(3, 5))
    with pytest.raises(ValueError, match="bias must be"):
        stream.advance(torch.zeros(2, 5, 16), torch.zeros(2, 5, 16), torch.zeros(2, 4))

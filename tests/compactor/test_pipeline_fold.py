"""compactor.pipeline.layers: a heads-independent method gets a layer's equal chunks in one
call (stacked along the head dim) and the result equals compacting chunk by chunk."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import pytest
import torch

from compactor.methods import get_method
from compactor.pipeline import Hooks, compact_prefix
from compactor.pipeline.layers import _split_heads, chunk_groups
from compactor.spec import CompactionSpec, QueryConfig
from compactor.types import CompactedLayer
from tests._tiny import random_ids


def _counting(name: str, fold: bool, calls: list[int]) -> Any:
    """The registered method `name` with heads_independent = `fold`, counting its calls
    (the heads of each call appended to `calls`)."""
    base = type(get_method(name))

    def compact(self: Any, x: Any) -> Any:
        calls.append(x.H)
        return base.compact(self, x)

    ns = {"compact": compact, "heads_independent": fold, "__annotations__": {}}
    ns["__annotations__"]["heads_independent"] = ClassVar[bool]
    return dataclasses.dataclass(type(f"Counting{base.__name__}", (base,), ns))()


def test_chunk_groups():
    bounds = [(0, 13), (13, 26), (26, 39), (39, 43)]
    assert chunk_groups(bounds, fold=False) == [[0], [1], [2], [3]]
    assert chunk_groups(bounds, fold=True) == [[0, 1, 2], [3]]
    assert chunk_groups([(0, 5)], fold=True) == [[0]]


def test_split_heads_round_trip():
    g = torch.Generator().manual_seed(0)
    lengths = [3, 1, 4, 2, 5, 2]  # 3 parts of 2 heads
    n = sum(lengths)
    indptr = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    layer = CompactedLayer(
        torch.randn(n, 4, generator=g),
        torch.randn(n, 4, generator=g),
        torch.randn(n, generator=g),
        indptr,
        torch.arange(n, dtype=torch.int64),
    )
    parts = _split_heads(layer, 3)
    assert [p.head_lengths() for p in parts] == [[3, 1], [4, 2], [5, 2]]
    for c, p in enumerate(parts):
        p.validate()
        for h in range(2):
            for got, want in zip(p.head(h), layer.head(2 * c + h)):
                assert torch.equal(got, want)
    assert _split_heads(layer, 1)[0] is layer
    with pytest.raises(ValueError, match="split"):
        _split_heads(layer, 4)


@pytest.mark.parametrize("name", ["am-highest", "am-omp-fast"])
def test_folded_chunks_equal_chunk_by_chunk(tiny, name, monkeypatch):
    # the projected NNLS solves each head on its own; the active set's convergence test
    # is per batch (a larger batch may run a head for more rounds, within its accuracy)
    monkeypatch.setattr("compactor.methods.refit.NNLS_SOLVER", "projected")
    ids = random_ids(60, seed=5)
    spec = CompactionSpec(
        method=name,
        tokens=21,  # 17 past the sinks: 4 in each chunk of 13 (no padding when stacked)
        keep_sink_tokens=4,
        chunk_size=13,  # 56 non-sink tokens: chunks of 13, 13, 13, 13, 4
        queries=QueryConfig(sources=("repeat-prefill",)),
    )
    out = {}
    for fold in (False, True):
        calls: list[int] = []
        hooks = Hooks(progress=False, method=_counting(name, fold, calls))
        out[fold], _ = compact_prefix(tiny, None, ids, spec, hooks=hooks)
        h = tiny.config.num_key_value_heads
        per_layer = [4 * h, h] if fold else [h] * 5
        assert calls == per_layer * tiny.config.num_hidden_layers
    a, b = out[False], out[True]
    assert a.kept_per_head() == b.kept_per_head()
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(la.indptr, lb.indptr)
        assert torch.equal(la.kept_indices, lb.kept_indices)
        assert torch.equal(la.keys, lb.keys)
        torch.testing.assert_close(la.beta, lb.beta, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(la.values, lb.values, atol=1e-5, rtol=1e-5)

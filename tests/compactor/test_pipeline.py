"""compactor.pipeline: sinks, chunking, identity, on-policy, errors, real-model run."""

from __future__ import annotations

import pytest
import torch

from compactor import hf
from compactor.pipeline import Hooks, compact_prefix, split_budget
from compactor.spec import CompactionSpec, QueryConfig
from tests._tiny import random_ids, real_model
from tests.compactor import _methods  # noqa: F401  (registers test-identity, test-first)

SRC = ("repeat-prefill",)
QUIET = Hooks(progress=False)


def _spec(method: str, **kw) -> CompactionSpec:
    """A spec with repeat-prefill queries (the tiny model has no tokenizer)."""
    kw.setdefault("queries", QueryConfig(sources=SRC))
    return CompactionSpec(method=method, **kw)


def test_split_budget():
    assert split_budget(10, [50, 50]) == [5, 5]
    assert sum(split_budget(7, [10, 3, 20])) == 7
    assert split_budget(3, [1, 1, 100]) == [1, 1, 1]
    with pytest.raises(ValueError, match="budget 1"):
        split_budget(1, [5, 5])


def test_identity_pipeline_equals_full_logits(tiny):
    ids = random_ids(40)
    prefix, times = compact_prefix(
        tiny, None, ids[:32], _spec("test-identity", ratio=1.0), hooks=QUIET
    )
    assert prefix.logical_length == 32 and prefix.num_layers == 2
    assert times.total >= times.compaction >= 0 and len(times.per_layer) == 2
    full = tiny(input_ids=torch.tensor([ids])).logits[0, 32:]
    got = hf.PrefixState.from_compacted(prefix).forward(tiny, ids[32:])
    torch.testing.assert_close(got, full, atol=1e-4, rtol=0)


def test_chunked_identity_matches_unchunked(tiny):
    ids = random_ids(50, seed=1)
    a, _ = compact_prefix(tiny, None, ids, _spec("test-identity", ratio=1.0), hooks=QUIET)
    b, _ = compact_prefix(
        tiny, None, ids, _spec("test-identity", ratio=1.0, chunk_size=13), hooks=QUIET
    )
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(la.indptr, lb.indptr) and torch.equal(la.kept_indices, lb.kept_indices)
        torch.testing.assert_close(la.keys, lb.keys)


def test_sinks_kept_with_beta_zero_and_budget(tiny):
    ids = random_ids(50, seed=2)
    spec = _spec("test-first", ratio=0.2, keep_sink_tokens=3, chunk_size=20)
    prefix, _ = compact_prefix(tiny, None, ids, spec, hooks=QUIET)
    assert prefix.kept_per_head() == [[10, 10], [10, 10]]
    layer = prefix.layers[0]
    _k, _, b = layer.head(1)
    assert torch.equal(b[:3], torch.zeros(3)) and bool((b[3:] == 0.5).all())
    # chunks of 20 over the 47 non-sink tokens: budgets 3+3+1 starting at 3, 23, 43
    assert layer.kept_indices[10:20].tolist() == [0, 1, 2, 3, 4, 5, 23, 24, 25, 43]


def test_kvzip_gets_each_querys_mass_after_the_prefix_off_policy(tiny, monkeypatch):
    """The pipeline hands kvzip (``needs_suffix_lse``) the queries' suffix log-sum-exp, one per
    query row (chunks too: the rows repeat with the queries); on-policy it has none."""
    from compactor.methods.baselines import KVzip

    seen: list[tuple[tuple[int, ...], tuple[int, ...] | None]] = []
    real = KVzip.score

    def spy(self, x):
        lse = x.suffix_lse
        seen.append((tuple(x.queries.shape[:2]), None if lse is None else tuple(lse.shape)))
        if lse is not None:
            assert bool(torch.isfinite(lse).all())  # repeat-prefill: every query has its own
        return real(self, x)

    monkeypatch.setattr(KVzip, "score", spy)
    ids = random_ids(40, seed=6)
    for kw in ({}, {"chunk_size": 13}):
        seen.clear()
        compact_prefix(tiny, None, ids, _spec("kvzip", ratio=0.3, **kw), hooks=QUIET)
        assert seen and all(lse == q for q, lse in seen)
    seen.clear()  # the ratio search's candidates too (fitted on two follow-ups, one held out)
    follow = QueryConfig(sources=("follow-up",))
    spec = _spec("kvzip", target_error=0.5, queries=follow)
    compact_prefix(tiny, None, ids, spec, [[1, 2, 3], [4, 5], [6, 7, 8]], hooks=QUIET)
    assert seen and all(lse == q for q, lse in seen)
    seen.clear()
    compact_prefix(tiny, None, ids, _spec("kvzip", ratio=0.3, on_policy=True), hooks=QUIET)
    assert seen and all(lse is None for _, lse in seen)


def test_a_shared_reuse_collects_the_suffix_lse_once_and_only_when_asked(tiny, monkeypatch):
    """Hooks.reuse shared by methods with and without ``needs_suffix_lse``: one prefill, one
    query plan; the queries are collected again once (with the suffix) when kvzip follows a
    method that did not need it, never after; a method without the need gets none."""
    from compactor.methods.baselines import KVzip, SnapKV
    from compactor.pipeline import inputs as inputs_mod

    calls = {"prefill": 0, "collect": []}
    real_prefill, real_collect = inputs_mod.hf.prefill, inputs_mod.collect_reference

    def prefill(*a, **kw):
        calls["prefill"] += 1
        return real_prefill(*a, **kw)

    def collect(*a, **kw):
        calls["collect"].append(a[-1])  # with_suffix_lse
        return real_collect(*a, **kw)

    monkeypatch.setattr(inputs_mod.hf, "prefill", prefill)
    monkeypatch.setattr(inputs_mod, "collect_reference", collect)
    got: list[tuple[str, bool]] = []  # (method, handed a suffix lse)
    for cls in (KVzip, SnapKV):
        real_score = cls.score

        def spy(self, x, real=real_score):
            got.append((self.name, x.suffix_lse is not None))
            return real(self, x)

        monkeypatch.setattr(cls, "score", spy)
    hooks = Hooks(progress=False, reuse={})
    ids = random_ids(40, seed=7)
    for method in ("snapkv", "kvzip", "kvzip", "snapkv"):
        prefix, _ = compact_prefix(tiny, None, ids, _spec(method, ratio=0.3), hooks=hooks)
        assert prefix.num_layers == 2
    assert calls == {"prefill": 1, "collect": [False, True]}
    assert {"kvzip", "snapkv"} == {name for name, _ in got}
    assert all(has == (name == "kvzip") for name, has in got)


def test_on_policy_runs_and_matches_shapes(tiny):
    ids = random_ids(30, seed=3)
    a, _ = compact_prefix(
        tiny, None, ids, _spec("test-first", tokens=8, on_policy=True), hooks=QUIET
    )
    b, _ = compact_prefix(tiny, None, ids, _spec("test-first", tokens=8), hooks=QUIET)
    assert a.kept_per_head() == b.kept_per_head() == [[8, 8], [8, 8]]
    assert a.params["on_policy"] is True


def test_method_reports_collected_per_layer_and_chunk(tiny):
    ids = random_ids(40, seed=4)
    run = dict(ratio=0.3, keep_sink_tokens=2)
    gv, _ = compact_prefix(tiny, None, ids, _spec("gvote", chunk_size=19, **run), hooks=QUIET)
    report = gv.params["method_report"]
    assert [r["layer"] for r in report] == [0, 0, 1, 1]  # one per layer and chunk
    assert [r["span"] for r in report[:2]] == [[2, 21], [21, 40]]
    for r in report:
        assert 0 < r["ratio"] <= 1 and len(r["kept_per_kv_head"]) == 2
    ratios = [r["ratio"] for r in report]
    assert gv.budget.ratio_chosen == sum(ratios) / len(ratios)
    flat = _spec("kvzip", method_params={"layerwise": True}, **run)
    zip_, _ = compact_prefix(tiny, None, ids, flat, hooks=QUIET)
    assert [sum(r["budgets"]) for r in zip_.params["method_report"]] == [20, 20]
    assert zip_.budget.ratio_chosen is None  # a report without "ratio"
    am, _ = compact_prefix(tiny, None, ids, _spec("am-highest", **run), hooks=QUIET)
    assert am.params["method_report"] is None and am.budget.ratio_chosen is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ratio": 0.0}, "ratio must be in"),
        ({"ratio": 0.5, "tokens": 3}, "exactly one"),
        ({"tokens": 0}, "tokens must be"),
        ({"ratio": 0.5, "chunk_size": 0}, "chunk_size"),
        ({"ratio": 0.5, "keep_sink_tokens": -1}, "keep_sink_tokens"),
        ({}, "exactly one of ratio and tokens .*budget 'auto'"),
        ({"ratio": 0.5, "method": "nosuch"}, "unknown method 'nosuch'; available: .*am-omp"),
        ({"ratio": 0.5, "method_params": {"bogus": 1}}, r"no parameter\(s\) \['bogus'\]"),
    ],
)
def test_bad_arguments(tiny, kwargs, match):
    spec = _spec(kwargs.pop("method", "test-first"), **kwargs)
    with pytest.raises(ValueError, match=match):
        compact_prefix(tiny, None, random_ids(20), spec, hooks=QUIET)


def test_spec_is_checked_before_the_model_is_touched():
    with pytest.raises(ValueError, match="ratio must be in"):
        compact_prefix(None, None, random_ids(20), _spec("test-first", ratio=2.0), hooks=QUIET)


def test_prebuilt_method_hook(tiny):
    from compactor.methods import get_method

    ids = random_ids(30, seed=4)
    spec = _spec("test-first", tokens=8)
    a, _ = compact_prefix(tiny, None, ids, spec, hooks=QUIET)
    meth = get_method("test-first")
    b, _ = compact_prefix(tiny, None, ids, spec, hooks=Hooks(progress=False, method=meth))
    assert a.metadata() == b.metadata()
    with pytest.raises(ValueError, match=r"hooks\.method is 'test-first'"):
        compact_prefix(tiny, None, ids, _spec("am-highest", tokens=8), hooks=Hooks(method=meth))


def test_real_model_am_omp_fast(prepared_model):
    from compactor.models import fingerprint

    model, tok = real_model(prepared_model)
    ids = tok("The mill stands where the river bends twice. " * 8)["input_ids"]
    prefix, times = compact_prefix(model, tok, ids, _spec("am-omp-fast", ratio=0.25), hooks=QUIET)
    prefix.validate(
        expected_fingerprint=fingerprint(prepared_model), num_layers=30, num_kv_heads=3, head_dim=64
    )
    assert max(max(h) for h in prefix.kept_per_head()) <= round(0.25 * len(ids))
    assert times.prefill > 0 and times.queries > 0 and times.compaction > 0

"""Long prefixes: chunked prefill, mask-bounded appends, the service's automatic chunk size."""

from __future__ import annotations

import pytest
import torch

from compactor import hf
from compactor.hf import decode as hf_decode
from compactor.query_capture import QueryConfig, collect_queries, plan_queries
from compactor.service.engine import AUTO_CHUNK_TOKENS, auto_chunk_size
from compactor.spec import CompactionSpec
from compactor.workers.job import CompactJob
from tests._tiny import random_ids


def _close(a, b):
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_chunked_prefill_matches_one_call(tiny):
    ids = random_ids(50, seed=1)
    whole = hf.prefill(tiny, ids, with_queries=True)
    for chunk in (7, 16, 49):  # uneven last chunk, exact split, one token left over
        part = hf.prefill(tiny, ids, with_queries=True, chunk=chunk)
        for a, b in zip(whole.keys + whole.values, part.keys + part.values):
            assert a.shape == b.shape == (2, 50, 16)
            _close(a, b)
        assert whole.queries is not None and part.queries is not None
        for a, b in zip(whole.queries, part.queries):
            assert b.shape == (4, 50, 16)
            _close(a, b)
        _close(whole.last_logits, part.last_logits)
    with pytest.raises(ValueError, match="chunk must be >= 1, got 0"):
        hf.prefill(tiny, ids, chunk=0)


def test_short_prefill_is_one_call(tiny):
    """A prefix of at most PREFILL_CHUNK tokens runs in one forward (results as before)."""
    calls = []
    h = tiny.model.layers[0].register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        hf.prefill(tiny, random_ids(40), chunk=40)
        assert len(calls) == 1
        hf.prefill(tiny, random_ids(40), chunk=13)
        assert len(calls) == 1 + 4
    finally:
        h.remove()


def test_long_append_runs_in_mask_bounded_blocks(tiny, monkeypatch):
    ids = random_ids(60, seed=2)
    pre = hf.prefill(tiny, ids[:20])
    state = hf.PrefixState.full(pre)
    want = state.fork().forward(tiny, ids[20:])  # [40, V], one call
    assert state.append_block(tiny, 40) == 40
    # a mask budget of 10 rows of a uniform-beta [q, 20 + 40] mask: blocks of 10 tokens
    monkeypatch.setattr(hf_decode, "APPEND_MASK_BYTES", 4 * 60 * 10)
    assert state.append_block(tiny, 40) == 10
    with hf.record_queries(tiny, [1]) as rec:
        got = state.fork().forward(tiny, ids[20:])
    assert len(rec[1]) == 4 and rec[1][0].shape == (4, 10, 16)  # one entry per call
    _close(got, want)
    last = state.fork().forward(tiny, ids[20:], last_only=True)
    assert last.shape == (1, want.shape[-1])
    _close(last[0], want[-1])
    # batched, left-padded prompts: same logits as one call per prompt
    prompts = [ids[20:45], ids[30:33]]
    out = hf.batched_generate(tiny, state.fork(), prompts, 3)
    assert out == [hf.greedy_generate(tiny, state.fork(), p, 3) for p in prompts]


def test_per_head_beta_counts_every_query_head(tiny, monkeypatch):
    pre = hf.prefill(tiny, random_ids(20))
    bias = torch.zeros(2, 2, 20)
    bias[:, 1, 3] = -1.0  # heads differ: the mask is per query head (4 of them)
    state = hf.PrefixState(list(pre.keys), list(pre.values), bias, 20)
    monkeypatch.setattr(hf_decode, "APPEND_MASK_BYTES", 4 * 4 * 60 * 10)
    assert state.append_block(tiny, 40) == 10


def test_collect_queries_joins_the_blocks(tiny, monkeypatch):
    ids = random_ids(30, seed=3)
    pre = hf.prefill(tiny, ids)
    plan = plan_queries(
        tiny, None, ids, pre, QueryConfig(sources=("repeat-prefill",), max_queries_per_head=999)
    )
    want = collect_queries(tiny, hf.PrefixState.full(pre), plan)
    monkeypatch.setattr(hf_decode, "APPEND_MASK_BYTES", 4 * 60 * 8)
    got = collect_queries(tiny, hf.PrefixState.full(pre), plan)
    for layer in want:
        assert got[layer].shape == want[layer].shape == (2, 2 * 30, 16)
        _close(got[layer], want[layer])


def test_auto_chunk_size_rule():
    spec = CompactionSpec(method="am-highest", ratio=0.1)
    assert auto_chunk_size(spec, AUTO_CHUNK_TOKENS, AUTO_CHUNK_TOKENS) is None  # not longer
    assert auto_chunk_size(spec, AUTO_CHUNK_TOKENS + 1, AUTO_CHUNK_TOKENS) == AUTO_CHUNK_TOKENS
    assert auto_chunk_size(spec, 32768, 4096) == 4096
    assert auto_chunk_size(spec, 32768, None) is None  # the rule is off
    own = spec.replace(chunk_size=1000)
    assert auto_chunk_size(own, 32768, 4096) == 1000  # the spec's own choice stands
    assert auto_chunk_size(spec.replace(head_budgets="auto"), 32768, 4096) is None
    assert auto_chunk_size(CompactionSpec(method="kvcompose", ratio=0.1), 32768, 4096) is None


def test_service_keys_the_effective_chunk_size(tmp_path):
    """The job is computed and keyed with the chunk size the rule picked."""
    from compactor.service.engine import CompactionService, ModelSummary, ServiceConfig
    from compactor.service.metrics import ServiceMetrics
    from compactor.workers.pool import PoolConfig

    summary = ModelSummary("fp", "m", 2, 2, 16, "float32", 128, 512)
    cfg = ServiceConfig(PoolConfig(model_dir=str(tmp_path)), auto_chunk_tokens=100)
    service = CompactionService(cfg, summary, pool=None, metrics=ServiceMetrics())
    spec = CompactionSpec(method="am-highest", ratio=0.1)
    long_job = CompactJob("fp", tuple(range(2, 300)), spec)
    short_job = CompactJob("fp", tuple(range(2, 90)), spec)
    eff = service.effective_job(long_job)
    assert eff.spec.chunk_size == 100
    assert eff.key() == CompactJob("fp", long_job.token_ids, spec.replace(chunk_size=100)).key()
    assert service.effective_job(short_job) is short_job


def test_generation_is_one_batch_over_the_shared_prefix(tiny, monkeypatch):
    """Every prompt decodes in one batch (the prefix is held once), answers as one by one."""
    import compactor.query_plan as query_plan

    ids = random_ids(40, seed=4)
    pre = hf.prefill(tiny, ids[:24])
    prompts = [ids[24:27], ids[27:35], ids[35:36], ids[30:32], ids[25:38]]
    calls = []
    real = hf.batched_generate
    monkeypatch.setattr(
        hf,
        "batched_generate",
        lambda m, s, p, *a, **k: calls.append(len(p)) or real(m, s, p, *a, **k),
    )
    got = query_plan._generate(tiny, None, pre, prompts, 4, 0.0, 0)
    assert calls == [len(prompts)]
    full = hf.PrefixState.full(pre)
    assert got == [hf.greedy_generate(tiny, full.fork(), p, 4) for p in prompts]


def test_prefill_chunk_rule():
    from compactor.hf.model import PREFILL_CHUNK, prefill_chunk

    assert prefill_chunk(10) == 10 and prefill_chunk(PREFILL_CHUNK) == PREFILL_CHUNK
    assert prefill_chunk(8192) == PREFILL_CHUNK  # its [4096, 8192] mask fits 256 MiB
    assert prefill_chunk(32768) == 2048  # [2048, 32768] fp32 = 256 MiB
    assert prefill_chunk(1 << 22) == 256  # never below 256 tokens
    # on an accelerator the chunk is PREFILL_CHUNK whatever T (no float mask on the host)
    assert prefill_chunk(1 << 17, "cuda") == prefill_chunk(1 << 22, "meta") == PREFILL_CHUNK
    assert prefill_chunk(100, "cuda") == 100

"""Batched decoding over a shared prefix: the prefix is held once, each row caches only its
own tokens, and the logits and tokens equal decoding each prompt alone."""

from __future__ import annotations

import pytest
import torch

from compactor import hf
from compactor.hf import shared_prefix
from tests._tiny import random_ids
from tests.compactor._fixtures import prefix_from

T = 30
PROMPTS = [[5, 9, 77], [3, 1, 4, 1, 5, 9, 2, 6], [42], [8, 8, 100, 7, 11]]  # unequal: left padding


def _states(tiny):
    """(name, PrefixState, prefill): a full prefix, and a compacted one with ragged heads
    (head 0 keeps every 3rd slot, head 1 all but the last 4) and non-uniform beta."""
    ids = random_ids(T, seed=11)
    pre = hf.prefill(tiny, ids)
    keep = [list(range(0, T, 3)), list(range(T - 4))]
    n = sum(len(k) for k in keep)
    beta = torch.linspace(-1.5, 1.0, n)
    compacted = hf.PrefixState.from_compacted(prefix_from(pre, keep, beta))
    assert not all(compacted._uniform_layers())  # the heads differ in beta and length
    return [("full", hf.PrefixState.full(pre), pre), ("compacted", compacted, pre)]


def _left_pad(prompts):
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    pad = torch.ones(len(prompts), width, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        pad[i, width - len(p) :] = False
    return ids, pad


@pytest.mark.parametrize("which", [0, 1], ids=["full", "compacted"])
def test_batched_logits_equal_each_prompt_alone(tiny, which):
    _, state, _ = _states(tiny)[which]
    ids, pad = _left_pad(PROMPTS)
    batch = state.fork()
    got = batch.forward(tiny, ids, pad=pad)  # [B, width, V]
    steps = [torch.tensor([[7], [19], [64], [2]]), torch.tensor([[90], [1], [33], [5]])]
    got_steps = [batch.forward(tiny, s)[:, 0] for s in steps]
    for i, p in enumerate(PROMPTS):
        alone = state.fork()
        want = alone.forward(tiny, p)  # one sequence: prefix in its own cache, fused SDPA
        torch.testing.assert_close(got[i, -len(p) :], want, atol=2e-5, rtol=1e-5)
        for s, g in zip(steps, got_steps):
            torch.testing.assert_close(g[i], alone.forward(tiny, s[i])[0], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("which", [0, 1], ids=["full", "compacted"])
def test_batched_greedy_tokens_equal_each_prompt_alone(tiny, which):
    _, state, _ = _states(tiny)[which]
    got = hf.batched_generate(tiny, state.fork(), PROMPTS, 6)
    assert got == [hf.greedy_generate(tiny, state.fork(), p, 6) for p in PROMPTS]


def test_seeded_sampling_is_deterministic(tiny):
    _, state, _ = _states(tiny)[1]

    def draw(seed):
        gen = torch.Generator().manual_seed(seed)
        return hf.batched_generate(tiny, state.fork(), PROMPTS, 8, temperature=1.5, generator=gen)

    first = draw(3)
    assert draw(3) == first
    assert all(len(row) == 8 for row in first)


def test_prefix_is_held_once_and_rows_cache_only_their_tokens(tiny):
    _, state, pre = _states(tiny)[0]
    s = state.fork()
    ids, pad = _left_pad(PROMPTS)
    s.forward(tiny, ids, pad=pad)
    s.forward(tiny, torch.tensor([[1], [2], [3], [4]]))
    rows = s._rows
    assert rows is not None and rows.num_new == ids.shape[1] + 1
    for layer in range(2):
        k, v = rows.cache.layers[layer].keys, rows.cache.layers[layer].values
        assert k.shape == v.shape == (len(PROMPTS), 2, ids.shape[1] + 1, 16)  # [B, H_kv, n, D]
        # the prefix's own tensors, neither expanded nor copied per row
        assert rows.keys[layer].data_ptr() == pre.keys[layer].data_ptr()
        assert rows.values[layer].data_ptr() == pre.values[layer].data_ptr()
        assert rows.keys[layer].shape == (2, T, 16)
    with pytest.raises(ValueError, match="4 rows, got one sequence"):
        s.forward(tiny, [1, 2])
    with pytest.raises(ValueError, match="4 rows, got 2"):
        s.forward(tiny, torch.tensor([[1], [2]]))
    one = state.fork()
    one.forward(tiny, [1, 2])
    with pytest.raises(ValueError, match="one sequence, got a batch"):
        one.forward(tiny, ids)


def test_blocked_prefix_rows_and_tail_calls_give_the_same_logits(tiny, monkeypatch):
    _, state, _ = _states(tiny)[1]
    ids, pad = _left_pad(PROMPTS)
    want = state.fork().forward(tiny, ids, pad=pad)
    monkeypatch.setattr(shared_prefix, "PREFIX_LOGITS_BYTES", 4 * 2 * T * 5)  # 5 query rows
    # a tail budget of 3 tokens' logits at this width: the prompts run in 3 forward calls
    monkeypatch.setattr(shared_prefix, "TAIL_LOGITS_BYTES", 4 * 4 * 4 * 8 * 3)
    with hf.record_queries(tiny, [1]) as rec:
        got = state.fork().forward(tiny, ids, pad=pad)
    assert [q.shape[1] for q in rec[1]] == [3, 3, 2]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_record_queries_sees_the_batched_forward(tiny):
    """Row 0 of a batch (the longest prompt: no padding) records the queries it has alone."""
    _, state, _ = _states(tiny)[1]
    prompts = [PROMPTS[1], PROMPTS[0]]
    ids, pad = _left_pad(prompts)
    with hf.record_queries(tiny) as batched:
        state.fork().forward(tiny, ids, pad=pad)
    with hf.record_queries(tiny) as alone:
        state.fork().forward(tiny, prompts[0])
    for layer in range(2):
        torch.testing.assert_close(batched[layer][0], alone[layer][0], atol=1e-5, rtol=0)


def test_check_aborts_the_batched_generation(tiny):
    _, state, _ = _states(tiny)[0]
    calls = []

    class Stop(Exception):
        pass

    def check():
        calls.append(1)
        if len(calls) == 3:
            raise Stop

    with pytest.raises(Stop):
        hf.batched_generate(tiny, state.fork(), PROMPTS, 10, check=check)
    assert len(calls) == 3  # the prompt's forward, then one per generated token


@pytest.mark.parametrize("which", [0, 1], ids=["full", "compacted"])
def test_static_rows_give_the_logits_of_the_growing_cache(tiny, which):
    _, state, _ = _states(tiny)[which]
    ids, pad = _left_pad(PROMPTS)
    steps = [torch.tensor([[7], [19], [64], [2]]), torch.tensor([[90], [1], [33], [5]])]
    grow, static = state.fork(), state.fork()
    rows = static.start_rows(tiny, len(PROMPTS), ids.shape[1] + len(steps))
    torch.testing.assert_close(
        static.forward(tiny, ids, pad=pad), grow.forward(tiny, ids, pad=pad), atol=2e-5, rtol=1e-5
    )
    ptrs = [k.data_ptr() for k in rows.cache.keys]
    for s in steps:
        torch.testing.assert_close(
            static.forward(tiny, s), grow.forward(tiny, s), atol=2e-5, rtol=1e-5
        )
    assert [k.data_ptr() for k in rows.cache.keys] == ptrs  # written in place, never grown
    assert rows.num_new == ids.shape[1] + len(steps) == rows.capacity
    with pytest.raises(ValueError, match="capacity"):
        static.forward(tiny, steps[0])
    with pytest.raises(ValueError, match="fresh state"):
        static.start_rows(tiny, 4, 3)


def test_greedy_steps_read_device_state_only(tiny, monkeypatch):
    """What a CUDA graph replays: each decode step is one model call, with no host sync
    and no Python value that changes per step (the step is rerun with rows._n frozen)."""
    _, state, _ = _states(tiny)[1]
    want = hf.batched_generate(tiny, state.fork(), PROMPTS, 6)
    ids, pad = _left_pad(PROMPTS)
    s = state.fork()
    rows = s.start_rows(tiny, len(PROMPTS), ids.shape[1] + 5)
    logits = s.forward(tiny, ids, last_only=True, pad=pad)[:, -1]
    calls = []
    handle = tiny.register_forward_pre_hook(lambda *_: calls.append(1))

    def no_sync(*_a, **_k):
        raise AssertionError("host sync inside a decode step")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, no_sync)
    tok = logits.argmax(-1, keepdim=True)
    got = [tok.clone()]
    frozen = rows._n
    with torch.inference_mode():
        for _ in range(5):
            rows._step(tiny, tok)  # rows._n is not advanced: the step must not read it
            got.append(tok.clone())
    monkeypatch.undo()
    handle.remove()
    assert rows._n == frozen and len(calls) == 5  # one model call per step
    tokens = torch.cat(got, 1).tolist()
    assert [row[: len(w)] for row, w in zip(tokens, want)] == want

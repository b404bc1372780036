"""compactor.query_capture: sources, pooling, reservoir, plan/collect."""

from __future__ import annotations

import pytest
import torch

from compactor import hf
from compactor.query_capture import (
    QueryConfig,
    collect_queries,
    plan_queries,
    random_queries,
    reservoir,
)
from tests._tiny import random_ids, real_model


def test_reservoir_is_deterministic_and_capped():
    q = torch.randn(2, 50, 4)
    a, b = reservoir(q, 10, seed=3), reservoir(q, 10, seed=3)
    assert a.shape == (2, 10, 4) and torch.equal(a, b)
    assert not torch.equal(a, reservoir(q, 10, seed=4))
    assert reservoir(q, 100) is q
    with pytest.raises(ValueError, match="cap"):
        reservoir(q, 0)


def test_random_queries_norms():
    q = random_queries(torch.tensor([1.0, 5.0]), 7, 8, seed=0)
    assert q.shape == (2, 7, 8)
    torch.testing.assert_close(q.norm(dim=-1), torch.tensor([[1.0] * 7, [5.0] * 7]))


def test_config_validation():
    with pytest.raises(ValueError, match="unknown query source 'nope'"):
        QueryConfig(sources=("nope",))
    with pytest.raises(ValueError, match="max_queries_per_head"):
        QueryConfig(max_queries_per_head=0)


def test_sources_shapes_and_repeat_prefill_semantics(tiny):
    ids = random_ids(24)
    pre = hf.prefill(tiny, ids, with_queries=True)
    cfg = QueryConfig(
        sources=("context-prefill", "repeat-prefill", "random", "follow-up"),
        max_queries_per_head=10_000,
        random_count=5,
    )
    plan = plan_queries(tiny, None, ids, pre, cfg, follow_ups=[[1, 2, 3]])
    qs = collect_queries(tiny, hf.PrefixState.full(pre), plan)
    # per KV head: G=2 x (24 repeat + 3 follow-up + 24 context) + 5 random
    assert set(qs) == {0, 1} and qs[0].shape == (
        2,
        2 * (24 + 3 + 24) + 6,
        16,
    )  # 5 random -> 6 (multiple of G=2)
    # repeat-prefill: queries of the second copy == queries of positions T..2T-1 of C+C
    with hf.record_queries(tiny, [1]) as rec:
        tiny(input_ids=torch.tensor([ids + ids]))
    expect = hf.pool_gqa(rec[1][0][:, 24:], 2)
    only = plan_queries(
        tiny, None, ids, pre, QueryConfig(sources=("repeat-prefill",), max_queries_per_head=10_000)
    )
    got = collect_queries(tiny, hf.PrefixState.full(pre), only, layers=[1])[1]
    torch.testing.assert_close(got, expect, atol=1e-4, rtol=0)


def test_suffix_lse_is_the_models_mass_over_the_repeated_tokens(tiny):
    """repeat-prefill over C: each query's suffix log-sum-exp is the log-sum-exp of its logits
    over the keys of the second copy up to itself, as the model's C+C forward has them; under
    a reservoir cap every pooled query keeps its own value, and the prefix-side sources
    (context-prefill, random) have none (-inf)."""
    from transformers import DynamicCache

    from compactor.query_capture import collect_reference

    ids, T = random_ids(24, seed=3), 24
    pre = hf.prefill(tiny, ids, with_queries=True)
    cache = DynamicCache()
    with hf.record_queries(tiny, [1]) as rec:
        tiny(input_ids=torch.tensor([ids + ids]), past_key_values=cache, use_cache=True)
    q, k = rec[1][0][:, T:].float(), cache.layers[1].keys[0, :, T:].float()  # [4|2, T, 16]
    logits = q @ k.repeat_interleave(2, 0).transpose(1, 2) * hf.model_info(tiny).sm_scale
    logits.masked_fill_(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    want_q, want = hf.pool_gqa(q, 2), logits.logsumexp(-1).reshape(2, 2 * T)

    only = QueryConfig(sources=("repeat-prefill",), max_queries_per_head=10_000)
    plan = plan_queries(tiny, None, ids, pre, only)
    full = hf.PrefixState.full(pre)
    got_q, got = collect_reference(tiny, full, plan, [1], with_suffix_lse=True)
    torch.testing.assert_close(got_q[1], want_q, atol=1e-4, rtol=0)
    torch.testing.assert_close(got[1], want, atol=1e-3, rtol=0)
    assert collect_reference(tiny, full, plan, [1])[1] == {}

    mixed = QueryConfig(
        sources=("repeat-prefill", "context-prefill", "random"),
        max_queries_per_head=20,
        random_count=4,
    )
    plan = plan_queries(tiny, None, ids, pre, mixed)
    got_q, got = collect_reference(tiny, full, plan, [1], with_suffix_lse=True)
    assert got_q[1].shape == (2, 20, 16) and got[1].shape == (2, 20)
    repeated = 0
    for h in range(2):
        for row, lse in zip(got_q[1][h], got[1][h]):
            match = ((want_q[h] - row).abs().amax(-1) < 1e-4).nonzero()
            if len(match):  # a repeat-prefill query: its own value
                torch.testing.assert_close(lse, want[h, match[0, 0]], atol=1e-3, rtol=0)
                repeated += 1
            else:  # context-prefill or random: no mass after the prefix
                assert lse == float("-inf")
    assert 0 < repeated < 40


def test_follow_up_answers_are_the_full_prefix_greedy_answers(tiny):
    ids = random_ids(20, seed=5)
    pre = hf.prefill(tiny, ids)
    follow = [[1, 2, 3], [4, 5]]
    cfg = QueryConfig(sources=("follow-up",), follow_up_answer_tokens=4)
    plan = plan_queries(tiny, None, ids, pre, cfg, follow_ups=follow)
    for f, cont in zip(follow, plan.continuations):
        answer = hf.greedy_generate(tiny, hf.PrefixState.full(pre), f, 4)
        assert cont.source == "follow-up" and cont.tokens == f + answer and len(answer) == 4
    plain = plan_queries(tiny, None, ids, pre, QueryConfig(sources=("follow-up",)), follow)
    assert [c.tokens for c in plain.continuations] == follow
    with pytest.raises(ValueError, match="follow_up_answer_tokens must be >= 0, got -1"):
        QueryConfig(follow_up_answer_tokens=-1)


def test_missing_inputs_raise(tiny):
    ids = random_ids(10)
    pre = hf.prefill(tiny, ids)
    with pytest.raises(ValueError, match="with_queries"):
        plan_queries(tiny, None, ids, pre, QueryConfig(sources=("random",)))
    with pytest.raises(ValueError, match="tokenizer"):
        plan_queries(tiny, None, ids, pre, QueryConfig(sources=("self-study",)))
    with pytest.raises(ValueError, match="follow_ups"):
        plan_queries(tiny, None, ids, pre, QueryConfig(sources=("follow-up",)))


def test_self_study_on_real_model(prepared_model):
    model, tok = real_model(prepared_model)
    ids = tok("The lighthouse on the north cape shows two red flashes every twenty seconds.")[
        "input_ids"
    ]
    pre = hf.prefill(model, ids)
    cfg = QueryConfig(sources=("self-study",), self_study_tokens=1)
    plan = plan_queries(model, tok, ids, pre, cfg)
    assert len(plan.continuations) == 4 and all(
        c.source == "self-study" for c in plan.continuations
    )
    assert (
        plan_queries(model, tok, ids, pre, cfg).continuations == plan.continuations
    )  # deterministic
    qs = collect_queries(model, hf.PrefixState.full(pre), plan, layers=[0, 29])
    n = 3 * sum(len(c.tokens) for c in plan.continuations)
    assert all(len(c.tokens) > 1 for c in plan.continuations)
    assert qs[29].shape == (3, n, 64)


def test_cat_pooled_and_grouped_reservoir_keep_query_heads_contiguous() -> None:
    from compactor.hf import pool_gqa
    from compactor.query_capture import cat_pooled, reservoir

    # 2 KV heads x G=3 query heads; each row's value encodes (query head, token)
    def block(n: int, offset: int) -> torch.Tensor:
        q = torch.stack([torch.full((n, 1), 100.0 * h) + offset for h in range(6)])
        q = q + torch.arange(n, dtype=torch.float32).view(1, n, 1)
        return pool_gqa(q, 2)  # [2, 3n, 1]

    a, b = block(4, 0), block(5, 50)
    joined = cat_pooled([a, b], 3)
    assert joined.shape == (2, 27, 1)
    heads = joined.reshape(2, 3, 9, 1)  # [H_kv, G, n, 1]: each query head's rows together
    assert torch.all(heads // 100 == torch.tensor([[0, 1, 2], [3, 4, 5]]).view(2, 3, 1, 1))
    capped = reservoir(joined, cap=12, seed=0, group_size=3)
    assert capped.shape == (2, 12, 1)
    kept = capped.reshape(2, 3, 4, 1) % 100  # the same tokens for every query head
    assert torch.equal(kept[:, 0], kept[:, 1]) and torch.equal(kept[:, 1], kept[:, 2])
    assert torch.equal(reservoir(joined, 12, 0), reservoir(joined, 12, 0, 1))  # G=1 unchanged
    with pytest.raises(ValueError, match="do not split"):
        reservoir(joined[:, :26], 12, 0, 3)


def test_repeat_turn_asks_for_the_copy_as_the_assistants_turn(prepared_model):
    """repeat-turn: the instruction, the chat template's close of the user turn and open of
    the assistant's, then the prefix; every token's queries kept (the instruction's too)."""
    from compactor.query_plan import REPEAT_TURN_INSTRUCTION, assistant_turn

    model, tok = real_model(prepared_model)
    assert assistant_turn(tok) == "<|im_end|>\n<|im_start|>assistant\n"
    assert assistant_turn(None) == "\n"
    ids = list(tok("The code is 4417.", add_special_tokens=False)["input_ids"])
    pre = hf.prefill(model, ids)
    plan = plan_queries(model, tok, ids, pre, QueryConfig(sources=("repeat-turn",)))
    (cont,) = plan.continuations
    instr = tok(REPEAT_TURN_INSTRUCTION + assistant_turn(tok), add_special_tokens=False)
    assert cont.source == "repeat-turn" and cont.keep_from == 0
    assert cont.tokens == list(instr["input_ids"]) + ids

"""The plugin's shared-document workload in transformers: prompts cut into a shared prefix and
per-question suffixes, greedy answers after a (full or compacted) prefix, strict agreement.

Used by ``benchmarks/server/agreement.py`` and ``benchmarks/server/next_question.py``. Token ids are plain
``list[int]``; a prefix is [T], a suffix is the rest of one question's prompt. Shape legend:
T prefix tokens, n queries, H_kv KV heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "attention_error",
    "common_length",
    "greedy_answers",
    "ints",
    "prompt_ids",
    "question_queries",
    "same_first",
]


def ints(text: str) -> list[int]:
    """A comma-separated flag value as ints ("2,6" -> [2, 6])."""
    return [int(x) for x in text.split(",") if x]


def prompt_ids(tokenizer: Any, doc: str, questions: Sequence[str]) -> list[list[int]]:
    """Token ids of ``harness.workload.prompt(doc, q)`` for each question, in order."""
    from harness.workload import prompt

    return [list(tokenizer(prompt(doc, q))["input_ids"]) for q in questions]


def common_length(seqs: Sequence[Sequence[int]]) -> int:
    """Length of the longest common prefix of `seqs` (the radix tree's branch point).

    Raises ValueError on no sequences.
    """
    if not seqs:
        raise ValueError("common_length: no sequences")
    n = 0
    while all(len(x) > n and x[n] == seqs[0][n] for x in seqs):
        n += 1
    return n


def greedy_answers(
    model: Any,
    state: Any,
    suffixes: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos: Sequence[int],
) -> list[list[int]]:
    """Greedy answer to each suffix after `state` (an ``hf.PrefixState``, forked per suffix:
    `state` itself is not mutated)."""
    from compactor import hf

    return [
        hf.greedy_generate(model, state.fork(), s, max_new_tokens, eos_ids=eos) for s in suffixes
    ]


def same_first(a: Sequence[int], b: Sequence[int], n: int) -> bool:
    """Strict agreement: the first `n` tokens of `a` and `b` are identical (an answer that
    stopped at EOS earlier must stop at the same place)."""
    return list(a[:n]) == list(b[:n])


def question_queries(
    model: Any,
    tokenizer: Any,
    prefix: Sequence[int],
    prefill: Any,
    suffixes: Sequence[Sequence[int]],
    answer_tokens: int,
) -> dict[int, Any]:
    """The queries ``compactor.pipeline.target`` holds out, for `suffixes` instead of its
    held-out follow-ups: each suffix as a ``follow-up`` continuation with the model's greedy
    `answer_tokens` answer on the full prefix appended, recorded on the full prefix
    (``collect_queries`` on ``hf.PrefixState.full(prefill)``); ``{layer: [H_kv, n, D]}`` fp32.

    `prefill`: ``hf.prefill`` of `prefix` [T]. Raises ValueError on no suffixes.
    """
    from compactor import hf
    from compactor.query_capture import QueryConfig, collect_queries, plan_queries

    if not suffixes:
        raise ValueError("question_queries: no suffixes")
    cfg = QueryConfig(sources=("follow-up",), follow_up_answer_tokens=answer_tokens)
    plan = plan_queries(model, tokenizer, list(prefix), prefill, cfg, suffixes)
    return collect_queries(model, hf.PrefixState.full(prefill), plan)


def attention_error(model: Any, compacted: Any, prefill: Any, queries: dict[int, Any]) -> float:
    """``compactor.pipeline.target.held_out_error`` of `queries` ({layer: [H_kv, n, D]}) on
    `compacted` (a CompactedPrefix) vs the full prefix `prefill`: the relative attention-output
    error the target_error search estimates, mean over layers and KV heads."""
    from compactor import hf
    from compactor.pipeline.target import held_out_error

    dev = prefill.keys[0].device
    layers = [layer.to(dev) for layer in compacted.layers]
    sm_scale = hf.model_info(model).sm_scale
    return held_out_error(layers, prefill.keys, prefill.values, queries, sm_scale)

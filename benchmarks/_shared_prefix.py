"""The plugin's shared-document workload in transformers: prompts cut into a shared prefix and
per-question suffixes, greedy answers after a (full or compacted) prefix, strict agreement.

Used by ``benchmarks/agreement.py`` and ``benchmarks/next_question.py``. Token ids are plain
``list[int]``; a prefix is [T], a suffix is the rest of one question's prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["common_length", "greedy_answers", "ints", "prompt_ids", "same_first"]


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

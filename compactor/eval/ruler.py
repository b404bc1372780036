"""RULER-style tasks, deterministic from (task, tokens, seed, haystack).

Tasks (after RULER, arXiv 2404.06654, sized for a small model's 2k-4k contexts):

  niah_single      one "special magic number" needle; asked for it.
  niah_multikey    four needles with distinct keys; asked for one of them.
  niah_multivalue  four needles with the same key; asked for all four values.
  niah_multiquery  four needles with distinct keys; asked for two of them at once.
  vt               variable tracking: "VAR A = 12345." then "VAR B = VAR A." ... spread
                   through the prose; asked which variables hold the value.
  cwe              common words: a numbered list in which a few words come often; asked
                   for the most common ones.
  fwe              frequent words: "coded" words drawn from a Zipf law; asked for the three
                   most frequent.

The NIAH tasks and vt hide their needles in a haystack of prose (`niah.HAYSTACKS`: the
shipped filler, or the essays RULER uses); cwe and fwe have none, their context is the list.

A case is a prefix (what is compacted) and questions about it; the first question is the
one scored, the others are further questions about the same context (what the multi-query
setting fits on before the scored one is asked). A question's score is the fraction of its
expected answers found as whole words in the model's answer (`niah.score_answer`); it is
correct at 1.
"""

from __future__ import annotations

import itertools
import random
import re
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from compactor.eval.niah import (
    HAYSTACKS,
    NiahQuestion,
    chat_frame,
    count_tokens,
    embed_in_haystack,
    filler_text,
    make_niah,
    question_text,
)

__all__ = ["HAYSTACK_TASKS", "RULER_TASKS", "RulerCase", "make_ruler"]

RULER_TASKS = (
    "niah_single",
    "niah_multikey",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
)
HAYSTACK_TASKS = RULER_TASKS[:5]  # the tasks whose needles sit in prose
_NIAH_KIND = {
    "niah_single": "single",
    "niah_multikey": "multi-key",
    "niah_multivalue": "multi-value",
    "niah_multiquery": "multi-key",
}
_NUMBER = "The special magic number for"
_NUMBERS = "The special magic numbers are"


@dataclass(frozen=True)
class RulerCase:
    """One context: `prefix` (text to compact) and `questions`, the first one scored.

    answer_tokens: greedy tokens an answer needs (more for the list-valued tasks).
    """

    task: str
    seed: int
    prefix: str
    questions: tuple[NiahQuestion, ...]
    answer_tokens: int = 16


def make_ruler(
    tokenizer: Any, task: str, num_tokens: int, seed: int = 0, haystack: str = "filler"
) -> RulerCase:
    """The case of `task` at about `num_tokens` prefix tokens (never more) for `seed`, its
    needles in `haystack` (`HAYSTACK_TASKS` only; the others take the default).

    Raises:
        ValueError: unknown `task` or `haystack`, a haystack for a task without one, or
            `num_tokens` < 256.
    """
    if task not in RULER_TASKS:
        raise ValueError(f"unknown RULER task {task!r}; choose from {', '.join(RULER_TASKS)}")
    if haystack not in HAYSTACKS:
        raise ValueError(f"unknown haystack {haystack!r}; choose from {', '.join(HAYSTACKS)}")
    if haystack != "filler" and task not in HAYSTACK_TASKS:
        raise ValueError(f"task {task!r} has no haystack (its context is a list): {haystack!r}")
    if num_tokens < 256:
        raise ValueError(f"num_tokens must be >= 256, got {num_tokens}")
    if task in _NIAH_KIND:
        return _niah(tokenizer, task, num_tokens, seed, haystack)
    salt = "" if haystack == "filler" else f"-{haystack}"
    rng = random.Random(f"ruler-{task}-{seed}-{num_tokens}{salt}")
    if task == "vt":
        prefix, questions, answer_tokens = _variable_tracking(tokenizer, rng, num_tokens, haystack)
    else:
        build = {"cwe": _common_words, "fwe": _frequent_words}[task]
        prefix, questions, answer_tokens = build(tokenizer, rng, num_tokens)
    return RulerCase(task, seed, prefix, tuple(questions), answer_tokens)


def _ask(tokenizer: Any, question: str, answer_prefix: str) -> str:
    return question_text(tokenizer, question, answer_prefix)


def _niah(tokenizer: Any, task: str, num_tokens: int, seed: int, haystack: str) -> RulerCase:
    kind = _NIAH_KIND[task]
    c = make_niah(tokenizer, num_tokens, kind, seed, num_needles=4, haystack=haystack)
    if kind == "multi-value":
        return RulerCase(task, seed, c.prefix, c.questions, answer_tokens=40)
    order = list(range(len(c.needles)))
    random.Random(f"ruler-order-{task}-{seed}").shuffle(order)
    pairs = [c.needles[i] for i in order]
    single = [
        NiahQuestion(_ask(tokenizer, f"What is the special magic number for {k}?", _NUMBER), (v,))
        for k, v in pairs
    ]
    if task != "niah_multiquery":
        return RulerCase(task, seed, c.prefix, tuple(single))
    (k1, v1), (k2, v2) = pairs[:2]
    q = f"What are the special magic numbers for {k1} and {k2}?"
    both = NiahQuestion(_ask(tokenizer, q, _NUMBERS), (v1, v2))
    return RulerCase(task, seed, c.prefix, (both, *single[2:]), answer_tokens=32)


def _var_names(rng: random.Random, n: int) -> list[str]:
    names: set[str] = set()
    while len(names) < n:
        names.add("".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)))
    return sorted(names, key=lambda _: rng.random())


def _variable_tracking(
    tokenizer: Any, rng: random.Random, num_tokens: int, haystack: str
) -> tuple[str, list[NiahQuestion], int]:
    """Two chains of four assignments each; the first chain is asked about."""
    names = _var_names(rng, 8)
    chains = [names[:4], names[4:]]
    values = rng.sample(range(10000, 100000), 2)
    needles = []
    for chain, value in zip(chains, values):
        needles.append(f"VAR {chain[0]} = {value}.")
        needles += [f"VAR {b} = VAR {a}." for a, b in itertools.pairwise(chain)]
    intro = "Memorize and track the chain(s) of variable assignment hidden in the text."
    prefix, _ = embed_in_haystack(tokenizer, rng, num_tokens, needles, intro=intro,
                                  haystack=haystack)  # fmt: skip
    questions = [
        NiahQuestion(
            _ask(
                tokenizer,
                f"Find all variables that are assigned the value {value} in the text above.",
                f"The variables assigned the value {value} are:",
            ),
            tuple(chain),
        )
        for chain, value in zip(chains, values)
    ]
    return prefix, questions, 32


@lru_cache(maxsize=1)
def _vocabulary() -> tuple[str, ...]:
    """Distinct lowercase words of 4-9 letters from the filler text, in first-seen order."""
    seen = dict.fromkeys(w for w in re.findall(r"[a-z]{4,9}", filler_text().lower()))
    return tuple(seen)


def _fit_list(
    tokenizer: Any, num_tokens: int, head: str, items: list[str], join: str
) -> tuple[str, int]:
    """The longest prefix of `items` whose text after `head` fits in `num_tokens`."""
    lo, hi = 1, len(items)
    while lo < hi:  # binary search on the count of items
        mid = (lo + hi + 1) // 2
        if count_tokens(tokenizer, head + join.join(items[:mid])) <= num_tokens:
            lo = mid
        else:
            hi = mid - 1
    return head + join.join(items[:lo]), lo


def _common_words(
    tokenizer: Any, rng: random.Random, num_tokens: int
) -> tuple[str, list[NiahQuestion], int]:
    """Five common words, each about three times as frequent as any other word."""
    words = rng.sample(_vocabulary(), 400)
    common, rare = words[:5], words[5:]
    intro = "Below is a numbered list of words. Some of them appear more often than others."
    head, _tail = chat_frame(tokenizer, True, intro)
    per_common = max(6, num_tokens // 90)
    bag = common * per_common + [w for w in rare for _ in range(rng.choice((1, 2)))]
    rng.shuffle(bag)
    entries = [f"{i + 1}. {w}" for i, w in enumerate(bag)]
    prefix, kept = _fit_list(tokenizer, num_tokens, head, entries, "\n")
    counts = Counter(bag[:kept])
    top = tuple(w for w, _ in counts.most_common(5))
    q = "What are the 5 most common words in the list above?"
    return prefix, [NiahQuestion(_ask(tokenizer, q, "The 5 most common words are:"), top)], 40


def _frequent_words(
    tokenizer: Any, rng: random.Random, num_tokens: int
) -> tuple[str, list[NiahQuestion], int]:
    """Coded words from a Zipf law (alpha 2): the three most frequent are asked for."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = sorted(
        {"".join(rng.choice(letters) for _ in range(rng.choice((3, 4)))) for _ in range(300)}
    )
    rng.shuffle(vocab)
    weights = [1.0 / (r + 1) ** 2 for r in range(len(vocab))]
    draws = rng.choices(vocab, weights, k=4000)
    intro = "Read the following coded text and track the frequency of each coded word."
    head, _ = chat_frame(tokenizer, True, intro)
    prefix, kept = _fit_list(tokenizer, num_tokens, head, draws, " ")
    counts = Counter(draws[:kept]).most_common()
    top = tuple(w for w, c in counts[:3] if c > (counts[3][1] if len(counts) > 3 else 0))
    if len(top) < 3:  # a tie at the third place: ask for the ones that are clear
        top = tuple(w for w, _ in counts[:2]) if counts[1][1] > counts[2][1] else (counts[0][0],)
    q = f"What are the {len(top)} most frequently appearing coded words in the coded text above?"
    a = f"The {len(top)} most frequent coded words are:"
    return prefix, [NiahQuestion(_ask(tokenizer, q, a), top)], 24

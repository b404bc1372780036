"""Reference-query settings of a compaction spec (torch-free): the sources, their sizes,
the self-study prompts. ``compactor.query_capture`` runs them; ``compactor.spec`` re-exports."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from compactor.spec.fields import SpecError, is_int, is_number, knob

__all__ = [
    "DEFAULT_QUERY_SOURCES",
    "MAX_QUERIES_PER_HEAD",
    "QUERY_SOURCES",
    "SELF_STUDY_PROMPTS",
    "QueryConfig",
]

# Reference queries kept per KV head: the default, and the service's cap
# (`compactor.spec.limits.WorkLimits.max_queries`). Above what a repeat source yields for any
# prefix the embedded model can repeat (G x T, ~12k at 4k tokens): none dropped at random.
MAX_QUERIES_PER_HEAD = 16384

QUERY_SOURCES = (
    "context-prefill",
    "repeat-prefill",
    "repeat-turn",
    "self-study",
    "random",
    "follow-up",
)
# The default sources, and what a spec whose only source is ``follow-up`` falls back to for a
# prefix that arrives without follow-ups (CompactionSpec.for_follow_ups). repeat-turn (the
# repeat asked as the assistant's turn, every token's queries kept) over repeat-prefill, kvzip
# query-agnostic on the RULER-style items: dev multi-key at 10x 25 of stock's 29 against 23;
# held-out, 33 of 39 at 10x as before (48 items) and 46 of 60 against 42 at 20x (72 items,
# 5 vs 1 item by item) (the ruler_repeat table of docs/results.md).
DEFAULT_QUERY_SOURCES = ("repeat-turn",)
SELF_STUDY_PROMPTS = (
    "Summarize the text above in a few sentences.",
    "Ask and answer three questions about the specific facts and numbers in the text above.",
    "Quote the most important sentence of the text above word for word, then continue it.",
    "Structure the key information in the text above as a list of short bullet points.",
)


@dataclass(frozen=True)
class QueryConfig:
    """Which reference-query sources to use and how many queries to keep (``compactor.query_capture``).

    Attributes:
        sources: names from ``QUERY_SOURCES``.
        max_queries_per_head: reservoir cap on n for each source, then on the total.
        self_study_tokens: tokens generated per self-study prompt.
        self_study_prompts: the prompts (one generation each).
        temperature: 0 = greedy self-study answers, else sampling with `seed`.
        random_count: n for the ``random`` source.
        follow_up_answer_tokens: greedy answer tokens generated (on the full prefix) after
            each follow-up and kept in its continuation; 0 = the follow-ups alone.
        seed: seeds the reservoirs, random queries and sampling.
    Raises SpecError (a ValueError naming the field) when built with a bad value.

    The defaults (repeat-turn, 16384 per head) are the ones chosen for the default method
    on the RULER-style dev seeds and reported on the held-out ones: see
    :class:`compactor.spec.CompactionSpec`.
    """

    sources: tuple[str, ...] = knob(
        DEFAULT_QUERY_SOURCES,
        "query-sources",
        f"comma-separated reference-query sources ({', '.join(QUERY_SOURCES)})",
        "csv",
    )
    max_queries_per_head: int = knob(
        MAX_QUERIES_PER_HEAD, "max-queries", "reservoir cap of queries per KV head", "int"
    )
    self_study_tokens: int = knob(
        24, "self-study-tokens", "tokens generated per self-study prompt", "int"
    )
    self_study_prompts: tuple[str, ...] = knob(
        SELF_STUDY_PROMPTS,
        "self-study-prompt",
        "a self-study prompt (repeatable; replaces the four built-in prompts)",
        "lines",
    )
    temperature: float = knob(
        0.0, "self-study-temperature", "0 = greedy self-study answers, else sampled", "float"
    )
    random_count: int = knob(256, "random-queries", "queries drawn by the random source", "int")
    follow_up_answer_tokens: int = knob(
        0,
        "follow-up-answer-tokens",
        "append the model's greedy answer (this many tokens) to each follow-up query text",
        "int",
    )
    seed: int = knob(
        0, "query-seed", "seed of the query reservoirs, random queries, sampling", "int"
    )

    def __post_init__(self) -> None:
        for name in ("sources", "self_study_prompts"):  # lists (JSON, argparse) -> tuples
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        self.validate()

    def validate(self) -> None:
        """Raise SpecError naming the first bad field (``queries.<name>``)."""
        if isinstance(self.sources, str) or not isinstance(self.sources, Sequence):
            raise SpecError(
                f"QueryConfig.sources must be a list of names, got {self.sources!r}",
                "queries.sources",
            )
        if not self.sources:
            raise SpecError("QueryConfig.sources is empty", "queries.sources")
        for s in self.sources:
            if s not in QUERY_SOURCES:
                raise SpecError(
                    f"unknown query source {s!r}; choose from {', '.join(QUERY_SOURCES)}",
                    "queries.sources",
                )
        for name in ("max_queries_per_head", "self_study_tokens", "random_count"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise SpecError(
                    f"QueryConfig.{name} must be >= 1, got {value!r}", f"queries.{name}"
                )
        prompts = self.self_study_prompts
        if isinstance(prompts, str) or not prompts or not all(isinstance(p, str) for p in prompts):
            raise SpecError(
                f"QueryConfig.self_study_prompts must be non-empty strings, got {prompts!r}",
                "queries.self_study_prompts",
            )
        if not is_number(self.temperature) or self.temperature < 0:
            raise SpecError(
                f"QueryConfig.temperature must be >= 0, got {self.temperature!r}",
                "queries.temperature",
            )
        if not is_int(self.follow_up_answer_tokens) or self.follow_up_answer_tokens < 0:
            raise SpecError(
                "QueryConfig.follow_up_answer_tokens must be >= 0, got "
                f"{self.follow_up_answer_tokens!r}",
                "queries.follow_up_answer_tokens",
            )
        if not is_int(self.seed):
            raise SpecError(f"QueryConfig.seed must be an int, got {self.seed!r}", "queries.seed")
